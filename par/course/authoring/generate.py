"""Exercises: `solutions/` is the source of truth, `exercises/` is generated from it.

A solution notebook has three kinds of cells the tools care about:

* **answer cells**: code cells with answer regions, the lines between a `### BEGIN SOLUTION` line and a
  `### END SOLUTION` line inside a function body. In the exercise each region becomes one line, at the
  marker's indentation,

      raise NotImplementedError("your code here")

* **check cells**: code cells tagged `check`. They assert on the student's functions, import the reference
  they compare with inside the cell, and carry their points in the cell metadata (`"points": 2`;
  1 when absent). A check cell may hold hidden checks between `### BEGIN HIDDEN CHECKS` and
  `### END HIDDEN CHECKS`: the exercise shows one comment line in their place, and only the official
  grade (`python -m par grade` with `solutions/` at hand) runs them.
* every other cell (text, setup, demos) is copied as it is.

The exercise is the solution with answers stubbed, hidden checks removed, outputs and execution counts
stripped, and a note on top. Cell ids are kept: they are how `par.course.grading.grade` matches a student's answer cells
with the instructor's.

    python -m par exercises generate   # write exercises/NN.ipynb for every solutions/NN.ipynb (and delete
                                       # exercises that have no solution any more)
    python -m par exercises check      # exit 1 naming every exercise out of sync (missing, stale, extra)
    python -m par exercises record [NN_topic ...]   # execute solutions, keep their outputs, then generate
    python -m par exercises release DIR             # the student bundle, without solutions/ (par.course.authoring.release)

(The command line is `par.course.authoring.cli`.)

`record` stores each solution's outputs in the notebook: they are the reference that
`tests/test_exercises.py` compares with strict nbval (`pytest --nbval`, sanitized by
`tests/nbval_sanitize.cfg`). Mark a cell whose output changes run to run (timings,
random ports) with a `# NBVAL_IGNORE_OUTPUT` comment line. Notebooks run in a temporary
directory, so files a cell writes (`%%writefile my_ring.py`) never land in solutions/.
"""
from __future__ import annotations

import ast
import copy
import inspect
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from par.course.authoring.markers import BEGIN, CHECK, END, HIDDEN_BEGIN, HIDDEN_END, HIDDEN_NOTE, NOTE_ID, STUB
from par.course.batch.kernel_poll import sliced
from par.runtime.paths import ROOT

SANITIZE = Path("tests") / "nbval_sanitize.cfg"


class ExerciseError(ValueError):
    """A solution notebook whose answer regions cannot be turned into stubs."""


# ---------------------------------------------------------------- cell roles
def is_check(cell) -> bool:
    """A code cell tagged `check`: its asserts decide the grade."""
    return cell.cell_type == "code" and CHECK in (cell.metadata.get("tags") or [])


def is_answer(cell) -> bool:
    """A code cell the student fills in: answer regions in the solution, the stub line in the exercise."""
    return cell.cell_type == "code" and not is_check(cell) and any(
        line.strip().startswith(BEGIN) or line.strip() == STUB for line in cell.source.split("\n"))


def points(cell) -> float:
    """The points a check cell is worth (metadata `points`, default 1)."""
    value = cell.metadata.get("points", 1)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ExerciseError(f"cell {cell.get('id')}: metadata 'points' must be a number >= 0, got {value!r}")
    return value


def exercise_name(nb) -> str | None:
    """The exercise a generated notebook says it belongs to (metadata `par.exercise`, a notebook's file stem such as
    `01_model_state_bytes`); None when there is none, or when what is there is not such a name (a list, a number,
    a path): a student's notebook may carry anything there."""
    metadata = nb.get("metadata") if isinstance(nb, dict) else None
    meta = metadata.get("par") if isinstance(metadata, dict) else None
    name = meta.get("exercise") if isinstance(meta, dict) else None
    return name if isinstance(name, str) and re.fullmatch(r"\w[\w.-]*", name) else None


# ---------------------------------------------------------------- regions
def _regions(source: str, begin: str, end: str, replacement: str | None, where: str, top_level_ok: bool) -> str:
    """`source` with every begin/end region replaced by `replacement` at the marker's indentation."""
    out, opened = [], None
    for number, line in enumerate(source.split("\n"), start=1):
        text = line.strip()
        if text.startswith(begin):
            if opened is not None:
                raise ExerciseError(f"{where}, line {number}: {begin!r} inside the region opened at line "
                                    f"{opened}; close it with {end!r} first.")
            indent = line[:len(line) - len(line.lstrip())]
            if not indent and not top_level_ok:
                raise ExerciseError(f"{where}, line {number}: answer region at top level; put it inside a "
                                    f"function body so the stub raises only when the function is called.")
            out.append(indent + replacement)
            opened = number
        elif text.startswith(end):
            if opened is None:
                raise ExerciseError(f"{where}, line {number}: {end!r} without a {begin!r} before it.")
            opened = None
        elif opened is None:
            out.append(line)
    if opened is not None:
        raise ExerciseError(f"{where}, line {opened}: {begin!r} is never closed by {end!r}.")
    return "\n".join(out)


def stub_source(source: str, where: str = "cell") -> str:
    """The cell source with every BEGIN/END SOLUTION region replaced by the stub line."""
    return _regions(source, BEGIN, END, STUB, where, top_level_ok=False)


def visible_source(source: str, where: str = "cell") -> str:
    """A check cell's source with every hidden-checks region replaced by one comment line."""
    return _regions(source, HIDDEN_BEGIN, HIDDEN_END, HIDDEN_NOTE, where, top_level_ok=True)


def check_solution(nb, name: str) -> None:
    """Raise ExerciseError naming the cell when a solution's cells break the rules above."""
    checks = 0
    for number, cell in enumerate(nb.cells, start=1):
        where = f"solutions/{name}, cell {number}"
        if cell.cell_type != "code":
            continue
        has_answer = BEGIN in cell.source
        has_hidden = HIDDEN_BEGIN in cell.source
        if is_check(cell):
            checks += 1
            points(cell)
            if has_answer:
                raise ExerciseError(f"{where}: a check cell holds an answer region; move the answer to its own cell")
        elif has_hidden:
            raise ExerciseError(f"{where}: hidden checks outside a check cell; tag the cell `check`")
        elif "points" in cell.metadata:
            raise ExerciseError(f"{where}: 'points' on a cell that is not tagged `check`")
    if not checks:
        raise ExerciseError(f"solutions/{name}: no code cell is tagged `check`, so nothing can be graded")


# ---------------------------------------------------------------- generation
def note_cell(solution_name: str):
    import nbformat
    text = (f"*Generated from `solutions/{solution_name}`: edit the solution, then run "
            f"`python -m par exercises generate`.*\n\n"
            f"Fill in every `raise NotImplementedError(\"your code here\")`, then grade your work with "
            f"`python -m par grade exercises/{solution_name}`. The cells tagged `check` hold the checks; each "
            f"is worth the `points` in its metadata. Your instructor grades with their own copy of the check "
            f"cells, so editing them here changes nothing.")
    return nbformat.v4.new_markdown_cell(text, id=NOTE_ID)


def exercise_notebook(solution, solution_name: str):
    """The exercise notebook (an nbformat node) generated from a solution notebook."""
    check_solution(solution, solution_name)
    nb = copy.deepcopy(solution)
    for number, cell in enumerate(nb.cells, start=1):
        cell.metadata.pop("execution", None)  # timings left by nbclient / papermill
        if cell.cell_type == "code":
            where = f"solutions/{solution_name}, cell {number}"
            cell.source = visible_source(cell.source, where) if is_check(cell) else stub_source(cell.source, where)
            cell.outputs = []
            cell.execution_count = None
    nb.cells = [c for c in nb.cells if c.get("id") != NOTE_ID]
    nb.cells.insert(0, note_cell(solution_name))
    nb.nbformat_minor = max(nb.nbformat_minor, 5)  # cells carry ids from 4.5 on
    for number, cell in enumerate(nb.cells):
        cell.setdefault("id", f"cell-{number}")
    for key in ("papermill", "widgets"):
        nb.metadata.pop(key, None)
    nb.metadata["par"] = {"exercise": Path(solution_name).stem}
    return nb


def read_notebook(path: Path):
    """The notebook at `path` (nbformat 4), or ExerciseError naming the file: unreadable, not UTF-8, not JSON,
    not a notebook (no cells list), or cells that are not cells."""
    import json
    import warnings

    import nbformat
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise ExerciseError(f"{path}: cannot be read ({e.strerror})") from None
    except UnicodeDecodeError:
        raise ExerciseError(f"{path}: not a notebook (its bytes are not UTF-8 text): restore it, e.g. with "
                            f"git checkout -- {path.name}") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ExerciseError(f"{path}: not a notebook ({'it is empty' if not text.strip() else f'not JSON: {e}'}): "
                            f"restore it, e.g. with git checkout -- {path.name}") from None
    if not isinstance(data, dict) or not isinstance(data.get("cells"), list) or "nbformat" not in data:
        raise ExerciseError(f"{path}: valid JSON but not a notebook (no 'cells' list or 'nbformat')")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            nb = nbformat.reads(text, as_version=4)
        for i, cell in enumerate(nb.cells):
            if not isinstance(cell.get("source"), str) or not isinstance(cell.get("cell_type"), str):
                raise ValueError(f"its cell {i} has no text source or cell_type")
    except Exception as e:  # nbformat raises many kinds for a broken notebook
        raise ExerciseError(f"{path}: not a readable notebook ({type(e).__name__}: "
                            f"{' '.join(str(e).split())[:200]})") from None
    return nb


def exercise_text(solution_path: Path) -> str:
    """The exact text of the exercise file generated from `solution_path` (deterministic)."""
    import nbformat
    nb = read_notebook(solution_path)
    text = nbformat.writes(exercise_notebook(nb, solution_path.name))
    return text if text.endswith("\n") else text + "\n"


def solutions(root: Path = ROOT) -> list[Path]:
    return sorted((Path(root) / "solutions").glob("*.ipynb"))


def generate(root: Path = ROOT) -> list[Path]:
    """Write exercises/<name> for every solutions/<name>, delete exercises without a solution;
    return the files written or deleted. All stubs are built before anything is written."""
    root = Path(root)
    texts = {path.name: exercise_text(path) for path in solutions(root)}
    folder = root / "exercises"
    folder.mkdir(exist_ok=True)
    changed = []
    for name, text in texts.items():
        target = folder / name
        if not target.exists() or target.read_bytes() != text.encode("utf-8"):
            target.write_text(text, encoding="utf-8")
            changed.append(target)
    for extra in sorted(set(folder.glob("*.ipynb")) - {folder / name for name in texts}):
        extra.unlink()
        changed.append(extra)
    return changed


def out_of_sync(root: Path = ROOT) -> list[str]:
    """One line per exercise that is missing, stale or has no solution (empty when in sync)."""
    root = Path(root)
    problems = []
    expected = {p.name: p for p in solutions(root)}
    present = {p.name for p in (root / "exercises").glob("*.ipynb")}
    for name, path in expected.items():
        target = root / "exercises" / name
        if name not in present:
            problems.append(f"exercises/{name}: missing (solutions/{name} exists)")
        elif target.read_bytes() != exercise_text(path).encode("utf-8"):
            problems.append(f"exercises/{name}: out of sync with solutions/{name}")
    for name in sorted(present - set(expected)):
        problems.append(f"exercises/{name}: extra (no solutions/{name})")
    return problems


# ---------------------------------------------------------------- recording the solutions' outputs
def execute_in_place(path: Path, timeout: float = 300) -> None:
    """Run a notebook top to bottom (kernel python3, in a fresh temporary directory) and save its outputs in it."""
    import nbformat
    from nbclient import NotebookClient

    nb = read_notebook(path)
    with tempfile.TemporaryDirectory(prefix="par-record-") as tmp, sliced():
        NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                       resources={"metadata": {"path": tmp}}).execute()
    nbformat.write(nb, path)


def nbval_command(path: Path, strict: bool, root: Path = ROOT) -> list[str]:
    """`pytest --nbval-lax` or strict `pytest --nbval` with the sanitizer, on one notebook."""
    mode = ["--nbval", "--nbval-sanitize-with", str(Path(root) / SANITIZE)] if strict else ["--nbval-lax"]
    return [sys.executable, "-m", "pytest", *mode, "--nbval-current-env", "-p", "no:cacheprovider", str(path)]


def strict_nbval(path: Path, root: Path = ROOT, timeout: float = 600) -> subprocess.CompletedProcess:
    """Strict nbval on a copy of the notebook in a fresh temporary directory (where its kernel runs)."""
    with tempfile.TemporaryDirectory(prefix="par-nbval-") as tmp:
        copy_ = Path(tmp) / Path(path).name
        shutil.copy(path, copy_)
        (Path(tmp) / "pytest.ini").write_text("[pytest]\n")  # no ini or conftest from the repository
        env = {**os.environ, "TMPDIR": tmp}    # the kernel's connection file too: nothing outlives the folder
        return subprocess.run(nbval_command(copy_, strict=True, root=root), cwd=tmp, capture_output=True,
                              text=True, timeout=timeout, env=env)


def record(root: Path = ROOT, names=()) -> int:
    """Execute solutions (all, or those named), keep their outputs, check they reproduce, regenerate."""
    root = Path(root)
    paths = [p for p in solutions(root) if not names or p.name in names or p.stem in names]
    if not paths:
        raise ExerciseError(f"no solution matches {list(names) or '*'} in {root / 'solutions'}")
    failing, unstable = [], []
    for path in paths:
        print(f"recording solutions/{path.name} ...", flush=True)
        try:
            execute_in_place(path)
        except Exception as e:  # nbclient's CellExecutionError carries the cell and its traceback
            print(str(e)[-3000:], file=sys.stderr)
            failing.append(path.name)
            continue
        check = strict_nbval(path, root)
        if check.returncode != 0:
            print(check.stdout[-4000:])
            unstable.append(path.name)
    generate(root)
    if failing:
        print(f"\nThese solutions raise (left as they were): {', '.join(failing)}.", file=sys.stderr)
    if unstable:
        print(f"\nThese solutions do not reproduce their own outputs: {', '.join(unstable)}.\n"
              f"Add a line `# NBVAL_IGNORE_OUTPUT` to each cell whose output changes run to run "
              f"(see the diffs above), then record again.", file=sys.stderr)
    if failing or unstable:
        return 1
    print(f"recorded {len(paths)} solution(s); exercises regenerated")
    return 0


_PARSE_LOCK = threading.RLock()


def parse_python(source: str) -> ast.Module:
    """`ast.parse`, one thread at a time: CPython 3.11 builds the Python AST objects with a recursion counter in
    state shared by all threads, so two grading threads parsing at once can fail with "SystemError: AST
    constructor recursion depth mismatch"."""
    with _PARSE_LOCK:
        return ast.parse(source)


def source_of(obj) -> str:
    """`inspect.getsource(obj)` under parse_python's lock: for a class, inspect finds its lines by parsing the
    whole module with `ast.parse`."""
    with _PARSE_LOCK:
        return inspect.getsource(obj)


def defined_names(source: str) -> frozenset:
    """What a cell defines at top level (functions, classes; `%%writefile FILE` cells: the file)."""
    first = source.lstrip().split("\n", 1)[0]
    if first.startswith("%%writefile"):
        return frozenset({("file", first.split()[-1])})
    try:
        tree = parse_python(source)
        return frozenset(n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)))
    except SyntaxError:
        return frozenset(re.findall(r"^(?:def|class)\s+(\w+)", source, re.M))
