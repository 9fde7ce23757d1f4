"""Small helpers for the lecture notebooks.

`record(name, value)` marks a key number of the notebook (bytes measured,
a ratio, a loss). It prints it, and it leaves it in the cell's output under a
mime type of its own, where the papermill batch (`python -m par batch`) finds
it for its summary.
"""
from __future__ import annotations

import json

RECORD_MIME = "application/vnd.par.record+json"


def record(name: str, value) -> None:
    """Show `name = value` and keep it for the batch summary."""
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
