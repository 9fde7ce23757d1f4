"""The communication thread (`par.comm.thread`): on the CPU a plain thread that overlaps the caller, with no
torch.cuda call; on a GPU a CUDA stream of its own, ordered against the caller's stream by events (checked
with fake streams and events, so the bookkeeping is tested without a GPU; tests/test_gpu.py runs real ones)."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from par.comm import thread as comm_thread
from test_timeline import FakeCudaRecorder, GpuClock


def test_on_the_cpu_there_is_no_stream_and_the_job_overlaps_the_caller(monkeypatch):
    def no_cuda(*a, **k):
        raise AssertionError("torch.cuda called on the CPU")
    for name in ("Stream", "current_stream", "stream", "Event"):
        monkeypatch.setattr(torch.cuda, name, no_cuda)
    t = torch.ones(4)
    t0 = time.perf_counter()
    pending = comm_thread.run_async(lambda: time.sleep(0.3), tensors=[t])
    assert time.perf_counter() - t0 < 0.1 and pending.stream is None     # returned at once
    time.sleep(0.3)                                                      # the caller computes meanwhile
    assert pending.wait() is pending and time.perf_counter() - t0 < 0.55, "the job ran beside the caller"
    assert comm_thread.all_reduce_async(t, "avg", impl="torch").wait().stream is None


class FakeCommStream:
    """Notes, in order, each step of `CommStream` and the thread that took it."""

    def __init__(self):
        self.stream, self.log = "comm stream", []

    def note(self, what):
        self.log.append((what, threading.current_thread().name))

    def submit(self, tensors):
        self.note(f"submit {len(tensors)}")
        return "submitted event"

    def run(self, submitted):
        stream = self

        class Ctx:
            def __enter__(self):
                stream.note(f"comm stream waits for the {submitted}")

            def __exit__(self, *exc):
                stream.note("comm stream no longer current")
        return Ctx()

    def done(self):
        self.note("done event")
        return "done event"

    def wait(self, done):
        self.note(f"caller waits for the {done}")


def test_on_a_gpu_the_job_runs_on_its_own_stream_between_two_events(monkeypatch):
    fake = FakeCommStream()
    monkeypatch.setattr(comm_thread, "comm_stream", lambda tensors: fake)
    rec = FakeCudaRecorder(GpuClock())
    pending = comm_thread.run_async(lambda: fake.note("job"), recorder=rec, tensors=[torch.ones(2)])
    pending.wait()
    caller = threading.current_thread().name
    assert fake.log == [("submit 1", caller), ("comm stream waits for the submitted event", "par-comm"),
                        ("job", "par-comm"), ("done event", "par-comm"), ("comm stream no longer current", "par-comm"),
                        ("caller waits for the done event", caller)]
    assert pending.started.stream == pending.ended.stream == "comm stream", "the comm span is timed on the comm stream"


def test_comm_stream_orders_the_caller_and_the_comm_stream(monkeypatch):
    """`CommStream` itself against fake torch.cuda streams: FSDP2's event pattern, and record_stream."""
    log = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def record_event(self):
            log.append(f"{self.name} records")
            return f"event on {self.name}"

        def wait_event(self, event):
            log.append(f"{self.name} waits for {event}")

    class Buffer:
        is_cuda = True

        def record_stream(self, stream):
            log.append(f"buffer used on {stream.name}")

    caller = Stream("caller")
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: Stream("comm"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: caller)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: log.append(f"current: {s.name}") or _Nothing())
    cs = comm_thread.CommStream(torch.device("cuda", 0))
    submitted = cs.submit([Buffer(), torch.ones(1)])      # a CPU tensor has no stream to be recorded on
    with cs.run(submitted):
        log.append("job")
    cs.wait(cs.done())
    assert log == ["buffer used on comm", "caller records", "current: comm", "comm waits for event on caller", "job",
                   "comm records", "caller waits for event on comm"]


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_comm_stream_is_none_for_cpu_tensors():
    assert comm_thread.comm_stream([torch.ones(1)]) is None and comm_thread.comm_stream([]) is None
    with pytest.raises(ValueError, match="unknown impl"):
        comm_thread.all_reduce_async(torch.ones(1), impl="nccl")


@pytest.mark.gpu
def test_on_a_real_gpu_the_job_runs_on_the_comm_stream_in_order_and_overlaps_the_caller():
    from par.timeline import Recorder
    dev = torch.device("cuda", 0)
    rec = Recorder(rank=0, sync=False, device=dev)
    a, x, seen = torch.randn(4096, 4096, device=dev), torch.zeros(1, device=dev), []

    def job():
        seen.append(torch.cuda.current_stream(dev))
        for _ in range(20):
            a @ a
        x.add_(1)
    x.fill_(41)                          # queued on the caller's stream before the submit: the job sees it
    pending = comm_thread.run_async(job, recorder=rec, tensors=[x, a])
    with rec.span("compute"):
        for _ in range(20):
            a @ a
    pending.wait()
    assert x.item() == 42 and seen == [comm_thread.comm_stream([x]).stream]
    rec.add("comm", pending.started, pending.ended, lane="comm")
    compute, comm = rec.spans
    assert comm.start < compute.end and compute.start < comm.end, "the two streams ran side by side"
