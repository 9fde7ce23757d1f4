"""Bucketed, overlapped data parallelism: what torch's DistributedDataParallel does.

Two system optimizations over naive DP (`par.dp.naive`), same mathematics:

* **Bucketing.** Collectives are efficient on large messages, so the gradients are copied into a few
  flat buffers ("buckets") of at most `bucket_bytes` each, and each bucket is all-reduced at once.
* **Overlap.** Backward produces gradients from the last layer to the first. Buckets are filled in
  that reverse order, and a bucket's all-reduce starts (asynchronously) the moment its last gradient
  arrives, while backward keeps computing the earlier layers. At the end of backward we only wait for
  what is still in flight, then copy the averaged gradients back into `.grad`.

Buckets are launched strictly in bucket order, so every rank issues the same all-reduces in the
same order even when its gradients become ready in a different order (a parameter unused on one
rank but not another). Bytes per step: Σ over buckets of the ring all-reduce of the bucket,
= 2(N−1)/N × gradient bytes, up to a few elements per bucket when N does not divide its size.
"""
from __future__ import annotations

import functools
import time
from contextlib import contextmanager

import torch
import torch.nn as nn

from par import clock
from par.comm import collectives, thread as comm_thread
from par.dp.naive import broadcast_parameters, trainable_parameters

DEFAULT_BUCKET_BYTES = 25 * 2 ** 20  # DDP's bucket_cap_mb=25


def assign_buckets(nbytes: list[int], cap: int) -> list[list[int]]:
    """Which parameters go in which bucket.

    `nbytes[i]` is the gradient size of parameter i (registration order). Walk the parameters from
    last to first (the order backward produces their gradients) and start a new bucket whenever the
    next one would take the current bucket past `cap` bytes. A parameter larger than `cap` gets a
    bucket of its own. Returns the parameter indices of each bucket, in the order they were added.
    """
    if cap <= 0:
        raise ValueError(f"bucket size must be positive, got {cap} bytes")
    buckets, current, size = [], [], 0
    for i in reversed(range(len(nbytes))):
        if current and size + nbytes[i] > cap:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes[i]
    if current:
        buckets.append(current)
    return buckets


def bucket_all_reduce_bytes(bucket_numels: list[int], n: int, rank: int, itemsize: int = 4) -> int:
    """Exact bytes one rank sends per step: the ring all-reduce of every bucket."""
    return sum(collectives.ring_all_reduce_bytes(k, n, rank, itemsize) for k in bucket_numels)


class Bucket:
    """A flat buffer holding the gradients of a few parameters, end to end."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self.offsets, start = [], 0
        for p in params:
            self.offsets.append((start, start + p.numel()))
            start += p.numel()
        self.flat = torch.zeros(start, dtype=params[0].dtype, device=params[0].device)
        self.ready: set[int] = set()   # slots whose gradient has been copied in this step
        self.pending = None            # the all-reduce in flight

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def view(self, slot: int) -> torch.Tensor:
        a, b = self.offsets[slot]
        return self.flat[a:b]

    def put(self, slot: int, grad: torch.Tensor | None) -> None:
        """Copy a gradient into its slot (zeros when there is none: an unused parameter)."""
        if grad is None:
            self.view(slot).zero_()
        else:
            self.view(slot).copy_(grad.reshape(-1))
        self.ready.add(slot)

    def complete(self) -> bool:
        return len(self.ready) == len(self.params)

    def write_back(self) -> None:
        """Averaged gradients from the buffer into each parameter's .grad."""
        for slot, p in enumerate(self.params):
            averaged = self.view(slot).view_as(p)
            if p.grad is None:
                p.grad = averaged.clone()
            else:
                p.grad.copy_(averaged)


class BucketedDP(nn.Module):
    """Data parallelism with gradient buckets whose all-reduces overlap the backward pass.

        dp = BucketedDP(model, bucket_bytes=2**20, impl="ring")
        loss_fn(dp(x), y).backward()   # buckets are all-reduced while backward runs; it returns averaged
        dp.sync_gradients()            # a no-op unless backward ended without our end-of-backward callback
        optimizer.step()

    `impl="ring"` runs par's ring on the communication thread (`par.comm.thread`); `impl="torch"` uses
    `dist.all_reduce(async_op=True)` (on a GPU issued from that thread too). On a GPU the thread runs them on a
    CUDA stream of its own, so they overlap backward on the device, not only on the host. `compression` (see
    `par.dp.compression`) replaces each bucket's exact average by a lossy one. `recorder` (a
    `par.timeline.Recorder`) gets spans "B" (backward compute), "sync" (waiting at its end) and "AR<i>"
    (bucket i's all-reduce, lane "comm"), every time read from the recorder's own marks (on the CPU with the
    thread's CPU and run-queue clocks, `par.clock`; on a GPU, CUDA events, AR<i>'s on the comm stream).
    `waited` adds up the run-queue seconds of what backward's end waited for (the communication thread, the other
    ranks: `par.clock.Waiting`; "sync" keeps them in its `ready`): what the load added to that wait.
    """

    def __init__(self, module: nn.Module, bucket_bytes: int = DEFAULT_BUCKET_BYTES, impl: str = "ring",
                 group=None, compression=None, recorder=None):
        super().__init__()
        self.module, self.impl, self.group = module, impl, group
        self.compression, self.recorder = compression, recorder
        self.params = trainable_parameters(module)
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) > 1:
            raise ValueError(f"BucketedDP needs one gradient dtype, got {sorted(map(str, dtypes))}")
        broadcast_parameters(module, 0, group)
        plan = assign_buckets([p.numel() * p.element_size() for p in self.params], bucket_bytes)
        self.buckets = [Bucket([self.params[i] for i in idx]) for idx in plan]
        self.slot_of = {i: (b, s) for b, idx in enumerate(plan) for s, i in enumerate(idx)}
        self._sync = True
        self._in_backward = False
        self.launched_in_backward = 0   # of the last synchronizing backward (see `_grad_ready`)
        self.waited = 0.0               # run-queue seconds of what the waits at backward's end waited for
        self._next = 0                  # the next bucket to launch: buckets go out strictly in order
        self._backward_start = None
        self._backward_start_mark = self._backward_done_mark = None   # the recorder's marks (`_mark`)
        self.backward_done_at = None    # when the last gradient of the step was ready (`_clock()`)
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, i))
                       for i, p in enumerate(self.params)]

    # ------------------------------------------------------------ the user-facing part
    def forward(self, *args, **kwargs):
        out = self.module(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._backward_starts)
        return out

    @contextmanager
    def no_sync(self):
        """Gradient accumulation: backward inside this block only adds into .grad, nothing is sent."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def sync_gradients(self) -> None:
        """Make sure the step's averaged gradients are in .grad (waits for anything still in flight)."""
        if self._in_backward:
            self._end_of_backward()

    @property
    def bucket_numels(self) -> list[int]:
        return [b.flat.numel() for b in self.buckets]

    # ------------------------------------------------------------ what runs inside backward
    def _clock(self) -> float:
        """The recorder's clock when there is one (its spans need its times), else perf_counter."""
        return self.recorder.now() if self.recorder is not None else time.perf_counter()

    def _mark(self, seconds):
        """The recorder's mark for a span (`Recorder.mark()`: a CUDA event on a GPU, where the CPU clock would
        time the launch, not the work; on the CPU the seconds with the thread's clocks), else `seconds`."""
        rec = self.recorder
        return rec.mark() if rec is not None else seconds

    def _backward_starts(self, grad):
        self._backward_start = self._clock()
        self._backward_start_mark = self._mark(self._backward_start)
        if self._sync:
            self._begin_step()

    def _begin_step(self) -> None:
        """First sign of a synchronizing backward: reset the buckets, ask autograd to call us at its end."""
        if self._in_backward:
            return
        self._in_backward = True
        self._next = 0
        self.launched_in_backward = 0   # buckets handed to the comm thread while autograd still ran
        for b in self.buckets:
            b.ready.clear()
            b.pending = None
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _grad_ready(self, index: int, param: torch.Tensor) -> None:
        """Hook run by autograd right after `param.grad` got its final value for this backward."""
        if not self._sync:
            return
        self._begin_step()
        b, slot = self.slot_of[index]
        self.buckets[b].put(slot, param.grad)
        launched = self._next
        self._launch_ready_buckets()
        self.launched_in_backward += self._next - launched

    def _launch_ready_buckets(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].complete():
            self._launch(self._next)
            self._next += 1

    def _launch(self, i: int) -> None:
        flat = self.buckets[i].flat
        rec = self.recorder
        if self.compression is None:
            self.buckets[i].pending = comm_thread.all_reduce_async(flat, "avg", self.group, self.impl, recorder=rec)
        else:
            compression, group, impl = self.compression, self.group, self.impl
            self.buckets[i].pending = comm_thread.run_async(
                lambda: compression.average(flat, key=i, group=group, impl=impl), recorder=rec, tensors=[flat])

    def _end_of_backward(self) -> None:
        """Every gradient is computed: send what is left (unused parameters as zeros), wait, write back."""
        if not self._in_backward:
            return
        self.backward_done_at = self._clock()
        self._backward_done_mark = self._mark(self.backward_done_at)
        for b in self.buckets:
            for slot, p in enumerate(b.params):
                if slot not in b.ready:  # no gradient this backward: whatever accumulated, else zeros
                    b.put(slot, p.grad)
        self._launch_ready_buckets()
        waiting = clock.Waiting(comm_thread.NAME)      # for the comm thread, and through it the other ranks
        for b in self.buckets:
            b.pending.wait()
            b.write_back()
        synced = self._mark(self._clock())        # before reading the waiting's end: no part of the wait
        waited = waiting.done()
        self.waited += waited
        self._in_backward = False
        self._record_spans(synced, waited)

    def _record_spans(self, synced, waited: float) -> None:
        rec = self.recorder
        if rec is None:
            return
        if self._backward_start_mark is not None:
            rec.add("B", self._backward_start_mark, self._backward_done_mark)
        rec.add("sync", self._backward_done_mark, synced, waited=waited)
        for i, b in enumerate(self.buckets):     # marks: CUDA events on a GPU (par.timeline.Recorder)
            p = b.pending
            if p.started is not None and p.ended is not None:
                rec.add(f"AR{i}", p.started, p.ended, lane="comm")
