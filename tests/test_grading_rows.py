"""What a grading run writes holds, whatever the submissions (`par.course.grading.grade`, `report`, `checks`).

- The gradebook: no cell reads as a formula in a spreadsheet (`=HYPERLINK(...)` as a file name), and `--resume`
  still finds the rows it wrote.
- The feedback: SAME ANSWERS names no other student's submission (the gradebook does); DUPLICATE may name the
  student's own other file.
- Hidden cases: once a check with hidden cases has started, every later cell's error shows its type only (a fake
  kernel, and once end to end on exercise 01, `slow`).
- Every submission gets a row: odd notebooks (metadata, cells, nbformat 3), an exception of the grader's on one
  notebook, and a seeded fuzz over notebook JSON; none of them stops the batch, and `--resume` goes past them.
- 07's layouts are measured before any submission runs, and only when a 07 submission is in the batch.

No test here starts a kernel except the end-to-end one: `checks.run` is replaced by a fake where a notebook would
reach it.
"""
import copy
import csv
import json
import random
from pathlib import Path

import nbformat
import pytest
from tiers import slow

from par.__main__ import main as python_m_par
from par.course.authoring import generate as exercises
from par.course.grading import checks, exercise_layout, grade, report
from par.course.grading.kernel import Reply

from classroom import ROOT, read, solution, solved

EX = "01_model_state_bytes"
EXERCISE = json.loads((ROOT / "exercises" / f"{EX}.ipynb").read_text())
HYPERLINK = '=HYPERLINK("http://x","y").ipynb'
FORMULA_FILE = '=HYPERLINK("x","y").ipynb'          # a file name can hold no "/"


@pytest.fixture
def no_kernel(monkeypatch):
    """`checks.run` answers at once that every cell passed, and 07's layouts are not measured (a notebook that
    says it is 07's would launch the measurement); the submissions `checks.run` was asked for are listed."""
    asked = []
    monkeypatch.setattr(exercise_layout, "measured", lambda: None)

    def run(assembled, reference, **_):
        asked.append(assembled)
        cells = {i: checks.CellResult(ran=True, passed=True) for i in range(len(assembled.roles))}
        return checks.NotebookRun(cells=cells), []
    monkeypatch.setattr(grade.checks, "run", run)
    return asked


def rows_of(path: Path) -> dict:
    return {r["submission"]: r for r in csv.DictReader(path.open(newline=""))}


def grade_folder(folder: Path, tmp_path: Path, *more) -> tuple[int, dict]:
    code = python_m_par(["grade", str(folder), "--report", str(tmp_path / "grades.csv"),
                         "--feedback", str(tmp_path / "feedback"), *more])
    return code, rows_of(tmp_path / "grades.csv")


# ---- the gradebook ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", [HYPERLINK, "+1", "-2+3", "@SUM(A1)", "\tx", "\rx", "'quoted", "''=x", "'=x",
                                  "plain.ipynb", "", "1.5"])
def test_a_gradebook_cell_is_escaped_by_content_and_read_back_the_same(text):
    cell = report.escaped(text)
    assert not cell.startswith(("=", "+", "-", "@", "\t", "\r")), cell
    assert report.unescaped(cell) == text
    assert cell == text or cell == "'" + text


def test_no_gradebook_cell_reads_as_a_formula(tmp_path):
    g = grade.Grade(submission=HYPERLINK, exercise="@SUM(A1)", status="error", reason="-2+3", flags=["=1+1"])
    for write in (lambda p: report.write_report([g], p), lambda p: _row_writer(p, g)):
        path = tmp_path / "grades.csv"
        write(path)
        row = list(csv.reader(path.open(newline="")))[1]
        assert row[0] == "'" + HYPERLINK and row[1] == "'@SUM(A1)" and row[7] == "'-2+3; =1+1", row
        assert not any(cell.startswith(("=", "+", "-", "@", "\t", "\r")) for cell in row), row


def _row_writer(path: Path, g) -> None:
    rows = report.RowWriter(path)
    rows(g)
    rows.close()


def test_resume_recognises_the_escaped_rows_and_does_not_escape_them_twice(tmp_path, monkeypatch, capsys, no_kernel):
    folder = tmp_path / "class"
    folder.mkdir()
    (folder / FORMULA_FILE).write_text(json.dumps(EXERCISE))            # an exercise 01: graded (a fake run)
    (folder / "-broken.ipynb").write_text("{not json")
    monkeypatch.chdir(folder)                                             # submissions named as found: "=HYPERLINK..."
    report_path = tmp_path / "grades.csv"
    assert python_m_par(["grade", ".", "--report", str(report_path)]) == 0
    first = report_path.read_text()
    assert set(rows_of(report_path)) == {"'" + FORMULA_FILE, "'-broken.ipynb"}, first
    assert len(no_kernel) == 1
    for _ in range(2):
        assert python_m_par(["grade", ".", "--report", str(report_path), "--resume"]) == 0
        assert "resuming: 2 submission(s) already in" in capsys.readouterr().out
        assert len(no_kernel) == 1, "a row already written was graded again"
        assert report_path.read_text() == first


# ---- the feedback names no other student -------------------------------------------------------------------------

def test_same_answers_names_the_others_in_the_gradebook_and_nobody_in_the_feedback(tmp_path, course, no_kernel):
    one, other = "student_aaa", "student_bbb"
    for who in (one, other):
        (tmp_path / who).mkdir()
        nbformat.write(solved(EX), tmp_path / who / f"{EX}.ipynb")
    nbformat.write(solved(EX), tmp_path / one / f"{EX} (1).ipynb")      # the first student's own second copy
    grades = grade.grade_many(sorted(tmp_path.rglob("*.ipynb")), course, progress=None)
    assert len(grades) == 3
    report.write_feedback(grades, course, tmp_path / "feedback")
    for g in grades:
        mine, theirs = (one, other) if one in g.submission else (other, one)
        assert "SAME ANSWERS: the answer cells of " in g.row()["reason"] and theirs in g.row()["reason"], g.row()
        text = report.format_grade(g, course, student=True)
        assert "SAME ANSWERS: another submission's answer cells are the same" in text, text
        assert theirs not in text, text
        if mine == one:     # DUPLICATE names the student's own other file
            copy_of = next(p for p in grades if one in p.submission and p is not g).submission
            assert copy_of in next(line for line in text.splitlines() if "flag: DUPLICATE" in line), text
    feedback = sorted((tmp_path / "feedback").glob("*.txt"))
    assert len(feedback) == 3
    for path in feedback:
        assert (other if one in path.name else one) not in path.read_text(), path.read_text()


def test_a_flag_keeps_what_the_student_is_told_when_pickled():
    import pickle
    flag = pickle.loads(pickle.dumps(report.Flag("SAME ANSWERS: the answer cells of x are the same", "told")))
    assert isinstance(flag, report.Flag) and report.told(flag) == "told" and flag.startswith("SAME ANSWERS")


# ---- no error message after a hidden check reaches the feedback ------------------------------------------------

SECRET = "secret-1234"
HIDDEN_REFERENCE = [
    ("setup", "setup", "x = 1"),
    ("answer", "f-cell", "def f(x):\n    ### BEGIN SOLUTION\n    return x\n    ### END SOLUTION"),
    ("check", "check-visible", "assert False, 'the visible case failed: 41'"),
    ("check", "check-hidden", "assert True\n### BEGIN HIDDEN CHECKS\nassert True\n### END HIDDEN CHECKS"),
    ("answer", "g-cell", f"def g(x):\n    ### BEGIN SOLUTION\n    return x\n    ### END SOLUTION\n"
                         f"raise ValueError({SECRET!r})"),
    ("setup", "setup-late", f"class Leak_{SECRET.replace('-', '_')}(Exception):\n    pass\n"
                            f"raise Leak_{SECRET.replace('-', '_')}({SECRET!r})"),
    ("check", "check-later", f"assert False, 'you returned ' + {SECRET!r}"),
    ("check", "check-stub", "raise NotImplementedError('your code here')"),
]


class FakeKernel:
    """What `checks.run` needs of a kernel: a cell that raises replies with its error (ename, evalue, traceback)."""

    def __init__(self, box, env, deadline):
        self.cap = type("Cap", (), {"tripped": False, "limit": 0})()

    def execute(self, source, deadline):
        reply = Reply()
        reply.status = "ok"
        if source == checks.KERNEL_HELPER:
            return reply
        try:
            exec(compile(source, "<student>", "exec"), {})       # noqa: S102  (the test's own cells)
        except Exception as e:
            reply.status, reply.ename, reply.evalue = "error", type(e).__name__, str(e)
            reply.traceback = f"Traceback (most recent call last):\n  File <student>, line 5\n{reply.ename}: {e}"
        return reply

    def open_channel(self):
        pass

    def close(self):
        pass


def test_every_error_after_a_hidden_check_shows_its_type_only(monkeypatch, course):
    """A fake kernel (no process): the answer cell after the hidden check raises with a secret, a later setup cell
    raises an exception class named after it, a later check asserts with it; none of it reaches what is written."""
    monkeypatch.setattr(checks, "Kernel", FakeKernel)
    reference = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell(source, id=cid, metadata={"tags": ["check"]} if role == "check" else {})
        for role, cid, source in HIDDEN_REFERENCE])
    assembled = grade.assemble(reference, reference)
    run, notes = checks.run(assembled, reference, timeout=60, cell_timeout=30, sandboxed=False)
    g = grade.score(assembled, run, reference, 60, 30, grade.Grade("x.ipynb", notes=assembled.notes + notes))
    text = report.format_grade(g, course, student=True)
    assert SECRET not in text and "1234" not in text, text
    assert "the visible case failed: 41" in text, "an error before any hidden case keeps its message"
    errors = {c.id: report.told(c.error) for c in g.checks}
    assert errors["check-later"].startswith("AssertionError after a check with hidden cases ran"), errors
    assert errors["check-stub"] == "NotImplementedError: your code here", "the handed-out stub's error is kept"
    assert "answer cell g-cell itself failed: ValueError after a check with hidden cases ran" in text, text
    assert "setup cell setup-late failed in the grader: an error after a check" in text, \
        "a type of the student's naming is withheld too"
    assert not report.told(run.cells[assembled.roles.index(("answer", "g-cell"))].traceback), \
        "a kernel cell's traceback is not told"
    instructor = report.format_grade(g, course) + "\n" + g.row()["reason"]      # the gradebook keeps the messages
    assert SECRET in instructor and SECRET in g.row()["reason"], instructor


STASH = ("\n\n_model_state_bytes_per_rank, stash = model_state_bytes_per_rank, []\n\n\n"
         "def model_state_bytes_per_rank(*args, **kwargs):\n"
         "    stash.append(args)\n"
         "    return _model_state_bytes_per_rank(*args, **kwargs)\n")
LEAK = "\n\nif stash:\n    raise ValueError(str(stash[-4:]))\n"
HIDDEN_INPUTS = ("12345", "6700000000", "sgd", "1024")     # only in check-states-per-rank's hidden cases


@slow
def test_a_stash_of_the_hidden_inputs_never_reaches_the_feedback(tmp_path, course):
    answers = {c.id: c.source for c in solution(EX).cells}
    stubs = {c.id: c.source for c in read(ROOT / "exercises" / f"{EX}.ipynb").cells}
    nb = solved(EX, {"states-per-rank": answers["states-per-rank"] + STASH,
                     "max-params": answers["max-params"] + LEAK,
                     "measured-states": stubs["measured-states"], "memory-ranks": stubs["memory-ranks"]})
    nbformat.write(nb, tmp_path / f"{EX}.ipynb")
    g = grade.grade_one(tmp_path / f"{EX}.ipynb", course, timeout=300, cell_timeout=120)
    assert "check-states-per-rank" not in g.failed_checks, (g.reason, g.notes)
    report.write_feedback([g], course, tmp_path / "feedback")
    text = next((tmp_path / "feedback").glob("*.txt")).read_text()
    assert "answer cell max-params itself failed: ValueError after a check with hidden cases ran" in text, text
    assert not any(value in text for value in HIDDEN_INPUTS), text


# ---- every submission gets a row ---------------------------------------------------------------------------------

def _odd(change):
    nb = copy.deepcopy(EXERCISE)
    change(nb)
    return nb


ANSWER = next(i for i, c in enumerate(EXERCISE["cells"]) if exercises.STUB in "".join(c["source"]))
V3 = {"nbformat": 3, "nbformat_minor": 0, "metadata": {}}
ODD = {   # name: (notebook JSON, what its row's reason says; "" when it is graded)
    "par-list": (_odd(lambda nb: nb["metadata"].update(par=["07_layout"])), ""),
    "par-number": (_odd(lambda nb: nb["metadata"].update(par=3)), ""),
    "par-str": (_odd(lambda nb: nb["metadata"].update(par="07_layout")), ""),
    "exercise-list": (_odd(lambda nb: nb["metadata"]["par"].update(exercise=["07_layout"])), ""),
    "exercise-dict": (_odd(lambda nb: nb["metadata"]["par"].update(exercise={"07_layout": 1})), ""),
    "exercise-int": (_odd(lambda nb: nb["metadata"]["par"].update(exercise=7)), ""),
    "exercise-path": (_odd(lambda nb: nb["metadata"]["par"].update(exercise="../07_layout")), ""),
    "metadata-list": (_odd(lambda nb: nb.update(metadata=[])), "not a readable notebook"),
    "source-dict": (_odd(lambda nb: nb["cells"][ANSWER].update(source={"a": 1})), "has no text source (dict)"),
    "source-int": (_odd(lambda nb: nb["cells"][ANSWER].update(source=5)), "has no text source (int)"),
    "source-list-of-ints": (_odd(lambda nb: nb["cells"][ANSWER].update(source=[1, 2])), "not a readable notebook"),
    "id-list": (_odd(lambda nb: nb["cells"][ANSWER].update(id=["x"])), "not a readable notebook"),
    "id-dict": (_odd(lambda nb: nb["cells"][ANSWER].update(id={"x": 1})), "not a readable notebook"),
    "cell-type-int": (_odd(lambda nb: nb["cells"][ANSWER].update(cell_type=3)), "not a readable notebook"),
    "cell-type-odd": (_odd(lambda nb: nb["cells"][ANSWER].update(cell_type="weird")), ""),
    "cell-without-source": (_odd(lambda nb: nb["cells"][ANSWER].pop("source")), "has no text source (missing)"),
    "cell-a-string": (_odd(lambda nb: nb["cells"].__setitem__(ANSWER, "hello")), "not a readable notebook"),
    "cells-of-empty-dicts": (_odd(lambda nb: nb.update(cells=[{}, {}])), "not a readable notebook"),
    "cell-metadata-list": (_odd(lambda nb: nb["cells"][ANSWER].update(metadata=[1])), "not a readable notebook"),
    "v3-worksheets-of-str": ({**V3, "worksheets": ["x"]}, "not a readable notebook"),
    "v3-worksheet-cells-str": ({**V3, "worksheets": [{"cells": "x"}]}, "not a readable notebook"),
    "v3-empty-worksheet": ({**V3, "worksheets": [{}]}, "not a readable notebook"),
    "v3-input-dict": ({**V3, "worksheets": [{"cells": [{"cell_type": "code", "input": {"a": 1}}]}]},
                      "not a readable notebook"),
}


@pytest.mark.parametrize("value, name", [(None, None), ([EX], None), ({"x": 1}, None), (7, None), ("", None),
                                         ("../x", None), (EX, EX)])
def test_exercise_name_is_a_name_or_none(value, name):
    nb = nbformat.v4.new_notebook(metadata={"par": {"exercise": value}})
    assert exercises.exercise_name(nb) == name
    for metadata in ([1], {"par": [1]}, {"par": 3}, {"par": EX}):
        assert exercises.exercise_name(nbformat.from_dict({"metadata": metadata, "cells": []})) is None


def test_every_odd_notebook_gets_its_row_and_the_batch_goes_on(tmp_path, no_kernel):
    folder = tmp_path / "class"
    folder.mkdir()
    for name, (nb, _) in ODD.items():
        (folder / f"{name}.ipynb").write_text(json.dumps(nb))
    nbformat.write(solved(EX), folder / f"zz_{EX}.ipynb")     # graded after all of them
    code, rows = grade_folder(folder, tmp_path)
    assert code == 0 and len(rows) == len(ODD) + 1, rows.keys()
    for name, (_, reason) in ODD.items():
        row = rows[str(folder / f"{name}.ipynb")]
        if reason:
            assert row["status"] == "error" and reason in row["reason"], (name, row)
        else:
            assert row["status"] == "ok" and row["exercise"] == EX, (name, row)
    assert rows[str(folder / f"zz_{EX}.ipynb")]["status"] == "ok"
    assert len(list((tmp_path / "feedback").glob("*.txt"))) == len(rows)


@pytest.mark.parametrize("where", ["identify", "assemble", "answer_fingerprint"])
def test_an_exception_of_the_grader_on_one_notebook_is_its_row(tmp_path, monkeypatch, capsys, no_kernel, where):
    """The grader itself trips on one notebook (here made to): that notebook's row says so, the others are graded,
    and --resume goes past it."""
    folder = tmp_path / "class"
    folder.mkdir()
    for name in ("a", "boom", "c"):
        nbformat.write(solved(EX), folder / f"{name}_{EX}.ipynb")
    real = getattr(grade, where)

    def trips(nb, *args, **kwargs):
        if any("BOOM" in repr(a) for a in (nb, *args)):
            raise TypeError("unhashable type: 'list'")
        return real(nb, *args, **kwargs)
    monkeypatch.setattr(grade, where, trips)
    nb = solved(EX)
    nb.cells.append(nbformat.v4.new_code_cell("# BOOM"))
    nbformat.write(nb, folder / f"boom_{EX}.ipynb")
    code, rows = grade_folder(folder, tmp_path)
    assert code == 0 and len(rows) == 3, rows
    boom = rows[str(folder / f"boom_{EX}.ipynb")]
    if where == "answer_fingerprint":       # only the flags need it: graded as usual
        assert boom["status"] == "ok", boom
    else:
        assert boom == {**boom, "status": "error",
                        "reason": "the grader could not read this notebook: TypeError: unhashable type: 'list'"}
    assert all(rows[str(folder / f"{n}_{EX}.ipynb")]["status"] == "ok" for n in "ac")
    capsys.readouterr()
    code, again = grade_folder(folder, tmp_path, "--resume")
    assert code == 0 and again == rows and "resuming: 3 submission(s) already" in capsys.readouterr().out


def test_an_exception_while_running_one_notebook_is_its_row(tmp_path, monkeypatch, course):
    def run(*args, **kwargs):
        raise RuntimeError("the grader's own bug\nsecond line")
    monkeypatch.setattr(grade.checks, "run", run)
    nbformat.write(solved(EX), tmp_path / f"{EX}.ipynb")
    g, = grade.grade_many([tmp_path / f"{EX}.ipynb"], course, progress=None)
    assert (g.status, g.reason) == ("error", "the grader failed while running this notebook: RuntimeError: the "
                                             "grader's own bug")


VALUES = [None, 0, -1, 3.5, True, "", "x", "07_layout", [], [1], ["a", 2], {}, {"a": 1}, {"source": 1},
          {"cell_type": "code"}, [{}], "### BEGIN SOLUTION", {"exercise": ["x"]}]


def mutated(rng: random.Random, nb: dict, times: int) -> dict:
    """`nb` with `times` nodes of its JSON tree (a dict's value or a list's item, anywhere) replaced by odd values."""
    nb = copy.deepcopy(nb)
    for _ in range(times):
        node, path = nb, []
        while isinstance(node, (dict, list)) and node and (not path or rng.random() < 0.7):
            key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
            path.append((node, key))
            node = node[key]
        if path:
            parent, key = path[-1]
            cells = nb.get("cells") if isinstance(nb.get("cells"), list) and nb["cells"] else [{}]
            parent[key] = copy.deepcopy(rng.choice([*VALUES, rng.choice(cells)]))
    return nb


def test_a_fuzz_of_notebook_json_gives_one_row_each_in_one_line(tmp_path, course, no_kernel):
    rng = random.Random(53)
    folder = tmp_path / "class"
    folder.mkdir()
    for i in range(200):
        (folder / f"fuzz-{i:03d}.ipynb").write_text(json.dumps(mutated(rng, EXERCISE, rng.randint(1, 4))))
    paths = sorted(folder.glob("*.ipynb"))
    grades = grade.grade_many(paths, course, progress=None)
    assert [g.submission for g in grades] == [str(p) for p in paths]
    for g in grades:
        assert g.status in report.STATUSES and "\n" not in g.reason, (g.submission, g.reason)
        assert g.status == "ok" or g.reason, g.submission
    assert {g.status for g in grades} >= {"ok", "error"}, "the fuzz reached both ends"


# ---- 07's measurement before any submission runs ----------------------------------------------------------------

@pytest.mark.parametrize("exercise, measured", [("07_layout", 1), (EX, 0)])
def test_the_layouts_are_measured_before_the_first_submission_and_only_for_07(tmp_path, monkeypatch, course,
                                                                              exercise, measured):
    events = []
    monkeypatch.setattr(exercise_layout, "measured", lambda: events.append("measured"))
    monkeypatch.setattr(grade, "grade_one", lambda path, *a, **k: events.append(path.name) or grade.Grade(str(path)))
    for name in ("a", "b", "c"):
        nbformat.write(read(ROOT / "exercises" / f"{exercise}.ipynb"), tmp_path / f"{name}.ipynb")
    nbformat.write(read(ROOT / "exercises" / f"{EX}.ipynb"), tmp_path / "d.ipynb")
    grade.grade_many(sorted(tmp_path.glob("*.ipynb")), course, jobs=2, progress=None)
    assert events.count("measured") == measured and sorted(events[measured:]) == ["a.ipynb", "b.ipynb", "c.ipynb",
                                                                                  "d.ipynb"], events


def test_a_failed_preparation_is_said_and_the_batch_goes_on(tmp_path, monkeypatch, course, no_kernel):
    said = []

    def fails():
        raise RuntimeError("dp 2 pp 1 tp 1 ZeRO-0 m=1 did not run")
    monkeypatch.setattr(exercise_layout, "measured", fails)
    nbformat.write(read(ROOT / "exercises" / "07_layout.ipynb"), tmp_path / "a.ipynb")
    g, = grade.grade_many([tmp_path / "a.ipynb"], course, progress=lambda *a, **k: said.append(a[0]))
    assert g.status == "ok" and any("preparing 07_layout failed (RuntimeError: dp 2" in s for s in said), said
