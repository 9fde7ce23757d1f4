"""`python -m par bench <name> [options]`: run one of the course's benchmarks (its `main(argv)`).

Every benchmark times a par implementation against the torch built-in doing the same job and
prints the ratio. Each lives in the folder of its lecture, beside the strategy it times;
`BENCHMARKS` names them. `python -m par bench` lists them. (`python -m par` checks a benchmark's
`--backend` against its `--nproc` / `--world-sizes` / `--worlds` before it starts:
`par.runtime.preflight`.)
"""
from __future__ import annotations

import argparse
import importlib
import sys

from par.runtime.checks import unknown

BENCHMARKS = {
    # name: (module, what it times against what)
    "collectives": ("par.comm.bench", "par's ring all-reduce vs torch.distributed.all_reduce"),
    "dp": ("par.dp.bench", "par's data parallelism vs DistributedDataParallel"),
    "pipeline": ("par.pp.bench", "par's 1F1B vs torch.distributed.pipelining's Schedule1F1B"),
    "tp": ("par.tp.bench", "par's tensor parallelism vs torch.distributed.tensor.parallel"),
    "zero": ("par.zero.bench", "par ZeRO-1/3 vs ZeroRedundancyOptimizer / FSDP2"),
    "suite": ("par.train.suite", "lecture 07's table: GPT-lite under every strategy, measured and predicted"),
    "mfu": ("par.device.bench", "lecture 10: par eager and par's fast path vs a nanoGPT-style reference, MFU/HFU"),
}


def available() -> list[str]:
    """The benchmarks' names."""
    return sorted(BENCHMARKS)


def usage() -> str:
    rows = "\n".join(f"  {name:<12} {BENCHMARKS[name][1]}  ({BENCHMARKS[name][0]})" for name in available())
    return f"usage: python -m par bench <name> [options]\n\nbenchmarks:\n{rows}\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        raise argparse.ArgumentError(None, unknown("benchmark", name, BENCHMARKS, "python -m par bench --help"))
    return int(importlib.import_module(BENCHMARKS[name][0]).main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
