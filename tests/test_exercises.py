"""Exercises: every solution passes strictly, exercises/ is generated from solutions/, the generator's rules; each
exercise states its expected time, and the README, docs/instructor.md and docs/ta.md name the exercises whose
checks run the student's code on real ranks as the grader's rank runners do.

How solutions are checked (strict nbval where outputs are stable):
- `solutions/NN_topic.ipynb` keep their outputs. `python -m par exercises record` executes them, stores the
  outputs, verifies that a second run reproduces them, and regenerates exercises/. Those outputs are the reference.
- `test_solution_passes_and_reproduces_its_outputs` runs, per solution, in a subprocess and a fresh temporary
  directory, `pytest --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg`: every cell must run without error
  AND print what it printed when recorded, after the sanitizer has removed what changes run to run (timings,
  tqdm bars, lines streamed by launched ranks, ports, addresses). Figures are not compared (nbval skips
  images). A cell whose output is unstable in another way carries a `# NBVAL_IGNORE_OUTPUT` line. nbval does not
  compare a cell that was never executed, so a solution not yet recorded is checked as `--nbval-lax` would,
  and `test_solutions_are_recorded` fails naming the fix.
- Exercises and lecture notebooks are stored without outputs (tests/test_notebooks.py).
- That the instructor's checks grade every solution full marks and every untouched exercise zero, and that
  they catch the wrong answers kept in tests/fixtures/wrong_answers, is tests/test_grading.py.

The parametrised tests pick up whatever solutions/ holds (none: pytest reports them skipped). The unit tests
use the fixture course in tests/fixtures/course (one solution with a hidden check, its generated exercise).
"""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from tiers import slow

from par.__main__ import main as python_m_par
from par.course.authoring import generate as exercises, cli as exercises_cli
from par.course.grading import grade
from par.course.authoring.generate import ExerciseError, stub_source, visible_source

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = Path(__file__).parent / "fixtures" / "course"
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))


def code_cells(nb):
    return [cell for cell in nb.cells if cell.cell_type == "code"]


# ---- the course's own notebooks -------------------------------------------------------------------------------

def test_exercises_are_in_sync_with_solutions():
    assert exercises.out_of_sync(ROOT) == [], "run: python -m par exercises generate"


def test_solutions_are_recorded():
    unrecorded = [p.name for p in SOLUTIONS
                  if any(c.execution_count is None for c in code_cells(nbformat.read(p, as_version=4)))]
    assert not unrecorded, f"solutions without recorded outputs: {unrecorded}; run: python -m par exercises record"


@pytest.fixture(scope="module")
def warm_caches():
    """Build matplotlib's font cache here, so no notebook prints "building the font cache" in one run only."""
    import matplotlib.font_manager  # noqa: F401


@slow
@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_solution_passes_and_reproduces_its_outputs(path, warm_caches):
    run = exercises.strict_nbval(path, ROOT)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_solution_follows_the_grading_rules(path):
    nb = nbformat.read(path, as_version=4)
    exercises.check_solution(nb, path.name)
    checks = [c for c in nb.cells if exercises.is_check(c)]
    ids = [c.id for c in nb.cells]
    assert len(ids) == len(set(ids)) and all(i.startswith("check-") for i in (c.id for c in checks)), \
        "check cells carry readable ids (check-...): the gradebook names the failed ones"
    assert all("points" in c.metadata for c in checks), "every check cell states its points"
    answers = [c for c in nb.cells if exercises.is_answer(c)]
    setup = "\n".join(c.source for c in nb.cells if c.cell_type == "code" and not exercises.is_check(c)
                      and not exercises.is_answer(c))
    for cell in answers:  # a stub never hands the student par's copy of the function it asks for
        for name in exercises.defined_names(cell.source):
            if isinstance(name, str):
                assert not re.search(rf"\bimport\b[^\n]*\b{name}\b", setup), f"{path.name}: setup imports {name}"
                assert not re.search(rf"\bimport\b[^\n]*\b{name}\b", exercises.stub_source(cell.source)), name


def real_rank_exercises() -> list[str]:
    """The exercises whose checks launch the student's code on real ranks: the numbers of the solutions that launch a
    module `par.course.grading.rank_io.exercise` accepts (a rank runner of the grader)."""
    import pkgutil

    import par.course.grading
    from par.course.grading import rank_io
    modules = [f"par.course.grading.{m.name}" for m in pkgutil.iter_modules(par.course.grading.__path__)]
    runners = [m for m in modules if rank_io.exercise(m) is not None]
    code = {p.name[:2]: "\n".join(c.source for c in code_cells(nbformat.read(p, as_version=4))) for p in SOLUTIONS}
    launching = {m: sorted(n for n, source in code.items() if f'"{m}"' in source) for m in runners}
    assert runners and all(launching.values()), f"a rank runner no solution launches: {launching}"
    return sorted({n for numbers in launching.values() for n in numbers})


# where each page names the exercises with real ranks (words may wrap; the numbers are the first group)
REAL_RANK_SENTENCES = {
    "README.md": "Exercises ([0-9, and]+?) also run your code on real gloo ranks",
    "docs/instructor.md": "Exercises ([0-9, and]+?) also run the student's code on real gloo ranks",
    "docs/ta.md": r"On the exercises with real ranks \(([0-9, ]+?), whose checks run the student's code"}


def test_the_docs_name_the_exercises_that_run_the_students_code_on_real_ranks():
    want = real_rank_exercises()
    found = {}
    for doc, sentence in REAL_RANK_SENTENCES.items():
        m = re.search(sentence.replace(" ", r"\s+"), (ROOT / doc).read_text())
        found[doc] = sorted(re.findall(r"\d\d", m.group(1))) if m else "the sentence is missing"
    wrong = {doc: got for doc, got in found.items() if got != want}
    assert not wrong, f"the exercises with real ranks are {', '.join(want)} (rank_io.exercise's runners, by the " \
                      f"solutions that launch them); the docs say {wrong}"


def expected_time_problems(path: Path) -> list[str]:
    """What is wrong with the expected time an exercise states near its top (its cell `expected-time`: the total,
    then one `part N about M min` per numbered section, adding up)."""
    nb = nbformat.read(path, as_version=4)
    top = [c for c in nb.cells[:3] if c.get("id") == "expected-time" and c.cell_type == "markdown"]
    if not top:
        return [f"{path.name}: no markdown cell `expected-time` among its first three cells"]
    text = top[0].source
    total = re.search(r"Expected time: about (?:(\d+) h)? ?(?:(\d+) min)?\*\*", text)
    parts = [(int(n), int(m)) for n, m in re.findall(r"part (\d+) about (\d+) min", text)]
    sections = [int(n) for c in nb.cells if c.cell_type == "markdown"
                for n in re.findall(r"^## (\d+)\.", c.source, re.M)]
    problems = []
    if not total or not any(total.groups()):
        problems.append(f"{path.name}: no total (`**Expected time: about 1 h 20 min**`)")
    elif sum(m for _, m in parts) != 60 * int(total.group(1) or 0) + int(total.group(2) or 0):
        problems.append(f"{path.name}: its parts do not add up to its total")
    if [n for n, _ in parts] != sections:
        problems.append(f"{path.name}: times for parts {[n for n, _ in parts]}, sections {sections}")
    return problems


def test_every_exercise_states_its_expected_time():
    problems = [p for path in sorted((ROOT / "exercises").glob("*.ipynb")) for p in expected_time_problems(path)]
    assert not problems, "\n".join(problems)


# ---- the generator, on the fixture course -----------------------------------------------------------------------

def test_regions_become_stubs_at_the_marker_indentation():
    source = ("def f(x):\n"
              "    y = 1\n"
              "    ### BEGIN SOLUTION\n"
              "    return x + y\n"
              "    ### END SOLUTION\n"
              "\n"
              "def g(n):\n"
              "    for i in range(n):\n"
              "        ### BEGIN SOLUTION  (a note)\n"
              "        print(i)\n"
              "        print(i * 2)\n"
              "        ### END SOLUTION\n"
              "    return n")
    assert stub_source(source) == ("def f(x):\n"
                                   "    y = 1\n"
                                   f"    {exercises.STUB}\n"
                                   "\n"
                                   "def g(n):\n"
                                   "    for i in range(n):\n"
                                   f"        {exercises.STUB}\n"
                                   "    return n")
    assert stub_source("x = 1\nprint(x)") == "x = 1\nprint(x)"


@pytest.mark.parametrize("source, message", [
    ("def f():\n    ### BEGIN SOLUTION\n    return 1\n", "line 2: .* never closed"),
    ("def f():\n    return 1\n    ### END SOLUTION\n", "line 3: .* without"),
    ("def f():\n    ### BEGIN SOLUTION\n    ### BEGIN SOLUTION\n    ### END SOLUTION\n", "line 3: .* opened at line 2"),
    ("### BEGIN SOLUTION\nx = 1\n### END SOLUTION\n", "line 1: answer region at top level"),
])
def test_unbalanced_or_top_level_regions_are_refused(source, message):
    with pytest.raises(ExerciseError, match=message):
        stub_source(source, where="solutions/x.ipynb, cell 3")


def test_generated_exercise_strips_answers_and_outputs_and_keeps_the_rest():
    solution = nbformat.read(FIXTURE / "solutions" / "99_example.ipynb", as_version=4)
    solution.cells[1].outputs = [nbformat.v4.new_output("stream", text="hi\n")]
    solution.cells[1].execution_count = 3
    nb = exercises.exercise_notebook(solution, "99_example.ipynb")
    note = nb.cells[0]
    assert note.cell_type == "markdown"
    assert "Generated from `solutions/99_example.ipynb`: edit the solution, then run " \
           "`python -m par exercises generate`" in note.source
    assert [c.source for c in nb.cells[1:] if c.cell_type == "markdown"] == \
           [c.source for c in solution.cells if c.cell_type == "markdown"]
    assert all(c.outputs == [] and c.execution_count is None for c in code_cells(nb))
    text = nbformat.writes(nb)
    assert "BEGIN SOLUTION" not in text and "END SOLUTION" not in text and "divmod" not in text
    assert sum(c.source.count(exercises.STUB) for c in code_cells(nb)) == 2
    assert [c.metadata.get("tags") for c in code_cells(nb)] == [c.metadata.get("tags") for c in code_cells(solution)]


def test_generate_is_deterministic_and_check_names_every_problem(tmp_path, capsys):
    course = tmp_path / "course"
    shutil.copytree(FIXTURE, course)
    committed = (course / "exercises" / "99_example.ipynb").read_bytes()
    assert exercises_cli.main(["check", "--root", str(course)]) == 0  # the committed fixture exercise is in sync
    assert "in sync" in capsys.readouterr().out

    (course / "exercises" / "99_example.ipynb").unlink()
    (course / "exercises" / "98_orphan.ipynb").write_text("{}")
    shutil.copy(course / "solutions" / "99_example.ipynb", course / "solutions" / "97_copy.ipynb")
    (course / "exercises" / "97_copy.ipynb").write_text("{}")
    assert exercises_cli.main(["check", "--root", str(course)]) == 1
    err = capsys.readouterr().err
    assert "exercises/99_example.ipynb: missing" in err
    assert "exercises/98_orphan.ipynb: extra" in err
    assert "exercises/97_copy.ipynb: out of sync" in err

    assert exercises_cli.main(["generate", "--root", str(course)]) == 0
    assert (course / "exercises" / "99_example.ipynb").read_bytes() == committed
    assert not (course / "exercises" / "98_orphan.ipynb").exists()
    first = {p.name: p.read_bytes() for p in (course / "exercises").glob("*.ipynb")}
    assert exercises.generate(course) == []  # a second run changes nothing...
    assert {p.name: p.read_bytes() for p in (course / "exercises").glob("*.ipynb")} == first  # ...byte for byte
    assert exercises.out_of_sync(course) == []


def test_generate_refuses_an_unbalanced_solution_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("PAR_DEBUG", raising=False)
    course = tmp_path / "course"
    shutil.copytree(FIXTURE, course)
    shutil.rmtree(course / "exercises")
    nb = nbformat.read(course / "solutions" / "99_example.ipynb", as_version=4)
    nb.cells[3].source = nb.cells[3].source.replace("    ### END SOLUTION\n", "", 1)
    nbformat.write(nb, course / "solutions" / "50_broken.ipynb")
    assert python_m_par(["exercises", "generate", "--root", str(course)]) == 2
    err = capsys.readouterr().err
    assert "solutions/50_broken.ipynb, cell 4, line 11" in err and "inside the region opened at line 3" in err
    assert not list((course / "exercises").glob("*.ipynb"))


# ---- hidden checks, points and grading, on the fixture course ---------------------------------------------------

def test_hidden_checks_and_points_stay_out_of_the_exercise():
    source = "assert f(1) == 1\n### BEGIN HIDDEN CHECKS\nassert f(2) == 4\n### END HIDDEN CHECKS\nprint('ok')"
    assert visible_source(source) == f"assert f(1) == 1\n{exercises.HIDDEN_NOTE}\nprint('ok')"
    nb = nbformat.read(FIXTURE / "exercises" / "99_example.ipynb", as_version=4)
    text = nbformat.writes(nb)
    assert "600, 3" not in text and exercises.HIDDEN_NOTE in text
    assert [exercises.points(c) for c in nb.cells if exercises.is_check(c)] == [1, 2]
    assert exercises.exercise_name(nb) == "99_example"


@pytest.mark.parametrize("change, message", [
    (lambda nb: nb.cells[5].metadata.update(points=-1), "'points' must be a number >= 0"),
    (lambda nb: nb.cells[5].metadata.update(points="2"), "'points' must be a number >= 0"),
    (lambda nb: setattr(nb.cells[5], "source", "def f():\n    ### BEGIN SOLUTION\n    pass\n    ### END SOLUTION"),
     "a check cell holds an answer region"),
    (lambda nb: setattr(nb.cells[4], "source", "### BEGIN HIDDEN CHECKS\n### END HIDDEN CHECKS"),
     "hidden checks outside a check cell"),
    (lambda nb: setattr(nb, "cells", [c for c in nb.cells if not exercises.is_check(c)]),
     "no code cell is tagged `check`"),
])
def test_a_solution_breaking_the_grading_rules_is_refused(change, message):
    nb = nbformat.read(FIXTURE / "solutions" / "99_example.ipynb", as_version=4)
    change(nb)
    with pytest.raises(ExerciseError, match=message):
        exercises.exercise_notebook(nb, "99_example.ipynb")


def grade_cli(path: Path, *more):
    return subprocess.run([sys.executable, "-m", "par", "grade", str(path), *more], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


def test_grade_passes_the_solution_and_fails_the_stub_with_a_readable_report():
    official = ["--solutions", str(FIXTURE / "solutions")]
    passed = grade_cli(FIXTURE / "solutions" / "99_example.ipynb", *official)
    assert passed.returncode == 0, passed.stdout[-3000:] + passed.stderr[-3000:]
    assert "official grade" in passed.stdout and "99_example.ipynb: 3/3 points (100%), status ok" in passed.stdout
    failed = grade_cli(FIXTURE / "exercises" / "99_example.ipynb", *official)
    assert failed.returncode == 1
    assert "FAIL  99-example-5" in failed.stdout and "NotImplementedError: your code here" in failed.stdout
    assert "99_example.ipynb: 0/3 points (0%), status failed" in failed.stdout


def test_hidden_checks_count_in_the_official_grade_only(tmp_path):
    nb = nbformat.read(FIXTURE / "exercises" / "99_example.ipynb", as_version=4)
    answers = {c.id: c.source for c in nbformat.read(FIXTURE / "solutions" / "99_example.ipynb", as_version=4).cells}
    nb.cells[4].source = answers["99-example-3"].replace(  # hard-codes the two visible cases of ring_bytes
        "### BEGIN SOLUTION\n    return 2 * (world_size - 1) * size_bytes / world_size",
        "### BEGIN SOLUTION\n    return {(1000, 2): 1000, (1200, 4): 1800}[size_bytes, world_size]")
    nbformat.write(nb, tmp_path / "99_example.ipynb")
    official = grade.grade_one(tmp_path / "99_example.ipynb", grade.load_course(FIXTURE / "solutions"))
    assert (official.status, official.points, official.max_points, official.failed_checks) == \
           ("failed", 2, 3, ["99-example-5"]), official.reason
    practice = grade.grade_one(tmp_path / "99_example.ipynb", grade.load_course(practice=True, root=FIXTURE))
    assert (practice.status, practice.points, practice.max_points, practice.official) == ("ok", 3, 3, False)


@slow
def test_record_stores_outputs_that_strict_nbval_then_compares(tmp_path, warm_caches):
    course = tmp_path / "course"
    shutil.copytree(FIXTURE, course)
    (course / "tests").mkdir()
    shutil.copy(ROOT / "tests" / "nbval_sanitize.cfg", course / "tests" / "nbval_sanitize.cfg")
    broken = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("raise ValueError('broken solution')",
                                                                       metadata={"tags": ["check"], "points": 1})],
                                      metadata={"kernelspec": {"name": "python3", "display_name": "Python 3"}})
    nbformat.write(broken, course / "solutions" / "50_broken.ipynb")
    assert exercises_cli.main(["record", "--root", str(course)]) == 1  # 50_broken raises: reported, left alone
    assert nbformat.read(course / "solutions" / "50_broken.ipynb", as_version=4) == broken
    solution = course / "solutions" / "99_example.ipynb"  # recorded (executed, verified with strict nbval)
    nb = nbformat.read(solution, as_version=4)
    assert all(c.execution_count is not None for c in code_cells(nb))
    assert nb.cells[4].outputs[0].text == "world sizes tried: [2, 3, 4]\n"
    assert exercises.out_of_sync(course) == []  # recording changes no exercise (and generated the new one)

    nb.cells[4].outputs[0].text = "world sizes tried: [2, 3]\n"  # a reference the code no longer prints
    nbformat.write(nb, solution)
    strict = subprocess.run(exercises.nbval_command(solution, strict=True, root=course), cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert strict.returncode == 1 and "Cell outputs differ" in strict.stdout
