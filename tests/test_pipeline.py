"""The pipeline runtime equals single-process training; naive model parallel too; errors are one clear line.

One launch per p = 2, 3, 4 (tests/workers/pp_equivalence.py) runs every schedule for
m in {1, p-1, p, 2p+1}: gradients, losses and parameters after 3 Adam steps against the
reference, plus the executed timeline, the measured activation memory and the p2p groups each
rank posted. Each launch runs twice: plain gloo, and with NCCL's p2p semantics emulated
(PAR_NCCL_EMULATION=1: one Work per batch, a received tensor holds NaN until that Work is waited).
"""
from __future__ import annotations

from pathlib import Path

import pytest
from tiers import tiered, tiered_one
import torch

import par.runtime.launch
from par.pp import p2p_plan, sim as sim, schedules
from par.data import CharDataset, global_batches
from par.model import TinyMLP, build, lm_loss, preset
from par.pp.naive_mp import NaiveModelParallel
from par.pp.pipeline import ActionCosts, Pipeline, PipelineError, split_microbatches
from test_timeline import FakeEvent, GpuClock

WORKER = Path(__file__).parent / "workers" / "pp_equivalence.py"
_RESULTS: dict = {}


@pytest.fixture(params=tiered_one([(p, emulate) for p in (2, 3, 4) for emulate in (False, True)],
                                   lambda x: f"p{x[0]}" + ("-nccl-emulation" if x[1] else "")))
def run(request):
    if request.param not in _RESULTS:
        p, emulate = request.param
        env = {"PAR_NCCL_EMULATION": "1"} if emulate else None
        _RESULTS[request.param] = par.runtime.launch.run(str(WORKER), nproc=p, timeout=500, quiet=True, env=env)
    return request.param[0], _RESULTS[request.param]


def expected_cases(p):
    ms = sorted({1, p - 1, p, 2 * p + 1} - {0})
    names = [f"{k} m={m}" for m in ms for k in ("gpipe", "1f1b", "interleaved")]
    names += [f"naive m={m}" for m in ms if m <= p] + [f"interleaved m={2 * p}"]
    return set(names) | {"1f1b mlp"} | ({"dp2 x pp2"} if p == 4 else set())


def test_pipeline_equals_single_process(run):
    p, res = run
    assert set(res) == expected_cases(p)
    for name, r in res.items():
        assert r["grad"] <= 1e-5, (name, r["grad"])
        if name != "dp2 x pp2":
            assert r["grad_whole_batch"] <= 1e-5, (name, r["grad_whole_batch"])
        assert r["loss"] <= 1e-5, (name, r["loss"])
        assert r["param"] <= 1e-5, (name, r["param"])
        assert len(r["losses"]) == 3 or name == "dp2 x pp2", name   # the last stage reported every step's loss
        if name == "dp2 x pp2":
            assert len(r["losses"]) == 6 and r["n_params"] == sum(x.numel() for x in build("tiny").parameters())
            continue
        if name != "1f1b mlp":
            assert 2.0 < r["losses"][0] < 6.0, name     # a real cross-entropy, not a zero
            v = 2 if name.startswith("interleaved") else 1
            n_layer = max(4, p * v - 2)
            assert r["n_params"] == sum(x.numel() for x in build(preset("tiny", n_layer=n_layer)).parameters())
    assert res["1f1b mlp"]["n_params"] == sum(x.numel() for x in TinyMLP((10, 33, 17, 29, 5)).parameters())


def test_runtime_posts_exactly_the_checked_plan(run):
    """Every rank's p2p groups, as the runtime posted them in its last step, are the groups of the plan
    that `pipeline_sim` replayed under NCCL's rule (`p2p_plan.build`, one shared function)."""
    p, res = run
    for name, r in res.items():
        if name == "1f1b mlp":
            sched = schedules.one_f_one_b(p, p + 1)
        elif name == "dp2 x pp2":
            sched = schedules.one_f_one_b(2, 3)
        else:
            kind, m = name.split(" m=")
            sched = schedules.make(kind, p, int(m), 2 if kind == "interleaved" else 1)
        plan = sim.verified_plan(sched)
        executed = r["executed"] if name != "dp2 x pp2" else r["executed"][:2]   # replica 0's two stages
        assert len(executed) == sched.num_ranks
        for rank, groups in enumerate(executed):
            posted = [[(kind, peer, tuple(message)) for kind, peer, message in g] for g in groups]
            assert posted == [[(o.kind, o.peer, o.message) for o in g.sends + g.recvs] for g in plan.groups(rank)], \
                (name, rank)
        assert sum(len(g) for groups in executed for g in groups) == 2 * sum(
            1 for rank, acts in enumerate(sched.ranks) for a in acts
            if (out := p2p_plan.message_out(sched, rank, a)) is not None and out[1] != rank)


def test_executed_timeline_follows_the_schedule(run):
    p, res = run
    for name, r in res.items():
        if name in ("1f1b mlp", "dp2 x pp2"):
            continue
        kind, m = name.split(" m=")
        sched = schedules.make(kind, p, int(m), 2 if kind == "interleaved" else 1)
        for rank in range(p):
            mine = sorted((s for s in r["spans"] if s["rank"] == rank and s["lane"] == "compute"),
                          key=lambda s: s["start"])
            assert [s["name"] for s in mine] == [str(a) for a in sched.ranks[rank]], (name, rank)
            assert all(a["end"] <= b["start"] for a, b in zip(mine, mine[1:]))
        # (no cross-rank start/end comparisons: each rank's clock starts at its own exit from a barrier)


def test_measured_in_flight_and_activation_memory(run):
    p, res = run
    m = 2 * p + 1
    gpipe, ofob = res[f"gpipe m={m}"]["memory"], res[f"1f1b m={m}"]["memory"]
    for s in range(p):
        assert gpipe[s]["peak_in_flight"] == m
        assert ofob[s]["peak_in_flight"] == min(p - s, m)
        per_mb = gpipe[s]["bytes_per_microbatch"]
        assert per_mb > 0
        assert gpipe[s]["peak_bytes"] == pytest.approx(m * per_mb, rel=0.02)
        assert ofob[s]["peak_bytes"] == pytest.approx(min(p - s, m) * per_mb, rel=0.02)


# ---------------------------------------------------------------- in-process: errors, naive MP
def test_errors_are_one_clear_line():
    layers = build("tiny").to_layers()
    with pytest.raises(ValueError, match="cannot cut 6 layers into 8 stages"):
        Pipeline(layers, schedules.interleaved(1, 2, 8), lm_loss)
    with pytest.raises(PipelineError, match=r"a batch of 10 rows does not split into 3 equal micro-batches: "
                                            r"use a batch divisible by 3 \(e\.g\. 9 or 12\)"):
        split_microbatches(torch.zeros(10, 4), 3)
    with pytest.raises(ValueError, match="unknown schedule 'gpip'"):
        schedules.make("gpip", 1, 2)
    with pytest.raises(PipelineError, match="the schedule is for 2 ranks but the job has 1"):
        Pipeline(layers, schedules.gpipe(2, 2), lm_loss)
    with pytest.raises(sim.ScheduleError, match="backward B0 comes before its forward"):
        Pipeline(layers, schedules.from_lists(["B0 F0"]), lm_loss)
    pipe = Pipeline(layers, schedules.gpipe(1, 3), lm_loss)
    with pytest.raises(PipelineError, match="a batch of 4 rows does not split into 3"):
        pipe.step(torch.zeros(4, 32, dtype=torch.long), torch.zeros(4, 32, dtype=torch.long))


def test_one_rank_with_chunks_equals_the_model():
    """p = 1 and v = 3: every hand-off stays on the rank; gradients still equal the whole-batch ones."""
    cfg = preset("tiny")
    x, y = next(global_batches(CharDataset(block_size=cfg.block_size), 6, 1, seed=4))
    ref, model = build(cfg, seed=3), build(cfg, seed=3)
    pipe = Pipeline(model.to_layers(), schedules.interleaved(1, 3, 3), lm_loss, method="uniform")
    loss = pipe.step(x, y)
    ref_loss = lm_loss(ref(x), y)
    ref_loss.backward()
    assert loss == pytest.approx(ref_loss.item(), abs=1e-6)
    assert max((a.grad - b.grad).abs().max().item() for a, b in zip(model.parameters(), ref.parameters())) < 1e-6


def test_action_costs_are_cpu_time_on_the_cpu_and_cuda_events_on_a_gpu(monkeypatch):
    cpu = ActionCosts(torch.device("cpu"))
    with cpu.action("F0"):
        sum(range(200_000))
    with cpu.action("B0"):
        pass
    assert set(cpu.seconds()) == {"F0", "B0"} and cpu.seconds()["F0"] > cpu.seconds()["B0"] >= 0
    gpu, synced = GpuClock(), []

    class Event(FakeEvent):
        def synchronize(self):
            synced.append(self.t)
    monkeypatch.setattr(ActionCosts, "_event", lambda self: Event(gpu.t, "current"))
    costs = ActionCosts(torch.device("cuda", 0))
    gpu.t = 1.0
    with costs.action("F0"):           # the CPU only launches: the GPU runs F0 from 1.0 s to 1.5 s ...
        gpu.t = 1.5
    gpu.t = 3.0
    with costs.action("B0"):           # ... and B0 (on autograd's device thread) from 3.0 s to 4.25 s
        gpu.t = 4.25
    assert costs.seconds() == {"F0": 0.5, "B0": 1.25} and synced == [4.25], "read after the last event"


def test_a_pipeline_step_reports_each_actions_cost():
    cfg = preset("tiny")
    x, y = next(global_batches(CharDataset(block_size=cfg.block_size), 4, 1, seed=4))
    pipe = Pipeline(build(cfg, seed=3).to_layers(), schedules.gpipe(1, 2), lm_loss)
    pipe.step(x, y)
    assert set(pipe.cpu_s) == {"F0", "F1", "B0", "B1"} and all(s > 0 for s in pipe.cpu_s.values())
    assert set(pipe.after_s) == set(pipe.cpu_s) and pipe.after_s["B1"] == {"wall": 0.0, "steady": 0.0, "cpu": 0.0}
    assert all(0 <= t[c] for t in pipe.after_s.values() for c in ("wall", "steady", "cpu"))   # the time between actions
    assert all(t["cpu"] <= t["wall"] + 1e-3 for t in pipe.after_s.values())


@pytest.mark.gpu
def test_on_a_real_gpu_backward_costs_more_than_nothing():
    """Backward runs on autograd's device thread: the caller's CPU time would read ≈ 0, CUDA events do not."""
    cfg = preset("small")
    x, y = next(global_batches(CharDataset(block_size=cfg.block_size), 16, 1, seed=4))
    pipe = Pipeline(build(cfg, seed=3).to_layers(), schedules.gpipe(1, 2), lm_loss, device="cuda:0")
    for _ in range(2):
        pipe.step(x, y)
    assert pipe.cpu_s["B0"] > 0.5 * pipe.cpu_s["F0"] > 0


def test_naive_model_parallel_on_cpu_equals_one_device():
    cfg = preset("tiny")
    x, y = next(global_batches(CharDataset(block_size=cfg.block_size), 4, 1, seed=2))
    ref = build(cfg, seed=5)
    nmp = NaiveModelParallel(build(cfg, seed=5).to_layers(), ["cpu", "cpu", "cpu"])
    assert [len(s) for s in nmp.stages] == [2, 2, 2]
    assert torch.equal(nmp(x), ref(x))
    loss, spans = nmp.timed_step(x, y, lm_loss)
    ref_loss = lm_loss(ref(x), y)
    ref_loss.backward()
    assert loss == pytest.approx(ref_loss.item(), abs=1e-6)
    assert max((a.grad - b.grad).abs().max().item() for a, b in zip(nmp.parameters(), ref.parameters())) < 1e-6
    # one device at a time: F0 F1 F2 B2 B1 B0, each starting after the previous one ended
    assert [(s["rank"], s["name"]) for s in spans] == [(0, "F"), (1, "F"), (2, "F"), (2, "B"), (1, "B"), (0, "B")]
    assert all(a["end"] <= b["start"] for a, b in zip(spans, spans[1:]))


@pytest.mark.parametrize("m", tiered([4, 3]))
def test_torch_pipelining_trains_the_same_model(m):
    """par.pp.vs_torch_job: par's GPipe and torch's ScheduleGPipe on the same stages, 3 Adam steps.
    m = 4: par divides each micro-batch's loss by m, torch its summed gradients; by 4 both are exact, so the
    runs are bit-identical. m = 3: 1/3 is not exact in binary, so the gradients differ in rounding (≤ 1e-6);
    Adam's first steps move a parameter by about lr·sign(g) where |g| is near its eps, which turns that rounding
    into parameter differences of order 1e-5, so for m = 3 the parameters are not compared."""
    res = par.runtime.launch.run("par.pp.vs_torch_job", nproc=2, timeout=300, quiet=True,
                                 args=["--schedule", "gpipe", "--microbatches", m, "--steps", 3])
    assert res["world_size"] == 2 and len(res["losses"]) == len(res["losses_torch"]) == 3
    assert 2.0 < res["losses"][0] < 6.0 and res["losses"][-1] < res["losses"][0]
    if m == 4:
        assert res["max_grad_diff"] == res["max_loss_diff"] == res["max_param_diff"] == 0.0
    else:
        assert res["max_grad_diff"] <= 1e-6 and res["max_loss_diff"] <= 1e-6
    assert [tuple(r["bounds"]) for r in res["per_rank"]] == [(0, 3), (3, 6)]
