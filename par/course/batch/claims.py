"""A lecture's claim checked where it is made, against this run's numbers.

A lecture states targets as data beside its key numbers (`KEY_NUMBERS` in `par/course/lectures/lNN_topic.py`: "the
bubble within 0.05 of its formula", "a speed-up at most the number of ranks"). In the notebook, the cell that makes
the claim calls

    v = check(NOTEBOOK, "bubble_measured_minus_formula_max", gap)

which records the value (`par.course.batch.record.record`, so the batch keeps it in `summary.json`), prints one
verdict line per key of that record (✓ met, or ✗ with the value and the side of the target it fell on), and
returns the verdict, so the sentence around it is written from the run:

    say(f"The largest gap is {gap:.3f}, {v.word('inside', 'outside')} the band the lecture sets ({v.target}).")

A missed target is printed, never raised: noise is real, and the batch goes on. The batch writes every verdict into
`summary.json` and `summary.md` (`verdicts`), and the site marks the missed ones.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from par.course.batch.launches import CourseError, lecture
from par.course.batch.record import record
from par.measure import plain
from par.site import numbers

MARK = {numbers.MET: "✓", numbers.MISSED: "✗"}


@dataclass(frozen=True)
class Verdict:
    """One key number of a lecture judged against its target: `verdict` is "met", "missed" or "" (no target, or no
    number recorded)."""
    what: str
    record: str
    part: str | None
    value: object
    target: str
    verdict: str
    reason: str = ""

    @property
    def met(self) -> bool:
        return self.verdict == numbers.MET

    def word(self, if_met: str, if_missed: str) -> str:
        """The word a sentence needs for this verdict ("inside" / "outside")."""
        return if_met if self.met else if_missed

    def line(self) -> str:
        """✓ what = value (target …) — or ✗ what = value: misses target … (why)."""
        shown = numbers.fmt(self.value)
        if self.verdict == numbers.MISSED:
            return f"✗ {self.what} = {shown}: misses its target {self.target} ({self.reason})"
        if self.verdict == numbers.MET:
            return f"✓ {self.what} = {shown} (target {self.target})"
        return f"· {self.what} = {shown}"

    def __str__(self) -> str:
        return self.line()

    def to_json(self) -> dict:
        return {"what": self.what, "record": self.record, "part": self.part, "value": self.value,
                "target": self.target, "verdict": self.verdict, "reason": self.reason}


def _reason(key: numbers.Key, value) -> str:
    """Which number of a missed value fell where: '0.065 > 0.05'."""
    found = numbers.numbers_in(value) or []
    for x in found:
        if math.isnan(x):
            return "not a number"
        if key.target.high is not None and x > key.target.high:
            return f"{numbers.fmt(x)} > {numbers.bound_text(key.target.high)}"
        if key.target.low is not None and x < key.target.low:
            return f"{numbers.fmt(x)} < {numbers.bound_text(key.target.low)}"
    return ""


def judge(key: numbers.Key, records: dict) -> Verdict:
    """`key` judged against `records` (a notebook's records, as `record` leaves them)."""
    value = numbers.value(records, key)
    verdict = numbers.verdict(key, records)
    return Verdict(what=key.what, record=key.record, part=key.part,
                   value=None if value is numbers.MISSING else value,
                   target=key.target.text if key.target else "", verdict=verdict,
                   reason=_reason(key, value) if verdict == numbers.MISSED else "")


def keys_of(notebook: str) -> list[numbers.Key]:
    """The key numbers of the lecture of `notebook` (its lecture module's KEY_NUMBERS)."""
    return list(lecture(notebook).KEY_NUMBERS)


def check(notebook: str, name: str, value, part: str | None = None) -> Verdict:
    """Record `value` as `name`, print the verdict of every key number of `notebook`'s lecture read from that record,
    and return the one of `part` (or the first with a target). A record no key reads is refused: a claim checked on
    the page is declared in the lecture module, where the batch and the site find it too."""
    keys = [k for k in keys_of(notebook) if k.record == name]
    if not keys:
        raise CourseError(f"lecture {notebook!r} declares no key number recorded as {name!r}: add a Key to its "
                          f"KEY_NUMBERS (par/course/lectures/)")
    record(name, value)
    records = {name: plain(value)}
    judged = [judge(k, records) for k in keys]
    for v in judged:
        print(v.line())
    chosen = [v for v in judged if v.part == part] if part is not None else [v for v in judged if v.target]
    return (chosen or judged)[0]


def verdicts(notebook: str, records: dict) -> list[dict]:
    """Every verdict of `notebook`'s targets that `records` holds a number for, as JSON (the batch's summary);
    [] for a notebook without a lecture module."""
    try:
        keys = keys_of(notebook)
    except CourseError:
        return []
    return [v.to_json() for v in (judge(k, records) for k in keys) if v.verdict]


def say(text: str) -> None:
    """Show a sentence rendered from this run's numbers as Markdown in a notebook (printed elsewhere)."""
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
    except ImportError:
        print(text)
        return
    if get_ipython() is None:
        print(text)
    else:
        display(Markdown(text))
