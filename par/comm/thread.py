"""Asynchronous communication: a thread of its own that runs collectives while the caller computes.

Overlapping communication with computation (bucketed data parallelism, ZeRO-3's prefetch) needs a
collective that starts now and is waited for later. torch's own collectives can do that
(`async_op=True`: the backend runs them on its threads); par's hand-written ring is Python, so it
runs on a communication thread, one per process:

    pending = run_async(lambda: collectives.all_reduce(buf))   # returns at once
    ...compute...
    pending.wait()                                              # buf is reduced now

Rules: jobs run one at a time, in submission order; while any is in flight the calling thread
does not communicate itself (one talker per process); every rank submits the same collectives in
the same order. A `Pending` carries `submitted`, `start` and `end` times read from the clock it
was given (`time.perf_counter`, or a `par.timeline.Recorder`'s `now`): CPU seconds, for ordering.
Given a `recorder`, it also carries `started` and `ended`, the recorder's marks (`Recorder.mark()`:
CUDA events on a GPU, where the CPU clock would time the launch rather than the collective; the
same CPU seconds as `start` and `end` on the CPU), for the timeline's spans (`Recorder.add`).
"""
from __future__ import annotations

import queue
import threading
import time

import torch
import torch.distributed as dist

from par.comm import collectives, commlog


class Pending:
    """A collective in flight. `wait()` blocks until it is done and re-raises its error."""

    def __init__(self, timeout: float = 300.0, clock=None, recorder=None):
        self.clock = clock or (recorder.now if recorder is not None else time.perf_counter)
        self.recorder = recorder
        self.events = recorder is not None and recorder.clock == "cuda"   # marks are CUDA events, not seconds
        self.submitted, self.start, self.end = self.clock(), None, None
        self.started = self.ended = None    # the recorder's marks of start and end (see the module docstring)
        self.timeout, self.error, self._done = timeout, None, threading.Event()
        self._finish = None  # work the caller's thread does in wait() (e.g. divide for "avg")

    def _mark(self, seconds):
        """The recorder's mark now: a CUDA event on this thread's stream on a GPU, else `seconds` itself."""
        return self.recorder.mark() if self.events else seconds

    def _run(self, fn) -> None:
        self.start = self.clock()
        self.started = self._mark(self.start)
        try:
            fn()
        except BaseException as e:  # handed to the waiting thread
            self.error = e
        self.end = self.clock()
        self.ended = self._mark(self.end)      # after the ring waited every Work: its stream has the collective
        self._done.set()

    def wait(self):
        if not self._done.wait(self.timeout):
            raise TimeoutError(f"asynchronous collective not done after {self.timeout:.0f}s "
                               "(a rank stopped communicating, or ranks launched collectives in different orders)")
        if self.error is not None:
            raise self.error
        if self._finish is not None:
            self._finish, finish = None, self._finish
            finish()
        return self


_QUEUE = None


def _loop(q) -> None:
    while True:
        pending, fn = q.get()
        pending._run(fn)


def run_async(fn, clock=None, recorder=None) -> Pending:
    """Run `fn()` on this process's communication thread and return its `Pending` at once (`recorder`: its
    `started`/`ended` marks, see the module docstring)."""
    global _QUEUE
    if _QUEUE is None:
        _QUEUE = queue.Queue()
        threading.Thread(target=_loop, args=(_QUEUE,), name="par-comm", daemon=True).start()
    pending = Pending(clock=clock, recorder=recorder)
    _QUEUE.put((pending, fn))
    return pending


def all_reduce_async(tensor: torch.Tensor, op: str = "sum", group=None, impl: str = "ring", clock=None,
                     recorder=None) -> Pending:
    """Start an all-reduce in place and return at once; `.wait()` on the result before using `tensor`.

    impl="ring": par's ring runs on the communication thread. impl="torch": `dist.all_reduce(async_op=True)`,
    its end noted when the backend completes it. Logged like `collectives.all_reduce`.
    """
    n = collectives.group_size(group)
    if impl == "ring" or n == 1:
        return run_async(lambda: collectives.all_reduce(tensor, op, group, "ring"), clock, recorder)
    if impl != "torch":
        raise ValueError(f"unknown impl {impl!r}: use 'ring' or 'torch'")
    pending = Pending(clock=clock, recorder=recorder)
    pending.start = pending.submitted
    pending.started = pending._mark(pending.start)
    work = dist.all_reduce(tensor, collectives.TORCH_OPS[op], group=group, async_op=True)
    commlog.record("all_reduce", tensor.numel(), collectives.ring_all_reduce_bytes(
        tensor.numel(), n, collectives.group_rank(group), tensor.element_size()), n, "torch")

    def done(_fut):  # runs on the backend's thread when the work completes (an error shows in work.wait())
        pending.end = pending.clock()
        if not pending.events:
            pending.ended = pending.end
        pending._done.set()

    work.get_future().then(done)

    def finish():
        work.wait()
        if pending.events:     # on a GPU: after wait() the caller's stream holds the collective's end
            pending.ended = pending.recorder.mark()
        if op == "avg":
            tensor.div_(n)
    pending._finish = finish
    return pending
