"""Show the code that *is* the technique: a lecture prints the few par functions it is about before it runs them.

    from par.course.show import show
    show(collectives._ring_reduce_scatter, collectives._ring_all_gather)

Each function, method or class is shown whole (its source, docstring included, dedented), headed by its
qualified name and where it lives (`par/comm/collectives.py:204`), optionally under the formula it
implements (`formula=r"2\\frac{N-1}{N}S"`, LaTeX). In Jupyter the code is a highlighted ```python block;
the same cell output also carries the plain text, which is what papermill's executed copy shows outside
a browser and what `python` prints. `source_text` and `markdown_text` return the two texts (tested).
"""
from __future__ import annotations

import inspect
import re
import textwrap
from pathlib import Path

from par.runtime.paths import ROOT


def _target(obj):
    """The object whose source to read: a property's getter, a wrapped function's original."""
    if isinstance(obj, property):
        obj = obj.fget
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    return inspect.unwrap(obj) if callable(obj) else obj


def _name(obj) -> str:
    module = getattr(obj, "__module__", None) or "?"
    return f"{module}.{getattr(obj, '__qualname__', getattr(obj, '__name__', repr(obj)))}"


def _where(obj) -> str:
    path = Path(inspect.getsourcefile(obj) or inspect.getfile(obj)).resolve()
    line = inspect.getsourcelines(obj)[1]
    try:
        path = path.relative_to(ROOT)
    except ValueError:
        pass
    return f"{path.as_posix()}:{line}"


def source(obj) -> tuple[str, str, str]:
    """(qualified name, file:line, dedented source) of a function, method or class; TypeError when Python
    keeps no source for it (a builtin, a C extension), rather than an empty or elided listing."""
    target = _target(obj)
    try:
        code = textwrap.dedent("".join(inspect.getsourcelines(target)[0])).rstrip("\n")
    except (TypeError, OSError) as e:
        raise TypeError(f"show: no Python source for {obj!r} ({e}); pass a function, method or class of par") from e
    return _name(target), _where(target), code


def source_text(*objects, formula: str | None = None) -> str:
    """Plain text: each object's header line (name, file:line) and its source, the formula first if given."""
    parts = [f"formula: {formula}"] if formula else []
    for obj in objects:
        name, where, code = source(obj)
        parts.append(f"# {name}  ({where})\n{code}")
    return "\n\n".join(parts)


def markdown_text(*objects, formula: str | None = None) -> str:
    """Markdown: the formula as display math, then per object a header and a ```python block."""
    parts = [f"$${formula}$$"] if formula else []
    for obj in objects:
        name, where, code = source(obj)
        fence = "`" * max(3, 1 + max((len(run) for run in re.findall(r"`+", code)), default=0))
        parts.append(f"**`{name}`** · `{where}`\n\n{fence}python\n{code}\n{fence}")
    return "\n\n".join(parts)


class Shown:
    """One cell output with two faces: highlighted Markdown in Jupyter, the plain text everywhere else."""

    def __init__(self, *objects, formula: str | None = None):
        self.text = source_text(*objects, formula=formula)
        self.markdown = markdown_text(*objects, formula=formula)

    def __repr__(self) -> str:
        return self.text

    def _repr_markdown_(self) -> str:
        return self.markdown


def show(*objects, formula: str | None = None) -> None:
    """Display the source of `objects` (functions, methods, classes) in a notebook, or print it."""
    if not objects:
        raise TypeError("show() needs at least one function, method or class")
    shown = Shown(*objects, formula=formula)
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        get_ipython = None
    if get_ipython is None or get_ipython() is None:
        print(shown.text)
    else:
        display(shown)
