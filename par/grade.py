"""Grade one exercise notebook: `python -m par grade exercises/NN_topic.ipynb`.

The notebook runs top to bottom in one fresh kernel of this interpreter under
`pytest --nbval-lax`: a cell fails when it raises, outputs are not compared. The
cells tagged `check` hold the asserts on your functions, so the grade is

    k/n checks passed    (n = cells tagged `check`; every code cell when none is)

printed after pytest's own report. The exit code is pytest's: 0 when no cell failed.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from par.exercises import nbval_command


def graded_cells(nb) -> list[int]:
    """nbval's numbers (index among code cells) of the cells tagged `check`, or of all code cells."""
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    checks = [i for i, cell in enumerate(code) if "check" in cell.metadata.get("tags", [])]
    return checks or list(range(len(code)))


def pytest_runtest_logreport(report):
    """pytest hook (this module is loaded with `-p par.grade`): one JSON line per cell phase."""
    path = os.environ.get("PAR_GRADE_REPORT")
    if path and "::Cell " in report.nodeid:
        with open(path, "a") as f:
            f.write(json.dumps({"cell": int(report.nodeid.rsplit(" ", 1)[1]), "when": report.when,
                                "outcome": report.outcome}) + "\n")


def cell_results(report_path: Path) -> dict[int, bool]:
    """{cell number: passed}: the cell's test ran, and none of its phases failed or was skipped."""
    phases: dict[int, list] = {}
    for line in Path(report_path).read_text().splitlines():
        r = json.loads(line)
        phases.setdefault(r["cell"], []).append((r["when"], r["outcome"]))
    return {cell: any(when == "call" for when, _ in ph) and all(out == "passed" for _, out in ph)
            for cell, ph in phases.items()}


def grade(path: Path) -> int:
    import nbformat
    path = Path(path)
    if path.suffix != ".ipynb" or not path.is_file():
        print(f"error: {path} is not a notebook file; try: python -m par grade exercises/00_<topic>.ipynb",
              file=sys.stderr)
        return 2
    nb = nbformat.read(path, as_version=4)
    sources = [cell.source for cell in nb.cells if cell.cell_type == "code"]
    cells = graded_cells(nb)
    with tempfile.TemporaryDirectory(prefix="par-grade-") as tmp:
        report = Path(tmp) / "cells.jsonl"
        code = subprocess.run([*nbval_command(path, strict=False), "-p", "par.grade"],
                              env={**os.environ, "PAR_GRADE_REPORT": str(report)}).returncode
        results = cell_results(report) if report.exists() else {}
    passed = sum(results.get(i, False) for i in cells)
    print(f"\n{path.name}: {passed}/{len(cells)} checks passed")
    for i in cells:
        if not results.get(i, False):
            first = next((line.strip() for line in sources[i].splitlines() if line.strip()), "")
            print(f"  FAILED Cell {i}: {first[:70]}")
    return code


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return grade(Path(argv[0]))
