"""par's own answers, taken away from a graded submission: the functions an exercise's checks compare with.

The student's kernel needs par (the setup cells import its tools: `predict`, `route`, `column_shard`), and par
holds the reference answer of every exercise (`par.memory.accounting.bytes_per_param` is exercise 01's). A
sandboxed submission therefore sees, over its read-only copy of par, a stubbed copy of every module that
defines an answer: the answer's body is gone (its signature and docstring stay), and calling it raises

    RuntimeError: par.memory.accounting.bytes_per_param is not available during grading: it is the exercise's answer

Which functions, per exercise (computed from the instructor's notebook, so a new exercise needs no list):

    in the kernel     every par function the check cells use (`reference.bytes_per_param(...)`,
                      `from par.tp.layers import qkv_for_column_split`), except those the setup and answer
                      cells of the solution import themselves (the tools the student is given), and their
                      twins (`twins`: every other function of their modules, and what they call,
                      transitively, except what the given tools need), plus RANKS below
    on the ranks      the exercise's stubs (`Exercise.stubs`, its record: `par.course.grading.exercise`): par's
                      implementations of the collective the exercise has the student build
                      (the job's own code keeps every helper the student's module may import), and the
                      grader's own code (`grader_names`): every function and class of par.course.grading but
                      what the rank runner runs (`rank_io.main`, the job's `run_rank` and `Args`, the guards of
                      `answers`, the ledger's rank end) — the job's expected values (`make_inputs`, `verify`)
                      among them; the runner also hides the grader's modules from the student's imports
                      (`guards.grader_hidden`)

The grader's checks run in the grader's process, on the real par: only the submission loses the answers.
What it does not cover: code that is not par's (a student who copies par's source from the course's web
site or from memory), and unsandboxed grading (no overlay: the note "unsandboxed" says so).
"""
from __future__ import annotations

import ast
import atexit
import functools
import importlib
import importlib.util
import inspect
import threading
from pathlib import Path

import par.course.grading as grading
from par.course.grading import exercise, guards, launcher, ledger, sandbox
from par.course.authoring.generate import is_check, parse_python, source_of

from par.runtime.paths import ROOT

_LOCK = threading.Lock()
_MADE: dict = {}           # (role key) -> [(stubbed file, path relative to the package folder)]
_FOLDER: list = []


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _par_names(source: str) -> set[tuple[str, str]]:
    """(module, attribute) of par that `source` uses: `from par.x import f`, `reference.f` of a module alias."""
    try:
        tree = parse_python("\n".join(line for line in source.splitlines() if not line.lstrip().startswith("%")))
    except SyntaxError:
        return set()
    aliases, used = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "par":
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if _is_module(full):
                    aliases[a.asname or a.name] = full
                else:
                    used.add((node.module, a.name))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "par" and a.asname:
                    aliases[a.asname] = a.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            used.add((aliases[node.value.id], node.attr))
    return used


_ANSWERS: dict = {}
_ANSWERS_LOCK = threading.Lock()


def answers_of(reference) -> list[tuple[str, str]]:
    """What a kernel graded against `reference` (the instructor's notebook) must not call."""
    key = tuple(c.source for c in reference.cells)
    with _ANSWERS_LOCK:         # computed once per notebook, whichever grading thread asks first
        if key not in _ANSWERS:
            _ANSWERS[key] = _answers_of(reference)
        return _ANSWERS[key]


def _answers_of(reference) -> list[tuple[str, str]]:
    checked, given, jobs = set(), set(), set()
    for cell in reference.cells:
        if cell.cell_type != "code":
            continue
        if is_check(cell):
            checked |= _par_names(cell.source)
            jobs |= {e.runner for e in exercise.records() if e.runner and e.runner in cell.source}
        elif not cell.source.lstrip().startswith("%%writefile"):   # a module for the ranks: not the kernel's
            given |= _par_names(cell.source)     # the tools setup and answer cells import
    answers = {name for name in checked - given if callable(_resolve(*name)) and not name[0].startswith("par.course")}
    out = answers | twins(answers, given)
    for job in jobs:
        out |= set(exercise.of_runner(job).stubs)
    return sorted(out)


# ---------------------------------------------------------------- the answers' twins, by meaning
def _callees(obj) -> set:
    """The functions and classes of par that the source of `obj` (a function, a class: all its methods) names."""
    try:
        tree = parse_python(inspect.cleandoc("\n" + source_of(obj)) if not inspect.ismodule(obj) else source_of(obj))
    except (OSError, TypeError, SyntaxError):
        return set()
    if inspect.ismodule(obj):       # a module: only what it calls when it is imported (decorators included)
        module, nodes = obj, []
        for node in tree.body:
            if _runs_as_script_only(node):
                continue
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                nodes += node.decorator_list
                if not isinstance(node, ast.ClassDef):
                    nodes += [call.func for d in [*node.args.defaults, *node.args.kw_defaults] if d is not None
                              for call in ast.walk(d) if isinstance(call, ast.Call)]
            else:
                nodes += [call.func for call in ast.walk(node) if isinstance(call, ast.Call)]
    else:
        module, nodes = inspect.getmodule(obj), [tree]
    names = getattr(module, "__dict__", {})
    found = set()
    for root in nodes:
        for node in ast.walk(root) if root is not None else ():
            target = None
            if isinstance(node, ast.Name):
                target = names.get(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and inspect.ismodule(names.get(node.value.id)):
                target = getattr(names[node.value.id], node.attr, None)
            target = inspect.unwrap(target) if callable(target) and hasattr(target, "__wrapped__") else target
            if (inspect.isfunction(target) or inspect.isclass(target)) \
                    and (getattr(target, "__module__", None) or "").startswith("par."):
                found.add(target)
    return found


def _runs_as_script_only(node) -> bool:
    """`if __name__ == "__main__": ...`: what a module runs as a script (a job's `main()`), never on import."""
    test = getattr(node, "test", None) if isinstance(node, ast.If) else None
    return isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__" \
        and len(test.comparators) == 1 and getattr(test.comparators[0], "value", None) == "__main__"


def _closure(objs) -> set:
    """`objs` and everything of par they name, transitively."""
    seen, todo = set(), list(objs)
    while todo:
        obj = todo.pop()
        if obj not in seen:
            seen.add(obj)
            todo += list(_callees(obj))
    return seen


def twins(answers: set[tuple[str, str]], given: set[tuple[str, str]]) -> set[tuple[str, str]]:
    """par's other ways to compute the answers: every function of an answer's module, and everything an answer
    calls (transitively), except what the tools the student is given need (what they call, transitively, and
    what the modules run when imported). `format_actions(one_f_one_b_actions(...))` is 1F1B's answer by
    another name; `finish(*block_state(block_scores(...)))` is attention in blocks."""
    modules = {importlib.import_module(m) for m, _ in answers if _is_module(m)}
    tools = [obj for obj in (_resolve(*name) for name in given) if inspect.isfunction(obj) or inspect.isclass(obj)]
    keep = _closure([*tools, *_imported(modules)])
    candidates = _closure(obj for obj in (_resolve(*name) for name in answers) if obj is not None)
    for module in modules:
        candidates |= {obj for obj in vars(module).values()
                       if inspect.isfunction(obj) and obj.__module__ == module.__name__}
    return {(obj.__module__, obj.__qualname__) for obj in candidates - keep
            if inspect.isfunction(obj) and "<locals>" not in obj.__qualname__}


def on_the_ranks(job: str) -> list[tuple[str, str]]:
    """Everything a rank of the real-rank job `job` must not call: its exercise's stubs and `grader_names(job)`."""
    return sorted({*exercise.of_runner(job).stubs, *grader_names(job)})


@functools.lru_cache(maxsize=None)
def grader_names(job: str) -> tuple[tuple[str, str], ...]:
    """(module, name) of every function and class of the grader's own modules (par.course.grading) that a rank
    of `job` does not run: all of them but the closure of the rank runner (`rank_io.main` and what it runs
    before the student's code, the job's `run_rank` and `Args`, the guards, the ledger's rank end, the job's
    launcher in its sandbox) and what the grader's modules call when imported."""
    import pkgutil

    from par.course.grading import rank_io   # defers torch (rank_io) to the first listing of a job's names
    job_module = importlib.import_module(job)
    modules = [importlib.import_module(f"{grading.__name__}.{m.name}") for m in pkgutil.iter_modules(grading.__path__)]
    runner = [sandbox.limit, launcher.main,                # the job's launcher, in the job's sandbox
              rank_io.main, rank_io.take_inputs, rank_io.put_outputs, rank_io.guarded, rank_io.to_cpu,
              job_module.run_rank, job_module.Args, ledger.Writer, ledger.connect, ledger.local, ledger.record,
              ledger.kept, *(o for o in vars(guards).values() if inspect.isfunction(o) or inspect.isclass(o))]
    keep = _closure([*(inspect.unwrap(o) for o in runner), *modules])
    found = set()
    for module in modules:
        for obj in vars(module).values():
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ == module.__name__ \
                    and inspect.unwrap(obj) not in keep:
                found.add((module.__name__, obj.__qualname__))
    return tuple(sorted(found))


def _imported(modules) -> list:
    """`modules` and every module of par imported so far: their module-level code runs when the kernel imports
    them, so what it calls stays."""
    import sys
    return [*modules, *(m for name, m in list(sys.modules.items()) if name.startswith("par.") and inspect.ismodule(m))]


def _resolve(module: str, attr: str):
    try:
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj
    except Exception:
        return None


def _where(module: str, attr: str) -> tuple[Path, str] | None:
    """(the source file of par that defines it, its dotted name there)."""
    obj = _resolve(module, attr)
    obj = inspect.unwrap(obj) if callable(obj) else obj
    if obj is None or not (inspect.isfunction(obj) or inspect.isclass(obj)):
        return None
    try:
        path = Path(inspect.getsourcefile(obj)).resolve()
    except TypeError:
        return None
    if (ROOT / "par") not in path.parents:
        return None
    return path, obj.__qualname__


def stubbed_module_source(source: str, names: dict[str, str]) -> str:
    """`source` with the bodies of the functions `names` (qualified name -> what calling it says) replaced by a
    raise (a class: each of its methods)."""
    tree = parse_python(source)
    lines = source.splitlines(keepends=True)
    cuts = []

    def visit(body, prefix):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qual = prefix + node.name
                if isinstance(node, ast.ClassDef):
                    if qual in names:
                        for sub in node.body:
                            if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                                names.setdefault(f"{qual}.{sub.name}", names[qual])
                    visit(node.body, qual + ".")
                elif qual in names:
                    first = node.body[0]
                    doc = isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant) \
                        and isinstance(first.value.value, str)
                    keep_to = first.end_lineno if doc else node.body[0].lineno - 1
                    if node.body[0].lineno == node.lineno:      # `def f(): return 1` on one line: leave it
                        continue
                    indent = " " * first.col_offset
                    cuts.append((keep_to, node.end_lineno, f"{indent}raise RuntimeError({names[qual]!r})\n"))
    visit(tree.body, "")
    for start, end, text in sorted(cuts, reverse=True):
        lines[start:end] = [text]
    return "".join(lines)


def _folder() -> Path:
    if not _FOLDER:
        _FOLDER.append(sandbox.temporary_workdir("stubs"))
        atexit.register(sandbox.remove, _FOLDER[0])
    return _FOLDER[0]


def stubbed_files(names: list[tuple[str, str]]) -> list[tuple[Path, Path]]:
    """[(a stubbed copy of a par source file, its path relative to the folder holding `par`)] for `names`."""
    key = tuple(sorted(names))
    with _LOCK:
        if key in _MADE:
            return _MADE[key]
        per_file: dict[Path, dict[str, str]] = {}
        for module, attr in names:
            found = _where(module, attr)
            if found is not None:
                path, qual = found
                per_file.setdefault(path, {})[qual] = (f"{module}.{attr} is not available during grading: it is "
                                                       f"the exercise's answer")
        made = []
        folder = _folder() / str(len(_MADE))
        for path, quals in per_file.items():
            rel = path.relative_to(ROOT)
            target = folder / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(stubbed_module_source(path.read_text(encoding="utf-8"), dict(quals)), encoding="utf-8")
            target.chmod(0o444)
            made.append((target, rel))
        _MADE[key] = made
        return made


def overlays(names: list[tuple[str, str]], pythonpath: str) -> tuple:
    """The (stubbed file, path in the sandbox) overlays of a sandbox whose par lives under `pythonpath`."""
    return tuple((source, Path(pythonpath) / rel) for source, rel in stubbed_files(names))
