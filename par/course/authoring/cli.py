"""`python -m par exercises generate | check | record | release DIR`: the exercises' command line.

`generate`, `check` and `record` are `par.course.authoring.generate`; `release` is `par.course.authoring.release` (which builds
on `par.course.authoring.generate`): this module imports both, so that neither imports the other.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from par.course.authoring import release
from par.course.authoring.generate import ROOT, ExerciseError, generate, out_of_sync, record, solutions


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m par exercises", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["generate", "check", "record", "release"])
    parser.add_argument("names", nargs="*", help="record: only these solutions (file names or stems); "
                                                 "release: the folder to write the bundle into")
    parser.add_argument("--root", type=Path, default=ROOT, help="course repository (default: %(default)s)")
    parser.add_argument("--force", action="store_true", help="release: replace an existing bundle folder")
    args = parser.parse_args(argv)
    if not (args.root / "solutions").is_dir():   # else "check" finds nothing out of sync in a folder that is no course
        raise ExerciseError(f"--root {args.root} is not the course repository (it has no solutions/ folder): "
                            f"pass the folder of the course checkout")
    if args.action == "generate":
        changed = generate(args.root)
        print(f"{len(solutions(args.root))} exercise(s); written or removed: "
              + (", ".join(p.name for p in changed) or "none"))
        return 0
    if args.action == "check":
        problems = out_of_sync(args.root)
        for line in problems:
            print(line, file=sys.stderr)
        if problems:
            print("fix: python -m par exercises generate", file=sys.stderr)
            return 1
        print("in sync")
        return 0
    if args.action == "release":
        if len(args.names) != 1:
            parser.error("name one folder: python -m par exercises release DIR")
        return release.main(Path(args.names[0]), root=args.root, force=args.force)
    return record(args.root, args.names)


if __name__ == "__main__":
    sys.exit(main())
