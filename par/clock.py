"""The load-proof clock: how long a piece of work took on the core it ran on, whatever else the machine runs.

On a busy machine the wall clock counts the time a thread waited for a core. Linux keeps that wait per thread
(`/proc/thread-self/schedstat`: seconds on a core, seconds runnable but waiting in the run queue, timeslices),
so the time a span would have taken on a core of its own is

    steady = wall − ready        ready: the run-queue wait of the thread that timed the span, during the span
                                 (never below the thread's CPU seconds in the span: `load_proof`)

Beside it, `cpu` is the thread's CPU time (`time.thread_time`): the same as `steady` for a span that computes,
nothing for a span that waits on another rank (a blocking receive, a collective's wait), where `steady` keeps
the waiting. A verdict about time on the CPU reads `steady`, and a page shows `wall` beside it.

    start = clock.read()
    ...work...
    took = clock.since(start)          # Elapsed(wall, cpu, ready); took.steady = wall − ready

The kernel charges a thread's run-queue wait when the thread gets its core back, and on some kernels the charge
runs late: a wait can include time the thread ran before it was preempted (on this course's 2-core VM, beside two
busy loops, 41 and 223 of 400 spans of 1.4 ms of matmuls, in two runs, were charged more wait than their
wall time). A span cannot have waited longer than it did not compute, so `steady` never goes below the thread's
CPU seconds: steady = max(cpu, wall − ready), at most wall.

What it counts that is no mechanism's: the kernel's work on the thread's behalf, above all faulting in (and
zeroing) the pages of memory the allocator handed back; ranks keep the memory they free (`par.runtime.heap`).
What it does not remove by itself: a wait on another thread or another rank that was itself kept from its core
(rank A's receive lasts as long as rank B's delayed send). Where the code knows it waits, `Waiting` reads the
run-queue wait of what it waits for (the communication thread; the job's other ranks on this machine, `watch`),
and a span or a step counts it as its own (`Recorder.add(..., waited=)`, `Step.waited_s`). A comparison across
ranks is read on the worst rank, and where it still does not resolve, the simulator with this run's measured costs
says what the mechanism gives. Without schedstat
(macOS, a kernel built without it) `ready` is 0 and `steady` is the wall clock; `available()` says which. On a
GPU the course times with CUDA events instead (`par.timeline`).
"""
from __future__ import annotations

import functools
import os
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
    """What a span took: wall seconds, the thread's CPU seconds, its run-queue seconds; steady = wall − ready,
    never below cpu (`load_proof`)."""
    wall: float
    cpu: float
    ready: float

    @property
    def steady(self) -> float:
        return load_proof(self.wall, self.cpu, self.ready)


def load_proof(wall: float, cpu: float, ready: float) -> float:
    """The steady seconds of a span of `wall` seconds in which the thread computed `cpu` seconds and was charged
    `ready` seconds of run-queue wait: wall − ready, never below cpu (a wait charged late, above), never above
    wall."""
    return max(0.0, min(wall, max(cpu, wall - ready)))


def read() -> Reading:
    """The calling thread's clocks now."""
    return Reading(time.perf_counter(), time.thread_time(), _ready_ns() / 1e9)


def between(start: Reading, end: Reading) -> Elapsed:
    """What passed from `start` to `end` (both read on the same thread)."""
    return Elapsed(end.wall - start.wall, end.cpu - start.cpu, max(0.0, end.ready - start.ready))


def since(start: Reading) -> Elapsed:
    """What passed from `start` to now, on the calling thread."""
    return between(start, read())



# ---------------------------------------------------------------- a wait on other threads and other ranks
_PEERS: list[int] = []      # the other processes of this job on this machine (`watch`)


_FDS: dict[str, int] = {}   # schedstat files kept open: a read is then one pread, not open, read and close
_TASKS: dict[int, tuple[float, list[str]]] = {}   # pid -> (when listed, its threads' schedstat paths)
TASKS_TTL_S = 1.0           # a process's thread list is listed again after this long


def _forget() -> None:
    """A forked child reads its own threads: the parent's open files and lists are not its."""
    for fd in _FDS.values():
        os.close(fd)
    _FDS.clear()
    _TASKS.clear()


os.register_at_fork(after_in_child=_forget)


def _task_ready_ns(path: str) -> int:
    """The run-queue nanoseconds in a thread's schedstat file (0 once the thread is gone)."""
    try:
        fd = _FDS.get(path)
        if fd is None:
            fd = _FDS[path] = os.open(path, os.O_RDONLY)
        return int(os.pread(fd, 128, 0).split()[1])
    except (OSError, IndexError, ValueError):
        fd = _FDS.pop(path, None)
        if fd is not None:
            os.close(fd)
        return 0


def _task_paths(pid: int) -> list[str]:
    """The schedstat files of process `pid`'s threads, listed at most once per TASKS_TTL_S (threads come and go
    rarely; reading /proc for the list each time would cost more than the reads themselves)."""
    now = time.monotonic()
    listed = _TASKS.get(pid)
    if listed is None or now - listed[0] > TASKS_TTL_S:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            tasks = []
        for path in (listed[1] if listed else []):
            if path.split("/")[4] not in tasks and path in _FDS:
                os.close(_FDS.pop(path))
        listed = _TASKS[pid] = (now, [f"/proc/{pid}/task/{t}/schedstat" for t in tasks])
    return listed[1]


def ready_of(thread_name: str) -> float:
    """Seconds the threads of this process named `thread_name` (`threading.Thread.name`, e.g. "par-comm") have
    waited in the run queue so far; 0 for none, or without schedstat."""
    import threading
    return sum(_task_ready_ns(f"/proc/self/task/{t.native_id}/schedstat") for t in threading.enumerate()
               if t.name == thread_name and t.native_id is not None) / 1e9


def process_ready(pid: int) -> float:
    """Seconds every thread of process `pid` has waited in the run queue so far (0 where it cannot be read)."""
    return sum(_task_ready_ns(path) for path in _task_paths(pid)) / 1e9


def others_ready() -> float:
    """Seconds every thread of this process but the calling one has waited in the run queue so far (the
    communication thread, the backend's threads, ...)."""
    import threading
    mine = f"/task/{threading.get_native_id()}/"
    return sum(_task_ready_ns(path) for path in _task_paths(os.getpid()) if mine not in path) / 1e9


def watch(pids) -> None:
    """The processes this one waits for in a collective (the job's other ranks, where they share this machine):
    `Waiting` counts their run-queue wait. The calling process itself is left out; the files of processes no
    longer watched are closed."""
    _PEERS[:] = [int(p) for p in pids if int(p) != os.getpid()]
    for pid in [p for p in _TASKS if p not in _PEERS and p != os.getpid()]:
        for path in _TASKS.pop(pid)[1]:
            if path in _FDS:
                os.close(_FDS.pop(path))


class Waiting:
    """A wait of the calling thread for others, from its creation to `done()`: for the threads of this process
    named `thread_name` (a collective on the communication thread), or with `others` for every other thread of
    this process (the backend's own threads too: a step that waits on any of them), and for the other ranks
    (`watch`). A thread that
    blocks has no run-queue wait of its own meanwhile; what the load added to its wait is the run-queue wait of
    what it waited for, read at both ends: that thread's, plus the most delayed other rank's (every thread of it).
    For a wait that also computes this can count more than the load added (a peer's wait for a core while this
    thread ran); a span's steady seconds never go below its CPU seconds (`load_proof`)."""

    def __init__(self, thread_name: str | None = None, others: bool = False):
        self.thread_name, self.others, self.ready = thread_name, others, 0.0
        self._own = self._own_ready()
        self._peers = [(p, process_ready(p)) for p in _PEERS]

    def _own_ready(self) -> float:
        if self.others:
            return others_ready()
        return ready_of(self.thread_name) if self.thread_name else 0.0

    def done(self) -> float:
        """The run-queue seconds of what was waited for, since the wait began (also kept in `ready`)."""
        own = self._own_ready() - self._own
        self.ready = own + max((process_ready(p) - before for p, before in self._peers), default=0.0)
        return self.ready

