"""The lecture modules (`par/course/lectures/`), and the README's "Adding a lecture" kept true.

- every lecture module declares what the engine reads (NOTEBOOK, CELLS, launches, KEY_NUMBERS), its key numbers
  are data the site can read back (`python -m par.course.lectures`), and a target is stated as the lecture does;
- no module of `par/` outside the lecture modules names a lecture notebook: the lectures are found, not listed;
- the README's recipe lists five places, and a throw-away lecture 99 written from it (a notebook, a lecture module
  copied from `l04_tensor_parallel.py`, a concept package with a job whose `work` sits beside its `Args`), in a
  temporary folder found through PAR_LECTURES, goes through the batch's dry run (the function and
  `python -m par batch --dry-run`) and the site's key numbers with their verdicts, and leaves the course as it was.
"""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import nbformat
import pytest
from tiers import slow

from par.course.batch import dry_run as checker, launches as course
from par.site import build, numbers

ROOT = Path(__file__).resolve().parent.parent
LECTURES = ROOT / "par" / "course" / "lectures"


def test_every_lecture_module_declares_what_the_engine_reads():
    found = course.lectures()
    assert list(found) == sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
    for name, module in found.items():
        assert Path(module.__file__).name.startswith(f"l{name.split('_', 1)[0]}_"), module.__file__
        assert isinstance(module.CELLS, tuple) and all(isinstance(k, numbers.Key) for k in module.KEY_NUMBERS)
    stated = {(k.record, k.part): k.target for k in found["03_pipelines"].KEY_NUMBERS}
    assert stated[("bubble_measured_over_formula", None)] == numbers.Target("½ to 2 × the formula", 0.5, 2.0)


@slow
def test_the_key_numbers_command_hands_the_site_every_lecture():
    done = subprocess.run([sys.executable, "-m", "par.course.lectures"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=True)
    keys = json.loads(done.stdout)
    assert list(keys) == list(course.lectures())
    assert [numbers.Key.from_dict(k) for k in keys["04_tensor_parallel"]] == \
        course.lectures()["04_tensor_parallel"].KEY_NUMBERS


def test_no_module_outside_the_lectures_names_a_lecture_notebook():
    """A lecture's notebook is named in its lecture module only; an exercise's record names its solution (some
    exercises share their lecture's name, 04_tensor_parallel), which is the exercise, not the lecture."""
    from par.course.grading.exercise import records
    stems = {p.stem for p in (ROOT / "notebooks").glob("*.ipynb")}
    exercises = {r.notebook for r in records()}
    grading = ROOT / "par" / "course" / "grading"
    named = [f"{p.relative_to(ROOT)}: {n.value}" for p in (ROOT / "par").rglob("*.py") if LECTURES not in p.parents
             for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.Constant) and n.value in stems
             and not (p.parent == grading and p.name.startswith("exercise_") and n.value in exercises)]
    assert named == []


# ---------------------------------------------------------------- a throw-away lecture, from the README's recipe
def recipe() -> list[str]:
    """The numbered items of the README's "Adding a lecture"."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Adding a lecture\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\d+\. (.+?)(?=^\d+\. |^\s*$)", section, flags=re.M | re.S)


JOB = '''
"""A throw-away concept's job: a data-parallel run of GPT-lite."""
from dataclasses import dataclass

from par.runtime.job_args import JobArgs, arg


@dataclass(frozen=True)
class Args(JobArgs):
    preset: str = arg("tiny")
    steps: int = arg(3, minimum=1)
    batch: int = arg(8)


def work(args: Args, nproc: int) -> list:
    from par.model import preset
    from par.runtime.job_work import Training
    return [Training(model=preset(args.preset), global_batch=args.batch, dp=nproc, steps=args.steps, label="demo")]
'''


def lecture_99(folder: Path) -> Path:
    """Items 1-3 of the recipe in `folder`: notebooks/99_demo.ipynb, lectures/l99_demo.py (l04 copied and changed),
    demo99/job.py (the concept package). Returns the folder of lecture modules."""
    (folder / "notebooks").mkdir()
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell('world_size, backend, preset, steps = 2, "auto", "tiny", 3', metadata={
            "tags": ["parameters"]}),
        nbformat.v4.new_code_cell('from par.course.batch import launches as course\n'
                                  'from par.course.batch.record import record\n'
                                  'jobs = course.find("99_demo", "demo training", world_size, backend, preset, steps)\n'
                                  'record("demo_max_diff", 2e-7)')])
    nbformat.write(nb, folder / "notebooks" / "99_demo.ipynb")
    (folder / "demo99").mkdir()
    (folder / "demo99" / "__init__.py").write_text("")
    (folder / "demo99" / "job.py").write_text(textwrap.dedent(JOB))
    template = (LECTURES / "l04_tensor_parallel.py").read_text()
    head, _, _ = template.partition('NOTEBOOK = "04_tensor_parallel"')
    module = head.replace("from par.tp import job as tp_job\n", "from demo99 import job as demo_job\n") + textwrap.dedent('''
        NOTEBOOK = "99_demo"
        CELLS = ("demo training",)


        def launches(W, backend, preset, steps):
            return [launch(NOTEBOOK, "demo training", W, demo_job.Args(preset=preset, steps=steps,
                                                                       batch=cost.per_rank_batch(model_preset(preset), 4) * W),
                           backend)]


        KEY_NUMBERS = [Key("demo vs one process (max |Δ|)", "≤ 1e-5", "demo_max_diff", target=at_most(1e-5))]
        ''')
    (folder / "lectures").mkdir()
    (folder / "lectures" / "l99_demo.py").write_text(module)
    return folder / "lectures"


def test_the_readme_lists_the_five_places_a_lecture_touches():
    items = recipe()
    assert [re.match(r"`([^`]+)`", i).group(1) for i in items] == [
        "notebooks/NN_topic.ipynb", "par/course/lectures/lNN_topic.py", "par/<concept>/", "solutions/NN_topic.ipynb",
        "tests/test_<concept>.py"]
    assert "copy `l04_tensor_parallel.py`" in items[1] and "work(args, nproc)" in items[2]


def test_a_lecture_made_from_the_recipe_goes_through_the_dry_run_and_the_site(tmp_path, monkeypatch):
    lectures = lecture_99(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PAR_LECTURES", str(lectures))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    known = course.lectures()
    assert list(known)[-1] == "99_demo" and len(known) == len(list((ROOT / "notebooks").glob("*.ipynb"))) + 1
    (job,) = course.find("99_demo", "demo training", 8, "nccl", "gpt3-small", 200)
    assert job.module == "demo99.job" and job.work[0].dp == 8 and job.work[0].global_batch == 8

    estimates, problems = checker.dry_run(8, "nccl", "gpt3-small", 200, 80e9, notebooks=["99_demo"])
    assert problems == [] and [e.launch.name() for e in estimates] == ["99_demo [demo training] demo99.job on 8 ranks"]
    _, problems = checker.dry_run(8, "nccl", "gpt3-small", 200, 1e9, notebooks=["99_demo"])
    assert [p.kind for p in problems] == ["memory"]                  # the dry run really costs it
    done = subprocess.run([sys.executable, "-m", "par", "batch", "--dry-run", "--backend", "nccl", "--world-size", "8",
                           "--preset", "gpt3-small", "--steps", "200", "--gpu-memory", "80e9"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "99_demo [demo training] demo99.job on 8 ranks" in done.stdout

    run = tmp_path / "runs" / "20260101-120000"                       # the batch's folder, as it leaves it
    run.mkdir(parents=True)
    nbformat.write(nbformat.read(tmp_path / "notebooks" / "99_demo.ipynb", 4), run / "99_demo.ipynb")
    row = {"notebook": "99_demo.ipynb", "status": "ok", "error": None, "duration_s": 1.0,
           "records": {"demo_max_diff": 2e-7}}
    (run / "summary.json").write_text(json.dumps({
        "folder": str(run), "parameters": {"world_size": 2, "backend": "gloo", "preset": "tiny", "steps": 3},
        "provenance": {"date": "2026-01-01T12:00:00+00:00", "machine": "test", "backend": "gloo", "world_size": 2,
                       "preset": "tiny", "steps": 3, "torch": "2", "commit": "abc1234"},
        "notebooks": [row], "failed": 0, "duration_s": 1.0, "records": row["records"]}))
    numbers.lecture_keys.cache_clear()
    try:
        build.build(run, out=tmp_path / "site", mathjax_url=None, exercises={})
        index = (tmp_path / "site" / "index.html").read_text()
    finally:
        numbers.lecture_keys.cache_clear()         # the next site reads the course's own lectures again
    assert "demo vs one process (max |Δ|)" in index and "≤ 1e-5" in index and ">met<" in index


def test_the_throw_away_lecture_leaves_the_course_as_it_was():
    assert "99_demo" not in course.lectures() and "99_demo" not in numbers.lecture_keys()


def test_a_runs_verdicts_name_every_missed_target(tmp_path, capsys):
    from par.course.lectures.__main__ import main
    run = tmp_path / "20260101-120000"
    run.mkdir()
    records = {"gpipe_over_1f1b_measured": {"16": 1.3}, "pipeline_max_grad_diff_vs_single": 0.0}
    row = {"notebook": "03_pipelines.ipynb", "status": "ok", "error": None, "duration_s": 1.0, "records": records}
    (run / "summary.json").write_text(json.dumps({"folder": str(run), "parameters": {}, "provenance": {},
                                                  "notebooks": [row], "failed": 0, "duration_s": 1.0,
                                                  "records": records}))
    assert main(["--verdicts", str(run)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["missed  03_pipelines: GPipe bubble / 1F1B bubble, measured in one launch on the same stages, by m = "
                     "16: 1.3 (target 0.8 to 1.25)",
                     "   met  03_pipelines: pipeline gradients vs one process (max |Δ|) = 0 (target ≤ 1e-5)",
                     "2 targets checked: 1 missed"]
    records["gpipe_over_1f1b_measured"] = {"16": 1.03}
    (run / "summary.json").write_text(json.dumps({"folder": str(run), "notebooks": [row], "failed": 0}))
    assert main(["--verdicts", str(run)]) == 0 and capsys.readouterr().out.endswith("all met\n")
    assert main(["--verdicts", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.startswith("error: ")
