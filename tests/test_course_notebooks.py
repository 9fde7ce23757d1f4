"""The lecture notebooks run the launches their lecture modules (`par/course/lectures/`) describe, so the dry run
checks exactly what runs.

- every notebook has exactly one lecture module, found by its NOTEBOOK;
- no lecture notebook starts ranks itself (`par.runtime.launch.run`, `launch.run`, `!torchrun`, multiprocessing);
- every cell name a lecture module declares (CELLS) is used by its notebook (a string in its code), and
  every `course.find` call in a notebook names a declared cell (a lecture with no cells, 07b, launches nothing
  and calls no `course.find`);
- lecture 07's launches are exactly those `par.train.suite.run_suite` makes;
- the work a notebook does in its own kernel is its lecture's (`course.in_kernel`), so the dry run checks it.
Static: the notebooks are read, not executed (tests/test_notebooks.py executes them).
"""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from par.course.batch import launches as course
from par.course.lectures import l07_putting_it_together as l07
from par.zero import job as zero_job

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
LECTURES = sorted(NOTEBOOKS.glob("[0-9]*.ipynb"))


def code(path: Path) -> ast.Module:
    """The notebook's code cells as one module (IPython magics and shell lines left out)."""
    cells = json.loads(path.read_text())["cells"]
    lines = []
    for c in cells:
        if c["cell_type"] == "code":
            src = "".join(c["source"])
            lines += [l for l in src.splitlines() if not l.lstrip().startswith(("%", "!"))] + [""]
    return ast.parse("\n".join(lines))


def shell_lines(path: Path) -> list[str]:
    return [l for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"
            for l in "".join(c["source"]).splitlines() if l.lstrip().startswith("!")]


def strings(tree: ast.Module) -> set[str]:
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def calls(tree: ast.Module) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)]


def test_every_notebook_has_exactly_one_lecture_module():
    found = course.lectures()
    assert [p.stem for p in LECTURES] == list(found)
    assert all(m.__name__.startswith(f"par.course.lectures.l{nb.split('_')[0]}_") for nb, m in found.items())


@pytest.mark.parametrize("path", LECTURES, ids=lambda p: p.stem)
def test_no_notebook_starts_ranks_itself(path):
    tree = code(path)
    direct = [ast.unparse(c) for c in calls(tree) if ast.unparse(c.func) in ("par.runtime.launch.run", "launch.run", "run")]
    assert direct == [], f"{path.name} launches without par.course.batch.launches: {direct}"
    imports = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not [i for i in imports if i.startswith("from par.runtime.launch import") or "multiprocessing" in i], imports
    assert not [l for l in shell_lines(path) if "torchrun" in l or "torch.distributed.run" in l]


@pytest.mark.parametrize("path", LECTURES, ids=lambda p: p.stem)
def test_every_registered_cell_is_used_by_its_notebook(path):
    tree = code(path)
    used = strings(tree)
    missing = [cell for cell in course.lecture(path.stem).CELLS if cell not in used]
    assert missing == [], f"{path.name} never runs its registered cell(s) {missing}"
    finds = [c for c in calls(tree) if ast.unparse(c.func) == "course.find"]
    if not course.lecture(path.stem).CELLS:      # a lecture that launches nothing (07b: pure planner, its own cluster)
        assert finds == [] and course.launches(path.stem, 2, "gloo") == [], f"{path.name} has no cell to find"
        return
    assert finds, f"{path.name} never asks par.course.batch.launches for its launches"
    for c in finds:
        nb, cell = c.args[0], c.args[1]
        if isinstance(nb, ast.Constant):
            assert nb.value == path.stem, ast.unparse(c)
        if isinstance(cell, ast.Constant):
            assert cell.value in course.lecture(path.stem).CELLS, ast.unparse(c)


@pytest.mark.parametrize("path", LECTURES, ids=lambda p: p.stem)
def test_in_kernel_work_is_asked_of_the_lecture_module(path):
    asked = [c for c in calls(code(path)) if ast.unparse(c.func) == "course.in_kernel"]
    assert all(isinstance(c.args[0], ast.Constant) and c.args[0].value == path.stem for c in asked)
    registered = [k.cell for k in course.kernel_work(path.stem, 2, "gloo", "tiny", 20)]
    assert sorted(c.args[1].value for c in asked) == sorted(registered), f"{path.name} sizes its own kernel work"


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_launch_belongs_to_a_declared_cell(world_size):
    for nb, lecture in course.lectures().items():
        for launch in course.launches(nb, world_size, "gloo", "tiny", 20):
            assert launch.cell in lecture.CELLS, launch.name()


def test_find_knows_the_cells():
    with pytest.raises(course.CourseError, match="has no cell 'nope'"):
        course.find("03_pipelines", "nope", 2)
    assert course.find("03_pipelines", "dp x pp", 2, "nccl", "gpt3-small", 20) == []   # 2 GPUs: no dp 2 × pp 2


def test_lecture_07_launches_are_the_suites(monkeypatch):
    """What `suite.run_suite` launches in lecture 07 (recorded, not run) equals the lecture module's launches."""
    import par.runtime.launch
    from par.train import suite
    made = []

    def fake_run(module, nproc, args, backend, timeout, quiet):
        made.append((module, nproc, tuple(args), backend))
        raise par.runtime.launch.LaunchError("not run in this test")
    monkeypatch.setattr(par.runtime.launch, "run", fake_run)
    world_size, preset, steps = 2, "tiny", 20
    for cell, names in (("3D", ["3D"]), ("benchmark table", [n for n in l07.ROWS if n != "bf16"])):
        made.clear()
        suite.run_suite(names, nproc=world_size, preset=preset, steps=l07.bench_steps(steps), backend="gloo")
        expected = [(l.module, l.nproc, tuple(l.args.to_argv()), l.backend)
                    for l in course.find("07_putting_it_together", cell, world_size, "gloo", preset, steps)]
        assert sorted(made) == sorted(expected) and made, cell


def test_launch_reads_like_a_command():
    """A launch carries its job's typed arguments; its command line is what they parse back from."""
    (job,) = course.find("04_tensor_parallel", "TP training", 2, "gloo", "small", 20)
    assert job.command().startswith("torchrun --nproc-per-node=2 -m par.tp.job --preset small")
    assert job.args.preset == "small" and job.with_args(steps=3).args.steps == 3
    assert job.with_args(steps=3).command().endswith("--steps 3 --eps 1e-06")
    zero = course.find("06_zero", "stages", 4, "gloo", "tiny", 20)
    filled = zero[0].fill(checkpoint="/tmp/x").args
    assert zero[0].args.checkpoint == "{checkpoint}" and (filled.checkpoint, filled.resume) == ("/tmp/x", "")
    assert zero[0].args.runs[-1] == zero_job.ZeroRun(3, fsdp2=True) and "3+offload" in zero[0].command()


@pytest.mark.parametrize("path", LECTURES, ids=lambda p: p.stem)
def test_every_name_a_notebook_reads_from_a_course_module_exists(path):
    """`course.find`, `lecture.pipeline_setup`, `plots.curves`...: each attribute a notebook reads from a module of
    `par.course` it imported under a name is defined there (a helper that moved is caught here, not in the batch)."""
    import importlib
    tree = code(path)
    modules = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("par.course"):
            for a in node.names:
                target = importlib.import_module(node.module)
                value = getattr(target, a.name, None)
                if value is None:
                    value = importlib.import_module(f"{node.module}.{a.name}")
                if isinstance(value, type(ast)):
                    modules[a.asname or a.name] = value
    missing = sorted({f"{n.value.id}.{n.attr}" for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                      and isinstance(n.value, ast.Name) and n.value.id in modules
                      and not hasattr(modules[n.value.id], n.attr)})
    assert missing == [], f"{path.name} reads names its modules lack: {missing}"
