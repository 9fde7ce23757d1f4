"""The batch-size identity of data-parallel training (DeepSpeed's `train_batch_size` rule).

One optimizer step consumes the global batch. Each of the N data-parallel ranks runs
`grad_accum` micro-batches of `micro_batch` samples before the gradients are averaged:

    train_batch_size = micro_batch × grad_accum × world_size

DeepSpeed calls these `train_batch_size`, `train_micro_batch_size_per_gpu` and
`gradient_accumulation_steps`; give any two and it derives the third. A triple that does
not satisfy the identity is a configuration error, reported here with the numbers.
"""
from __future__ import annotations

from dataclasses import dataclass


class BatchSizeError(ValueError):
    """The batch sizes of a data-parallel run do not fit together."""


@dataclass(frozen=True)
class BatchSizes:
    train_batch_size: int
    micro_batch: int
    grad_accum: int
    world_size: int

    @property
    def per_rank(self) -> int:
        """Samples one rank processes per optimizer step: micro_batch × grad_accum."""
        return self.micro_batch * self.grad_accum


def _positive(name: str, value) -> int:
    if value is None or int(value) != value or value < 1:
        raise BatchSizeError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def check_batch_identity(train_batch_size: int, micro_batch: int, grad_accum: int, world_size: int) -> BatchSizes:
    """Raise `BatchSizeError` unless train_batch_size == micro_batch × grad_accum × world_size."""
    train_batch_size, micro_batch, grad_accum, world_size = (
        _positive(n, v) for n, v in (("train_batch_size", train_batch_size), ("micro_batch", micro_batch),
                                     ("grad_accum", grad_accum), ("world_size", world_size)))
    product = micro_batch * grad_accum * world_size
    if train_batch_size != product:
        raise BatchSizeError(
            f"train_batch_size {train_batch_size} != micro_batch {micro_batch} × grad_accum {grad_accum} "
            f"× world_size {world_size} = {product}. Fix: set train_batch_size={product}, or choose "
            f"micro_batch × grad_accum = {train_batch_size / world_size:g} per rank "
            f"(train_batch_size / world_size).")
    return BatchSizes(train_batch_size, micro_batch, grad_accum, world_size)


def resolve_batch(world_size: int, train_batch_size: int | None = None, micro_batch: int | None = None,
                  grad_accum: int | None = None) -> BatchSizes:
    """Fill in the missing one of the three (grad_accum defaults to 1 when two are missing), then check.

    train_batch_size alone: micro_batch = train_batch_size / world_size, grad_accum = 1.
    """
    world_size = _positive("world_size", world_size)
    if train_batch_size is None and micro_batch is None:
        raise BatchSizeError("give train_batch_size or micro_batch (or both)")
    if train_batch_size is None:
        grad_accum = 1 if grad_accum is None else grad_accum
        train_batch_size = _positive("micro_batch", micro_batch) * _positive("grad_accum", grad_accum) * world_size
    elif micro_batch is None:
        grad_accum = 1 if grad_accum is None else _positive("grad_accum", grad_accum)
        per_step = world_size * grad_accum
        if train_batch_size % per_step:
            raise BatchSizeError(
                f"train_batch_size {train_batch_size} is not divisible by grad_accum {grad_accum} × world_size "
                f"{world_size} = {per_step}, so no whole micro_batch fits. Fix: use a multiple of {per_step}.")
        micro_batch = train_batch_size // per_step
    elif grad_accum is None:
        per_step = _positive("micro_batch", micro_batch) * world_size
        if train_batch_size % per_step:
            raise BatchSizeError(
                f"train_batch_size {train_batch_size} is not divisible by micro_batch {micro_batch} × world_size "
                f"{world_size} = {per_step}. Fix: use a multiple of {per_step}.")
        grad_accum = train_batch_size // per_step
    return check_batch_identity(train_batch_size, micro_batch, grad_accum, world_size)
