"""Grade exercise notebooks with the instructor's checks: one notebook, or a whole class at once.

    python -m par grade exercises/00_ring_chunks.ipynb                    # one notebook, a readable report
    python -m par grade submissions/ --report grades.csv [--jobs 2]      # a class: one CSV row per notebook

Which exercise. A notebook belongs to the exercise its metadata names (exercises carry it), else the one
whose name its file name contains (`alice_03_pipelines.ipynb`), else the one whose cell ids it shares.

What decides the grade. The notebook that runs is assembled from the instructor's copy,
`solutions/NN_topic.ipynb` (code cells only, in the instructor's order):

    answer cells (`### BEGIN SOLUTION` in the solution)   the student's cell with the same cell id, or the
                                                          student cell defining the same functions; if none,
                                                          the stub (graded as unanswered)
    cells the student added                               kept, after the cell the student put them after
    every other cell: setup, demos, the checks            the instructor's, hidden checks included

up to the last check cell (what would run after it cannot change the grade). It runs cell by cell
(`par.course.grading.checks`): answers, added cells and setup in a fresh kernel in a fresh temporary folder, inside
a sandbox (`par.course.grading.sandbox`: bubblewrap where available, else "unsandboxed"); the check cells in the
grader's own process, on plain data fetched from the student's functions. Whatever the student did to the
check cells (emptied, edited, asserts added or removed) or to their kernel is ignored. A check cell (tagged
`check`) earns the points in its metadata (`"points": 2`, default 1) when it runs to its end without error;
the grade is points earned / points possible.

Practice grade. Without `solutions/` (the student bundle of `python -m par exercises release`), or with
`--practice`, the checks are the visible ones of `exercises/NN_topic.ipynb`; hidden checks do not run,
and the report says it is a practice grade, not the official one.

Status of a submission:

    ok        every check passed
    failed    some check failed (failed_checks names them; reason gives the first error)
    timeout   the notebook ran past --timeout (then killed, with any ranks it launched) or a cell past
              --cell-timeout (interrupted; later cells still ran). Checks that passed still count.
    error     not valid JSON, not a notebook, belongs to no exercise, the kernel died, or the grader could
              not read or run it (any exception of the grader's on one submission: its type and first line);
              the reason says which. Checks that passed before the kernel died still count.

Every file found gets a row (a `.py` file, an unreadable one, a notebook of no exercise: `error`) and no
submission stops the batch; nbformat 3 is converted; two submissions of one student's exercise are both
flagged DUPLICATE, and submissions of different students whose answer cells are the same (blank lines and
comments aside) are flagged SAME ANSWERS (a note for the instructor: the grade is unchanged; the gradebook
names the other submissions, the student's feedback does not). Rows are appended and
flushed as each submission finishes (a killed batch keeps them; `--resume` grades the rest), and the report
and feedback paths are checked before grading starts. Feedback never shows a hidden check's source, nor the
message of an error that could carry a hidden case's inputs (`par.course.grading.checks.withheld`).

Before any submission runs, what an exercise of the batch needs once is done (its record's `prepare`: 07's measured
layouts, taken while no student code runs).

Exit code: with --report, 0 once every submission has its row, whatever its status (2 when nothing could
be graded at all: no notebook found, the report cannot be written); without --report, 0 when every
notebook passed all its checks, 1 otherwise. Usage errors: 2.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from par.course.grading import checks
from par.runtime import procs
from par.course.grading.report import (Flag, RowWriter, format_points, class_summary, describe, format_grade, told,
                                       write_feedback, write_report)
from par.course.authoring import generate as exercises
from par.course.authoring.generate import ROOT, is_answer, is_check
from par.course.grading import sandbox
from par.course.grading.exercise import of_notebook
from par.runtime.checks import check_writable

TIMEOUT = 600          # seconds per notebook
CELL_TIMEOUT = 300     # seconds per cell


class SubmissionError(ValueError):
    """A submission that cannot be graded at all; the message is the reason recorded for it."""


@dataclass
class Check:
    id: str
    points: float
    passed: bool = False
    error: str = ""
    traceback: str = ""


@dataclass
class Grade:
    submission: str
    exercise: str = ""
    status: str = "error"
    reason: str = ""
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    official: bool = True
    seconds: float = 0.0
    flags: list[str] = field(default_factory=list)   # shown whatever the status (a duplicate, unsandboxed)
    sandboxed: bool = True

    @property
    def points(self) -> float:
        return sum(c.points for c in self.checks if c.passed)

    @property
    def max_points(self) -> float:
        return sum(c.points for c in self.checks)

    @property
    def failed_checks(self) -> list[str]:
        return [c.id for c in self.checks if not c.passed]

    def row(self) -> dict:
        pct = 100 * self.points / self.max_points if self.max_points else 0.0
        return {"submission": self.submission, "exercise": self.exercise, "points": format_points(self.points),
                "max_points": format_points(self.max_points) if self.checks else "", "percent": f"{pct:.1f}",
                "status": self.status, "failed_checks": ";".join(self.failed_checks),
                "reason": " ".join("; ".join(([self.reason, *self.notes] if self.status != "ok" else [])
                                             + self.flags).split()),
                "seconds": f"{self.seconds:.1f}"}


# ---------------------------------------------------------------- the checks' source: solutions/ or exercises/
@dataclass
class Course:
    folder: Path                  # where the reference notebooks are
    official: bool                # solutions/ (the instructor's checks) or exercises/ (the visible ones)
    notebooks: dict               # exercise name (file stem) -> reference notebook


def load_course(solutions: Path | None = None, practice: bool = False, root: Path = ROOT) -> Course:
    """The instructor's solutions/ (official), or exercises/ when practising or when there is no solutions/."""
    import nbformat
    if practice:
        folder, official = Path(root) / "exercises", False
    elif solutions is not None:
        folder, official = Path(solutions), True
        if not sorted(folder.glob("*.ipynb")):
            raise SubmissionError(f"no solution notebooks in {folder}: pass the solutions/ folder of the "
                                  f"instructor's checkout, or --practice for the visible checks")
    else:
        folder = Path(root) / "solutions"
        official = bool(sorted(folder.glob("*.ipynb")))
        folder = folder if official else Path(root) / "exercises"
    try:
        notebooks = {p.stem: exercises.read_notebook(p) for p in sorted(folder.glob("*.ipynb"))}
    except exercises.ExerciseError as e:
        raise SubmissionError(f"the checks cannot be read: {e}") from None
    if not notebooks:
        raise SubmissionError(f"no exercise notebooks in {folder}")
    return Course(folder, official, notebooks)


# ---------------------------------------------------------------- reading and recognising a submission
def read_submission(path: Path):
    """The notebook node, or SubmissionError saying why the file is not one."""
    import nbformat
    path = Path(path)
    if path.suffix != ".ipynb":
        raise SubmissionError(f"not a notebook file (.ipynb): {path.name}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SubmissionError(f"cannot read the file: {e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise SubmissionError(f"not valid JSON ({e}); the file is damaged: ask for it again") from None
    old = isinstance(data, dict) and data.get("nbformat") in (3, 2) and isinstance(data.get("worksheets"), list)
    if not old and (not isinstance(data, dict) or not isinstance(data.get("cells"), list) or "nbformat" not in data):
        raise SubmissionError("valid JSON but not a Jupyter notebook (no 'cells' list or 'nbformat')")
    try:
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # a schema warning is no reason to refuse a notebook
            nb = nbformat.reads(text, as_version=4)       # nbformat 3 (and 2) converted to 4
            if old:
                nb = nbformat.convert(nb, 4)
    except Exception as e:  # nbformat raises many kinds for a broken notebook
        raise SubmissionError(f"not a readable notebook: {one_line(e)}") from None
    for i, cell in enumerate(nb.cells):
        odd = _odd_cell(cell)
        if odd:
            raise SubmissionError(f"not a readable notebook: its cell {i} {odd}")
    return nb


def _odd_cell(cell) -> str:
    """Why `cell` is no cell the grader reads ("" when it is one): a cell is a dict whose cell_type and source are
    text, and whose id, if it has one, is text."""
    if not isinstance(cell, dict):
        return f"is not a cell ({_kind(cell)})"
    for key in ("cell_type", "source"):
        if not isinstance(cell.get(key), str):
            return f"has no text {key} ({_kind(cell.get(key))})"
    if cell.get("id") is not None and not isinstance(cell.get("id"), str):
        return f"has an id that is not text ({_kind(cell.get('id'))})"
    return ""


def _kind(x) -> str:
    return "missing" if x is None else "dict" if isinstance(x, dict) else type(x).__name__


def one_line(e: BaseException) -> str:
    """`Type: message` of an exception, the message's first line only, at most 200 characters."""
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    return f"{type(e).__name__}: {first}"[:200] if first else type(e).__name__


def _code_ids(nb) -> set[str]:
    return {c.get("id") for c in nb.cells if c.cell_type == "code" and c.get("id")}


def identify(nb, path: Path, course: Course) -> str:
    """The exercise `nb` belongs to: its metadata, else its file name, else the cell ids it shares."""
    names = sorted(course.notebooks)
    meta = exercises.exercise_name(nb)
    if meta in course.notebooks:
        return meta
    in_name = [n for n in names if n in Path(path).name]
    if in_name:
        return max(in_name, key=len)
    ids = {c.get("id") for c in nb.cells} - {exercises.NOTE_ID, None}
    shared = {n: len(ids & _code_ids(ref)) for n, ref in course.notebooks.items()}
    best = max(shared.values(), default=0)
    winners = [n for n, k in shared.items() if k == best]
    if best > 0 and len(winners) == 1:
        return winners[0]
    raise SubmissionError(f"belongs to no exercise: neither its metadata, its file name nor its cell ids match "
                          f"one of {', '.join(names)}; rename it NN_topic.ipynb")


# ---------------------------------------------------------------- the notebook that runs
@dataclass
class Assembled:
    notebook: object
    roles: list[tuple[str, str]]    # per code cell: (role, cell id), role in setup|answer|check|added
    notes: list[str]


def assemble(reference, student, official: bool = True) -> Assembled:
    """The notebook to grade: the reference's cells, the student's answers and added cells (module docstring)."""
    import nbformat
    ref = [c for c in reference.cells if c.cell_type == "code"]
    ref_ids = {c.get("id") for c in ref}
    mine = [c for c in student.cells if c.cell_type == "code"]
    by_id = {c.get("id"): c for c in mine if c.get("id")}
    used, answers, notes = set(), {}, []      # used: id() of the student cells taken as answers
    for cell in (c for c in ref if is_answer(c)):
        cid = cell.get("id")
        if cid in by_id:
            answers[cid] = by_id[cid].source
            used.add(id(by_id[cid]))
            continue
        want = exercises.defined_names(cell.source)
        found = next((c for c in mine if c.get("id") not in ref_ids and id(c) not in used
                      and want and want <= exercises.defined_names(c.source)), None)
        if found is not None:
            answers[cid] = found.source
            used.add(id(found))
            notes.append(f"answer cell {cid} matched by what it defines ({', '.join(map(str, sorted(want)))})")
        else:
            answers[cid] = exercises.stub_source(cell.source) if official else cell.source
            notes.append(f"answer cell {cid} is missing: graded as unanswered")
    added: dict[str | None, list] = {}
    anchor = None
    for cell in mine:
        cid = cell.get("id")
        if cid in ref_ids:
            anchor = cid
        elif id(cell) not in used:
            added.setdefault(anchor, []).append(cell.source)
    last_check = max(i for i, c in enumerate(ref) if is_check(c))
    ref = ref[:last_check + 1]      # what runs after the last check cannot change the grade: it does not run
    cells, roles = [], []

    def put(source, role, cid, metadata=None):
        cells.append(nbformat.v4.new_code_cell(source, id=f"c{len(cells)}", metadata=metadata or {}))
        roles.append((role, cid))

    for source in added.get(None, []):
        put(source, "added", f"added-{len(roles)}")
    for cell in ref:
        cid = cell.get("id")
        if cid in answers:
            put(answers[cid], "answer", cid)
        else:
            meta = {k: v for k, v in cell.metadata.items() if k in ("tags", "points")}
            put(cell.source, "check" if is_check(cell) else "setup", cid, meta)
        for source in added.get(cid, []):
            put(source, "added", f"added-{len(roles)}")
    nb = nbformat.v4.new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3",
                                                                        "display_name": "Python 3"}})
    return Assembled(nb, roles, notes)


# ---------------------------------------------------------------- grading
def score(assembled: Assembled, run: checks.NotebookRun, reference, timeout: float, cell_timeout: float,
          grade: Grade) -> Grade:
    """Fill `grade` from what happened to the cells: checks passed, status and reason."""
    points = {c.get("id"): exercises.points(c) for c in reference.cells if is_check(c)}

    def where(i):
        role, cid = assembled.roles[i] if i is not None and i < len(assembled.roles) else ("?", "?")
        return f"code cell {i} ({role} {cid})"

    for i, (role, cid) in enumerate(assembled.roles):
        res = run.cells.get(i)
        if role == "answer" and res is not None and res.ran and not res.passed and not res.timed_out:
            grade.notes.append(Flag(f"answer cell {cid} itself failed: {res.error}",
                                    f"answer cell {cid} itself failed: {told(res.error)}"))
        if role != "check":
            continue
        grade.checks.append(Check(cid, points[cid], passed=bool(res and res.passed),
                                  error=(res.error if res else "did not run"), traceback=res.traceback if res else ""))
    grade.seconds = run.seconds
    if run.kernel_died is not None:
        grade.status, grade.reason = "error", f"the kernel died while running {where(run.kernel_died)}"
    elif run.timed_out:
        grade.status = "timeout"
        grade.reason = f"ran past the {timeout:g} s limit" + (f" in {where(run.running)}" if run.running is not None
                                                              else "") + "; it was stopped"
    elif run.cell_timeouts:
        grade.status = "timeout"
        grade.reason = "; ".join(f"{where(i)} ran past the {cell_timeout:g} s cell limit" for i in run.cell_timeouts)
        if run.running is not None:
            grade.reason += " and ignored the interrupt, so the cells after it did not run"
    elif not any(c.ran for c in run.cells.values()) or run.exit_code in (2, 3, 4):
        first = next((c.error for c in run.cells.values() if c.error), "")
        grade.status = "error"
        said = run.output.strip().splitlines() or ["no output"]
        grade.reason = Flag(f"the notebook could not be run: {first or said[-1]}",
                            f"the notebook could not be run: {told(first) if first else said[-1]}")
    elif all(c.passed for c in grade.checks):
        grade.status = "ok"
    else:
        grade.status = "failed"
        first = next(c for c in grade.checks if not c.passed)
        grade.reason = Flag(f"{first.id}: {first.error}", f"{first.id}: {told(first.error)}")
    return grade


def grade_one(path: Path, course: Course, timeout: float = TIMEOUT, cell_timeout: float = CELL_TIMEOUT,
              env: dict | None = None, label: str | None = None, package: Path | None = None) -> Grade:
    """Grade one submission; every failure of the submission, and any exception of the grader's on it, becomes
    its Grade's status and reason, never an exception (the batch goes on)."""
    grade = Grade(submission=label or str(path), official=course.official)
    start = time.monotonic()
    try:
        nb = read_submission(path)
        grade.exercise = identify(nb, path, course)
        reference = course.notebooks[grade.exercise]
        assembled = assemble(reference, nb, official=course.official)
    except SubmissionError as e:
        return _refused(grade, str(e), start)
    except Exception as e:  # an odd notebook the grader trips on while reading it: its row says so
        return _refused(grade, f"the grader could not read this notebook: {one_line(e)}", start)
    grade.notes = assembled.notes
    try:
        run, notes = checks.run(assembled, reference, timeout=timeout, cell_timeout=min(cell_timeout, timeout),
                                env=env, package=package)
        grade.notes += notes
        grade.sandboxed = not any(n.startswith("unsandboxed") for n in notes)
        return score(assembled, run, reference, timeout, cell_timeout, grade)
    except Exception as e:  # the kernel and its processes are gone (checks.run's own cleanup): its row says so
        return _refused(grade, f"the grader failed while running this notebook: {one_line(e)}", start)


def _refused(grade: Grade, reason: str, start: float) -> Grade:
    grade.status, grade.reason, grade.seconds = "error", reason, time.monotonic() - start
    return grade


def find_submissions(targets: list[str]) -> list[Path]:
    """The files to grade in `targets`, files and folders (searched recursively). Every file gets a row: one that is
    not a notebook is graded `error` with the reason; only hidden files and notebook checkpoints are passed over."""
    found = []
    for target in map(Path, targets):
        if target.is_dir():
            for p in sorted(target.rglob("*")):
                if not p.is_file() or ".ipynb_checkpoints" in p.parts or any(part.startswith(".") for part in
                                                                             p.relative_to(target).parts):
                    continue
                found.append(p)
        elif target.is_file():
            found.append(target)
        else:
            raise SubmissionError(f"no such file or folder: {target}")
    return found


def student_key(path: Path, exercise: str) -> tuple[str, str]:
    """Who handed `path` in, as far as the names say: its folder and its file name without the exercise or
    the marks of a second copy (`alice_01_x (1).ipynb`, `alice/01_x-copy.ipynb` -> alice)."""
    stem = Path(path).stem.replace(exercise, " ")
    stem = re.sub(r"\b(copy|final|v\d+|version\s*\d*|new|old|\d+)\b", " ", stem, flags=re.I)
    return str(Path(path).parent), " ".join(re.sub(r"[\W_]+", " ", stem).split()).lower()


def answer_fingerprint(nb, reference) -> str | None:
    """What the student answered, as text that ignores blank lines, comments and indentation changes at the ends
    of lines (None when every answer is the handed-out stub: nothing to compare)."""
    import hashlib
    stubs = {c.get("id"): exercises.stub_source(c.source) for c in reference.cells if is_answer(c)}
    out = assemble(reference, nb)
    texts = []
    for cell, (role, cid) in zip(out.notebook.cells, out.roles):
        if role == "answer":
            text = _normalized(cell.source)
            texts.append(None if text == _normalized(stubs.get(cid, "")) else text)
    if not any(texts):
        return None
    return hashlib.sha256(repr(texts).encode()).hexdigest()


def _normalized(source: str) -> str:
    lines = (re.sub(r"\s+#.*$|^\s*#.*$", "", line).rstrip() for line in source.splitlines())
    return "\n".join(line for line in lines if line.strip())


def identified(paths: list[Path], course: Course) -> dict[Path, tuple]:
    """{path: (notebook, exercise)} of the paths that read as a notebook of an exercise; the others are left out
    (grading them says why, in their row)."""
    found = {}
    for path in paths:
        try:
            nb = read_submission(path)
            found[path] = nb, identify(nb, path, course)
        except Exception:  # SubmissionError, or an odd notebook the grader trips on: grade_one's row says which
            continue
    return found


SAME_ANSWERS_TOLD = "SAME ANSWERS: another submission's answer cells are the same (your instructor has the list)"


def duplicates(paths: list[Path], course: Course, found: dict | None = None) -> dict[Path, Flag]:
    """{path: flag} for submissions of one student's exercise handed in more than once (DUPLICATE), and for
    submissions of different students whose answer cells are the same (SAME ANSWERS: a flag for the
    instructor to look at, which changes no grade). The flag's text names the other submissions (the gradebook);
    what the student is told of SAME ANSWERS names none (`Flag.told`). `found`: `identified(paths, course)`."""
    groups: dict = {}
    same: dict = {}
    for path, (nb, exercise) in (identified(paths, course) if found is None else found).items():
        key = student_key(path, exercise)
        groups.setdefault((exercise, *key), []).append(path)
        try:
            fingerprint = answer_fingerprint(nb, course.notebooks[exercise])
        except Exception:  # a notebook assemble cannot read: no fingerprint
            fingerprint = None
        if fingerprint is not None:
            same.setdefault((exercise, fingerprint), []).append((key, path))
    flags: dict = {}
    for (exercise, *_), group in groups.items():
        if len(group) > 1:
            for path in group:
                others = ", ".join(str(p) for p in group if p != path)
                flags[path] = [Flag(f"DUPLICATE: the same student's {exercise} is also in {others}")]
    for (exercise, _), group in same.items():
        if len({key for key, _ in group}) > 1:
            for key, path in group:
                others = ", ".join(str(p) for k, p in group if k != key)
                flags.setdefault(path, []).append(Flag(f"SAME ANSWERS: the answer cells of {others} are the same",
                                                       SAME_ANSWERS_TOLD))
    return {path: Flag("; ".join(f), "; ".join(map(told, f))) for path, f in flags.items()}


# ---------------------------------------------------------------- what an exercise needs before any submission runs
def prepare(names: set[str], progress=print) -> None:
    """Each exercise's `prepare` (its record, `par.course.grading.exercise`) for the exercises in `names`, before any
    submission's kernel starts (07's part 4 ranks every student on layouts measured while nothing of a student's
    runs). One that fails is printed; the exercise's checks then ask again, and fail with its error."""
    for name in sorted(names):
        record = of_notebook(name)
        if record is None or record.prepare is None:
            continue
        if progress:
            progress(f"preparing {name} before any submission runs ...", flush=True)
        try:
            record.prepare()
        except Exception as e:
            if progress:
                progress(f"note: preparing {name} failed ({one_line(e)}); its checks will try again", flush=True)


def grade_many(paths: list[Path], course: Course, timeout: float = TIMEOUT, cell_timeout: float = CELL_TIMEOUT,
               jobs: int = 1, progress=print, on_done=None) -> list[Grade]:
    """Grade every path (`jobs` at a time); the result is in the order of `paths`. Before the first submission
    runs, `prepare` does what the exercises found need. `on_done(grade)` is called (under a lock) as each
    submission finishes: the report writes its row there, so a killed batch keeps it."""
    import shutil
    import tempfile
    env = {}
    if jobs > 1:  # share the cores between the notebooks running at once
        from par.runtime.dist import physical_cores   # defers torch (dist) to a grade that shares its cores
        env["OMP_NUM_THREADS"] = str(max(1, physical_cores() // jobs))
    lock, done = threading.Lock(), [0]
    found = identified(paths, course)
    flags = duplicates(paths, course, found)
    sandbox.sweep()     # the work folders of a grader killed earlier, and any process it left in them
    prepare({exercise for _, exercise in found.values()}, progress)
    package = sandbox.package_copy(Path(tempfile.mkdtemp(prefix=f"{sandbox.PREFIX}{os.getpid()}-pkg-"))) if sandbox.available() else None

    def one(path):
        g = grade_one(path, course, timeout, cell_timeout, env=env, package=package)
        if path in flags:
            g.flags.append(flags[path])
        if not g.sandboxed:
            g.flags.append("unsandboxed")
        with lock:
            if on_done is not None:
                on_done(g)
            done[0] += 1
            if progress:
                pts = f"{format_points(g.points)}/{format_points(g.max_points)}" if g.checks else "-"
                progress(f"[{done[0]}/{len(paths)}] {g.submission}: {g.exercise or '?'} {pts} {g.status}"
                         f"{' (' + g.reason[:100] + ')' if g.status in ('timeout', 'error') else ''} "
                         f"{g.seconds:.0f} s", flush=True)
        return g

    pool = ThreadPoolExecutor(max_workers=max(1, jobs))
    try:
        return list(pool.map(one, paths))
    except BaseException:  # Ctrl-C: no notebook, kernel or rank outlives the grader
        procs.stop_all()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        if package is not None:
            for p in [package, *package.rglob("*")]:
                if p.is_dir():
                    p.chmod(0o700)
            shutil.rmtree(package, ignore_errors=True)


def check_outputs(report: Path | None, feedback: Path | None) -> None:
    """Refuse to start (`par.runtime.checks.CheckError`) when the report or the feedback folder cannot be written."""
    if report is not None:
        check_writable(report, parents=True)
    if feedback is not None:
        check_writable(feedback, directory=True, parents=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m par grade", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("submissions", nargs="+", metavar="SUBMISSION_OR_DIR",
                    help="notebooks, or folders searched recursively for *.ipynb")
    ap.add_argument("--report", type=Path, help="write the gradebook CSV here (one row per submission)")
    ap.add_argument("--feedback", type=Path, help="write each submission's report (what a student reads) into "
                                                  "this folder, one .txt per submission")
    ap.add_argument("--timeout", type=float, default=TIMEOUT, help="seconds per notebook (default %(default)s)")
    ap.add_argument("--cell-timeout", type=float, default=CELL_TIMEOUT,
                    help="seconds per cell (default %(default)s)")
    ap.add_argument("--jobs", type=int, default=1, help="notebooks graded at once (default %(default)s)")
    ap.add_argument("--solutions", type=Path, default=None,
                    help="the instructor's solutions/ folder (default: solutions/ of this checkout)")
    ap.add_argument("--practice", action="store_true", help="grade with the visible checks of exercises/ only")
    ap.add_argument("--resume", action="store_true", help="keep the rows already in --report and grade only the "
                                                           "submissions without one (after an interrupted batch)")
    args = ap.parse_args(argv)
    if not (0 < args.timeout < float("inf") and 0 < args.cell_timeout < float("inf")) or args.jobs < 1:
        ap.error("--timeout and --cell-timeout must be finite numbers > 0 and --jobs at least 1")
    if args.resume and args.report is None:
        ap.error("--resume needs --report")
    check_outputs(args.report, args.feedback)       # before any grading: a grade is never lost at the end
    course = load_course(args.solutions, args.practice)
    paths = find_submissions(args.submissions)
    if not paths:
        raise SubmissionError(f"no file to grade in {' '.join(args.submissions)}")
    if args.report is None and len(paths) == 1:
        print(f"grading {paths[0]} ({describe(course)}) ...", flush=True)
        grades = grade_many(paths, course, args.timeout, args.cell_timeout, 1, progress=None)
        print(format_grade(grades[0], course))
        return 0 if grades[0].status == "ok" else 1
    rows = RowWriter(args.report, args.resume) if args.report is not None else None
    if rows is not None and rows.done:
        before = len(paths)
        paths = [p for p in paths if str(p) not in rows.done]
        print(f"resuming: {before - len(paths)} submission(s) already in {args.report}")
    print(f"grading {len(paths)} file(s), {args.jobs} at a time ({describe(course)})", flush=True)
    try:
        grades = grade_many(paths, course, args.timeout, args.cell_timeout, args.jobs, on_done=rows)
    finally:
        if rows is not None:
            rows.close()
    print(class_summary(grades))
    if args.feedback is not None:
        write_feedback(grades, course, args.feedback)
        print(f"wrote {len(grades)} feedback file(s) to {args.feedback}")
    if args.report is None:
        return 0 if all(g.status == "ok" for g in grades) else 1
    write_report(grades, args.report, rows.earlier)     # the same rows, in the order of the submissions
    print(f"wrote {args.report} ({len(grades) + len(rows.earlier)} rows)")
    return 0
