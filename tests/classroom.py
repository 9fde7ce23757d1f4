"""One exercise's class: the notebooks a TA's folder would hold, built from the fixtures, graded once per session.

`exercise_class(name)` (the session fixture in conftest.py) grades one folder per exercise with the grader a TA
runs (`par.course.grading.grade.grade_many`, 2 notebooks at a time), the first time any test asks for it; every
test file that judges that exercise reads the same grades. The folder holds, by file stem:

    tampered-solved__NAME     solved, every check cell edited by the student (emptied, `assert False`, an assert
                              appended) and a failing cell added: the grade ignores all of it (full marks)
    tampered-unsolved__NAME   the exercise as handed out, its checks replaced by `pass` worth 100 points (nothing)
    wrong__NAME__FIXTURE      solved but one answer cell: tests/fixtures/wrong_answers/NAME/FIXTURE.py
    cheat__NAME__FIXTURE      solved but one answer cell: tests/fixtures/cheats/NAME/FIXTURE.py
    valid__NAME__FIXTURE      solved but one answer cell, another right answer: tests/fixtures/valid_answers/NAME/FIXTURE.py

A fixture file is the cell's body under a header: `# cell: <answer cell id>`, `# must fail: <check ids>` (none
for a valid answer), `# why: ...` (and for a cheat `# sandbox: yes` when its defence is the sandbox's view of par).
"""
from __future__ import annotations

import fcntl
import os
import pickle
import re
import time
from pathlib import Path

import nbformat

from par.course.authoring import generate as exercises
from par.course.authoring.generate import is_answer, is_check
from par.course.grading import grade

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"
NAMES = [p.stem for p in sorted((ROOT / "solutions").glob("*.ipynb"))]


def read(path):
    return nbformat.read(path, as_version=4)


def solution(name):
    return read(ROOT / "solutions" / f"{name}.ipynb")


def solved(name, replace: dict | None = None):
    """The exercise with every answer cell filled from the solution (or from `replace`, by cell id)."""
    nb, answers = read(ROOT / "exercises" / f"{name}.ipynb"), {c.id: c.source for c in solution(name).cells}
    for cell in nb.cells:
        if is_answer(cell):
            cell.source = (replace or {}).get(cell.id, answers[cell.id])
    return nb


def tampered_solved(name):
    """Solved, but every check cell edited: emptied, `assert False`, or an assert appended; a failing cell added."""
    nb = solved(name)
    for i, cell in enumerate(c for c in nb.cells if is_check(c)):
        cell.source = ["", "assert False, 'the student added this'",
                       cell.source + "\nassert 1 == 2, 'appended by the student'"][i % 3]
        cell.metadata["points"] = 0
    nb.cells.append(nbformat.v4.new_code_cell("raise RuntimeError('a cell the student added')"))
    return nb


def tampered_unsolved(name):
    """Unsolved, with every check cell's asserts deleted, its tag removed and its points raised."""
    nb = read(ROOT / "exercises" / f"{name}.ipynb")
    for cell in (c for c in nb.cells if is_check(c)):
        cell.source, cell.metadata = "pass", {"points": 100}
    return nb


def full_marks(name: str):
    """The points of every check cell of the exercise (what a solved notebook gets)."""
    return sum(exercises.points(c) for c in solution(name).cells if is_check(c))


def points_of(name: str, checks) -> float:
    """The points of the check cells `checks` of the exercise."""
    return sum(exercises.points(c) for c in solution(name).cells if is_check(c) and c.get("id") in set(checks))


HEADER = re.compile(r"^# (cell|must fail|sandbox|why): (.*)$", re.M)


def fixture_files(kind: str) -> list[tuple]:
    """[(exercise, fixture name, answer cell id, checks that must fail, needs the sandbox, cell source)] of
    tests/fixtures/<kind> ("wrong_answers", "cheats" or "valid_answers": no check must fail); the source keeps the
    answer cell's `%%writefile` line."""
    out = []
    for path in sorted((FIXTURES / kind).glob("*/*.py")):
        text = path.read_text()
        head = dict(HEADER.findall(text))
        body = "\n".join(line for line in text.splitlines() if not HEADER.match(line))
        cell = next(c for c in solution(path.parent.name).cells if c.id == head["cell"])
        magic = cell.source.split("\n", 1)[0]
        source = (magic + "\n" if magic.startswith("%%writefile") else "") + body.strip("\n")
        must_fail = [s.strip() for s in head["must fail"].split(",")] if "must fail" in head else []
        out.append((path.parent.name, path.stem, head["cell"], must_fail, head.get("sandbox") == "yes", source))
    return out


def class_folder(name: str, folder: Path) -> list[Path]:
    """Write exercise `name`'s class into `folder` (see the module docstring); the notebooks' paths."""
    nbformat.write(tampered_solved(name), folder / f"tampered-solved__{name}.ipynb")
    nbformat.write(tampered_unsolved(name), folder / f"tampered-unsolved__{name}.ipynb")
    for kind, prefix in (("wrong_answers", "wrong"), ("cheats", "cheat"), ("valid_answers", "valid")):
        for exercise, fixture, cell, _, _, source in fixture_files(kind):
            if exercise == name:
                nbformat.write(solved(name, {cell: source}), folder / f"{prefix}__{name}__{fixture}.ipynb")
    return sorted(folder.glob("*.ipynb"))


def grade_class(name: str, folder: Path, course) -> dict:
    """{file stem: Grade} of exercise `name`'s class, graded 2 at a time as a TA would."""
    paths = class_folder(name, folder)
    start = time.monotonic()
    graded = {Path(g.submission).stem: g for g in
              grade.grade_many(paths, course, timeout=600, cell_timeout=300, jobs=2, progress=None)}
    print(f"\n{name}: graded its class of {len(paths)} notebooks in {time.monotonic() - start:.0f} s")
    return graded


def grade_class_once(name: str, shared: Path, folder, course) -> dict:
    """grade_class, once for every pytest process sharing the folder `shared` (pytest-xdist's workers): under an
    exclusive lock on `shared/class-NAME.lock`, the grades pickled in `shared/class-NAME.pickle` if a process left
    them there, else graded now (in the folder `folder()` makes) and left there (written whole, then renamed)."""
    done = shared / f"class-{name}.pickle"
    with open(shared / f"class-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():
            return pickle.loads(done.read_bytes())
        graded = grade_class(name, folder(), course)
        part = done.with_suffix(f".{os.getpid()}.part")
        part.write_bytes(pickle.dumps(graded))
        os.replace(part, done)
        return graded
