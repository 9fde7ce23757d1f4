"""A batch's folder as the site reads it: `summary.json`, its executed notebooks, and where it came from.

    runs/<time>/summary.json     per notebook: status, duration, records; `provenance` (batches since it exists)
    runs/<time>/NN_topic.ipynb   the executed notebooks

`latest(runs)` is the folder whose summary was written last; a folder that is not a batch's is refused in one
line (`SiteError`, a `CheckError`: `python -m par` prints `error: ...` and exits 2).
"""
from __future__ import annotations

import json
import math
import string
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from par.runtime.checks import CheckError

SUMMARY = "summary.json"
REFERENCE_RUNS = Path("docs") / "reference-runs"   # under the repository: runs published beside the CPU run


class SiteError(CheckError):
    """A site that cannot be built from what was given (no run, not a run, an output folder in the way)."""


def latest(runs: Path = Path("runs")) -> Path:
    """The batch folder under `runs` whose summary.json was written last."""
    found = sorted(runs.glob(f"*/{SUMMARY}"), key=lambda p: (p.stat().st_mtime, p.parent.name)) \
        if runs.is_dir() else []
    if not found:
        raise SiteError(f"no executed run under {runs}/: run `python -m par batch` first "
                        f"(or name a run folder: python -m par site RUN_DIR)")
    return found[-1].parent


def reference_runs(root: Path) -> list[Path]:
    """The reference runs committed under `root`/docs/reference-runs/ (a GPU server's batch: its summary.json,
    wherever `python -m par gpu-check --out docs/reference-runs/<gpu>` put it), in path order."""
    folder = Path(root) / REFERENCE_RUNS
    return sorted(p.parent for p in folder.rglob(SUMMARY)) if folder.is_dir() else []


@dataclass
class Lecture:
    """One notebook of the batch: its row of the summary, and the executed file when there is one."""
    stem: str
    status: str
    error: str | None
    duration_s: float
    records: dict
    path: Path | None            # the executed notebook (None when the batch did not run it)

    @property
    def number(self) -> str:
        """"03" for 03_pipelines, "07b" for 07b_at_scale: the key of the lecture's key numbers."""
        return self.stem.split("_", 1)[0]

    @property
    def exercise_number(self) -> str:
        """The number of the lecture's exercise: its own, "07" for 07b_at_scale (the second part of lecture 07)."""
        return self.number.rstrip(string.ascii_lowercase)


@dataclass
class BatchRun:
    """One batch run as the site reads it (`load`): the folder `python -m par batch` wrote, its summary.json, and
    one `Lecture` per notebook row."""
    folder: Path
    summary: dict
    lectures: list[Lecture] = field(default_factory=list)
    reference: bool = False      # a reference run published in the repository (docs/reference-runs/)

    @property
    def provenance(self) -> dict:
        """Where the run came from. Batches older than `provenance` in summary.json: what their parameters and
        folder name say (the date from the folder's timestamp)."""
        p = dict(self.summary.get("provenance") or {})
        params = self.summary.get("parameters", {})
        for key in ("world_size", "backend", "preset", "steps"):
            p.setdefault(key, params.get(key))
        if "date" not in p:
            try:
                p["date"] = datetime.strptime(self.folder.name[:15], "%Y%m%d-%H%M%S").isoformat()
            except ValueError:
                p["date"] = None
        p.setdefault("machine", None)
        return p

    def label(self) -> str:
        """A short name for a column: `gloo x 2, tiny, 20 steps`."""
        p = self.provenance
        shown = f"{p['backend']} × {p['world_size']}, {p['preset']}, {p['steps']} steps"
        return f"reference, {shown}" if self.reference else shown

    def lecture(self, stem: str) -> Lecture | None:
        return next((l for l in self.lectures if l.stem == stem), None)


def load(folder: Path) -> BatchRun:
    """The run in `folder`, or a one-line SiteError saying why it is not one."""
    folder = Path(folder)
    if not folder.is_dir():
        raise SiteError(f"no run folder {folder}: pass a folder `python -m par batch` wrote (runs/<time>/), "
                        f"or nothing for the latest")
    path = folder / SUMMARY
    if not path.is_file():
        raise SiteError(f"{folder} has no {SUMMARY}: it is not a folder `python -m par batch` wrote "
                        f"(runs/<time>/); run the batch, or pass its folder")
    try:
        summary = json.loads(path.read_text())
        rows = summary["notebooks"] if isinstance(summary, dict) else summary["notebooks"][0]
    except (ValueError, KeyError, TypeError, OSError) as e:   # truncated, not UTF-8, unreadable
        raise SiteError(f"{path} is not a batch summary ({type(e).__name__}: {e}); run `python -m par batch` "
                        f"again") from None
    for key in ("provenance", "parameters"):
        if summary.get(key) is not None and not isinstance(summary[key], dict):
            raise SiteError(f"{path}: {key} must be an object, got {json.dumps(summary[key])[:60]}; fix it in "
                            f"{SUMMARY} or run `python -m par batch` again")
    lectures = [lecture(folder, row, i) for i, row in enumerate(rows if isinstance(rows, list) else [rows])]
    return BatchRun(folder=folder, summary=summary, lectures=lectures)


def lecture(folder: Path, row, index: int) -> Lecture:
    """The `index`-th row of a summary as a Lecture; a row that is not one (no notebook name, a duration that is no
    finite number, records that are no object) is a SiteError naming it."""
    where = f"{folder / SUMMARY}: notebook row {index}"
    if not isinstance(row, dict) or not isinstance(row.get("notebook"), str):
        raise SiteError(f"{where} has no notebook name ({json.dumps(row)[:60]}); run `python -m par batch` again")
    duration = row.get("duration_s") or 0.0
    if isinstance(duration, bool) or not isinstance(duration, (int, float)) or not math.isfinite(duration):
        raise SiteError(f"{where} ({row['notebook']}): duration_s must be a number of seconds, got "
                        f"{json.dumps(duration)}; fix it in summary.json or run the batch again")
    records = row.get("records") or {}
    if not isinstance(records, dict):
        raise SiteError(f"{where} ({row['notebook']}): records must be an object, got {json.dumps(records)[:60]}")
    stem = Path(row["notebook"]).stem
    executed = folder / f"{stem}.ipynb"
    return Lecture(stem=stem, status=str(row.get("status", "?")), error=row.get("error"), duration_s=float(duration),
                   records=records, path=executed if executed.is_file() else None)
