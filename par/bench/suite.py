"""The benchmark table of lecture 07: GPT-lite under every strategy, measured and predicted.

`python -m par bench suite --nproc 4 --preset small --steps 6` runs `par.jobs.train` on a
DeepSpeed-style config built here for each of (one launch per world size, configs in turn):

    single device | pipeline (4 stages, 1F1B) | DDP | ZeRO-1 | ZeRO-2 | ZeRO-3 | ZeRO-3 + offload |
    fp16 | bf16 (ZeRO-1, 16-bit with fp32 masters) | 3D (dp × pp × tp over all ranks)

and for each reports samples per second, average and peak memory per rank, bytes sent per rank
and step (par.commlog), next to the planner's prediction for the same config (`par.planner`):
model states + activations per device and bytes per step. Last column: the largest GPT-lite
(same depth and heads, wider) whose predicted memory fits `--memory` bytes per device under that
configuration on `--world` devices (default: the run's world size).

Writes JSON (`--out`, default runs/bench_suite.json) and prints the table. CPU timings on a
shared machine are noisy: compare the columns, not the absolute numbers. On a GPU server:
`--backend nccl --nproc 8 --preset gpt3-small`. Plot with `par.plots.benchmark_table(rows)`.
A configuration that cannot run here (fp16 on a CPU without fp16 kernels, a pipeline deeper
than the model) becomes a row with its error, not a crash.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

from par import planner
from par.config import ConfigError, model_config, parse
from par.memory import format_bytes

NAMES = ("single", "pipeline", "DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "ZeRO-3+offload", "fp16", "bf16", "3D")


def layout_3d(world: int) -> tuple[int, int, int]:
    """(dp, pp, tp) using all three dimensions when the world allows: tp 2, pp 2, the rest dp."""
    tp = 2 if world % 2 == 0 else 1
    pp = 2 if (world // tp) % 2 == 0 else 1
    return world // (tp * pp), pp, tp


def config_for(name: str, world: int, preset: str, micro_batch: int, steps: int) -> tuple[dict, int]:
    """(DeepSpeed-style config, number of ranks) of one benchmark row.

    Every row trains the same global batch B = micro_batch × 4 × world with micro-batches of
    `micro_batch` samples; the config derives the accumulation steps (= pipeline micro-batches):
    4 for DDP/ZeRO, 4·world on the single device, 4·pp·tp for pipeline and 3D layouts."""
    base = {"train_batch_size": micro_batch * 4 * world, "train_micro_batch_size_per_gpu": micro_batch,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "model": {"preset": preset}, "steps": steps}
    zero = lambda stage, **kw: {"zero_optimization": {"stage": stage, **kw}}
    if name == "single":
        return base, 1
    if name == "pipeline":
        return {**base, "pipeline": {"stages": min(4, world)}}, world
    if name == "DDP":
        return {**base, **zero(0)}, world
    if name.startswith("ZeRO"):
        extra = {"offload_optimizer": {"device": "cpu"}} if "offload" in name else {}
        return {**base, **zero(int(name[5]), **extra)}, world
    if name in ("fp16", "bf16"):
        return {**base, name: {"enabled": True}, **zero(1)}, world
    if name == "3D":
        dp, pp, tp = layout_3d(world)
        return {**base, "pipeline": {"stages": pp}, "tensor_parallel": {"tp_size": tp}, **zero(1 if dp > 1 else 0)}, world
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


def run_suite(names=NAMES, nproc: int = 2, preset: str = "tiny", micro_batch: int = 2, steps: int = 4,
              backend: str = "auto", memory: float = 80e9, search_world: int | None = None,
              hardware: str = "a100-80gb", timeout: int = 300, progress: bool = False) -> list[dict]:
    """One row per configuration: measured (par.jobs.train) beside predicted (par.planner).

    Configurations with the same number of ranks run in one launch (start-up costs seconds), the
    data-parallel family (DDP, ZeRO, 16-bit) apart from those with pipeline or tensor parallelism, so
    that one failing launch does not take every row with it."""
    from par.launch import LaunchError, run
    hw = planner.HARDWARE[hardware]
    rows = {}
    by_nproc: dict[tuple, list] = {}
    for name in names:
        cfg, n = config_for(name, nproc, preset, micro_batch, steps)
        rows[name] = {"name": name, "nproc": n, "config": cfg}
        try:
            tc = parse(cfg, n)
            rows[name].update(predicted(tc, hw, search_world or nproc, memory))
            by_nproc.setdefault((n, tc.pp * tc.tp > 1), []).append(name)
        except (ConfigError, ValueError) as e:
            rows[name]["error"] = str(e)
    launches = list(by_nproc.items())
    if progress:
        from tqdm.auto import tqdm
        launches = tqdm(launches, desc="launches", unit="launch")
    for (n, _), group in launches:
        args = [a for name in group for a in ("--config", json.dumps(rows[name]["config"]))]
        t0 = time.perf_counter()
        try:
            got = run("par.jobs.train", nproc=n, args=args, backend=backend, timeout=timeout, quiet=True)
        except LaunchError as e:
            for name in group:
                rows[name]["error"] = str(e).strip().splitlines()[-1][:300]
            continue
        got = got if isinstance(got, list) else [got]
        for name, measured in zip(group, got):
            rows[name].update(measured)
            rows[name]["launch_s"] = time.perf_counter() - t0
    return [rows[name] for name in names]


def format_table(rows: list[dict]) -> str:
    head = (f"{'configuration':<26} {'samples/s':>9} {'mem avg':>10} {'mem peak':>10} {'pred mem':>10} "
            f"{'bytes/step':>10} {'pred bytes':>10} {'largest fits':>12}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['name']:<26} error: {r['error'][:90]}")
            continue
        lines.append(f"{r['strategy'][:26]:<26} {r['samples_per_s']:>9.1f} {format_bytes(r['mem_avg']):>10} "
                     f"{format_bytes(r['mem_peak']):>10} {format_bytes(r['pred_mem']):>10} "
                     f"{format_bytes(r['bytes_per_step']):>10} {format_bytes(r['pred_bytes_per_step']):>10} "
                     f"{r['largest_params'] / 1e9:>10.2f} B")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m par bench suite", description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--configs", default=",".join(NAMES), help=f"comma-separated subset of {', '.join(NAMES)}")
    ap.add_argument("--memory", type=float, default=80e9, help="bytes per device for the largest-model search")
    ap.add_argument("--world", type=int, default=None, help="devices for the largest-model search (default nproc)")
    ap.add_argument("--hardware", default="a100-80gb", choices=sorted(planner.HARDWARE))
    ap.add_argument("--out", default="runs/bench_suite.json")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    rows = run_suite(names, args.nproc, args.preset, args.micro_batch, args.steps, args.backend, args.memory,
                     args.world, args.hardware)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print(format_table(rows))
    print(f"\n(memory: {rows[0].get('mem_source', '?')}; wrote {args.out})")
    return 0
