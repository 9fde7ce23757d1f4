"""Benchmark: par's ring all-reduce vs torch.distributed.all_reduce, same tensors, same ranks.

    python -m par bench collectives [--world-sizes 2,4] [--sizes 1048576,16777216] [--reps 9]

For each world size one launch of `par.jobs.collectives --parts timing` times both in alternating
turns after warm-up and keeps the median of the slowest rank's time. Printed: a table of the
ratio ring / torch per size: of the medians, and (column "fastest") of the fastest runs, which a
loaded machine disturbs least. Target: <= 1.15x. Timings on a shared machine are only as quiet as
the machine: the load average is printed beside them.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

TARGET = 1.15


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m par bench collectives", description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", default="2,4")
    p.add_argument("--sizes", default=f"{1 << 20},{1 << 24}", help="float32 element counts")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--backend", default="auto")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", default=None, help="also write the rows to this file")
    return p.parse_args(argv)


def measure(world_size: int, sizes: str, reps: int, warmup: int, backend: str = "auto", timeout: float = 600,
            quiet: bool = True) -> list[dict]:
    """Rows {numel, ring_s, torch_s, ratio, ...} from one launch on `world_size` ranks."""
    from par.launch import run
    out = run("par.jobs.collectives", nproc=world_size, backend=backend, timeout=timeout, quiet=quiet,
              args=["--parts", "timing", "--sizes", sizes, "--reps", reps, "--warmup", warmup])
    return [dict(row, world_size=world_size, backend=out["backend"]) for row in out["timing"]]


def table(rows: list[dict]) -> str:
    lines = [f"{'ranks':>5} {'backend':>7} {'floats':>12} {'ring ms':>9} {'torch ms':>9} {'ring/torch':>10}"
             f" {'fastest':>9}"]
    for r in rows:
        flag = "" if r["ratio"] <= TARGET else f"  > {TARGET}"
        fastest = min(r["ring_all"]) / min(r["torch_all"])
        lines.append(f"{r['world_size']:>5} {r['backend']:>7} {r['numel']:>12,} {r['ring_s'] * 1e3:9.2f} "
                     f"{r['torch_s'] * 1e3:9.2f} {r['ratio']:10.2f} {fastest:9.2f}{flag}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    rows = []
    for n in map(int, args.world_sizes.split(",")):
        load = os.getloadavg()[0]
        print(f"{n} ranks (load average {load:.1f}) ...", flush=True)
        rows += [dict(r, load=load) for r in measure(n, args.sizes, args.reps, args.warmup, args.backend,
                                                      args.timeout)]
    print(f"\nring all-reduce / dist.all_reduce, median of {args.reps} after {args.warmup} warm-up "
          f"(target <= {TARGET}x)\n{table(rows)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
