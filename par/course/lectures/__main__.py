"""`python -m par.course.lectures`: every lecture's key numbers and their targets as JSON, {notebook: [key]}.
`python -m par.course.lectures --verdicts RUN_DIR`: a batch's key numbers beside their targets, one line each, and
exit 1 where a target is missed (the check a GPU run is held to).

The site (`par.site.numbers.lecture_keys`) calls the first as a command: the course tooling stays a layer nothing
imports."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from par.course.batch.launches import lectures
from par.site import numbers
from par.site.run import SiteError, load


def key_numbers(extra=None) -> dict[str, list[dict]]:
    """{notebook name: its key numbers as plain data (`par.site.numbers.Key.to_dict`)}."""
    return {name: [k.to_dict() for k in module.KEY_NUMBERS] for name, module in lectures(extra).items()}


def verdicts(run_dir: Path) -> list[tuple[str, numbers.Key, object, str]]:
    """(notebook, key, recorded value, verdict) of every key number with a target that the run recorded."""
    run, out = load(run_dir), []
    for name, module in lectures().items():
        lecture = run.lecture(name)
        for key in module.KEY_NUMBERS if lecture else ():
            verdict = numbers.verdict(key, lecture.records)
            if verdict:
                out.append((name, key, numbers.value(lecture.records, key), verdict))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m par.course.lectures", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--verdicts", type=Path, metavar="RUN_DIR", help="a batch's folder (runs/<time>/)")
    args = parser.parse_args(argv)
    if args.verdicts is None:
        json.dump(key_numbers(), sys.stdout, ensure_ascii=False)
        sys.stdout.write("\n")
        return 0
    try:
        found = verdicts(args.verdicts)
    except SiteError as e:       # not a run folder: one line, as every command of par
        print(f"error: {e}", file=sys.stderr)
        return 2
    for name, key, value, verdict in found:
        print(f"{verdict:>6}  {name}: {key.what} = {numbers.fmt(value)} (target {key.target.text})")
    missed = sum(v == numbers.MISSED for *_, v in found)
    print(f"{len(found)} targets checked: " + (f"{missed} missed" if missed else "all met"))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
