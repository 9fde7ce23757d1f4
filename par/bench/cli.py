"""`python -m par bench <name> [options]`: run the benchmark `par.bench.<name>` (its `main(argv)`).

Every benchmark times a par implementation against the torch built-in doing the same job and
prints the ratio. `python -m par bench` lists them. (`python -m par` checks a benchmark's
`--backend` against its `--nproc` / `--world-sizes` / `--worlds` before it starts:
`par.preflight`.)
"""
from __future__ import annotations

import importlib
import pkgutil
import sys

import par.bench


def available() -> list[str]:
    """Names of the benchmark modules in par/bench/ (every module but this dispatcher)."""
    return sorted(m.name for m in pkgutil.iter_modules(par.bench.__path__) if m.name != "cli")


def usage() -> str:
    return "usage: python -m par bench <name> [options]\n\nbenchmarks: " + ", ".join(available()) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in available():
        print(f"unknown benchmark {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    return int(importlib.import_module(f"par.bench.{name}").main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
