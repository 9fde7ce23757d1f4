"""Benchmark: par's tensor parallelism vs torch.distributed.tensor.parallel on the same MLP and block.

    python -m par bench tp [--nproc 2] [--preset small] [--batch-size 8] [--steps 20] [--rounds 3]

One launch of `par.tp.bench_job` on `nproc` ranks (gloo on CPU, NCCL when every rank has a GPU). For the GPT-lite MLP and a
whole transformer block it builds the same dense module on every rank, then

* par TP: `TensorParallelMLP/Block.from_dense`, all-reduces by par's ring and by torch (`impl`)
* torch TP: `parallelize_module` with ColwiseParallel / RowwiseParallel on a 1-D DeviceMesh (the block's
  fused QKV weight re-laid out first, as par does, so a column split hands each rank whole heads)

and times a training step (forward, backward, Adam step) in rotating turns (a few steps of each, then
again, `--rounds` times, so a load spike on a shared machine hits all three): median over steps, slowest
rank. It also reports live parameter bytes per rank and the largest output difference from the dense
module. Ratios are par / torch: the target is time <= 1.15x and memory equal. The load average is printed
with the timings: on a busy machine they are only as good as the machine is quiet.
"""
from __future__ import annotations

import argparse
import sys

from par.runtime import launch
from par.runtime.checks import int_at_least, positive_float, positive_int
from par.tp.bench_job import KINDS


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m par bench tp", description="par TP vs torch.distributed.tensor.parallel")
    p.add_argument("--nproc", type=positive_int, default=2)
    p.add_argument("--preset", default="small")
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--steps", type=positive_int, default=10, help="timed steps per turn")
    p.add_argument("--warmup", type=int_at_least(0, "warm-up steps are counted"), default=3)
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--backend", default="auto")
    p.add_argument("--timeout", type=positive_float, default=600)
    return p.parse_args(argv)


# ---------------------------------------------------------------- the launcher side
def table(result) -> str:
    lines = [f"tensor parallel, {result['world_size']} ranks ({result['backend']}), preset {result['preset']}, "
             f"batch {result['batch_size']}; load average {result.get('loadavg')} (timings as noisy as that)",
             f"{'module':<7} {'implementation':<21} {'step ms':>8} {'vs torch':>9} {'param bytes/rank':>17} "
             f"{'mem vs torch':>13} {'max |y - dense|':>16}"]
    for kind in KINDS:
        rows = [r for r in result["rows"] if r["module"] == kind]
        ref = next(r for r in rows if r["impl"] == "torch TP")
        for r in rows:
            lines.append(f"{kind:<7} {r['impl']:<21} {r['step_s'] * 1e3:8.2f} {r['step_s'] / ref['step_s']:8.2f}x "
                         f"{r['param_bytes']:17d} {r['param_bytes'] / ref['param_bytes']:12.2f}x {r['max_err']:16.2e}")
    return "\n".join(lines)


def run(nproc=2, preset="small", batch_size=8, steps=20, warmup=3, rounds=3, backend="auto", timeout=600,
        quiet=True) -> dict:
    argv = ["--preset", preset, "--batch-size", batch_size, "--steps", steps, "--warmup", warmup,
            "--rounds", rounds]
    return launch.run("par.tp.bench_job", nproc=nproc, args=argv, backend=backend, timeout=timeout, quiet=quiet)


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    result = run(args.nproc, args.preset, args.batch_size, args.steps, args.warmup, args.rounds, args.backend,
                 args.timeout)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
