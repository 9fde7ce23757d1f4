"""Recorded timelines: what each rank did, and when.

A `Recorder` notes spans (name, lane, start, end) on one rank, against a clock that every rank
starts together after a barrier (`reset()`). `gather()` brings all ranks' spans to rank 0.
Pipelines, overlapped data parallel and ZeRO-3 record here, and `par.course.plots.gantt` draws what was
recorded.

    rec = Recorder()
    with rec.span("F3", lane="compute"):
        ...forward of micro-batch 3...

Two clocks, one API:

* On the CPU (gloo) a span is wall-clock time (`time.perf_counter`): the work happens while the
  Python code runs. Each span also keeps the recording thread's CPU seconds and run-queue seconds inside
  it (`par.clock`), so `Span.steady` = duration − ready is what it took on a core of its own, whatever else
  the machine ran: a verdict about time reads `steady` (`busy_fraction(..., clock="steady")`).
* On a GPU the Python code only *launches* kernels and returns; the GPU runs them later, and an
  NCCL `wait()` does not block the CPU. So a recorder on a CUDA device times `span()` with CUDA
  events recorded on the current stream at its start and end, resolved to seconds at `gather()`
  (after a synchronize) relative to an event recorded at `reset()`. Those are the GPU's times.

For work that runs on another stream or finishes asynchronously (a communication), take marks
yourself: `mark(stream)` records an event on `stream` (the current one by default) on a GPU, and
is `now()` on the CPU; `add(name, start_mark, end_mark, lane)` keeps the span between them.

    start = rec.mark(comm_stream)              # before the collective is issued on comm_stream
    work = dist.all_reduce(bucket, async_op=True)
    ...
    work.wait()                                # under NCCL: the current stream waits for it
    rec.add("AR1", start, rec.mark(), lane="comm")

`now()` and `add()` with float seconds stay the CPU clock on every device, starting at `reset()`
with the same zero as the events (the GPU is idle at that moment: `reset()` synchronizes first),
so a CPU-timed span can sit in a GPU timeline, approximately.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from par import clock
from par.runtime import dist as pdist


@dataclass(frozen=True)
class Span:
    rank: int
    name: str       # e.g. "F3", "B3", "allreduce bucket 1"
    lane: str       # "compute", "comm", ... (one row per lane per rank in a Gantt chart)
    start: float    # seconds since the recorder's zero
    end: float
    cpu: float = 0.0     # the recording thread's CPU seconds inside the span (CPU clock; 0 on a GPU's events)
    ready: float = 0.0   # its run-queue seconds inside the span: waiting for a core the machine gave elsewhere

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def steady(self) -> float:
        """The span's seconds on a core of its own: duration − ready, never below its CPU seconds
        (`par.clock.load_proof`)."""
        return seconds(asdict(self), "steady")


class Mark(float):
    """A point on the CPU clock (seconds since the recorder's zero) that also holds the thread's clocks then."""
    reading: clock.Reading

    def __new__(cls, seconds: float, reading: clock.Reading):
        mark = super().__new__(cls, seconds)
        mark.reading = reading
        return mark


@dataclass(frozen=True)
class _EventSpan:
    """A span between two CUDA events, resolved to seconds at gather()."""
    name: str
    lane: str
    start: object
    end: object


def _default_device() -> torch.device:
    """The device of this rank (`par.runtime.dist.env()`), the CPU before `par.runtime.dist.init()`."""
    here = pdist.current()
    return here.device if here is not None else torch.device("cpu")


class Recorder:
    def __init__(self, rank: int | None = None, sync: bool = True, device=None):
        self.rank = rank if rank is not None else (dist.get_rank() if dist.is_initialized() else 0)
        self.device = torch.device(device) if device is not None else _default_device()
        self.clock = "cuda" if self.device.type == "cuda" else "cpu"
        self._entries: list = []          # Span (CPU clock) or _EventSpan (GPU), in recording order
        self.reset(sync)

    # -- the GPU's clock (methods a test can replace)
    def _event(self, stream=None):
        """A timing event recorded now on `stream` (default: the device's current stream)."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return event

    def _synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def reset(self, sync: bool = True) -> None:
        """Forget all spans and start the clock again (after a barrier, so ranks share a zero)."""
        if self.clock == "cuda":
            self._synchronize()           # earlier GPU work must not run into the new timeline
        if sync and dist.is_initialized():
            dist.barrier()
        self._entries.clear()
        self.t0 = time.perf_counter()
        self._zero = self._event() if self.clock == "cuda" else None

    def now(self) -> float:
        """Seconds on the CPU clock since `reset()` (on every device)."""
        return time.perf_counter() - self.t0

    def mark(self, stream=None):
        """A point in time to pass to `add()`: a CUDA event recorded on `stream` on a GPU, on the CPU a `Mark` (the
        seconds since reset, with the thread's CPU and run-queue clocks)."""
        if self.clock == "cuda":
            return self._event(stream)
        reading = clock.read()
        return Mark(reading.wall - self.t0, reading)

    def add(self, name: str, start, end, lane: str = "compute", waited: float = 0.0) -> None:
        """Keep a span between two marks: both floats (CPU seconds since reset; two `Mark`s also give its CPU and
        run-queue seconds) or both CUDA events. `waited` (CPU clock): run-queue seconds of what this thread waited
        for inside the span (another thread, the other ranks: `par.clock.Waiting`), kept in the span's `ready`."""
        numbers = [isinstance(t, (int, float)) for t in (start, end)]
        if all(numbers):
            took = clock.between(start.reading, end.reading) if isinstance(start, Mark) and isinstance(end, Mark) \
                else None
            self._entries.append(Span(self.rank, name, lane, float(start), float(end),
                                      took.cpu if took else 0.0, (took.ready if took else 0.0) + waited))
        elif not any(numbers):
            self._entries.append(_EventSpan(name, lane, start, end))
        else:
            raise TypeError(f"span {name!r}: start and end must both be CPU seconds or both CUDA events "
                            f"(rec.mark()), got {type(start).__name__} and {type(end).__name__}")

    @contextmanager
    def span(self, name: str, lane: str = "compute", stream=None):
        """Time the block: CPU seconds, or on a GPU the stream's work enqueued inside it (`stream`: default current)."""
        start = self.mark(stream)
        try:
            yield
        finally:
            self.add(name, start, self.mark(stream), lane)

    @property
    def spans(self) -> list[Span]:
        """Every span in seconds since the zero (on a GPU this waits for the device to finish)."""
        if any(isinstance(e, _EventSpan) for e in self._entries):
            self._synchronize()
        return [self._resolve(e) for e in self._entries]

    def _resolve(self, e) -> Span:
        if isinstance(e, Span):
            return e
        return Span(self.rank, e.name, e.lane, self._zero.elapsed_time(e.start) / 1e3,
                    self._zero.elapsed_time(e.end) / 1e3)

    def gather(self, dst: int = 0) -> list[dict] | None:
        """All ranks' spans as dicts on rank `dst` (None elsewhere)."""
        mine = [asdict(s) for s in self.spans]
        if not dist.is_initialized():
            return mine
        parts = [None] * dist.get_world_size() if dist.get_rank() == dst else None
        dist.gather_object(mine, parts, dst=dst)
        return None if parts is None else [s for p in parts for s in p]


def seconds(span: dict, clock_: str = "wall") -> float:
    """A gathered span's seconds on `clock_`: "wall" (end − start) or "steady" (less its run-queue wait, never below
    its CPU seconds: `par.clock.load_proof`)."""
    wall = span["end"] - span["start"]
    if clock_ == "wall":
        return wall
    if clock_ == "steady":
        return clock.load_proof(wall, span.get("cpu", 0.0), span.get("ready", 0.0))
    raise ValueError(f"clock must be 'wall' or 'steady', got {clock_!r}")


def busy_fraction(spans: list[dict], rank: int, lane: str = "compute", clock_: str = "wall") -> float:
    """Time a rank spent in `lane` spans divided by the makespan of the whole timeline, both on `clock_` ("steady":
    each span less its run-queue wait, the makespan less the rank's run-queue wait inside its spans, both as
    `seconds` counts them)."""
    total = max(s["end"] for s in spans) - min(s["start"] for s in spans)
    mine = [s for s in spans if s["rank"] == rank]
    if clock_ == "steady":
        total -= sum(seconds(s, "wall") - seconds(s, "steady") for s in mine)
    busy = sum(seconds(s, clock_) for s in mine if s["lane"] == lane)
    return busy / total if total > 0 else 0.0
