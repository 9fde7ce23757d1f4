"""The parallelism planner: pure predictions checked against par.memory.accounting, par.pp.partition and measurements."""
from dataclasses import replace

import math

import pytest
from tiers import slow
import torch

from par.memory import accounting as memory
from par.pp import partition, schedules, sim
from par.model import GPTConfig, build, lm_loss, preset
from par.train.planner import HARDWARE, Hardware, Workload, enumerate_plans, format_plans, group_bandwidth, \
    largest_model, layouts, predict, rank_plans, stage_params
from par.runtime.grid import Layout
from par.tp.layers import tp_param_count

GPT3S = Workload(preset("gpt3-small"), 512)


def test_layouts_are_every_factorisation():
    got = layouts(12)
    assert all(dp * pp * tp == 12 for dp, pp, tp in got)
    assert len(got) == len(set(got)) == 18      # ordered triples with product 12 = 3·3·2
    assert (12, 1, 1) in got and (1, 1, 12) in got and (2, 3, 2) in got


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_stage_params_is_the_pipeline_partition_of_the_real_model(pp):
    cfg = preset("tiny", n_layer=5)
    layers = build(cfg).to_layers()
    counts = partition.param_counts(layers)
    want = max(sum(counts[a:b]) for a, b in partition.bounds_for(layers, pp, "parameters"))
    assert stage_params(cfg, pp, 1)[0] == want


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_params_match_tensor_parallel_count(tp):
    cfg = preset("tiny")
    assert stage_params(cfg, 1, tp)[0] == tp_param_count(cfg, tp)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_states_are_par_memory_formula(stage):
    p = predict(GPT3S, 8, 1, 1, stage, 1)
    want = memory.model_state_bytes(memory.param_count(GPT3S.model), 8, stage, "mixed", "adam")
    assert (p.memory["params"], p.memory["grads"], p.memory["optimizer"]) == (want.params, want.grads, want.optimizer)
    off = predict(GPT3S, 8, 1, 1, max(stage, 1), 1, offload=True)
    assert off.memory["optimizer"] == 0 and off.memory["host"] > 0 and off.time["offload"] > 0


@pytest.mark.parametrize("name,batch", [("tiny", 4), ("tiny", 16), ("small", 8)])
def test_activation_prediction_vs_measured_autograd(name, batch):
    cfg = preset(name)
    model = build(cfg)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size))
    _, measured = memory.saved_activation_bytes(lambda a: lm_loss(model(a), x), x, exclude=list(model.parameters()))
    predicted = predict(Workload(cfg, batch, "fp32"), 1, 1, 1, 0, 1, HARDWARE["cpu"]).memory["activations"]
    assert abs(predicted / measured - 1) < 0.03, (predicted, measured)


def test_time_parts_follow_their_formulas():
    base = predict(GPT3S, 2, 4, 2, 1, 8)      # the bubble idles the whole critical path of a micro-batch
    assert base.time["bubble"] == pytest.approx((base.time["compute"] + base.time["tp"] + base.time["pp"]) * 3 / 8)
    more = predict(GPT3S, 2, 4, 2, 1, 16)
    assert more.time["bubble"] < base.time["bubble"] and more.micro_batch == base.micro_batch // 2
    z1, z3 = predict(GPT3S, 16, 1, 1, 1, 1), predict(GPT3S, 16, 1, 1, 3, 1)
    assert z3.time["dp"] == pytest.approx(1.5 * z1.time["dp"])
    # under accumulation ZeRO-2 reduce-scatters every micro-batch, ZeRO-3 also gathers twice per micro-batch
    z1, z2, z3 = (predict(GPT3S, 16, 1, 1, s, 4).bytes["dp"] for s in (1, 2, 3))
    assert (z2 / z1, z3 / z1) == (pytest.approx(5 / 2), pytest.approx(12 / 2))
    assert predict(GPT3S, 16, 1, 1, 0, 1).time["tp"] == 0 and predict(GPT3S, 4, 1, 4, 0, 1).time["tp"] > 0


def test_bandwidth_depends_on_whether_the_group_stays_on_a_node():
    hw = Hardware(gpus_per_node=8)
    assert group_bandwidth("tp", Layout(2, 1, 8), hw) == hw.bw_node
    assert group_bandwidth("dp", Layout(2, 1, 8), hw) == hw.bw_network
    assert group_bandwidth("tp", Layout(1, 1, 16), hw) == hw.bw_network
    assert group_bandwidth("dp", Layout(4, 2, 2), hw) == hw.bw_node


@pytest.mark.parametrize("args,reason", [
    ((1, 1, 5, 0, 1), "tp 5 does not divide"),
    ((2, 2, 2, 3, 4), "ZeRO-3 with pp/tp > 1: par.train.job runs ZeRO-2/3 with pp = tp = 1 only"),
    ((8, 1, 1, 0, 128), "not divisible by dp 8 × m 128"),
    ((8, 1, 1, 0, 1), None),
])
def test_invalid_layouts_say_why(args, reason):
    dp, pp, tp, z, m = args
    p = predict(GPT3S, dp, pp, tp, z, m)
    assert p.valid == (reason is None)
    if reason:
        assert reason in p.reason


def test_ranking_fits_first_fastest_first_and_flags_the_rest():
    hw = replace(HARDWARE["a100-80gb"], memory=20e9)
    plans = enumerate_plans(GPT3S, 16, hw, microbatches=(1, 4, 16))
    ranked = rank_plans(plans)
    assert len(ranked) == sum(p.valid for p in plans)
    fits = [p.fits for p in ranked]
    assert True in fits and False in fits and fits == sorted(fits, reverse=True)
    ok = [p for p in ranked if p.fits]
    assert [p.time["total"] for p in ok] == sorted(p.time["total"] for p in ok)
    assert all(p.memory["total"] <= 20e9 for p in ok) and all(p.memory["total"] > 20e9 for p in ranked if not p.fits)
    assert "NO" in format_plans(ranked, top=len(ranked))


def test_largest_model_fits_and_one_step_wider_does_not():
    hw = replace(HARDWARE["a100-80gb"], memory=16e9)
    w = Workload(preset("gpt3-small"), 64)
    for stage in (0, 3):
        cfg, psi = largest_model(w, 8, 1, 1, stage, 8, hw)
        assert predict(replace(w, model=cfg), 8, 1, 1, stage, 8, hw).fits
        wider = replace(cfg, d_model=cfg.d_model + cfg.n_head)
        assert not predict(replace(w, model=wider), 8, 1, 1, stage, 8, hw).fits
        assert psi == memory.param_count(cfg)
    assert largest_model(w, 8, 1, 1, 3, 8, hw)[1] > largest_model(w, 8, 1, 1, 0, 8, hw)[1]
    assert largest_model(w, 8, 1, 1, 0, 8, replace(hw, memory=1e6)) == (None, 0)


def test_180b_on_800_gpus_needs_all_three_dimensions():
    cfg = GPTConfig(vocab_size=50257, block_size=2048, n_layer=100, n_head=96, d_model=12288)
    w = Workload(cfg, 2048, recompute="full")
    ranked = rank_plans(enumerate_plans(w, 800, HARDWARE["v100-32gb"], stages=(0, 1),
                                        microbatches=(32, 64, 128, 256), offload=(False,)))
    best = ranked[0]
    assert best.fits and best.pp > 1 and best.tp > 1 and best.dp > 1
    assert not any(p.fits for p in ranked if p.pp == 1 and p.tp == 1)      # data parallelism alone cannot


@slow
@pytest.mark.timeout(200)
def test_predictions_beside_a_measured_benchmark_run():
    """Smoke run of the benchmark suite (one 8-rank launch, checked against one process): bytes per step are
    predicted exactly (3D: within 1%, the planner charges every rank the busiest stage's gradients), model
    states exactly, activations within 15% (the pipeline's in-flight count is the first stage's)."""
    from par.train.suite import format_table, layouts_matching_reference, run_suite
    rows = run_suite(["ZeRO-2", "3D"], nproc=8, steps=2, timeout=180, model={"preset": "tiny"}, check=True,
                     strict=True)
    for r in rows:
        assert "error" not in r, r
        assert r["bytes_per_step"] == pytest.approx(r["pred_bytes_per_step"], rel=1e-3 if r["name"] != "3D" else 1e-2)
        assert r["model_states_max"] == pytest.approx(r["pred_model_states"], rel=1e-3), r["name"]
        assert r["activations_peak_max"] == pytest.approx(r["pred_activations"], rel=0.15), r["name"]
        assert r["samples_per_s"] > 0 and r["largest_params"] > 0 and len(r["losses"]) == 2
    assert rows[1]["layout"] == "dp2xpp2xtp2" and "3D dp2xpp2xtp2" in format_table(rows)
    assert layouts_matching_reference(rows) == ["dp8xpp1xtp1", "dp2xpp2xtp2"]


def test_benchmark_rows_never_time_more_ranks_than_slots():
    """Timed rows fit the cores (or GPUs); the others train the preset and are checked against one process;
    the '3D' row has every degree > 1; every row trains the same global batch."""
    from par.train.suite import NAMES, plan_rows, timing_model
    from par.train.config import parse
    from par.runtime.grid import Layout
    for nproc, slots in ((2, 2), (4, 2), (8, 16)):
        rows = plan_rows(NAMES, nproc=nproc, slots=slots)
        for r in rows.values():
            assert "error" not in r, r
            assert r["timed"] == (r["nproc"] <= slots) and r["checked"] == (not r["timed"])
            assert r["config"]["model"] == (timing_model("tiny") if r["timed"] else {"preset": "tiny"})
            assert r["config"]["train_batch_size"] == 2 * 4 * nproc
        tc = parse(rows["3D"]["config"], rows["3D"]["nproc"])
        assert Layout(tc.dp, tc.pp, tc.tp).is_3d and tc.strategy.startswith("3D ")
        assert not any(parse(r["config"], r["nproc"]).strategy.startswith("3D") for n, r in rows.items() if n != "3D")


def test_speedups_compare_timed_rows_of_single_precision_with_their_ranks():
    from par.train.suite import layouts_matching_reference, speedups
    row = lambda name, n, step, timed=True, precision="fp32", config=None, **kw: {
        "name": name, "nproc": n, "median_step_s": step, "median_cpu_s": step * n, "timed": timed,
        "precision": precision, "backend": "gloo", "config": config or {}, "grad_accum": 4, **kw}
    # single's reference is its wall-clock median like every row's (its CPU time, 0.9 s, is another clock)
    rows = [row("single", 1, 1.4, median_cpu_s=0.9), row("DDP", 2, 0.8), row("bf16", 2, 0.1, precision="bf16"),
            row("pipeline", 2, 0.75, config={"pipeline": {"stages": 2}}, grad_accum=8),
            row("3D", 8, 0.3, timed=False, layout="dp2xpp2xtp2", max_param_diff=2e-6),
            {"name": "ZeRO-3", "nproc": 2, "error": "boom"}]
    assert speedups(rows) == {"single": {"speedup": 1.0, "ranks": 1, "bound": 1.0},
                              "DDP": {"speedup": 1.75, "ranks": 2, "bound": 2.0},
                              "pipeline": {"speedup": 1.867, "ranks": 2, "bound": round(2 * 8 / 9, 3)}}
    assert speedups([{**r, "backend": "nccl"} for r in rows]) == speedups(rows)
    assert layouts_matching_reference(rows) == ["dp2xpp2xtp2"]
    assert layouts_matching_reference([{**rows[4], "max_param_diff": float("nan")}]) == []


CALIBRATION = {"ranks": 2, "threads_per_rank": 1, "cores": 2, "seconds": 1.0,
               "gemms": [[128, 96, 32, 1, 2e-5], [32, 32, 8, 8, 1e-6], [128, 32, 32, 1, 5e-6], [128, 128, 32, 1, 2e-5],
                         [128, 32, 128, 1, 2e-5], [128, 65, 32, 1, 1e-5]],
               "null_block_s": 30 * 2e-5, "memory": [[3e6, 1e-3 + 3e-4, 3e-4]], "optimizer": [1e6, 28, 28e6 / 5e9],
               "host_copy": [5e5, 8 * 5e5 / 4e9],
               "collectives": {kind: [[2, s, a + s / 1e9] for s in (1e5, 1e6, 1e7)]
                               for kind, a in (("all_reduce", 2e-4), ("reduce_scatter", 1e-4), ("all_gather", 1e-4),
                                               ("p2p", 5e-5))}}


def test_a_launchs_calibration_is_the_hardware_its_rows_are_predicted_on():
    """What a launch measured (`par.train.calibration.measure`'s dict) becomes a Hardware: its GEMM table, launch
    per operation (the null block over the operations the cost model charges a block), memory-bound and optimizer
    bytes/s, the host copies, and each collective kind's own α and bandwidth fitted to its formula."""
    from par.train import calibration
    hw = calibration.hardware(CALIBRATION)
    assert hw.launch == pytest.approx(2e-5 * 30 / calibration.launches_per_block())
    assert calibration.launches_per_block() == 30        # 6 GEMMs and 4 memory-bound kinds, forward and backward
    assert hw.hbm == pytest.approx(3e6 / 1e-3) and hw.optimizer_bw == pytest.approx(5e9)
    assert hw.host_optimizer_bw == hw.optimizer_bw and hw.bw_host == pytest.approx(4e9)
    link = hw.link(True)
    for kind, alpha in (("all_reduce", 2e-4), ("reduce_scatter", 1e-4), ("p2p", 5e-5)):
        steps, moved = cost.collective_terms(kind, 2, 1e6)
        assert cost.collective_seconds(kind, 2, 1e6, link) == pytest.approx(alpha + 1e6 / 1e9, rel=1e-6), kind
        assert link.of(kind).alpha == pytest.approx(alpha / steps, rel=1e-6)
    with pytest.raises(ValueError, match="without 'gemms'"):
        calibration.hardware({"ranks": 1})


def test_a_stalled_turn_is_neither_the_launch_nor_the_memory_bound_number(monkeypatch):
    """The launch and the memory-bound operations are small times whose difference the planner fits: each is the
    median of its turns, so one turn stalled 14-fold (as a launch under another batch once was) moves neither."""
    from par.model import preset
    from par.train import calibration, cost
    dims = cost.dims_of(preset("tiny"))
    times = iter([2e-4, 2e-4, 28e-4, 2e-4, 2e-4])
    monkeypatch.setattr(calibration, "_mean_s", lambda fn, window=0, **_: next(times))
    assert calibration.null_block_seconds(dims) == 2e-4
    turns = iter([x for _ in range(calibration.MEMORY_ROUNDS - 1) for x in (6e-4, 2e-4)] + [6e-4, 28e-4])
    monkeypatch.setattr(calibration, "_mean_s", lambda fn, window=0, **_: next(turns))
    assert calibration.memory_ops_seconds(dims, 1, 8, 1) == (6e-4, 2e-4)


def test_ranks_arriving_apart_cost_the_measured_share_of_a_multi_rank_rows_compute():
    """The straggle a calibration measured (seconds a collective waits per second of GEMMs before it: the slope
    between a short and a long gap, the kinds' mean, never below 0) is added to a multi-rank row as that share
    of its compute, and to one rank never."""
    from par.train import calibration, planner
    from par.train.config import parse
    from par.train.suite import config_for
    points = [["all_reduce", 1e-3, 2e-3, 5e-3, 2.8e-3], ["all_gather", 1e-3, 1e-3, 5e-3, 1.4e-3],
              ["p2p", 1e-3, 1e-3, 5e-3, 0.5e-3]]        # slopes 0.2, 0.1 and (negative, so) 0
    cal = {**CALIBRATION, "straggle": points}
    assert calibration.straggle(cal) == pytest.approx(0.1)
    assert calibration.straggle(CALIBRATION) == 0.0 and "straggle" in calibration.describe(cal)
    hw = calibration.hardware(cal)
    assert hw.straggle == pytest.approx(0.1)
    ddp = planner.from_config(parse(config_for("DDP", 2, {"preset": "tiny"}, 2, 3)[0], 2), hw).time
    assert ddp["straggle"] == pytest.approx(0.1 * ddp["compute"])
    without = planner.from_config(parse(config_for("DDP", 2, {"preset": "tiny"}, 2, 3)[0], 2),
                                  calibration.hardware(CALIBRATION)).time
    assert ddp["total"] == pytest.approx(without["total"] + ddp["straggle"])
    single = planner.from_config(parse(config_for("single", 2, {"preset": "tiny"}, 2, 3)[0], 1), hw).time
    assert single["straggle"] == 0.0


def test_predicted_step_times_predict_every_row_on_its_own_launchs_calibration():
    """Every timed row, single included, is predicted on the Hardware its launch measured: single's ratio is a
    measurement on the load-proof clock (here 1 only where the row took the predicted time; its wall clock is
    reported beside, not judged), a row twice as slow as predicted has 2, and
    the DDP row's prediction is the planner's on that Hardware; a row without a calibration is refused in one line."""
    from par.train import calibration, planner
    from par.train.config import parse
    from par.train.suite import config_for, predicted_step_times
    rows = []
    for name in ("single", "DDP"):
        cfg, n = config_for(name, 2, {"preset": "tiny"}, 2, 3)
        rows.append({"name": name, "nproc": n, "config": cfg, "timed": True, "precision": "fp32",
                     "grad_accum": parse(cfg, n).grad_accum, "median_step_s": 0.4,
                     "calibration": {**CALIBRATION, "ranks": n}})
    hw = calibration.hardware(CALIBRATION)
    want = {r["name"]: planner.from_config(parse(r["config"], r["nproc"]), hw).time["total"] for r in rows}
    rows[0]["median_steady_s"], rows[0]["median_step_s"] = want["single"], 1.5 * want["single"]
    rows[1]["median_steady_s"], rows[1]["median_step_s"] = 2 * want["DDP"], 3 * want["DDP"]
    got = predicted_step_times(rows)
    assert got["single"]["predicted_s"] == pytest.approx(want["single"]) and got["single"]["ratio"] == 1.0
    assert got["DDP"]["ratio"] == 2.0 and got["DDP"]["parts"]["dp"] > 0 and "pp" not in got["DDP"]["parts"]
    assert got["DDP"]["measured_wall_s"] == pytest.approx(3 * want["DDP"])    # the wall clock beside, not judged
    del rows[1]["calibration"]
    with pytest.raises(ValueError, match="'DDP' carries no calibration"):
        predicted_step_times(rows)


def test_the_in_step_efficiency_is_fitted_on_single_and_every_row_is_predicted_at_it():
    """Single measured 1.25x its prediction on its own calibration: η is the share of the measured rates at which
    the planner predicts single's step (its ratio 1, marked as the row that calibrates); each other row is the
    planner's on its own calibration at that η, slower than at η = 1, and its multi-rank straggle is the median of
    the rows' measurements, not its own."""
    from par.train import calibration, planner
    from par.train.config import parse
    from par.train.suite import config_for, in_step_efficiency, pooled_straggle, predicted_step_times
    slopes = {"DDP": 0.3, "ZeRO-1": 0.0, "ZeRO-3": 0.1}
    rows = []
    for name in ("single", *slopes):
        cfg, n = config_for(name, 2, {"preset": "tiny"}, 2, 3)
        cal = {**CALIBRATION, "ranks": n}
        if n > 1:                     # a slope of slopes[name] for every kind: a longer gap, a longer call
            cal["straggle"] = [[kind, 1e-3, 1e-3, 5e-3, 1e-3 + slopes[name] * 4e-3] for kind in calibration.KINDS]
        rows.append({"name": name, "nproc": n, "config": cfg, "timed": True, "precision": "fp32",
                     "grad_accum": parse(cfg, n).grad_accum, "calibration": cal})
    hw = calibration.hardware(CALIBRATION)
    at_one = planner.from_config(parse(rows[0]["config"], 1), hw).time["total"]
    for r in rows:
        r["median_steady_s"] = r["median_step_s"] = 1.25 * at_one
    eta = in_step_efficiency(rows)
    assert 0.5 < eta < 0.95
    assert planner.from_config(parse(rows[0]["config"], 1), replace(hw, efficiency=eta)).time["total"] == \
        pytest.approx(1.25 * at_one, rel=1e-3)
    assert pooled_straggle(rows) == pytest.approx(0.1)
    got = predicted_step_times(rows)
    assert got["single"]["ratio"] == 1.0 and got["single"]["calibrates"] and not got["DDP"]["calibrates"]
    ddp = parse(rows[1]["config"], 2)
    want = planner.from_config(ddp, replace(calibration.hardware(rows[1]["calibration"]), efficiency=eta,
                                            straggle=0.1)).time["total"]
    assert got["DDP"]["predicted_s"] == pytest.approx(want)
    assert want > planner.from_config(ddp, replace(calibration.hardware(rows[1]["calibration"]), straggle=0.1)).time["total"]
    assert got["DDP"]["efficiency"] == eta
    rows[0]["median_steady_s"] = 1e-9               # no η makes a step this fast: refused, in one line
    with pytest.raises(ValueError, match="outside what η"):
        in_step_efficiency(rows)


def test_single_is_launched_before_and_after_the_rows_and_keeps_its_faster_run(monkeypatch):
    """The reference's launch runs first and last; the faster of its two medians is kept (both recorded), so a
    burst of load during one of them cannot make every row look faster."""
    import par.runtime.launch
    from par.train.suite import launch_order, plan_rows, run_suite
    assert [k for k, _ in launch_order(plan_rows(["single", "DDP", "ZeRO-1"], nproc=2, slots=2))] == \
        [(1, False), (2, False), (1, False)]
    assert [k for k, _ in launch_order(plan_rows(["DDP"], nproc=2, slots=2))] == [(2, False)]
    single_medians = iter([2.0, 1.5])

    def fake(module, nproc, args, **kw):
        one = lambda t: {"median_step_s": t, "step_s": [t], "precision": "fp32"}
        return one(next(single_medians)) if nproc == 1 else {"runs": [one(0.8), one(0.9)]}
    monkeypatch.setattr(par.runtime.launch, "run", fake)
    rows = {r["name"]: r for r in run_suite(["single", "DDP", "ZeRO-1"], nproc=2, backend="gloo")}
    assert rows["single"]["median_step_s"] == 1.5 and rows["single"]["reference_medians"] == [2.0, 1.5]
    assert rows["DDP"]["median_step_s"] == 0.8 and rows["ZeRO-1"]["median_step_s"] == 0.9


def test_each_row_of_a_launch_is_calibrated_just_before_it_runs():
    """Two configs in one calibrated launch: each run carries the calibration measured for its own config (TP's
    GEMMs at tp = 2, DDP's whole), not one taken at the launch's start for both."""
    import json
    from par.runtime.launch import run
    from par.train import calibration, job, suite
    from par.train.config import parse
    model = {"preset": "tiny"}
    configs = [suite.config_for(name, 2, model, 2, 2)[0] for name in ("DDP", "TP")]
    args = job.Args(config=tuple(json.dumps(c) for c in configs), calibrate=True)
    got = run("par.train.job", nproc=2, args=args.to_argv(), backend="gloo", timeout=240, quiet=True)
    runs = got["runs"]
    assert "calibration" not in got and len(runs) == 2
    for config, r in zip(configs, runs):
        want = calibration.shapes([parse(config, 2)])["gemms"]
        assert [tuple(g[:4]) for g in r["calibration"]["gemms"]] == [tuple(g) for g in want]
        assert r["calibration"]["collectives"]["all_gather"]
    assert runs[0]["calibration"]["gemms"] != runs[1]["calibration"]["gemms"]


def test_a_failed_launch_is_one_line_naming_the_rank_error(monkeypatch):
    """A row's error is the LaunchError's root cause (its first line, which names the rank's exception),
    never a later line of the ranks' output."""
    import par.runtime.launch
    from par.train.suite import run_suite
    e = par.runtime.launch.LaunchError("rank 1 failed: ValueError: the real reason\nrank 1's output:\n"
                                       "[default1]:Traceback (most recent call last):\n[default1]:  File \"x.py\", line 3\n"
                                       "[default1]:ValueError: the real reason\n[default0]:exiting")

    def fail(module, nproc, args, **kw):
        raise e
    monkeypatch.setattr(par.runtime.launch, "run", fail)
    (row,) = run_suite(["DDP"], nproc=2)
    assert row["error"] == e.root_cause == "rank 1 failed: ValueError: the real reason"


def test_plan_command(capsys):
    from par.train.planner import main
    assert main(["--model", "100,96,12288", "--world", "800", "--hardware", "v100-32gb", "--batch", "2048",
                 "--recompute", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "Ψ = 182,470,213,632 on 800 × V100-32GB" in out and len(out.splitlines()) == 1 + 2 + 3 and "27 of 393 valid plans fit" in out   # tp>1: recomputed layer per tp rank (par.memory.accounting)


def test_a_failing_benchmark_launch_raises_its_own_error_in_one_line(monkeypatch):
    """Lecture 07's cell: the launch's error, not an IndexError later; without strict the rows carry it."""
    import par.runtime.launch
    from par.train.suite import BenchmarkError, format_table, run_suite

    def fail(module, nproc, args, **kw):
        raise par.runtime.launch.LaunchError("rank 0 failed: RuntimeError: Gloo connectFullMesh failed\n"
                                             "[default0]:RuntimeError: Gloo connectFullMesh failed")
    monkeypatch.setattr(par.runtime.launch, "run", fail)
    with pytest.raises(BenchmarkError, match=r"^single on 1 ranks: .*RuntimeError: Gloo connectFullMesh failed$"):
        run_suite(["single", "DDP"], nproc=2, strict=True)
    rows = run_suite(["single", "DDP"], nproc=2)
    assert all("RuntimeError: Gloo connectFullMesh failed" in r["error"] for r in rows)
    assert "error" in format_table(rows)


def test_the_planner_knows_the_zero_bubble_schedules():
    """ZB-H1 idles a third of 1F1B's bubble, ZB-V a sixth (equal costs), at 1F1B's activation memory, read off the
    schedules themselves; a V needs m >= pp."""
    from par.train import planner
    from par.model import preset
    w = planner.Workload(preset("gpt3-small"), 64)
    free = replace(planner.HARDWARE["cpu"], bw_node=1e30, bw_network=1e30)     # F = I = W: nothing but compute
    plans = {s: planner.predict(w, 1, 4, 2, 1, 8, free, schedule=s) for s in ("1f1b", "zb_h1", "zb_v")}
    ratio = {s: p.time["bubble"] / p.time["compute"] for s, p in plans.items()}
    assert ratio["1f1b"] == pytest.approx(3 / 8) and ratio["zb_h1"] == pytest.approx(3 / 24)
    assert ratio["zb_v"] == pytest.approx(3 / 48)
    assert len({p.memory["activations"] for p in plans.values()}) == 1
    assert plans["zb_v"].label.endswith("zb_v") and plans["1f1b"].label.endswith("m=8")
    short = planner.predict(w, 1, 4, 2, 1, 2, schedule="zb_v")
    assert not short.valid and "m >= pp" in short.reason
    assert not planner.predict(w, 1, 4, 2, 1, 8, schedule="zb_x").valid
    # where no closed form holds (ZB-V below m = 2p - 1) the simulator answers
    assert planner.pipeline_bubble("zb_v", 4, 4) > planner.pipeline_bubble("zb_v", 4, 8) > 0


# ---------------------------------------------------------------- the cost model (par.train.cost)
from par.train import cost  # noqa: E402


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("zb_h1", 1),
                                    ("zb_v", 1)])
@pytest.mark.parametrize("p,m", [(2, 4), (3, 6), (4, 8), (4, 12)])
def test_pipeline_closed_forms_are_the_simulator_with_these_costs(name, v, p, m):
    """m·(f + b)·(1 + r) is the makespan `par.pp.sim` replays: GPipe, 1F1B and interleaved for any f, b (a chunk
    costs 1/v of a stage); ZB-H1 when w = f; ZB-V when F = I = W."""
    f, i, w = {"zb_h1": (1.3, 1.6, 1.3), "zb_v": (1.0, 1.0, 1.0)}.get(name, (1.3, 1.45, 1.45))
    sched = schedules.make(name, p, m, v)
    k = sched.virtual
    timeline = sim.simulate(sched, forward=f / k, backward=(i + w) / k, backward_input=i / k, backward_weight=w / k)
    assert timeline.makespan == pytest.approx(m * (f + i + w) * (1 + cost.pipeline_bubble(name, p, m, v, f, i, w)))


@pytest.mark.parametrize("name", ["1f1b", "zb_h1"])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 16)])
def test_with_a_heavier_last_stage_the_busiest_stage_form_is_an_upper_bound(name, p, m):
    """The planner feeds the busiest stage's costs to the closed form: the simulator with the real per-stage costs
    (the last stage also computes the logits) is at most that, and within 15 %."""
    F, B = [1.0] * (p - 1) + [1.4], [2.0] * (p - 1) + [2.6]
    got = sim.simulate(schedules.make(name, p, m), forward=F, backward=B).makespan
    bound = m * (1.4 + 2.6) * (1 + cost.pipeline_bubble(name, p, m, 1, 1.4, 1.3, 1.3))
    assert 0.85 * bound <= got <= bound


def test_interleaving_divides_the_bubble_by_v_and_holds_chunks_of_a_stage():
    w = Workload(preset("gpt3-small"), 64)
    free = replace(HARDWARE["cpu"], bw_node=1e30, bw_network=1e30)
    one = predict(w, 1, 4, 1, 0, 8, free)
    two = predict(w, 1, 4, 1, 0, 8, free, schedule="interleaved", virtual=2)
    assert two.valid and two.label.endswith("interleaved v=2")
    assert two.time["bubble"] / two.time["compute"] == pytest.approx(3 / 16, rel=0.05)      # (p-1)/(v·m), ± the head
    assert one.time["bubble"] / one.time["compute"] == pytest.approx(3 / 8, rel=0.05)
    assert two.memory["activations"] > one.memory["activations"]          # more micro-batch chunks in flight
    assert two.bytes["pp"] == pytest.approx(2 * one.bytes["pp"])          # a send per chunk boundary
    assert not predict(w, 1, 4, 1, 0, 8, free, virtual=2).valid           # v > 1 needs the interleaved schedule


def test_zero3_with_tensor_and_pipeline_parallelism_is_stated_by_the_any_engine():
    w = Workload(preset("gpt3-small"), 64, engine="any")
    plan = predict(w, 4, 2, 2, 3, 4)
    assert plan.valid and plan.memory["params"] == pytest.approx(2 * plan.params_per_device / 4)
    assert plan.bytes["dp"] == pytest.approx(3 * 4 * 3 / 4 * 2 * plan.params_per_device)  # 3m passes over dp = 4
    full = predict(replace(w, recompute="full"), 4, 2, 2, 3, 4)            # ZeRO-3 gathers again to recompute
    assert full.bytes["dp"] == pytest.approx(4 * 4 * 3 / 4 * 2 * plan.params_per_device)
    assert not predict(replace(w, engine="par"), 4, 2, 2, 3, 4).valid


def test_overlap_hides_data_parallel_traffic_up_to_what_backward_leaves():
    """exposed = max(0, comm - overlappable): DDP's all-reduce behind the last backward, ZeRO-3 behind everything."""
    hw = HARDWARE["a100-80gb"]
    w = Workload(preset("gpt3-small"), 64)
    plain, hidden = predict(w, 16, 1, 1, 0, 1, hw), predict(replace(w, overlap=True), 16, 1, 1, 0, 1, hw)
    comm = cost.collective_seconds("all_reduce", 16, 2 * plain.params_per_device, hw.link(False))
    assert plain.time["dp"] == pytest.approx(comm)
    backward = plain.time["compute"] * 2 / 3                           # backward GEMMs are twice the forward's
    assert hidden.time["dp"] == pytest.approx(max(0.0, comm - backward), rel=0.05, abs=1e-6)
    assert hidden.time["total"] < plain.time["total"]
    slow = replace(hw, bw_network=1e8)                                 # comm far above backward: mostly exposed
    assert predict(replace(w, overlap=True), 16, 1, 1, 0, 1, slow).time["dp"] > 0.9 * predict(w, 16, 1, 1, 0, 1,
                                                                                                slow).time["dp"]


def test_links_are_alpha_plus_beta_bytes_per_collective():
    link = cost.Link(bandwidth=1e9, alpha=1e-5)
    assert cost.collective_seconds("all_reduce", 4, 8e6, link) == pytest.approx(6 * 1e-5 + 2 * 3 / 4 * 8e6 / 1e9)
    for kind in ("reduce_scatter", "all_gather", "all_to_all"):
        assert cost.collective_seconds(kind, 4, 8e6, link) == pytest.approx(3 * 1e-5 + 3 / 4 * 8e6 / 1e9)
    assert cost.collective_seconds("p2p", 2, 8e6, link) == pytest.approx(1e-5 + 8e6 / 1e9)
    assert cost.collective_seconds("all_reduce", 1, 8e6, link) == 0
    with pytest.raises(ValueError, match="unknown collective"):
        cost.collective_seconds("broadcast", 4, 1, link)
    hw = replace(HARDWARE["cpu"], alpha_node=1e-3)
    one, slow = predict(GPT3S, 4, 1, 1, 0, 1, HARDWARE["cpu"]), predict(GPT3S, 4, 1, 1, 0, 1, hw)
    assert slow.time["dp"] - one.time["dp"] == pytest.approx(6 * 1e-3)    # one all-reduce over 4 ranks: 2(n-1) steps


def test_the_roofline_rates_gemms_by_shape_and_a_measured_table_replaces_it():
    c = cost.Compute(peak=100e12, bandwidth=1e12, efficiency=0.5)
    big, thin = c.gemm_seconds(8192, 8192, 8192), c.gemm_seconds(8192, 8192, 16)
    assert 2 * 8192 ** 3 / big == pytest.approx(50e12)                    # compute-bound: η·P
    intensity = 2 * 8192 * 8192 * 16 / (2 * (8192 * 16 * 2 + 8192 * 8192))
    assert 2 * 8192 * 8192 * 16 / thin == pytest.approx(0.5 * intensity * 1e12)   # memory-bound: η·I·B
    table = cost.Compute(peak=100e12, table=((10.0, 1e12), (1000.0, 10e12)))
    assert table.rate(100.0) == pytest.approx(math.sqrt(1e12 * 10e12))     # log-log between the points
    assert table.rate(1e6) == 10e12 and table.rate(5.0) == pytest.approx(0.5e12)
    flat = HARDWARE["cpu"].compute
    assert flat.is_flat and flat.gemm_seconds(100, 100, 100) == pytest.approx(2e6 / HARDWARE["cpu"].flops)
    with pytest.raises(ValueError, match="efficiency"):
        cost.Compute(peak=1e12, efficiency=1.5)


def test_on_a_flat_rate_single_is_the_step_flops_over_the_rate():
    """The CPU preset (flat): one process's compute is `step_flops / flops`, what `par.train.suite.calibrated` sets
    the FLOP/s from; with the roofline the memory-bound work costs time on top."""
    w = Workload(preset("tiny"), 8, "fp32")
    plan = predict(w, 1, 1, 1, 0, 1, HARDWARE["cpu"])
    assert plan.time["compute"] == pytest.approx(planner_step_flops(w) / HARDWARE["cpu"].flops)
    assert plan.time["total"] == pytest.approx(plan.time["compute"])
    roof = predict(w, 1, 1, 1, 0, 1, HARDWARE["a100-80gb"])
    assert roof.time["compute"] > planner_step_flops(w) / HARDWARE["a100-80gb"].compute.rate(math.inf)


def planner_step_flops(w):
    from par.train.planner import step_flops
    return step_flops(w)


def test_recomputation_none_selective_full_in_memory_and_time():
    hw = HARDWARE["a100-80gb"]
    w = Workload(preset("gpt3-small"), 32, dropout=True)
    plans = {r: predict(replace(w, recompute=r), 4, 1, 2, 1, 2, hw) for r in ("none", "selective", "full")}
    mem = {r: p.memory["activations"] for r, p in plans.items()}
    comp = {r: p.time["compute"] for r, p in plans.items()}
    assert mem["none"] > mem["selective"] > mem["full"] and comp["none"] < comp["selective"] < comp["full"]
    assert plans["full"].time["tp"] == pytest.approx(1.5 * plans["none"].time["tp"])    # 6 all-reduces, not 4


def test_activation_formulas_are_korthikanti_et_al():
    """Table 2 of Korthikanti et al. 2022 (16-bit, dropout): no parallelism sbh(34 + 5as/h); tensor parallel
    sbh(10 + 24/t + 5as/(ht)); + sequence parallel sbh(34 + 5as/h)/t; + selective recomputation sbh(10 + 24/t)
    and 34·sbh/t; full recomputation 2·sbh."""
    s, b, h, a, t = 2048, 4, 12288, 96, 8
    f = lambda **kw: memory.activation_bytes_per_layer(s, b, h, a, **kw)  # noqa: E731
    sbh = s * b * h
    assert f() == sbh * (34 + 5 * a * s / h)
    assert f(tp=t) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert f(tp=t, sequence_parallel=True) == pytest.approx(sbh * (34 + 5 * a * s / h) / t)
    assert f(tp=t, recompute="selective") == pytest.approx(sbh * (10 + 24 / t))
    assert f(tp=t, recompute="selective", sequence_parallel=True) == pytest.approx(34 * sbh / t)
    assert f(recompute="full") == 2 * sbh
    flash = f(flash=True, dropout=False)
    assert flash == 2 * (17 * sbh + a * s * b) and f(flash=True) == flash + 2 * sbh     # + the 2 dropout masks
    peak = memory.activation_peak_bytes(s, b, h, a, 10, "selective", tp=t)
    assert peak == pytest.approx(10 * f(tp=t, recompute="selective") + f(tp=t) - f(tp=t, recompute="selective"))


def test_deepspeed_states_keep_fp32_gradients_and_the_gathered_layer():
    psi, n, big = 7.5e9, 64, 1e8
    ds = lambda stage, **kw: memory.deepspeed_state_bytes(psi, n, stage, big, **kw)  # noqa: E731
    assert ds(0)["total"] == 20 * psi and ds(1)["total"] == pytest.approx(4 * psi + 16 * psi / n)
    assert ds(2)["total"] == pytest.approx(2 * psi + 18 * psi / n)
    assert ds(3)["total"] == pytest.approx(18 * psi / n + 4 * big) and ds(3)["gathered"] == 4 * big
    off = ds(3, offload_optimizer=True)
    assert off["total"] == pytest.approx(2 * psi / n + 4 * big) and off["host"] == pytest.approx(16 * psi / n)
    assert ds(3, offload_optimizer=True, offload_params=True)["total"] == 4 * big
    assert ds(2, offload_optimizer=True)["total"] == 2 * psi
    with pytest.raises(ValueError, match="offload"):
        ds(0, offload_optimizer=True)
    paper = memory.model_state_bytes(psi, n, 3).total
    assert ds(3)["total"] - 4 * big == pytest.approx(paper * 18 / 16)     # + the fp32 gradients, - the 16-bit ones


@pytest.mark.parametrize("kind", ["ring", "ulysses", "all_gather"])
def test_context_parallel_kinds_cost_their_own_collectives(kind):
    w = Workload(preset("gpt3-small"), 8, cp_kind=kind, flash=True)
    plan = predict(w, 2, 1, 2, 1, 1, HARDWARE["a100-80gb"], cp=2)
    assert plan.valid and plan.time["cp"] > 0 and plan.bytes["cp"] > 0
    one = predict(w, 2, 1, 2, 1, 1, HARDWARE["a100-80gb"])
    assert plan.memory["activations"] == pytest.approx(one.memory["activations"] / 2)


def test_bad_settings_are_refused_in_one_line():
    for kw, text in (({"recompute": "some"}, "recompute 'some'"), ({"states": "mine"}, "states 'mine'"),
                     ({"cp_kind": "tree"}, "cp_kind 'tree'"), ({"engine": "x"}, "engine 'x'"),
                     ({"states": "deepspeed", "precision": "fp32"}, "mixed-precision Adam only")):
        plan = predict(replace(GPT3S, **kw), 8, 1, 1, 0, 1)
        assert not plan.valid and text in plan.reason and "\n" not in plan.reason


def test_a_calibration_on_this_machine_is_data():
    """Measured GEMMs become a Compute table, measured all-reduces a Link; a Hardware carries both."""
    samples = [(64, 64, 64, 2 * 64 ** 3 / 1e9), (512, 512, 512, 2 * 512 ** 3 / 4e9), (512, 512, 512, 1.0)]
    table = cost.gemm_table(samples, e=4)
    assert [r for _, r in table] == [pytest.approx(1e9), pytest.approx(4e9)]
    link = cost.fitted_link([(2, 1e6, 2 * 1e-4 + 1e6 / 1e9), (4, 1e6, 6 * 1e-4 + 1.5e6 / 1e9),
                             (4, 1e7, 6 * 1e-4 + 1.5e7 / 1e9)])
    assert link.alpha == pytest.approx(1e-4, rel=1e-6) and link.bandwidth == pytest.approx(1e9, rel=1e-6)
    hw = replace(HARDWARE["cpu"], gemm_table=table, bw_node=link.bandwidth, alpha_node=link.alpha)
    plan = predict(Workload(preset("tiny"), 8, "fp32"), 2, 1, 1, 0, 1, hw)
    assert plan.valid and plan.time["compute"] > 0 and plan.time["dp"] > 2 * link.alpha
