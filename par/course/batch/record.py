"""Small helpers for the lecture notebooks.

`record(name, value)` marks a key number of the notebook (bytes measured,
a ratio, a loss). It prints it, and it leaves it in the cell's output under a
mime type of its own, where the papermill batch (`python -m par batch`) finds
it for its summary.

Importing this module in a notebook also makes a failed launch readable there: a
`par.runtime.launch.LaunchError` is shown as its message alone (the root cause on the first
line, then the failing rank's traceback), without the launcher's own frames, which
say nothing about what went wrong; and every figure it shows carries its alt text
(`par.course.batch.alt_text`: its title and axis labels), which the website uses.
"""
from __future__ import annotations

import json

from par.course.batch import alt_text
from par.runtime.launch import LaunchError

RECORD_MIME = "application/vnd.par.record+json"


def record(name: str, value) -> None:
    """Show `name = value` and keep it for the batch summary. A typed result (`par.measure.JobResult`, a run,
    a rank's or any measured quantities) is kept as its JSON (`to_json()`), lists and mappings of them too."""
    from par.measure import plain   # defers torch (measure) to a record: a kernel that only reads stays torch-free
    value = plain(value)
    try:
        from IPython.display import display
    except ImportError:  # plain python: just print
        print(f"{name} = {value}")
        return
    json.dumps(value)  # must be JSON: fail here, not in the batch
    display({RECORD_MIME: {name: value}, "text/plain": f"{name} = {value}"}, raw=True)


def records(nb) -> dict:
    """Every value `record()` left in an executed notebook (an nbformat node)."""
    out = {}
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            out.update(o.get("data", {}).get(RECORD_MIME, {}))
    return out


def show_launch_error(shell, etype, value, tb, tb_offset=None) -> list[str]:
    """IPython's custom traceback for LaunchError: `LaunchError: <root cause>` and the rank's details,
    shown as the cell's error (IPython leaves the showing to a custom handler)."""
    stb = [f"{etype.__name__}: {value}"]
    shell._showtraceback(etype, value, stb)
    return stb


def _install_in_ipython() -> None:
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is not None and not shell.custom_exceptions:
        shell.set_custom_exc((LaunchError,), show_launch_error)
    if shell is not None:
        alt_text.install()


_install_in_ipython()
