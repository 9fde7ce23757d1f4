"""Benchmark: par's ring all-reduce vs torch.distributed.all_reduce, same tensors, same ranks.

    python -m par bench collectives [--world-sizes 2,4] [--sizes 1048576,16777216] [--reps 9]

For each world size one launch of `par.comm.job --parts timing` times both in alternating
turns after warm-up (each call timed from the last rank's entry to the last rank's exit). Printed per size: the median time of each
with its spread (the interquartile range, q1-q3), the ratio ring / torch as the median of the
paired turns with its spread, and (column "fastest") the ratio of the fastest runs, which a loaded
machine disturbs least. Target: <= 1.15x. Timings on a shared machine are only as quiet as the
machine: the load average is printed beside them, and world sizes above the physical cores are
flagged (their ranks wait for a core, which is not the collective's cost).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from par.runtime import dist, launch
from par.runtime.checks import check_writable, int_at_least, positive_float, positive_int, world_sizes

TARGET = 1.15


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m par bench collectives", description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", type=world_sizes, default=(2, 4))
    p.add_argument("--sizes", default=f"{1 << 20},{1 << 24}", help="float32 element counts")
    p.add_argument("--reps", type=positive_int, default=9)
    p.add_argument("--warmup", type=int_at_least(0, "warm-up steps are counted"), default=2)
    p.add_argument("--backend", default="auto")
    p.add_argument("--timeout", type=positive_float, default=600)
    p.add_argument("--json", default=None, help="also write the rows to this file")
    args = p.parse_args(argv)
    if args.json:
        check_writable(args.json)
    return args


def measure(world_size: int, sizes: str, reps: int, warmup: int, backend: str = "auto", timeout: float = 600,
            quiet: bool = True) -> list[dict]:
    """Rows {numel, ring_s, torch_s, ratio, ...} from one launch on `world_size` ranks."""
    out = launch.run("par.comm.job", nproc=world_size, backend=backend, timeout=timeout, quiet=quiet,
                     args=["--parts", "timing", "--sizes", sizes, "--reps", reps, "--warmup", warmup])
    return [dict(row, world_size=world_size, backend=out["backend"]) for row in out["timing"]]


def _spread_ms(q: list[float]) -> str:
    q1, q2, q3 = q
    return f"{q2 * 1e3:8.2f} ({q1 * 1e3:.2f}-{q3 * 1e3:.2f})"


def table(rows: list[dict], cores: int | None = None) -> str:
    lines = [f"{'ranks':>5} {'backend':>7} {'floats':>12} {'ring ms (q1-q3)':>24} {'torch ms (q1-q3)':>24} "
             f"{'ring/torch (q1-q3)':>20} {'fastest':>8}"]
    for r in rows:
        q1, q2, q3 = r["ratio_q"]
        flag = "" if q2 <= TARGET else f"  > {TARGET}"
        if cores is not None and r["world_size"] > cores:
            flag += f"  ({r['world_size']} ranks on {cores} cores: oversubscribed)"
        fastest = min(r["ring_all"]) / min(r["torch_all"])
        lines.append(f"{r['world_size']:>5} {r['backend']:>7} {r['numel']:>12,} {_spread_ms(r['ring_q']):>24} "
                     f"{_spread_ms(r['torch_q']):>24} {f'{q2:.2f} ({q1:.2f}-{q3:.2f})':>20} {fastest:8.2f}{flag}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.reps < 9:
        print(f"note: {args.reps} repetitions; the benchmark's claim is a median of at least 9", file=sys.stderr)
    rows = []
    for n in args.world_sizes:
        load = os.getloadavg()[0]
        print(f"{n} ranks (load average {load:.1f}) ...", flush=True)
        rows += [dict(r, load=load) for r in measure(n, args.sizes, args.reps, args.warmup, args.backend,
                                                      args.timeout)]
    print(f"\nring all-reduce / dist.all_reduce, median of {args.reps} after {args.warmup} warm-up, "
          f"spread q1-q3 (target <= {TARGET}x)\n{table(rows, dist.physical_cores())}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
