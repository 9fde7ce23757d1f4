"""The job's launcher inside a submission's sandbox: `python -m par.course.grading.launcher SPEC`.

A check that launches a job (`par.course.grading.proxies.sandboxed_launch`) starts this in a sandbox of its own; it
runs `par.runtime.launch.run(**SPEC)` there and prints its answer as one line of data after MARK, {"result": ...}
or {"error": "..."}, which the grader reads (and bounds) from its output. Nothing of the student's runs in it: the
ranks it starts do (the student's module on a real-rank exercise).
"""
from __future__ import annotations

import json
import sys

from par.runtime.launch import LaunchError, run

MARK = "@@par-grader-launch@@"


def main(spec_text: str) -> int:
    """Launch the job SPEC (JSON: `par.runtime.launch.run`'s keywords); print its answer after MARK."""
    spec = json.loads(spec_text)
    try:
        answer = {"result": run(**spec)}
    except LaunchError as e:
        answer = {"error": str(e)}
    except Exception as e:  # a preflight error, a bad spec: the check fails with it
        answer = {"error": f"{type(e).__name__}: {e}"}
    sys.stdout.write("\n" + MARK + json.dumps(answer) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m par.course.grading.launcher SPEC")
    sys.exit(main(sys.argv[1]))
