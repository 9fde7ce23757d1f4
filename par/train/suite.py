"""The benchmark table of lecture 07: GPT-lite under every strategy, measured and predicted.

`python -m par bench suite --nproc 2` trains the same model on the same global batches under each
configuration, each a DeepSpeed-style config handed to `par.train.job` (`par.train.loop`'s loop):

    single | pipeline (1F1B) | TP | DDP | ZeRO-1 | ZeRO-2 | ZeRO-3 | ZeRO-3 + offload | fp16 | bf16 (ZeRO-1) | 3D

and reports per row samples per second (median of the timed steps, with the fastest and slowest),
the speed-up over `single`, average and peak memory per rank, bytes sent per rank and step
(`par.comm.commlog`), beside the planner's prediction for the same config (`par.train.planner`); and the largest
GPT-lite (same depth and heads, wider) whose predicted memory fits `--memory` bytes per device.

A timed launch measures this machine just before each of its rows (`par.train.calibration`: the row's GEMMs,
the per-operation launch cost, the memory-bound and optimizer bytes/s, the host copies and, on more than one rank,
par's collectives), and each row keeps its own `calibration`: `predicted_step_times` predicts every timed row
on the Hardware measured just before it ran (`calibrated`), at the one in-step efficiency η fitted on single's
step (`in_step_efficiency`: the step reaches a share of the rates its operations reach one kind at a time), so a
ratio measured / predicted of any other row is a test of the planner on numbers it was not fitted to, taken
within seconds of the steps it predicts.

What makes the timings honest:

* every row pays the same per step: one loop (`par.train.loop`), the same micro-batch size, no activation meter in a
  timed step (`par.memory.accounting.saved_activation_bytes` measures every engine in the warm-up step);
* every row, `single` included, is timed the same way: each rank one thread (`par.runtime.launch`), one
  warm-up step, the same timed steps, a step's wall-clock time the slowest rank's, the median of the timed
  steps (`par.train.loop.summarize`); the speed-up is single's median over the row's (`speedups`);
* so n ranks have at most n times the arithmetic of `single`: a speed-up over `single` cannot exceed the
  number of ranks, nor, for a pipeline, n·m/(m+p−1) (`speedup_bound`; 16-bit rows change the arithmetic
  itself, so their speed-up is not compared);
* a row is timed only when every rank has a core of its own (`timing_slots`: physical cores for gloo,
  GPUs for NCCL); the others (the 3D row needs 8 ranks) run for correctness, bytes and memory and say
  "not timed";
* the model is big enough that the matmuls dominate (`timing_model`): `tiny` itself is Python overhead.

The 3D row is a real one, every degree > 1 (dp2xpp2xtp2 on 8 ranks below a world of 8); where it cannot
be timed it trains the preset and is checked against one process trained on the same batches (`--check`). A launch that fails makes its
rows carry the error; `run_suite(strict=True)` (the lecture's cell) raises it, in one line, at once.
Plot with `par.course.lectures.l07_putting_it_together.benchmark_table(rows)`.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import replace
from pathlib import Path

import par.runtime.dist
from par.measure import plain, typed
from par.memory.accounting import format_bytes
from par.model import preset
from par.runtime import launch, preflight
from par.runtime.checks import check_writable, int_at_least, positive_float, positive_int
from par.train import calibration, job, planner
from par.train.config import ConfigError, model_config, parse

NAMES = ("single", "pipeline", "TP", "DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "ZeRO-3+offload", "fp16", "bf16", "3D")
EXACT = 1e-5       # max |parameter - single process| for a layout to count as matching the reference
# Adam's eps, as in the equivalence tests: Adam's step lr·g/(√v + eps) turns a gradient element of eps's size
# (e.g. the LM-head row of a character absent from the batch, ~1e-8) into an lr-sized step, so with the
# default 1e-8 two summation orders of the same gradient differ by ~2e-5 after one step, even in one process.
ADAM_EPS = 1e-6


class BenchmarkError(RuntimeError):
    """A benchmark launch failed: the configuration and the failing rank's error, one line."""


def timing_model(preset: str) -> dict:
    """The model section the suite trains. 'tiny' is Python overhead on any device (a micro-batch of 2 × 32
    tokens is 0.025 GFLOP: ~5 ms on one CPU core, ~90 % of it outside the matmuls), so timing it would
    measure Python, not parallelism. The suite widens it to d_model 256 over 64 tokens: 2.6 GFLOP per
    micro-batch, ~50 ms on one core, ~90 % of it in matmuls. Other presets are timed as they are."""
    return {"preset": "tiny", "d_model": 256, "block_size": 64} if preset == "tiny" else {"preset": preset}


def timing_slots(backend: str = "auto", world: int = 1) -> int:
    """How many ranks can be timed at once: one per physical core on gloo, one per GPU on NCCL."""
    if par.runtime.dist.choose_backend(world, backend) == "nccl":
        import torch
        return torch.cuda.device_count()
    return par.runtime.dist.physical_cores()


def layout_3d(world: int) -> tuple[int, int, int]:
    """(dp, pp, tp) of the 3D row, every degree > 1: tp 2, pp 2, the rest dp (8 ranks below a world of 8)."""
    n = world if world >= 8 and world % 4 == 0 else 8
    return n // 4, 2, 2


def model_label(model: dict) -> str:
    """'tiny' or 'tiny d_model=256 block_size=64': a model section in a few words."""
    return " ".join([model.get("preset", "tiny"), *(f"{k}={v}" for k, v in model.items() if k != "preset")])


def config_for(name: str, world: int, model: dict | str, micro_batch: int, steps: int) -> tuple[dict, int]:
    """(DeepSpeed-style config, number of ranks) of one benchmark row; `model`: a model section or a preset name.

    Every row trains the same global batch B = micro_batch × 4 × world in micro-batches of `micro_batch`
    samples; the config derives the accumulation steps (= pipeline micro-batches): 4 for DDP/ZeRO, 4·world on
    the single device, 4·pp·tp/ (replicas) for pipeline, TP and 3D layouts."""
    model = {"preset": model} if isinstance(model, str) else model
    base = {"train_batch_size": micro_batch * 4 * world, "train_micro_batch_size_per_gpu": micro_batch,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "eps": ADAM_EPS}}, "model": dict(model),
            "steps": steps}
    zero = lambda stage, **kw: {"zero_optimization": {"stage": stage, **kw}}
    if name == "single":
        return base, 1
    if name == "pipeline":
        return {**base, "pipeline": {"stages": min(4, world)}}, world
    if name == "TP":
        heads = preset(model.get("preset", "tiny"), **{k: v for k, v in model.items() if k != "preset"}).n_head
        # tp = gcd(world, heads): the largest degree that divides the heads and the world (dp = world / tp)
        return {**base, "tensor_parallel": {"tp_size": math.gcd(world, heads)}}, world
    if name == "DDP":
        return {**base, **zero(0)}, world
    if name.startswith("ZeRO"):
        extra = {"offload_optimizer": {"device": "cpu"}} if "offload" in name else {}
        return {**base, **zero(int(name[5]), **extra)}, world
    if name in ("fp16", "bf16"):
        return {**base, name: {"enabled": True}, **zero(1)}, world
    if name == "3D":
        dp, pp, tp = layout_3d(world)
        return {**base, "pipeline": {"stages": pp}, "tensor_parallel": {"tp_size": tp}, **zero(1)}, dp * pp * tp
    raise ValueError(f"unknown benchmark configuration {name!r}: use {', '.join(NAMES)}")


def predicted(tc, hw: planner.Hardware, search_world: int, memory: float) -> dict:
    """The planner's numbers for this config, and the largest model that fits `memory` per device."""
    plan = planner.from_config(tc, hw)
    w = planner.Workload(model_config(tc), tc.train_batch_size,
                         "fp32" if tc.precision == "fp32" else "mixed", tc.optimizer)
    scale = search_world // tc.world_size if search_world % tc.world_size == 0 else 1
    dp = tc.dp * scale
    batch = tc.train_batch_size * scale
    _, psi = planner.largest_model(planner.Workload(w.model, batch, w.precision, w.optimizer), dp, tc.pp, tc.tp,
                                   tc.zero_stage, tc.grad_accum, replace(hw, memory=memory), tc.offload)
    states = plan.memory["params"] + plan.memory["grads"] + plan.memory["optimizer"]
    return {"pred_model_states": states, "pred_activations": plan.memory["activations"],
            "pred_mem": plan.memory["total"], "pred_bytes_per_step": plan.bytes["total"],
            "largest_params": psi, "search_world": dp * tc.pp * tc.tp}


def plan_rows(names=NAMES, nproc: int = 2, preset: str = "tiny", micro_batch: int = 2, steps: int = 6,
              slots: int = 1, model: dict | None = None, check: bool | None = None, memory: float = 80e9,
              search_world: int | None = None, hardware: str = "a100-80gb") -> dict:
    """{name: row} before anything runs: its config, its ranks, whether it is timed (ranks <= `slots`) and
    checked, the planner's prediction; a config that cannot be parsed gets its error.

    Timed rows train `model` (default `timing_model(preset)`). Rows that cannot be timed here train the preset
    itself, checked (`check=None`) against one process trained on the same batches, every parameter compared:
    they are there for correctness, bytes and memory, and the preset ('tiny') is where fp32 training matches
    one process to 1e-5 after several Adam steps (a wider model has more gradient elements of eps's size, see
    ADAM_EPS: accumulating 8 micro-batches instead of one batch moves it by ~4e-5 after one step)."""
    hw = planner.HARDWARE[hardware]
    rows = {}
    for name in names:
        n = config_for(name, nproc, {"preset": preset}, micro_batch, steps)[1]
        timed = n <= slots
        cfg, _ = config_for(name, nproc, (model or timing_model(preset)) if timed else {"preset": preset},
                            micro_batch, steps)
        rows[name] = {"name": name, "nproc": n, "config": cfg, "timed": timed,
                      "checked": (not timed) if check is None else check}
        try:
            rows[name].update(predicted(parse(cfg, n), hw, search_world or nproc, memory))
        except (ConfigError, ValueError) as e:
            rows[name]["error"] = f"{name}: {e}"
    return rows


def launches(rows: dict) -> dict:
    """{(ranks, checked): [row names]}: the launches `run_suite` makes for `plan_rows`' rows, one per group."""
    out = {}
    for name, row in rows.items():
        if "error" not in row:
            out.setdefault((row["nproc"], row["checked"]), []).append(name)
    return out


def launch_order(rows: dict) -> list[tuple[tuple[int, bool], list[str]]]:
    """`launches` in the order `run_suite` makes them: by ranks, and where `single` is timed and other launches
    follow it, single's launch once more at the end: the reference is measured before and after the rows."""
    todo = sorted(launches(rows).items())
    if len(todo) > 1 and "single" in todo[0][1] and rows["single"]["timed"]:
        todo.append(todo[0])
    return todo


def launch_args(rows: dict, group: list[str]) -> job.Args:
    """The arguments of `par.train.job` for one launch: every row's config, checked when the rows are, and a
    launch of timed rows calibrated (`par.train.calibration`: the machine measured before each row runs)."""
    return job.Args(config=tuple(json.dumps(rows[name]["config"]) for name in group), check=rows[group[0]]["checked"],
                    calibrate=all(rows[name]["timed"] for name in group))


def run_suite(names=NAMES, nproc: int = 2, preset: str = "tiny", micro_batch: int = 2, steps: int = 6,
              backend: str = "auto", memory: float = 80e9, search_world: int | None = None,
              hardware: str = "a100-80gb", timeout: int = 300, progress: bool = False, model: dict | None = None,
              check: bool | None = None, strict: bool = False) -> list[dict]:
    """One row per configuration (`plan_rows`): measured by `par.train.job` beside predicted by `par.train.planner`.

    Rows with the same number of ranks (and the same check) run in one launch (start-up costs seconds).
    Single's launch runs first and again last (`launch_order`), and single keeps the faster of its two runs
    (both medians in `reference_medians`): other programs on the machine only ever slow a run down, so a burst
    of load during the reference's launch would make every row look faster than it is; the faster run is the
    nearer to single's time on a machine of its own, and a speed-up can only come out lower for it. Each row
    keeps the `calibration` measured just before it ran (single: that of the run it keeps).
    `strict`: raise `BenchmarkError` at the first row that cannot run instead of recording it in the row."""
    rows = plan_rows(names, nproc, preset, micro_batch, steps, timing_slots(backend, nproc), model, check, memory,
                     search_world, hardware)
    bad = [row["error"] for row in rows.values() if "error" in row]
    if strict and bad:
        raise BenchmarkError(bad[0])
    if preflight.choose_backend(nproc, backend) == "nccl":   # on GPUs: a row needing more GPUs than there are is skipped
        for row in rows.values():
            if row["nproc"] > nproc and "error" not in row:
                row["skipped"] = f"needs {row['nproc']} GPUs, this run has {nproc}"
    todo = launch_order({k: r for k, r in rows.items() if "skipped" not in r})
    if progress:
        from tqdm.auto import tqdm
        todo = tqdm(todo, desc="launches", unit="launch")
    for (n, checked), group in todo:
        t0 = time.perf_counter()
        try:
            got = launch.run("par.train.job", nproc=n, args=launch_args(rows, group).to_argv(), backend=backend,
                             timeout=timeout, quiet=True)
        except launch.LaunchError as e:
            if strict:
                raise BenchmarkError(f"{', '.join(group)} on {n} ranks: {e.root_cause}") from None
            for name in group:
                rows[name]["error"] = e.root_cause
            continue
        got = dict(got)
        runs = got["runs"] if "runs" in got else [got]
        for name, measured in zip(group, runs):
            if "error" in measured:      # a configuration this device cannot run (fp16 without fp16 kernels)
                rows[name]["skipped"] = measured["error"]
                continue
            if "median_step_s" in rows[name]:     # single's second launch: keep the faster of the two
                medians = rows[name]["reference_medians"] + [measured["median_step_s"]]
                if measured["median_step_s"] >= rows[name]["median_step_s"]:
                    rows[name]["reference_medians"] = medians
                    continue
                measured = {**measured, "reference_medians": medians}
            else:
                measured = {**measured, "reference_medians": [measured["median_step_s"]]}
            rows[name].update(measured)
            rows[name]["launch_s"] = time.perf_counter() - t0
    return [rows[name] for name in names]


def results(rows: list[dict]) -> list:
    """The rows as typed results (`par.measure.typed`), as a notebook reads them: `row.samples_per_s`,
    `row.config.model`; every function here reads them too."""
    return typed(rows)


def measured(rows: list[dict]) -> list[dict]:
    """The rows that ran (no error, not skipped)."""
    return [r for r in rows if "error" not in r and "skipped" not in r]


def speedup_bound(row: dict) -> float:
    """The most a row can gain over `single`: n ranks share single's arithmetic, so at most n; a pipeline of p
    stages and m micro-batches idles in the bubble, (m + p − 1) micro-batch slots for m of work on each stage,
    so at most n·m/(m + p − 1)."""
    n, p = row["nproc"], plain(row["config"]).get("pipeline", {}).get("stages", 1)
    m = row["grad_accum"]
    return n * m / (m + p - 1) if p > 1 else float(n)


def speedups(rows: list[dict]) -> dict:
    """{row: {"speedup": single's median step time / the row's, "ranks": n, "bound": `speedup_bound`}} for the
    timed rows of single's precision (a 16-bit row changes the arithmetic, not only how it is shared out).

    Both step times are the same clock: wall-clock seconds of the slowest rank, the median of the timed steps
    after the same warm-up, one thread per rank. (Single's CPU seconds against the rows' wall seconds would
    compare two clocks: on a busy machine a process's CPU seconds run slower than the wall clock, and the
    ratio means neither.)"""
    ran = {r["name"]: r for r in measured(rows)}
    if "single" not in ran or not ran["single"]["timed"]:
        return {}
    base = ran["single"]["median_step_s"]
    return {name: {"speedup": 1.0 if name == "single" else round(base / r["median_step_s"], 3), "ranks": r["nproc"],
                   "bound": round(speedup_bound(r), 3)}
            for name, r in ran.items() if r["timed"] and r["precision"] == ran["single"]["precision"]}


def calibrated(row: dict, hardware: str = "cpu") -> planner.Hardware:
    """The Hardware a row is predicted on: what was measured on this machine just before the row ran
    (`par.train.calibration.hardware` of the row's `calibration`), memory and links between nodes `hardware`'s."""
    if not row.get("calibration"):
        raise ValueError(f"row {row['name']!r} carries no calibration: run it with par.train.suite.run_suite "
                         f"(its timed launches measure this machine first)")
    return calibration.hardware(plain(row["calibration"]), hardware)


def _plan(row: dict, hw: planner.Hardware) -> planner.Plan:
    """The planner's prediction of a row on `hw`: data-parallel communication overlapped with backward only where
    the engine overlaps (ZeRO-3 with prefetch) and a core is free for it (ranks < the machine's cores)."""
    tc = parse(plain(row["config"]), row["nproc"])
    cal = plain(row.get("calibration") or {})
    overlap = tc.prefetch and tc.zero_stage == 3 and row["nproc"] < cal.get("cores", row["nproc"])
    return planner.from_config(tc, hw, overlap=overlap)


def in_step_efficiency(rows: list[dict], hardware: str = "cpu", lo: float = 0.2, hi: float = 5.0) -> float:
    """η, the share of its calibration's rates (GEMMs, memory-bound and optimizer bytes/s, measured one kind at a
    time) that single's step reaches: the η at which the planner predicts single's measured median step on the
    load-proof clock, by bisection (predicted time falls as η rises). 1.0 without a timed single row. Fitted on
    this one row, as a GPU's η on one published run, and used for every row of the run."""
    single = next((r for r in measured(rows) if r["name"] == "single" and r.get("median_steady_s")), None)
    if single is None:
        return 1.0
    hw, want = calibrated(single, hardware), single["median_steady_s"]
    time_at = lambda eta: _plan(single, replace(hw, efficiency=eta)).time["total"]  # noqa: E731
    if not time_at(hi) <= want <= time_at(lo):
        raise ValueError(f"single's measured step {want * 1e3:.1f} ms is outside what η in [{lo}, {hi}] predicts")
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if time_at(mid) > want else (lo, mid)
    return round((lo + hi) / 2, 4)


def pooled_straggle(rows: list[dict]) -> float:
    """Seconds a collective waits per second of compute before it, the median over the run's multi-rank rows of
    each row's measurement (`calibration.straggle`): one row's is the difference of two short timings, and moved
    from 0.00 to 0.24 between rows a minute apart on this machine; 0.0 without a multi-rank calibration."""
    each = [calibration.straggle(plain(r["calibration"])) for r in measured(rows)
            if r.get("calibration") and r["nproc"] > 1 and plain(r["calibration"]).get("straggle")]
    return statistics.median(each) if each else 0.0


def predicted_step_times(rows: list[dict], hardware: str = "cpu") -> dict:
    """{row: {"predicted_s", "measured_s", "measured_wall_s", "ratio": measured / predicted, "parts": the
    prediction's seconds by part, "calibrates": True for single}} for every timed row of single's precision.
    Measured: the median step on the load-proof clock (`median_steady_s`), the clock the calibration measured on,
    with the wall clock's beside it; predicted: the planner's step time (`_plan`) on the Hardware measured just
    before the row ran (`calibrated`), at the run's in-step efficiency (`in_step_efficiency`, fitted on single,
    whose ratio is therefore 1) and the run's straggle (`pooled_straggle`)."""
    sp = speedups(rows)
    if not sp:
        return {}
    eta, straggle = in_step_efficiency(rows, hardware), pooled_straggle(rows)
    out = {}
    for r in measured(rows):
        if r["name"] in sp:
            hw = replace(calibrated(r, hardware), efficiency=eta)
            plan = _plan(r, replace(hw, straggle=straggle) if r["nproc"] > 1 else hw)
            t = plan.time["total"]
            out[r["name"]] = {"predicted_s": t, "measured_s": r["median_steady_s"],
                              "measured_wall_s": r["median_step_s"], "ratio": round(r["median_steady_s"] / t, 3),
                              "parts": {k: v for k, v in plan.time.items() if k != "total" and v > 0},
                              "efficiency": eta, "calibrates": r["name"] == "single"}
    return out


def work(rows: list[dict]) -> dict:
    """{row: CPU seconds per step summed over its ranks / single's}: >= 1 when no row skips work single does
    (a row below 1 would be measured unfairly, e.g. a meter only some engines pay)."""
    ran = {r["name"]: r for r in measured(rows)}
    if "single" not in ran:
        return {}
    return {name: round(r["median_cpu_s"] / ran["single"]["median_cpu_s"], 3) for name, r in ran.items()
            if r["timed"] and r["precision"] == ran["single"]["precision"]}


def layouts_matching_reference(rows: list[dict], tol: float = EXACT) -> list[str]:
    """Layouts ('dp2xpp2xtp2') of the rows that ran with the check and matched one process to `tol`."""
    return [r["layout"] for r in measured(rows) if r.get("max_param_diff", float("inf")) <= tol]


def format_table(rows: list[dict]) -> str:
    speed, cpu = speedups(rows), work(rows)
    head = (f"{'configuration':<26} {'ranks':>5} {'samples/s (min-max)':>21} {'speed-up':>8} {'work':>5} {'mem avg':>10} "
            f"{'mem peak':>10} {'pred mem':>10} {'bytes/step':>10} {'pred bytes':>10} {'largest fits':>12}  model")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r or "skipped" in r:
            lines.append(f"{r['name']:<26} {r['nproc']:>5} {'error' if 'error' in r else 'skipped'}: "
                         f"{r.get('error', r.get('skipped'))[:110]}")
            continue
        lo, hi = r["samples_per_s_range"]
        rate = f"{r['samples_per_s']:.1f} ({lo:.0f}-{hi:.0f})" if r["timed"] else "not timed"
        sp = f"{speed[r['name']]['speedup']:.2f}" if r["name"] in speed else "-"
        wk = f"{cpu[r['name']]:.2f}" if r["name"] in cpu else "-"
        lines.append(f"{r['strategy'][:26]:<26} {r['nproc']:>5} {rate:>21} {sp:>8} {wk:>5} {format_bytes(r['mem_avg']):>10} "
                     f"{format_bytes(r['mem_peak']):>10} {format_bytes(r['pred_mem']):>10} "
                     f"{format_bytes(r['bytes_per_step']):>10} {format_bytes(r['pred_bytes_per_step']):>10} "
                     f"{r['largest_params'] / 1e9:>10.2f} B  {model_label(r['config']['model'])}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m par bench suite", description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=positive_int, default=None, help="ranks of the timed rows (default: min(4, cores))")
    ap.add_argument("--preset", default="tiny", help="tiny is timed widened (see timing_model)")
    ap.add_argument("--micro-batch", type=positive_int, default=2)
    ap.add_argument("--steps", type=int_at_least(2, "the first step is a warm-up"), default=6, help="steps per row; the first is a warm-up, not timed")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--configs", default=None, help=f"comma-separated subset of {', '.join(NAMES)} (default: all; "
                                                    f"on CPUs all but fp16 and bf16, whose CPU kernels are slow)")
    ap.add_argument("--memory", type=positive_float, default=80e9, help="bytes per device for the largest-model search")
    ap.add_argument("--world", type=positive_int, default=None, help="devices for the largest-model search (default nproc)")
    ap.add_argument("--hardware", default="a100-80gb", choices=sorted(planner.HARDWARE))
    ap.add_argument("--out", default="runs/bench_suite.json")
    args = ap.parse_args(argv)
    if args.steps < 4:
        ap.error(f"--steps {args.steps}: use at least 4 (a warm-up and 3 timed steps for a median and a spread)")
    check_writable(args.out, parents=True)
    if args.nproc is None:
        args.nproc = par.runtime.dist.default_world_size()
    if args.configs is None:
        gpu = par.runtime.dist.choose_backend(args.nproc, args.backend) == "nccl"
        names = [n for n in NAMES if gpu or n not in ("fp16", "bf16")]
    else:
        names = [n.strip() for n in args.configs.split(",") if n.strip()]
    rows = run_suite(names, args.nproc, args.preset, args.micro_batch, args.steps, args.backend, args.memory,
                     args.world, args.hardware)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print(format_table(rows))
    ok = measured(rows)
    print(f"\n(timed rows: median of {len(ok[0]['step_s']) if ok else 0} steps after a warm-up; "
          f"memory: {ok[0]['mem_source'] if ok else '?'}; speed-up over single: "
          f"{json.dumps(speedups(rows))}; matched one process: {layouts_matching_reference(rows)}; wrote {args.out})")
    return 0
