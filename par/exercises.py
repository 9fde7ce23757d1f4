"""Exercises: `solutions/` is the source of truth, `exercises/` is generated from it.

An answer is the lines between a `### BEGIN SOLUTION` line and a `### END SOLUTION`
line inside a function body of a code cell. The exercise notebook is the solution
with every such region replaced by one line, at the marker's indentation,

    raise NotImplementedError("your code here")

and with outputs and execution counts stripped. Cells tagged `check` assert on the
student's functions; `python -m par grade exercises/NN_topic.ipynb` runs them.

    python -m par exercises generate   # write exercises/NN.ipynb for every solutions/NN.ipynb (and delete
                                       # exercises that have no solution any more)
    python -m par exercises check      # exit 1 naming every exercise out of sync (missing, stale, extra)
    python -m par exercises record [NN_topic ...]   # execute solutions, keep their outputs, then generate

`record` stores each solution's outputs in the notebook: they are the reference that
`tests/test_exercises.py` compares with strict nbval (`pytest --nbval`, sanitized by
`tests/nbval_sanitize.cfg`). Mark a cell whose output changes run to run (timings,
random ports) with a `# NBVAL_IGNORE_OUTPUT` comment line.
"""
from __future__ import annotations

import argparse
import copy
import subprocess
import sys
from pathlib import Path

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
STUB = 'raise NotImplementedError("your code here")'
NOTE_ID = "par-generated-note"
ROOT = Path(__file__).resolve().parents[1]
SANITIZE = Path("tests") / "nbval_sanitize.cfg"


class ExerciseError(ValueError):
    """A solution notebook whose answer regions cannot be turned into stubs."""


def stub_source(source: str, where: str = "cell") -> str:
    """The cell source with every BEGIN/END SOLUTION region replaced by the stub line."""
    out, opened = [], None
    for number, line in enumerate(source.split("\n"), start=1):
        text = line.strip()
        if text.startswith(BEGIN):
            if opened is not None:
                raise ExerciseError(f"{where}, line {number}: {BEGIN!r} inside the region opened at line "
                                    f"{opened}; close it with {END!r} first.")
            indent = line[:len(line) - len(line.lstrip())]
            if not indent:
                raise ExerciseError(f"{where}, line {number}: answer region at top level; put it inside a "
                                    f"function body so the stub raises only when the function is called.")
            out.append(indent + STUB)
            opened = number
        elif text.startswith(END):
            if opened is None:
                raise ExerciseError(f"{where}, line {number}: {END!r} without a {BEGIN!r} before it.")
            opened = None
        elif opened is None:
            out.append(line)
    if opened is not None:
        raise ExerciseError(f"{where}, line {opened}: {BEGIN!r} is never closed by {END!r}.")
    return "\n".join(out)


def note_cell(solution_name: str):
    import nbformat
    text = (f"*Generated from `solutions/{solution_name}`: edit the solution, then run "
            f"`python -m par exercises generate`.*\n\n"
            f"Fill in every `raise NotImplementedError(\"your code here\")`, then grade your work with "
            f"`python -m par grade exercises/{solution_name}`.")
    return nbformat.v4.new_markdown_cell(text, id=NOTE_ID)


def exercise_notebook(solution, solution_name: str):
    """The exercise notebook (an nbformat node) generated from a solution notebook."""
    nb = copy.deepcopy(solution)
    for number, cell in enumerate(nb.cells, start=1):
        cell.metadata.pop("execution", None)  # timings left by nbclient / papermill
        if cell.cell_type == "code":
            cell.source = stub_source(cell.source, where=f"solutions/{solution_name}, cell {number}")
            cell.outputs = []
            cell.execution_count = None
    nb.cells = [c for c in nb.cells if c.get("id") != NOTE_ID]
    nb.cells.insert(0, note_cell(solution_name))
    nb.nbformat_minor = max(nb.nbformat_minor, 5)  # cells carry ids from 4.5 on
    for number, cell in enumerate(nb.cells):
        cell.setdefault("id", f"cell-{number}")
    for key in ("papermill", "widgets"):
        nb.metadata.pop(key, None)
    return nb


def exercise_text(solution_path: Path) -> str:
    """The exact text of the exercise file generated from `solution_path` (deterministic)."""
    import nbformat
    nb = nbformat.read(solution_path, as_version=4)
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
        if not target.exists() or target.read_text(encoding="utf-8") != text:
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
        elif target.read_text(encoding="utf-8") != exercise_text(path):
            problems.append(f"exercises/{name}: out of sync with solutions/{name}")
    for name in sorted(present - set(expected)):
        problems.append(f"exercises/{name}: extra (no solutions/{name})")
    return problems


def execute_in_place(path: Path, timeout: float = 300) -> None:
    """Run a notebook top to bottom (kernel python3, cwd = its folder) and save its outputs in it."""
    import nbformat
    from nbclient import NotebookClient
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    nbformat.write(nb, path)


def nbval_command(path: Path, strict: bool, root: Path = ROOT) -> list[str]:
    """`pytest --nbval-lax` (grading) or strict `pytest --nbval` with the sanitizer, on one notebook."""
    mode = ["--nbval", "--nbval-sanitize-with", str(Path(root) / SANITIZE)] if strict else ["--nbval-lax"]
    return [sys.executable, "-m", "pytest", *mode, "--nbval-current-env", "-p", "no:cacheprovider", str(path)]


def record(root: Path = ROOT, names=()) -> int:
    """Execute solutions (all, or those named), keep their outputs, check they reproduce, regenerate."""
    root = Path(root)
    paths = [p for p in solutions(root) if not names or p.name in names or p.stem in names]
    if not paths:
        print(f"error: no solution matches {list(names) or '*'} in {root / 'solutions'}", file=sys.stderr)
        return 2
    failing, unstable = [], []
    for path in paths:
        print(f"recording solutions/{path.name} ...", flush=True)
        try:
            execute_in_place(path)
        except Exception as e:  # nbclient's CellExecutionError carries the cell and its traceback
            print(str(e)[-3000:], file=sys.stderr)
            failing.append(path.name)
            continue
        check = subprocess.run(nbval_command(path, strict=True, root=root), cwd=root,
                               capture_output=True, text=True)
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m par exercises", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["generate", "check", "record"])
    parser.add_argument("names", nargs="*", help="record: only these solutions (file names or stems)")
    parser.add_argument("--root", type=Path, default=ROOT, help="course repository (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        if args.action == "generate":
            changed = generate(args.root)
            print(f"{len(solutions(args.root))} exercise(s); written or removed: "
                  + (", ".join(p.name for p in changed) or "none"))
            return 0
        if args.action == "check":
            problems = out_of_sync(args.root)
            for line in problems:
                print(line, file=sys.stderr)
            if problems:
                print("fix: python -m par exercises generate", file=sys.stderr)
                return 1
            print("in sync")
            return 0
        return record(args.root, args.names)
    except ExerciseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
