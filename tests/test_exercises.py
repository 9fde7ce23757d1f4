"""Exercises: every solution passes, every stub fails its checks, exercises/ is generated from solutions/.

How solutions are checked (strict nbval where outputs are stable):
- `solutions/NN_topic.ipynb` keep their outputs. `python -m par exercises record` executes them, stores the
  outputs, verifies that a second run reproduces them, and regenerates exercises/. Those outputs are the reference.
- `test_solution_passes_and_reproduces_its_outputs` runs, per solution, in a subprocess,
  `pytest --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg`: every cell must run without error (all that
  `pytest --nbval-lax`, i.e. `python -m par grade`, asks) AND print what it printed when recorded, after the
  sanitizer has removed what changes run to run (timings, tqdm bars, lines streamed by launched ranks, ports,
  addresses). Figures are not compared (nbval skips images). A cell whose output is unstable in another way
  carries a `# NBVAL_IGNORE_OUTPUT` line. nbval does not compare a cell that was never executed, so a solution not
  yet recorded is checked exactly as `--nbval-lax` would, and `test_solutions_are_recorded` fails naming the fix.
- Exercises and lecture notebooks are stored without outputs (tests/test_notebooks.py).

The parametrised tests pick up whatever solutions/ and exercises/ hold (none: pytest reports them skipped).
The unit tests use the fixture course in tests/fixtures/course (one solution, its generated exercise).
"""
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from par import exercises
from par.exercises import ExerciseError, stub_source

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = Path(__file__).parent / "fixtures" / "course"
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
EXERCISES = sorted((ROOT / "exercises").glob("*.ipynb"))


def code_cells(nb):
    return [cell for cell in nb.cells if cell.cell_type == "code"]


def execute(path: Path, timeout: float = 180):
    """Run a notebook in a fresh kernel, going on past errors; return the executed node."""
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True, record_timing=False,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    return nb


def stub_problems(nb) -> list[str]:
    """What is wrong with an executed exercise notebook: its checks must fail, and fail first."""
    cells = code_cells(nb)
    checks = [i for i, c in enumerate(cells) if "check" in c.metadata.get("tags", [])]
    errors = {i: o for i, c in enumerate(cells) for o in c.outputs if o.output_type == "error"}
    if not checks:
        return ["no code cell is tagged `check`"]
    if not errors:
        return ["every cell ran without error: the stubs do not make the checks fail"]
    first = min(errors)
    problems = []
    if first not in checks:
        problems.append(f"the first failing cell (code cell {first}: {cells[first].source.splitlines()[0]!r}) "
                        f"is not a check: {errors[first].ename}: {errors[first].evalue}")
    elif errors[first].ename not in ("NotImplementedError", "AssertionError") \
            and "NotImplementedError" not in errors[first].evalue:  # e.g. a LaunchError carrying the stub's
        problems.append(f"the first check fails with {errors[first].ename}: {errors[first].evalue} "
                        f"(expected the stub's NotImplementedError or an AssertionError)")
    passing = [i for i in checks if i not in errors]
    if passing:
        problems.append(f"check cells {passing} pass on the stubs: they cannot fail")
    return problems


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


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_solution_passes_and_reproduces_its_outputs(path, warm_caches):
    run = subprocess.run(exercises.nbval_command(path, strict=True, root=ROOT), cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]


@pytest.mark.parametrize("path", EXERCISES, ids=lambda p: p.name)
def test_exercise_stub_fails_its_checks(path):
    assert stub_problems(execute(path)) == []


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
    assert exercises.main(["check", "--root", str(course)]) == 0  # the committed fixture exercise is in sync
    assert "in sync" in capsys.readouterr().out

    (course / "exercises" / "99_example.ipynb").unlink()
    (course / "exercises" / "98_orphan.ipynb").write_text("{}")
    shutil.copy(course / "solutions" / "99_example.ipynb", course / "solutions" / "97_copy.ipynb")
    (course / "exercises" / "97_copy.ipynb").write_text("{}")
    assert exercises.main(["check", "--root", str(course)]) == 1
    err = capsys.readouterr().err
    assert "exercises/99_example.ipynb: missing" in err
    assert "exercises/98_orphan.ipynb: extra" in err
    assert "exercises/97_copy.ipynb: out of sync" in err

    assert exercises.main(["generate", "--root", str(course)]) == 0
    assert (course / "exercises" / "99_example.ipynb").read_bytes() == committed
    assert not (course / "exercises" / "98_orphan.ipynb").exists()
    first = {p.name: p.read_bytes() for p in (course / "exercises").glob("*.ipynb")}
    assert exercises.generate(course) == []  # a second run changes nothing...
    assert {p.name: p.read_bytes() for p in (course / "exercises").glob("*.ipynb")} == first  # ...byte for byte
    assert exercises.out_of_sync(course) == []


def test_generate_refuses_an_unbalanced_solution_and_writes_nothing(tmp_path, capsys):
    course = tmp_path / "course"
    shutil.copytree(FIXTURE, course)
    shutil.rmtree(course / "exercises")
    nb = nbformat.read(course / "solutions" / "99_example.ipynb", as_version=4)
    nb.cells[3].source = nb.cells[3].source.replace("    ### END SOLUTION\n", "", 1)
    nbformat.write(nb, course / "solutions" / "50_broken.ipynb")
    assert exercises.main(["generate", "--root", str(course)]) == 2
    err = capsys.readouterr().err
    assert "solutions/50_broken.ipynb, cell 4, line 11" in err and "inside the region opened at line 3" in err
    assert not list((course / "exercises").glob("*.ipynb"))


# ---- grading, stubs failing and strict nbval, on the fixture course (these start kernels) -----------------------

def grade(path: Path):
    return subprocess.run([sys.executable, "-m", "par", "grade", str(path)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


def test_grade_passes_the_solution_and_fails_the_stub():
    passed = grade(FIXTURE / "solutions" / "99_example.ipynb")
    assert passed.returncode == 0, passed.stdout[-3000:]
    assert "99_example.ipynb: 1/1 checks passed" in passed.stdout
    failed = grade(FIXTURE / "exercises" / "99_example.ipynb")
    assert failed.returncode == 1
    assert "99_example.ipynb: 0/1 checks passed\n  FAILED Cell 3: assert ring_bytes(1000, 2) == 1000" in failed.stdout
    assert "NotImplementedError" in failed.stdout


def test_stub_check_on_the_fixture_exercise():
    assert stub_problems(execute(FIXTURE / "exercises" / "99_example.ipynb")) == []


def test_stub_check_rejects_checks_that_cannot_fail_or_fail_late():
    nb = nbformat.read(FIXTURE / "exercises" / "99_example.ipynb", as_version=4)
    assert stub_problems(nb) == ["every cell ran without error: the stubs do not make the checks fail"]
    cells = code_cells(nb)
    error = nbformat.v4.new_output("error", ename="ImportError", evalue="no module x", traceback=[])
    cells[0].outputs = [error]  # the setup cell fails before any check
    assert "is not a check: ImportError" in stub_problems(nb)[0]
    cells[0].outputs, cells[3].outputs = [], [error]  # the check fails, but not for the stub's reason
    assert "expected the stub's NotImplementedError" in stub_problems(nb)[0]
    cells[3].metadata["tags"] = []
    assert stub_problems(nb) == ["no code cell is tagged `check`"]


def test_record_stores_outputs_that_strict_nbval_then_compares(tmp_path, warm_caches):
    course = tmp_path / "course"
    shutil.copytree(FIXTURE, course)
    (course / "tests").mkdir()
    shutil.copy(ROOT / "tests" / "nbval_sanitize.cfg", course / "tests" / "nbval_sanitize.cfg")
    broken = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("raise ValueError('broken solution')")],
                                      metadata={"kernelspec": {"name": "python3", "display_name": "Python 3"}})
    nbformat.write(broken, course / "solutions" / "50_broken.ipynb")
    assert exercises.main(["record", "--root", str(course)]) == 1  # 50_broken raises: reported, left alone
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
