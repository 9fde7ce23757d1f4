"""Grading an instructor can trust (`python -m par grade`, `par.course.grading.grade`).

- The class run of each exercise (`exercise_class`, tests/classroom.py: graded once, shared with the other test
  files), a folder holding every wrong answer of tests/fixtures/wrong_answers (see its README), a solved notebook
  whose check cells the student tampered with (emptied, `assert False` added, asserts appended) and an unsolved
  one whose checks were replaced by `pass`. Every wrong answer must lose points and fail the checks its file names; the tampered notebooks
  keep their true grade (full marks, nothing); the checks that run on real gloo ranks pass with the
  solution and fail with the stub, on a rank.
- The class folder through the command line: solved, unsolved, hanging, crashing, malformed, not a notebook,
  no exercise: one CSV row each with the right status, exit code 0, within the timeouts.
- A notebook that ignores the cell timeout is killed at the notebook timeout, with what it started.
- Assembly without a kernel: answers matched by cell id or by what they define, added cells kept in place,
  missing answers graded as stubs; exercises recognised by metadata, file name or cell ids.
- The student bundle (`python -m par exercises release`): no answers in it, practice grading there, and the
  instructor's grading of its submissions.
"""
import csv
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from tiers import slow

from par.__main__ import main as python_m_par
from par.course.authoring import generate as exercises, cli as exercises_cli, release
from par.course.grading import grade
from par.course.grading.report import COLUMNS
from par.course.authoring.generate import is_answer, is_check

from classroom import NAMES, ROOT, fixture_files, full_marks, read, solution, solved

REAL_RANKS = {"00_ring_chunks": ["check-ring-ranks"], "07_layout": ["check-groups-ranks", "check-config-run"],
              "02_gradient_buckets": ["check-ddp-grads", "check-ddp-overlap", "check-ddp-bytes"],
              "03_pipelines": ["check-zb-h1-ranks"],
              "04_tensor_parallel": ["check-tp-forward", "check-tp-backward", "check-tp-traffic"],
              "08_online_softmax": ["check-ring-attention", "check-ring-bytes", "check-ring-skipping"],
              "09_expert_dispatch": ["check-alltoall-ranks"]}
WRONG_ANSWERS = [(name, fixture, cell, must_fail, source)
                 for name, fixture, cell, must_fail, _, source in fixture_files("wrong_answers")]


def by_exercise(cases, id=lambda c: "/".join(c[:2])):
    """Parameters of the class-run tests, all `slow` (the fast tier grades the solution and the stub of one exercise:
    tests/test_exercises.py)."""
    return [pytest.param(*c, id=id(c), marks=slow) for c in cases]


# ---- the fixtures themselves (no kernel) ------------------------------------------------------------------------

def test_every_exercise_keeps_six_wrong_answers_naming_real_cells():
    for name in NAMES:
        mine = [w for w in WRONG_ANSWERS if w[0] == name]
        assert len(mine) >= 6, f"{name}: {len(mine)} wrong answers in tests/fixtures/wrong_answers/{name}, at least 6 wanted"
        cells = {c.id: c for c in solution(name).cells}
        for _, fixture, cell, must_fail, _ in mine:
            assert cell in cells and is_answer(cells[cell]), f"{name}/{fixture}: {cell} is not an answer cell"
            assert all(c in cells and is_check(cells[c]) for c in must_fail), f"{name}/{fixture}: {must_fail}"


# ---- the class run -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, fixture, cell, must_fail, source", by_exercise(WRONG_ANSWERS))
def test_every_wrong_answer_loses_points(exercise_class, name, fixture, cell, must_fail, source):
    g = exercise_class(name)[f"wrong__{name}__{fixture}"]
    assert g.exercise == name and g.status == "failed", (g.status, g.reason)
    assert g.points < g.max_points
    assert set(must_fail) <= set(g.failed_checks), f"failed {g.failed_checks}, expected at least {must_fail}"
    broken = [(c.id, c.error) for c in g.checks if re.match(r"(NameError|SyntaxError|ImportError)", c.error)]
    assert not broken, f"the fixture itself is broken: {broken}"


@pytest.mark.parametrize("name", by_exercise([(n,) for n in NAMES], id=lambda c: c[0]))
def test_tampered_checks_keep_the_true_grade(exercise_class, name):
    full = exercise_class(name)[f"tampered-solved__{name}"]
    assert full.status == "ok" and full.points == full.max_points > 0, (full.reason, full.failed_checks)
    assert full.max_points == sum(exercises.points(c) for c in solution(name).cells if is_check(c))
    nothing = exercise_class(name)[f"tampered-unsolved__{name}"]
    assert nothing.status == "failed" and nothing.points == 0 and nothing.max_points == full.max_points
    assert len(nothing.failed_checks) == len(nothing.checks) > 0
    for check in nothing.checks:  # the stub's own error (or a check's assert), never a broken check
        assert re.search(r"NotImplementedError|AssertionError", check.error), (check.id, check.error)


@pytest.mark.parametrize("name", by_exercise([(n,) for n in sorted(REAL_RANKS)], id=lambda c: c[0]))
def test_real_rank_checks_pass_with_the_solution_and_fail_on_a_rank_with_the_stub(exercise_class, name):
    full, nothing = exercise_class(name)[f"tampered-solved__{name}"], exercise_class(name)[f"tampered-unsolved__{name}"]
    for check in REAL_RANKS[name]:
        assert check not in full.failed_checks
        assert check in nothing.failed_checks
    first = next(c for c in nothing.checks if c.id == REAL_RANKS[name][0])
    if name not in ("07_layout", "03_pipelines"):  # their stubs raise in the notebook, before the launch
        assert re.search(r"NotImplementedError: your code here \(rank \d\)", first.error), first.error


GRID = ("07_layout", "process-groups", ("check-process-groups", "check-groups-ranks"))   # 07's part 1: the grid


@slow
def test_the_process_grid_earns_its_points_right_and_loses_them_wrong(exercise_class):
    """07's part 1: the solution's groups earn full marks; each wrong grid loses exactly part 1's points, and the
    wrong grids that split the ranks were judged on the real ranks (the grader read their all-reduce sums)."""
    name, cell, checks = GRID
    part = sum(exercises.points(c) for c in solution(name).cells if c.get("id") in checks)
    right = exercise_class(name)[f"tampered-solved__{name}"]
    assert right.points == right.max_points == full_marks(name) and not set(checks) & set(right.failed_checks)
    wrong = [fixture for exercise, fixture, answer, *_ in WRONG_ANSWERS if (exercise, answer) == (name, cell)]
    assert len(wrong) >= 3, wrong
    for fixture in wrong:
        g = exercise_class(name)[f"wrong__{name}__{fixture}"]
        assert set(g.failed_checks) == set(checks), (fixture, g.failed_checks)
        assert g.points == full_marks(name) - part, (fixture, g.points)
        ranks = next(c for c in g.checks if c.id == checks[1])
        if fixture != "stage_stride_forgets_tp":   # a partition of the ranks: it ran, and a rank's sum was wrong
            assert "all-reduce" in ranks.error, (fixture, ranks.error)
        else:                                      # ranks listed twice: refused before any rank starts
            assert "do not split the 8 ranks" in ranks.error, ranks.error


# ---- a class folder through the command line -----------------------------------------------------------------

@slow
def test_a_class_folder_gives_a_complete_gradebook_within_the_timeouts(tmp_path):
    folder, name = tmp_path / "submissions", "01_model_state_bytes"
    (folder / "alice").mkdir(parents=True)
    nbformat.write(solved(name), folder / "alice" / f"{name}.ipynb")
    nbformat.write(read(ROOT / "exercises" / f"{name}.ipynb"), folder / f"bob_{name}.ipynb")
    hang = 'import time\n    while True:\n        time.sleep(0.01)'
    nbformat.write(solved(name, {"bytes-per-param": f"def bytes_per_param(precision, optimizer):\n    {hang}"}),
                   folder / f"carol_{name}.ipynb")
    crash = "import os, signal\n    os.kill(os.getpid(), signal.SIGKILL)"
    nbformat.write(solved(name, {"states-per-rank": f"def model_state_bytes_per_rank(*args, **kw):\n    {crash}"}),
                   folder / f"dave_{name}.ipynb")
    (folder / f"erin_{name}.ipynb").write_text(nbformat.writes(solved(name))[:500])
    (folder / "frank.ipynb").write_text('{"just": "json"}')
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print('hello')")]), folder / "gina.ipynb")
    (folder / "notes.txt").write_text("not a notebook")
    report = tmp_path / "grades.csv"
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "par", "grade", str(folder), "--report", str(report),
                          "--timeout", "240", "--cell-timeout", "40", "--jobs", "2"],   # 40 s: part 5 launches ranks
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    took = time.monotonic() - start
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = {Path(r["submission"]).name: r for r in csv.DictReader(report.open())}
    assert set(rows) == {f"{name}.ipynb", f"bob_{name}.ipynb", f"carol_{name}.ipynb", f"dave_{name}.ipynb",
                         f"erin_{name}.ipynb", "frank.ipynb", "gina.ipynb", "notes.txt"}, rows.keys()
    assert list(csv.reader(report.open()))[0] == COLUMNS
    status = {k: (r["status"], r["points"], r["max_points"]) for k, r in rows.items()}
    full = str(full_marks(name))
    assert status[f"{name}.ipynb"] == ("ok", full, full), rows[f"{name}.ipynb"]
    assert status[f"bob_{name}.ipynb"] == ("failed", "0", full)
    assert status[f"carol_{name}.ipynb"][0] == "timeout" and "40 s cell limit" in rows[f"carol_{name}.ipynb"]["reason"]
    assert "check-bytes-per-param" in rows[f"carol_{name}.ipynb"]["reason"]
    hanging = next(exercises.points(c) for c in solution(name).cells if c.id == "check-bytes-per-param")
    assert status[f"carol_{name}.ipynb"][1] == str(full_marks(name) - hanging), \
        "the checks after the hanging one still ran and count"
    assert status[f"dave_{name}.ipynb"][0] == "error" and "kernel died" in rows[f"dave_{name}.ipynb"]["reason"]
    assert status[f"dave_{name}.ipynb"][1] == "2", "the check before the crash counts"
    assert status[f"erin_{name}.ipynb"][0] == "error" and "not valid JSON" in rows[f"erin_{name}.ipynb"]["reason"]
    assert status["frank.ipynb"][0] == "error" and "not a Jupyter notebook" in rows["frank.ipynb"]["reason"]
    assert status["gina.ipynb"][0] == "error" and "belongs to no exercise" in rows["gina.ipynb"]["reason"]
    assert status["notes.txt"][0] == "error" and "not a notebook file" in rows["notes.txt"]["reason"]
    assert "notes.txt" in run.stdout and "1 ok, 1 failed, 1 timeout, 5 error" in run.stdout
    assert took < 240, f"the folder took {took:.0f} s"


@slow
def test_a_notebook_past_its_timeout_is_killed_with_what_it_started(tmp_path, course):
    """An added cell ignores the interrupt and starts a child, past the notebook's limit: the grade says timeout,
    and the kernel and its child are gone (the sandbox's pid namespace, or the kill of its session's tree)."""
    import uuid
    name, mark = "01_model_state_bytes", f"par-stuck-{uuid.uuid4().hex[:8]}"
    nb = solved(name)
    nb.cells.insert(1, nbformat.v4.new_code_cell(
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)  # the cell timeout's interrupt cannot stop it\n"
        f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1000)', {mark!r}])\n"
        "while True:\n    time.sleep(0.1)", id="stuck"))
    nbformat.write(nb, tmp_path / f"{name}.ipynb")
    start = time.monotonic()
    g = grade.grade_one(tmp_path / f"{name}.ipynb", course, timeout=20, cell_timeout=1000)
    assert time.monotonic() - start < 60 and g.status == "timeout" and "20 s limit" in g.reason, g.reason
    time.sleep(0.5)
    left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and mark.encode() in _cmdline(p)]
    assert not left, "the stuck cell's child survived the notebook's timeout"


def _cmdline(p: Path) -> bytes:
    try:
        return (p / "cmdline").read_bytes()
    except OSError:
        return b""


@slow
def test_a_cell_that_ignores_the_interrupt_ends_the_notebook_at_its_cell_limit_said_so(tmp_path, course):
    name = "01_model_state_bytes"
    stuck = ("def bytes_per_param(precision, optimizer):\n    import signal, time\n"
             "    signal.signal(signal.SIGINT, signal.SIG_IGN)\n    while True:\n        time.sleep(0.05)")
    nbformat.write(solved(name, {"bytes-per-param": stuck}), tmp_path / f"{name}.ipynb")
    start = time.monotonic()
    g = grade.grade_one(tmp_path / f"{name}.ipynb", course, timeout=300, cell_timeout=3)
    assert time.monotonic() - start < 60, "ended 10 s after the interrupt, not at the notebook's limit"
    assert g.status == "timeout" and "ran past the 3 s cell limit and ignored the interrupt" in g.reason, g.reason
    assert "300 s" not in g.reason and "check-bytes-per-param" in g.reason
    assert [c.id for c in g.checks if c.error == "did not run"] == [c.id for c in g.checks][1:]


# ---- assembling and recognising, without a kernel ------------------------------------------------------------

def test_assembly_takes_answers_by_id_or_by_what_they_define_and_keeps_added_cells(course):
    name = "02_gradient_buckets"
    nb = solved(name)
    answer = next(c for c in nb.cells if c.get("id") == "bytes-per-step")
    answer.id = "a-new-id"                               # the student re-created the answer cell
    nb.cells.remove(next(c for c in nb.cells if c.get("id") == "ddp-ranks"))   # and deleted another one
    helper = nbformat.v4.new_code_cell("def helper():\n    return 42", id="student-helper")
    nb.cells.insert(nb.cells.index(answer), helper)      # a helper just above it
    setup = next(c for c in nb.cells if c.get("id") == "setup")
    setup.source = "import os\nos.environ['CHEAT'] = '1'"   # edits to the instructor's cells are ignored
    out = grade.assemble(course.notebooks[name], nb)
    sources = [c.source for c in out.notebook.cells]
    roles = dict(zip([cid for _, cid in out.roles], [role for role, _ in out.roles]))
    assert roles["bytes-per-step"] == "answer" and answer.source in sources
    assert sources.index(helper.source) == sources.index(answer.source) - 1 == \
        [cid for _, cid in out.roles].index("assign-buckets") + 2, "the helper stays after the cell before it"
    ddp = next(c for c in out.notebook.cells if out.roles[out.notebook.cells.index(c)][1] == "ddp-ranks")
    assert exercises.STUB in ddp.source, "a missing answer is graded as unanswered, never with the solution"
    assert "CHEAT" not in "".join(sources)
    assert any("bytes-per-step matched by what it defines" in n for n in out.notes)
    assert any("answer cell ddp-ranks is missing" in n for n in out.notes)
    for cell in course.notebooks[name].cells:                 # every check is the instructor's, unchanged
        if is_check(cell):
            assert cell.source in sources


def test_exercise_recognised_by_metadata_file_name_or_cell_ids(course, tmp_path):
    nb = solved("03_pipelines")
    assert grade.identify(nb, Path("whatever.ipynb"), course) == "03_pipelines"     # metadata
    del nb.metadata["par"]
    assert grade.identify(nb, Path("alice-03_pipelines-v2.ipynb"), course) == "03_pipelines"   # file name
    assert grade.identify(nb, Path("alice.ipynb"), course) == "03_pipelines"        # cell ids
    other = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1")])
    with pytest.raises(grade.SubmissionError, match="belongs to no exercise"):
        grade.identify(other, Path("alice.ipynb"), course)
    bad = tmp_path / "bad.ipynb"
    bad.write_text("{not json")
    with pytest.raises(grade.SubmissionError, match="not valid JSON"):
        grade.read_submission(bad)


def test_the_grade_command_refuses_bad_usage(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("PAR_DEBUG", raising=False)
    assert python_m_par(["grade", str(tmp_path / "missing.ipynb")]) == 2
    assert python_m_par(["grade", str(tmp_path)]) == 2                  # an empty folder: nothing to grade
    assert python_m_par(["grade", str(tmp_path), "--jobs", "0"]) == 2
    assert python_m_par(["grade", str(tmp_path), "--solutions", str(tmp_path)]) == 2
    assert all(line.startswith("error: ") for line in capsys.readouterr().err.splitlines())


def test_answer_modules_load_with_collectives_off_and_calls_counted(tmp_path, monkeypatch):
    import torch.distributed as dist
    from par.course.grading import guards
    (tmp_path / "mine.py").write_text("import torch.distributed as dist\n\ndef ring(t):\n    dist.all_reduce(t)\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(guards.AnswerError, match="run the exercise's %%writefile cell first"):
        guards.load("missing.py")
    module = guards.load("mine.py")
    with guards.forbidden(guards.COLLECTIVES, "build it from sends and receives"):
        with pytest.raises(guards.AnswerError, match="your code called torch.distributed.all_reduce: build it"):
            module.ring(None)
    monkeypatch.setattr(dist, "all_reduce", lambda t: None)   # no process group here: a stand-in that works
    with guards.counted(dist, "all_reduce") as calls:
        module.ring(None)
        module.ring(None)
    assert calls == {"all_reduce": 2}


# ---- the student bundle ----------------------------------------------------------------------------------------

def test_release_writes_the_bundle_without_answers_and_refuses_to_overwrite(tmp_path, monkeypatch):
    monkeypatch.delenv("PAR_DEBUG", raising=False)
    dest = tmp_path / "course"
    assert exercises_cli.main(["release", str(dest)]) == 0
    for path in ("README.md", "requirements.txt", "pyproject.toml", "par/course/grading/grade.py", "par/course/grading/exercise_ring.py",
                 "notebooks/00_distributed_basics.ipynb", "configs/3d.json", release.MARKER):
        assert (dest / path).is_file(), path
    assert not (dest / "solutions").exists() and not (dest / "tests").exists()
    assert not list(dest.rglob("__pycache__"))
    assert sorted(p.name for p in (dest / "exercises").glob("*.ipynb")) == [f"{n}.ipynb" for n in NAMES]
    for name in NAMES:
        assert (dest / "exercises" / f"{name}.ipynb").read_text() == (ROOT / "exercises" / f"{name}.ipynb").read_text()
    assert release.leaks(dest) == []
    hidden = "cases = [*cases, *product("                   # a hidden check of exercise 01
    assert hidden in (ROOT / "solutions" / "01_model_state_bytes.ipynb").read_text()
    assert not any(hidden in p.read_text() for p in dest.rglob("*.ipynb"))
    assert python_m_par(["exercises", "release", str(dest)]) == 2       # not empty
    assert exercises_cli.main(["release", str(dest), "--force"]) == 0   # an earlier bundle may be replaced
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("precious")
    assert python_m_par(["exercises", "release", str(tmp_path / "mine"), "--force"]) == 2
    assert (tmp_path / "mine" / "thesis.tex").exists()
    assert python_m_par(["exercises", "release", str(ROOT / "solutions" / "x")]) == 2


@slow
def test_bundle_submissions_are_graded_from_the_checkout_and_practice_there(tmp_path, course):
    dest = tmp_path / "course"
    release.write_bundle(dest)
    name = "01_model_state_bytes"
    practice = subprocess.run([sys.executable, "-m", "par", "grade", f"exercises/{name}.ipynb"], cwd=dest,
                              capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(dest)})
    assert practice.returncode == 1, practice.stdout[-2000:] + practice.stderr[-2000:]
    assert "PRACTICE grade" in practice.stdout and "not the official grade" in practice.stdout
    assert f"{name}.ipynb: 0/{full_marks(name)} points" in practice.stdout
    submission = read(dest / "exercises" / f"{name}.ipynb")       # a student's work on the bundle
    answers = {c.id: c.source for c in solution(name).cells}
    for cell in submission.cells:
        if is_answer(cell):
            cell.source = answers[cell.id]
    nbformat.write(submission, tmp_path / "handed_in.ipynb")
    g = grade.grade_one(tmp_path / "handed_in.ipynb", course)
    assert (g.exercise, g.status, g.points, g.max_points) == (name, "ok", full_marks(name), full_marks(name)), g.reason
    assert g.official


def test_rank_outputs_are_judged_by_the_grader_and_never_run(tmp_path):
    """par.course.grading.rank_io: the result is computed from raw outputs; a missing one is wrong; none is unpickled as code."""
    import pickle
    from par.course.grading import exercise_ring, rank_io
    args = exercise_ring.Args(sizes=(3, 5))
    inputs, sums = exercise_ring.make_inputs(args, 2, seed=7)
    assert not torch_equal(inputs[0]["x"][0], exercise_ring.make_inputs(args, 2, seed=8)[0][0]["x"][0]), "fresh inputs per seed"
    right = {"out": [None, None], "mine": [s.float() for s in sums]}
    rank_io.put_outputs(tmp_path, 0, right)             # rank 1 exited before the work: no file
    result = exercise_ring.verify(args, sums, rank_io.read_outputs(tmp_path, 2))
    assert [c["max_error"] for c in result["cases"]] == [float("inf")] * 2
    assert not any(c["in_place"] for c in result["cases"])

    class Code:
        def __reduce__(self):
            return (open, (str(tmp_path / "ran"), "w"))
    (tmp_path / "out-1.pt").write_bytes(pickle.dumps({"mine": Code()}))
    assert rank_io.read_outputs(tmp_path, 2)[1] is None and not (tmp_path / "ran").exists()
    rank_io.put_outputs(tmp_path, 1, right)
    result = exercise_ring.verify(args, sums, rank_io.read_outputs(tmp_path, 2))
    assert all(c["max_error"] <= 1e-5 and c["in_place"] for c in result["cases"]), result


def torch_equal(a, b) -> bool:
    import torch
    return bool(torch.equal(a, b))


def test_every_exercise_is_named_in_one_record_only():
    """Each real-rank runner and each exercise with a preparation states one `EXERCISE` record, and nothing else
    lists exercises: the runners rank_io accepts are the records' runners, each notebook has at most one record."""
    import importlib
    import pkgutil

    import par.course.grading as grading
    from par.course.grading import exercise, rank_io
    records = exercise.records()
    notebooks = [r.notebook for r in records]
    assert len(notebooks) == len(set(notebooks)), notebooks
    assert all((ROOT / "solutions" / f"{n}.ipynb").exists() for n in notebooks), notebooks
    runners = {r.runner for r in records if r.runner}
    modules = [f"{grading.__name__}.{m.name}" for m in pkgutil.iter_modules(grading.__path__)]
    assert {m for m in modules if rank_io.exercise(m) is not None} == runners
    for m in modules:
        mod = importlib.import_module(m)
        assert not {"FORBIDDEN", "WHY", "P2P_ONLY", "OFF_LIMITS", "RANKS", "BEFORE_GRADING"} & set(vars(mod)), \
            f"{m} keeps a second registry of exercises"
