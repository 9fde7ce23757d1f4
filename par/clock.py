"""The load-proof clock: how long a piece of work took on the core it ran on, whatever else the machine runs.

On a busy machine the wall clock counts the time a thread waited for a core. Linux keeps that wait per thread
(`/proc/thread-self/schedstat`: seconds on a core, seconds runnable but waiting in the run queue, timeslices),
so the time a span would have taken on a core of its own is

    steady = wall − ready        ready: the run-queue wait of the thread that timed the span, during the span

Beside it, `cpu` is the thread's CPU time (`time.thread_time`): the same as `steady` for a span that computes,
nothing for a span that waits on another rank (a blocking receive, a collective's wait), where `steady` keeps
the waiting. A verdict about time on the CPU reads `steady`, and a page shows `wall` beside it.

    start = clock.read()
    ...work...
    took = clock.since(start)          # Elapsed(wall, cpu, ready); took.steady = wall − ready

What it does not remove: a wait on another rank that was itself kept from its core (rank A's receive lasts as
long as rank B's delayed send) — a comparison across ranks is read on the worst rank, and where it still does
not resolve, the simulator with this run's measured costs says what the mechanism gives. Without schedstat
(macOS, a kernel built without it) `ready` is 0 and `steady` is the wall clock; `available()` says which. On a
GPU the course times with CUDA events instead (`par.timeline`).
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass

SCHEDSTAT = "/proc/thread-self/schedstat"


def _ready_ns() -> int:
    """Nanoseconds the calling thread has waited in the run queue since it started (0 without schedstat)."""
    try:
        with open(SCHEDSTAT, "rb") as f:
            return int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return 0


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """This machine tells each thread's run-queue wait (else `steady` is the wall clock)."""
    try:
        with open(SCHEDSTAT, "rb") as f:
            return len(f.read().split()) >= 2
    except OSError:
        return False


@dataclass(frozen=True)
class Reading:
    """The calling thread's clocks at one moment, in seconds: wall (perf_counter), CPU (thread_time), run-queue
    wait so far."""
    wall: float
    cpu: float
    ready: float


@dataclass(frozen=True)
class Elapsed:
    """What a span took: wall seconds, the thread's CPU seconds, its run-queue seconds; steady = wall − ready."""
    wall: float
    cpu: float
    ready: float

    @property
    def steady(self) -> float:
        return max(0.0, self.wall - self.ready)


def read() -> Reading:
    """The calling thread's clocks now."""
    return Reading(time.perf_counter(), time.thread_time(), _ready_ns() / 1e9)


def between(start: Reading, end: Reading) -> Elapsed:
    """What passed from `start` to `end` (both read on the same thread)."""
    return Elapsed(end.wall - start.wall, end.cpu - start.cpu, max(0.0, end.ready - start.ready))


def since(start: Reading) -> Elapsed:
    """What passed from `start` to now, on the calling thread."""
    return between(start, read())
