"""par.timeline.Recorder: wall-clock spans on the CPU, CUDA-event spans on a GPU (checked here with a fake event
class that runs on its own clock, so the bookkeeping is tested without a GPU; tests/test_gpu.py uses real ones)."""
from __future__ import annotations

import time
from dataclasses import asdict

import pytest
import torch

from par.timeline import Recorder, Span, busy_fraction


def test_cpu_spans_are_wall_clock_seconds_since_reset():
    rec = Recorder(rank=3, sync=False)
    assert rec.clock == "cpu" and rec.device == torch.device("cpu")
    with rec.span("F0"):
        time.sleep(0.05)
    start = rec.now()
    time.sleep(0.02)
    rec.add("AR", start, rec.now(), lane="comm")
    mark = rec.mark()
    assert isinstance(mark, float) and mark >= rec.spans[-1].end
    f, ar = rec.spans
    assert (f.rank, f.name, f.lane) == (3, "F0", "compute") and 0.05 <= f.duration < 1.0
    assert (ar.name, ar.lane) == ("AR", "comm") and ar.start >= f.end and ar.duration >= 0.02
    assert rec.gather() == [{"rank": 3, "name": "F0", "lane": "compute", "start": f.start, "end": f.end,
                             "cpu": f.cpu, "ready": f.ready},
                            {"rank": 3, "name": "AR", "lane": "comm", "start": ar.start, "end": ar.end,
                             "cpu": 0.0, "ready": 0.0}]
    assert f.cpu < 0.04, "a sleeping span spends no CPU"
    rec.reset(sync=False)
    assert rec.spans == [] and rec.now() < 0.05


def test_busy_fraction():
    spans = [{"rank": 0, "lane": "compute", "start": 0.0, "end": 1.0},
             {"rank": 1, "lane": "compute", "start": 1.0, "end": 4.0},
             {"rank": 0, "lane": "comm", "start": 1.0, "end": 2.0}]
    assert busy_fraction(spans, 0) == 0.25 and busy_fraction(spans, 1) == 0.75


class GpuClock:
    """When the fake GPU would execute what is enqueued now (seconds), set by the test."""
    t = 0.0


class FakeEvent:
    def __init__(self, t: float, stream):
        self.t, self.stream = t, stream

    def elapsed_time(self, other: "FakeEvent") -> float:   # milliseconds, as torch.cuda.Event's
        return (other.t - self.t) * 1e3


class FakeCudaRecorder(Recorder):
    """A Recorder on "cuda:0" whose events come from GpuClock instead of a device."""

    def __init__(self, gpu: GpuClock, **kwargs):
        self.gpu, self.synchronized, self.events = gpu, 0, []
        super().__init__(rank=1, sync=False, device="cuda:0", **kwargs)

    def _event(self, stream=None):
        event = FakeEvent(self.gpu.t, stream if stream is not None else "current")
        self.events.append(event)
        return event

    def _synchronize(self):
        self.synchronized += 1


def test_on_a_gpu_spans_are_times_of_cuda_events_relative_to_reset():
    gpu = GpuClock()
    gpu.t = 100.0
    rec = FakeCudaRecorder(gpu)
    assert rec.clock == "cuda" and rec.synchronized == 1        # reset waited for earlier GPU work
    gpu.t = 100.5                 # the GPU reaches F0's first kernel at 100.5 s ...
    cpu_start = time.perf_counter()
    with rec.span("F0"):
        gpu.t = 102.0             # ... and is done with its last one at 102 s; the CPU left long before
    assert time.perf_counter() - cpu_start < 1.0
    assert [e.stream for e in rec.events] == ["current"] * 3
    (f,) = rec.gather()
    assert f == {"rank": 1, "name": "F0", "lane": "compute", "start": 0.5, "end": 2.0, "cpu": 0.0, "ready": 0.0}
    assert rec.synchronized == 2, "events are read only after a synchronize"


def test_a_communication_span_between_events_on_another_stream():
    gpu = GpuClock()
    rec = FakeCudaRecorder(gpu)
    gpu.t = 0.25
    start = rec.mark("nccl stream")
    gpu.t = 0.75
    rec.add("AR1", start, rec.mark(), lane="comm")
    assert start.stream == "nccl stream" and rec.events[-1].stream == "current"
    assert rec.spans == [Span(1, "AR1", "comm", 0.25, 0.75)]


def test_cpu_seconds_and_gpu_events_share_a_timeline_but_not_a_span():
    gpu = GpuClock()
    rec = FakeCudaRecorder(gpu)
    rec.add("host work", 0.0, 0.125)               # CPU seconds since reset: kept as they are
    gpu.t = 1.0
    with rec.span("B0", lane="compute"):
        gpu.t = 2.0
    assert [(s.name, s.start, s.end) for s in rec.spans] == [("host work", 0.0, 0.125), ("B0", 1.0, 2.0)]
    with pytest.raises(TypeError, match="both be CPU seconds or both CUDA events"):
        rec.add("mixed", 0.0, rec.mark())


BURN = "import time\nend = time.time() + 3\nwhile time.time() < end:\n    pass\n"


def _worker(name):
    """A thread that, once `go` is set, computes 0.3 CPU-s, sets `computed` and stays alive until `leave` (as the
    communication thread is alive before and after a wait); returns (go, computed, leave)."""
    import threading
    go, computed, leave = threading.Event(), threading.Event(), threading.Event()

    def work():
        go.wait()
        stop = time.thread_time() + 0.3
        while time.thread_time() < stop:
            pass
        computed.set()
        leave.wait()
    threading.Thread(target=work, name=name).start()
    return go, computed, leave


def test_a_span_under_load_keeps_its_steady_seconds():
    """Three processes burn this machine's cores while a span computes: its wall time grows by the run-queue wait,
    its steady time (wall − ready) stays the CPU time it spent (`par.clock`)."""
    import os
    import subprocess
    import sys

    from par import clock
    if not clock.available():
        pytest.skip("this kernel does not tell a thread's run-queue wait (/proc/thread-self/schedstat)")
    burners = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range((os.cpu_count() or 1) + 1)]
    try:
        time.sleep(0.3)
        rec = Recorder(rank=0, sync=False)
        with rec.span("busy"):
            stop = time.thread_time() + 0.3
            while time.thread_time() < stop:
                pass
        (span,) = rec.spans
    finally:
        for b in burners:
            b.kill()
    assert span.ready > 0.05 and span.duration > span.cpu + 0.05, f"the machine was not loaded: {span}"
    assert abs(span.steady - span.cpu) <= 0.2 * span.cpu + 0.02, span
    assert busy_fraction([{**asdict(span)}], 0, clock_="steady") == pytest.approx(1.0)


def test_a_wait_for_another_thread_counts_that_threads_wait_for_a_core():
    """The main thread blocks while a thread named "par-test-worker" computes 0.3 CPU-s beside burners:
    `par.clock.Waiting` reads the worker's run-queue wait, and the span that keeps it (`Recorder.add(...,
    waited=)`) has about the worker's CPU time as its steady time, not the wall time the load stretched it to.
    A watched process (a rank's stand-in, here a burner) has its run-queue wait read too."""
    import os
    import subprocess
    import sys

    from par import clock
    if not clock.available():
        pytest.skip("this kernel does not tell a thread's run-queue wait (/proc/thread-self/schedstat)")
    burners = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range((os.cpu_count() or 1) + 1)]

    go, computed, leave = _worker(name="par-test-worker")
    try:
        time.sleep(0.3)
        clock.watch([burners[0].pid, os.getpid()])          # this process itself is left out
        assert clock._PEERS == [burners[0].pid]
        peer = clock.Waiting()
        time.sleep(0.3)
        peer.done()
        clock.watch([])
        rec = Recorder(rank=0, sync=False)
        start, waiting = rec.mark(), clock.Waiting("par-test-worker")
        go.set()
        computed.wait()
        waited = waiting.done()
        rec.add("wait", start, rec.mark(), waited=waited)
        (span,) = rec.spans
    finally:
        leave.set()
        go.set()
        clock.watch([])
        for b in burners:
            b.kill()
    assert span.duration > 0.3 + 0.05 and waited > 0.05, f"the machine was not loaded: {span}, waited {waited}"
    assert span.cpu < 0.05 and span.ready >= waited        # the main thread itself only waited
    assert abs(span.steady - 0.3) <= 0.3 * 0.3 + 0.05, span
    assert peer.ready > 0.02, "the watched process's run-queue wait was not read"


def test_a_wait_for_any_other_thread_of_the_process_counts_its_wait_for_a_core():
    """`Waiting(others=True)` reads every other thread of this process (the backend's own threads have no name
    par knows): a wait for an unnamed worker that computes 0.3 CPU-s beside burners counts the worker's
    run-queue wait, and the caller's own is left out."""
    import os
    import subprocess
    import sys

    from par import clock
    if not clock.available():
        pytest.skip("this kernel does not tell a thread's run-queue wait (/proc/thread-self/schedstat)")
    burners = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range((os.cpu_count() or 1) + 1)]
    go, computed, leave = _worker(name=None)
    try:
        time.sleep(0.3 + clock.TASKS_TTL_S)        # the worker is in this process's thread list when it is read
        start, waiting = clock.read(), clock.Waiting(others=True)
        go.set()
        computed.wait()
        waited = waiting.done()
        took = clock.since(start)
    finally:
        leave.set()
        go.set()
        for b in burners:
            b.kill()
    assert took.wall > 0.3 + 0.05 and waited > 0.05, f"the machine was not loaded: {took}, waited {waited}"
    assert clock.load_proof(took.wall, took.cpu, took.ready + waited) == pytest.approx(0.3, abs=0.3 * 0.3 + 0.05)


def test_a_forked_child_reads_its_own_threads_not_its_parents_open_files():
    """The schedstat files `par.clock` keeps open are the process's own: a forked child starts without them; a
    process no longer watched has its files closed."""
    import os

    from par import clock
    if not clock.available():
        pytest.skip("this kernel does not tell a thread's run-queue wait (/proc/thread-self/schedstat)")
    clock.others_ready()
    assert clock._FDS and os.getpid() in clock._TASKS
    pid = os.fork()
    if pid == 0:
        os._exit(0 if not clock._FDS and not clock._TASKS else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert clock.process_ready(2 ** 22 + 12345) == 0.0        # no such process: nothing read, nothing kept open
    import subprocess
    import sys
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(10)"])
    try:
        clock.watch([peer.pid])
        clock.Waiting().done()
        assert peer.pid in clock._TASKS
        clock.watch([])                                        # no longer watched: its files are closed
        assert peer.pid not in clock._TASKS and not any(f"/proc/{peer.pid}/" in p for p in clock._FDS)
    finally:
        clock.watch([])
        peer.kill()
