"""Asynchronous communication: a thread of its own that runs collectives while the caller computes.

Overlapping communication with computation (bucketed data parallelism, ZeRO-3's prefetch) needs a
collective that starts now and is waited for later. torch's own collectives can do that
(`async_op=True`: the backend runs them on its threads); par's hand-written ring is Python, so it
runs on a communication thread, one per process:

    pending = run_async(lambda: collectives.all_reduce(buf), tensors=[buf])   # returns at once
    ...compute...
    pending.wait()                                                            # buf is reduced now

Rules: jobs run one at a time, in submission order; while any is in flight the calling thread
does not communicate itself (one talker per process); every rank submits the same collectives in
the same order.

On a GPU a thread is not enough: CUDA runs kernels in the order of their stream, and the thread's
current stream would be the default one, the stream autograd's backward uses, so every collective
would queue behind (or in front of) the compute it should overlap. So when the job's `tensors` are on
a GPU it runs on a CUDA stream of its own (`CommStream`, one per device), ordered against the caller's
stream by events, as FSDP2 does with its all-gather and reduce-scatter streams
(torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py) and ProcessGroupNCCL with its NCCL streams:

    submit  (caller)       an event on the caller's current stream; each tensor `record_stream(comm)`
    run     (comm thread)  the comm stream waits for that event; the job runs with it as current stream
                           (NCCL's own stream waits for it in turn, and the job's Work.wait() makes it
                           wait for NCCL)
    done    (comm thread)  an event on the comm stream after the job
    wait    (caller)       the caller's current stream waits for that event: kernels queued next see the result

`record_stream` keeps the caching allocator from handing a buffer's memory to another tensor while the
comm stream may still use it. On the CPU there is no stream and none of this happens (no torch.cuda call).

A `Pending` carries `submitted`, `start` and `end` times read from the clock it was given
(`time.perf_counter`, or a `par.timeline.Recorder`'s `now`): CPU seconds, for ordering. Given a
`recorder`, it also carries `started` and `ended`, the recorder's marks (`Recorder.mark()`): on a GPU
CUDA events on the comm stream around the job, so the timeline's comm spans are the collective's own
times on the device; the same CPU seconds as `start` and `end` on the CPU.
"""
from __future__ import annotations

import queue
import threading
import time
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist

from par.comm import collectives, commlog


class CommStream:
    """The communication stream of one GPU and the four steps that order it against the caller's stream
    (module docstring)."""

    def __init__(self, device: torch.device):
        self.device, self.stream = device, torch.cuda.Stream(device)

    def submit(self, tensors):
        """On the caller's thread: keep `tensors`' memory for the comm stream; an event after the caller's work."""
        for t in tensors:
            if t.is_cuda:
                t.record_stream(self.stream)
        return torch.cuda.current_stream(self.device).record_event()

    @contextmanager
    def run(self, submitted):
        """On the comm thread: the comm stream, current inside the block, starts after `submitted`."""
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(submitted)
            yield

    def done(self):
        """On the comm thread: an event after everything the job queued on the comm stream."""
        return self.stream.record_event()

    def wait(self, done) -> None:
        """On the caller's thread: its current stream waits for `done`."""
        torch.cuda.current_stream(self.device).wait_event(done)


_STREAMS: dict = {}


def comm_stream(tensors) -> CommStream | None:
    """The communication stream of the GPU the first CUDA tensor of `tensors` is on; None on the CPU."""
    device = next((t.device for t in tensors if t.device.type == "cuda"), None)
    if device is None:
        return None
    if device not in _STREAMS:
        _STREAMS[device] = CommStream(device)
    return _STREAMS[device]


class Pending:
    """A collective in flight. `wait()` blocks until it is done and re-raises its error."""

    def __init__(self, timeout: float = 300.0, clock=None, recorder=None, stream: CommStream | None = None,
                 tensors=()):
        self.clock = clock or (recorder.now if recorder is not None else time.perf_counter)
        self.recorder = recorder
        self.events = recorder is not None and recorder.clock == "cuda"   # marks are CUDA events, not seconds
        self.stream = stream                     # the comm stream on a GPU, None on the CPU
        self._submitted = stream.submit(tensors) if stream is not None else None
        self._finished = None                    # the comm stream's event after the job (on a GPU)
        self.submitted, self.start, self.end = self.clock(), None, None
        self.started = self.ended = None    # the recorder's marks of start and end (see the module docstring)
        self.timeout, self.error, self._done = timeout, None, threading.Event()
        self._finish = None  # work the caller's thread does in wait() (e.g. divide for "avg")

    def _mark(self, seconds):
        """The recorder's mark now: a CUDA event on the comm stream (else the current one) on a GPU, else `seconds`."""
        if not self.events:
            return seconds
        return self.recorder.mark(self.stream.stream if self.stream is not None else None)

    def _run(self, fn) -> None:
        with self.stream.run(self._submitted) if self.stream is not None else nullcontext():
            self.start = self.clock()
            self.started = self._mark(self.start)
            try:
                fn()
            except BaseException as e:  # handed to the waiting thread
                self.error = e
            self.end = self.clock()
            self.ended = self._mark(self.end)      # after the ring waited every Work: its stream has the collective
            if self.stream is not None:
                self._finished = self.stream.done()
        self._done.set()

    def wait(self):
        if not self._done.wait(self.timeout):
            raise TimeoutError(f"asynchronous collective not done after {self.timeout:.0f}s "
                               "(a rank stopped communicating, or ranks launched collectives in different orders)")
        if self._finished is not None:
            self.stream.wait(self._finished)
        if self.error is not None:
            raise self.error
        if self._finish is not None:
            self._finish, finish = None, self._finish
            finish()
        return self


NAME = "par-comm"     # the communication thread's name (`par.clock.Waiting` reads its run-queue wait)
_QUEUE = None


def _loop(q) -> None:
    while True:
        pending, fn = q.get()
        pending._run(fn)


def run_async(fn, clock=None, recorder=None, tensors=()) -> Pending:
    """Run `fn()` on this process's communication thread and return its `Pending` at once. `tensors`: the
    buffers `fn` uses (on a GPU they pick the comm stream and are recorded on it); `recorder`: the `started` /
    `ended` marks (module docstring)."""
    global _QUEUE
    if _QUEUE is None:
        _QUEUE = queue.Queue()
        threading.Thread(target=_loop, args=(_QUEUE,), name=NAME, daemon=True).start()
    tensors = list(tensors)
    pending = Pending(clock=clock, recorder=recorder, stream=comm_stream(tensors), tensors=tensors)
    _QUEUE.put((pending, fn))
    return pending


def all_reduce_async(tensor: torch.Tensor, op: str = "sum", group=None, impl: str = "ring", clock=None,
                     recorder=None) -> Pending:
    """Start an all-reduce in place and return at once; `.wait()` on the result before using `tensor`.

    impl="ring": par's ring runs on the communication thread. impl="torch": on the CPU
    `dist.all_reduce(async_op=True)`, its end noted when the backend completes it; on a GPU the communication
    thread issues it too, so that it runs from the comm stream and its marks time it there. Logged like
    `collectives.all_reduce`.
    """
    if impl not in ("ring", "torch"):
        raise ValueError(f"unknown impl {impl!r}: use 'ring' or 'torch'")
    n = collectives.group_size(group)
    if impl == "ring" or n == 1 or tensor.is_cuda:
        return run_async(lambda: collectives.all_reduce(tensor, op, group, impl), clock, recorder, tensors=[tensor])
    pending = Pending(clock=clock, recorder=recorder)
    pending.start = pending.submitted
    pending.started = pending._mark(pending.start)
    work = dist.all_reduce(tensor, collectives.TORCH_OPS[op], group=group, async_op=True)
    commlog.record("all_reduce", tensor.numel(), collectives.ring_all_reduce_bytes(
        tensor.numel(), n, collectives.group_rank(group), tensor.element_size()), n, "torch")

    def done(_fut):  # runs on the backend's thread when the work completes (an error shows in work.wait())
        pending.end = pending.clock()
        pending.ended = pending._mark(pending.end)
        pending._done.set()

    work.get_future().then(done)

    def finish():
        work.wait()
        if op == "avg":
            tensor.div_(n)
    pending._finish = finish
    return pending
