"""The key numbers of a lecture, beside the formula they check and the target the lecture states: what the landing
page shows.

Each lecture module (`par/course/lectures/lNN_topic.py`) lists its `KEY_NUMBERS`: the records
(`par.course.batch.record.record`, kept per notebook in `summary.json`) a reader should see first, each a `Key`:
what it is, the formula or the value expected, the record's name, for a record that is a dict the key inside it,
and its `Target` where the lecture states one. A target is data (a text and the closed interval every number of
the recorded value must lie in), so the site evaluates it to a verdict (`verdict`: met, missed) from any run's
records. The site reads the keys from the command `python -m par.course.lectures` (`lecture_keys`): the course
tooling is called, not imported. A record a run does not have (an older notebook, a notebook that failed, a
GPU-only number) is left out, never shown empty. Every record of a lecture, chosen or not, is on its own page.
"""
from __future__ import annotations

import functools
import json
import math
import subprocess
import sys
from dataclasses import asdict, dataclass

from par.runtime.paths import ROOT
from par.site.run import SiteError

MET, MISSED = "met", "missed"


@dataclass(frozen=True)
class Target:
    """Every number of the recorded value (a number, a bool as 0/1, or each number inside a dict or list) lies in
    [low, high]; `text` says so as the lecture does ("≤ 1e-5")."""
    text: str
    low: float | None = None       # None: unbounded
    high: float | None = None

    def holds(self, x: float) -> bool:
        return (self.low is None or x >= self.low) and (self.high is None or x <= self.high)


def bound_text(x: float) -> str:
    """1e-05 -> "1e-5", 0.05 -> "0.05": a bound as the lectures write it."""
    return f"{x:g}".replace("e-0", "e-").replace("e+0", "e+")


def at_most(bound: float) -> Target:
    return Target(f"≤ {bound_text(bound)}", high=bound)


def at_least(bound: float) -> Target:
    return Target(f"≥ {bound_text(bound)}", low=bound)


def near(value: float, tolerance: float, text: str = "") -> Target:
    """|x − value| ≤ tolerance (`text`: how the lecture says it, default "value ± tolerance")."""
    return Target(text or f"{bound_text(value)} ± {bound_text(tolerance)}", low=value - tolerance, high=value + tolerance)


def equal(value) -> Target:
    """x = value exactly (True counts as 1)."""
    return Target(f"= {value}", low=float(value), high=float(value))


@dataclass(frozen=True)
class Key:
    what: str
    formula: str              # plain text with Unicode (no TeX: the landing page needs no MathJax)
    record: str
    part: str | None = None   # a key inside a record that is a dict
    target: Target | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Key:
        target = d.get("target")
        return cls(d["what"], d["formula"], d["record"], d.get("part"), Target(**target) if target else None)


MISSING = object()


def value(records: dict, key: Key):
    """The recorded value of `key`, or MISSING."""
    v = records.get(key.record, MISSING)
    if key.part is not None:
        v = v.get(key.part, MISSING) if isinstance(v, dict) else MISSING
    return v


def numbers_in(v):
    """Every number in a recorded value (bools as 0/1), or None where it holds something else (a label)."""
    if isinstance(v, (bool, int, float)):
        return [float(v)]
    items = v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else None
    if items is None:
        return None
    out = []
    for x in items:
        found = numbers_in(x)
        if found is None:
            return None
        out += found
    return out


def verdict(key: Key, records: dict) -> str:
    """MET or MISSED where the key has a target and the run recorded numbers for it; "" otherwise."""
    v = value(records, key)
    found = numbers_in(v) if key.target is not None and v is not MISSING else None
    if not found:
        return ""
    return MET if all(not math.isnan(x) and key.target.holds(x) for x in found) else MISSED


@functools.cache
def lecture_keys() -> dict[str, list[Key]]:
    """{notebook name: its keys}, from the lecture modules through `python -m par.course.lectures`; refused in one
    line (`SiteError`) where that command fails."""
    done = subprocess.run([sys.executable, "-m", "par.course.lectures"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise SiteError(f"the lectures' key numbers could not be read: {why} (try `python -m par.course.lectures`)")
    return {name: [Key.from_dict(k) for k in keys] for name, keys in json.loads(done.stdout).items()}

def chosen(stem: str, records: dict) -> list[Key]:
    """The keys of the lecture of notebook `stem` that `records` holds, in the lecture's order."""
    return [k for k in lecture_keys().get(stem, []) if value(records, k) is not MISSING]


def fmt(v, width: int = 12) -> str:
    """A recorded value as a reader wants it: 4 significant digits, 1.2e-07 for tiny ones, dicts as `k: v`."""
    if v is MISSING or v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}".replace(",", " ") if abs(v) >= 10_000 else str(v)
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        if v == 0:
            return "0"
        if v.is_integer() and abs(v) < 1e15:
            return fmt(int(v))
        return f"{v:.3g}" if abs(v) < 1e-3 or abs(v) >= 1e6 else f"{v:.4g}"
    if isinstance(v, dict):
        items = list(v.items())
        text = ", ".join(f"{k}: {fmt(x)}" for k, x in items[:width])
        return text + (f", … ({len(items) - width} more)" if len(items) > width else "")
    if isinstance(v, (list, tuple)):
        text = ", ".join(fmt(x) for x in v[:width])
        return "[" + text + (f", … ({len(v) - width} more)" if len(v) > width else "") + "]"
    return str(v)
