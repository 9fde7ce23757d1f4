"""Naive data parallelism: replicate, shard the data, average the gradients after backward.

Mini-batch SGD on a global batch of B samples, split over N ranks of B/N samples each:

    w ← w − α · (1/B) Σ_{i=1..B} ∇f(w; ξ_i)
      = w − α · (1/N) Σ_{k=1..N} [ (N/B) Σ_{i in shard k} ∇f(w; ξ_i) ]   (the average of N local mean gradients)

So if every rank (1) starts from the same weights (broadcast from rank 0), (2) computes the
mean gradient of its own shard (DistributedSampler), and (3) averages the N gradients with an
all-reduce, then every rank takes exactly the step a single process would take on the whole
batch, and the replicas stay identical. Each rank computes C/N of the work and all-reduces D
parameters' gradients: 2(N−1)/N · 4D bytes sent per rank per step with a ring (fp32).

"Naive" because the all-reduces wait until backward has finished, and run one tensor at a time.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn

from par import clock
from par.comm import collectives, commlog
from par.dp.batch_size import BatchSizeError


def broadcast_parameters(module: nn.Module, src: int = 0, group=None) -> None:
    """Make every replica equal to rank `src`'s: broadcast each parameter and buffer."""
    for t in [*module.parameters(), *module.buffers()]:
        collectives.broadcast(t.data, src, group)


def trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Parameters that get gradients, each once (a tied weight appears once), in registration order."""
    return [p for p in module.parameters() if p.requires_grad]


def flatten_grads(params: list[torch.Tensor]) -> torch.Tensor:
    """One flat tensor holding every .grad (zeros for a parameter without one)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def unflatten_into_grads(flat: torch.Tensor, params: list[torch.Tensor]) -> None:
    """Copy consecutive slices of `flat` into each parameter's .grad (creating it if missing)."""
    start = 0
    for p in params:
        piece = flat[start:start + p.numel()].view_as(p)
        if p.grad is None:
            p.grad = piece.clone()
        else:
            p.grad.copy_(piece)
        start += p.numel()


def average_gradients(params: list[torch.Tensor], impl: str = "ring", group=None) -> None:
    """g ← (1/N) Σ_ranks g, one all-reduce per parameter tensor.

    A parameter with no gradient on this rank takes part with zeros, so every rank issues the same
    all-reduces in the same order and ends with the same averaged gradient.
    """
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        collectives.all_reduce(p.grad, "avg", group, impl)


def replica_rows(x: torch.Tensor, d: int, dp: int) -> torch.Tensor:
    """Replica d's share of a global batch: rows d, d+dp, ... (the DistributedSampler order)."""
    if x.size(0) % dp:
        raise BatchSizeError(f"a global batch of {x.size(0)} rows does not split over dp={dp} replicas: "
                              f"use a multiple of {dp}")
    return x[d::dp]


def mean_over(value: float, group, device, impl: str = "ring") -> float:
    """The mean of one number over a process group. Each data-parallel replica knows the mean loss of
    its own rows (equal shares of the batch), so their mean is the loss of the whole batch."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return value
    t = torch.tensor([value], dtype=torch.float32, device=device)
    with commlog.tag("loss"):
        collectives.all_reduce(t, op="avg", group=group, impl=impl)
    return t.item()


class NaiveDP(nn.Module):
    """Wrap a module for naive data parallelism.

        dp = NaiveDP(model, impl="ring")   # broadcasts rank 0's weights
        loss_fn(dp(x), y).backward()       # x: this rank's shard
        dp.sync_gradients()                # all-reduce (average) every gradient
        optimizer.step()

    `compression` (see `par.dp.compression`) replaces the exact average by a lossy one over a single
    flat gradient. `recorder` (a `par.timeline.Recorder`) gets a "B" span per backward and an
    "all-reduce" span (lane "comm") per sync, between its marks (`Recorder.mark()`: CUDA events on a GPU,
    where the CPU clock would time the kernels' launch, not their work). `waited` adds up the other ranks'
    run-queue seconds while the all-reduces ran (`par.clock.Waiting`; the span keeps them in its `ready`).
    """

    def __init__(self, module: nn.Module, impl: str = "ring", group=None, compression=None, recorder=None):
        super().__init__()
        self.module, self.impl, self.group = module, impl, group
        self.compression, self.recorder = compression, recorder
        self.params = trainable_parameters(module)
        self.waited = 0.0     # run-queue seconds of the other ranks during the all-reduces, so far
        broadcast_parameters(module, 0, group)

    def forward(self, *args, **kwargs):
        out = self.module(*args, **kwargs)
        if self.recorder is not None and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._backward_starts)
        return out

    def _backward_starts(self, grad):
        """Timeline only: note when backward begins and ask autograd to tell us when it ends."""
        start = self.recorder.mark()
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: self.recorder.add("B", start, self.recorder.mark()))

    @contextmanager
    def no_sync(self):
        """Gradient accumulation: nothing communicates during backward here anyway, so this is a no-op
        kept for the same interface as `BucketedDP`; call `sync_gradients()` once after the last micro-batch."""
        yield

    def sync_gradients(self) -> None:
        """Average the gradients across ranks (exactly, or through the compressor)."""
        waiting = clock.Waiting()      # for the other ranks; read outside the span
        start = self.recorder.mark() if self.recorder else None
        if self.compression is None:
            average_gradients(self.params, self.impl, self.group)
        else:
            flat = flatten_grads(self.params)
            self.compression.average(flat, key="all", group=self.group, impl=self.impl)
            unflatten_into_grads(flat, self.params)
        end = self.recorder.mark() if self.recorder else None
        self.waited += waiting.done()
        if self.recorder:
            self.recorder.add("all-reduce", start, end, lane="comm", waited=waiting.ready)
