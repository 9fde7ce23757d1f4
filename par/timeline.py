"""Recorded timelines: what each rank did, and when.

A `Recorder` notes spans (name, lane, start, end) on one rank, against a clock
that every rank starts together after a barrier. `gather()` brings all ranks'
spans to rank 0. Pipelines, overlapped data parallel and ZeRO-3 record here,
and `par.plots.gantt` draws what was recorded.

    rec = Recorder()
    with rec.span("F3", lane="compute"):
        ...forward of micro-batch 3...
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class Span:
    rank: int
    name: str       # e.g. "F3", "B3", "allreduce bucket 1"
    lane: str       # "compute", "comm", ... (one row per lane per rank in a Gantt chart)
    start: float    # seconds since the recorder's zero
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


class Recorder:
    def __init__(self, rank: int | None = None, sync: bool = True):
        self.rank = rank if rank is not None else (dist.get_rank() if dist.is_initialized() else 0)
        self.spans: list[Span] = []
        self.reset(sync)

    def reset(self, sync: bool = True) -> None:
        """Forget all spans and start the clock again (after a barrier, so ranks share a zero)."""
        if sync and dist.is_initialized():
            dist.barrier()
        self.spans.clear()
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def add(self, name: str, start: float, end: float, lane: str = "compute") -> None:
        self.spans.append(Span(self.rank, name, lane, start, end))

    @contextmanager
    def span(self, name: str, lane: str = "compute"):
        start = self.now()
        try:
            yield
        finally:
            self.add(name, start, self.now(), lane)

    def gather(self, dst: int = 0) -> list[dict] | None:
        """All ranks' spans as dicts on rank `dst` (None elsewhere)."""
        mine = [asdict(s) for s in self.spans]
        if not dist.is_initialized():
            return mine
        parts = [None] * dist.get_world_size() if dist.get_rank() == dst else None
        dist.gather_object(mine, parts, dst=dst)
        return None if parts is None else [s for p in parts for s in p]


def busy_fraction(spans: list[dict], rank: int, lane: str = "compute") -> float:
    """Time a rank spent in `lane` spans divided by the makespan of the whole timeline."""
    total = max(s["end"] for s in spans) - min(s["start"] for s in spans)
    busy = sum(s["end"] - s["start"] for s in spans if s["rank"] == rank and s["lane"] == lane)
    return busy / total if total > 0 else 0.0
