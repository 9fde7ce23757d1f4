"""The communication log: every collective `par` issues is written down here.

Each event records what kind of operation ran, how many elements it covered
and how many bytes *this rank sent* for it. For the hand-written ring
collectives that number is counted from the actual sends; for torch's own
collectives (`impl="torch"`) it is the bytes the same ring algorithm would
send, because the backend does not tell us. Runs compare these totals with
the formulas, e.g. ring all-reduce: 2(N-1)/N * S bytes per rank.

    with commlog.capture() as log:
        ...one training step...
    log.total_bytes("all_reduce")
"""
from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Event:
    kind: str          # all_reduce, reduce_scatter, all_gather, broadcast, send, recv, ...
    numel: int         # elements the operation covered (the full tensor, not the chunk)
    bytes_sent: int    # bytes this rank put on the wire for it
    group_size: int
    impl: str = "ring"  # "ring" (par's own), "torch" (torch.distributed)
    tag: str = ""      # free label set by the caller, e.g. "bucket 2", "layer 3 fwd"


class Log:
    """A list of events with the sums a lecture asks for."""

    def __init__(self, events=None):
        self.events: list[Event] = list(events or [])

    def total_bytes(self, kind: str | None = None) -> int:
        return sum(e.bytes_sent for e in self.events if kind is None or e.kind == kind)

    def count(self, kind: str | None = None) -> int:
        return sum(1 for e in self.events if kind is None or e.kind == kind)

    def by_kind(self) -> dict:
        """{kind: {"count": n, "bytes_sent": b}}"""
        out = defaultdict(lambda: {"count": 0, "bytes_sent": 0})
        for e in self.events:
            out[e.kind]["count"] += 1
            out[e.kind]["bytes_sent"] += e.bytes_sent
        return dict(out)

    def as_dicts(self) -> list[dict]:
        return [asdict(e) for e in self.events]

    def __len__(self):
        return len(self.events)


_LOG = Log()
_TAGS: list[str] = []


def record(kind: str, numel: int, bytes_sent: int, group_size: int, impl: str = "ring") -> Event:
    """Append one event to the process-wide log (called by par's communication code)."""
    event = Event(kind, int(numel), int(bytes_sent), int(group_size), impl, "/".join(_TAGS))
    _LOG.events.append(event)
    return event


def log() -> Log:
    """The process-wide log since the last `reset()`."""
    return _LOG


def reset() -> None:
    _LOG.events.clear()


@contextmanager
def capture():
    """Yield a Log that fills with the events issued inside the `with` block."""
    start = len(_LOG.events)
    view = Log()
    try:
        yield view
    finally:
        view.events = _LOG.events[start:]
    view.events = _LOG.events[start:]


@contextmanager
def tag(label: str):
    """Label the events issued inside the block (nested labels join with '/')."""
    _TAGS.append(label)
    try:
        yield
    finally:
        _TAGS.pop()
