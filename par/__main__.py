"""`python -m par <command> ...`: the course's command line.

Each command lives in its own module; this file only maps names to them.
"""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    # name: (module, one-line help). The module's main(argv) does the work.
    "exercises": ("par.exercises", "generate | check | record | release DIR: exercises/ from solutions/, the student bundle"),
    "grade": ("par.grade", "grade with the instructor's checks: python -m par grade NB_OR_DIR... [--report grades.csv]"),
    "bench": ("par.bench.cli", "benchmarks vs the torch built-ins: python -m par bench <name> (collectives, ...)"),
    "batch": ("par.batch", "run every lecture notebook with papermill into runs/<time>/ and summarise"),
    "train": ("par.jobs.train", "train GPT-lite from a DeepSpeed-style JSON config: --config configs/3d.json --nproc 8"),
    "plan": ("par.planner", "rank 3D layouts by predicted memory and step time: --model 100,96,12288 --world 800"),
    "memory": ("par.memory", "per-rank model-state memory per ZeRO stage (--params 7.5e9 --dp 64 | --model llama-7b)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS), default=0)
    rows = "\n".join(f"  {name:<{width}}  {help_}" for name, (_, help_) in sorted(COMMANDS.items()))
    return f"usage: python -m par <command> [options]\n\ncommands:\n{rows}\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
