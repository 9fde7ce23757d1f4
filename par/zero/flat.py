"""Flat partitioning: the data layout under every ZeRO stage.

The Ψ parameters of a group are laid end to end in one flat buffer, padded with
zeros to a multiple of the data-parallel degree N:

    padded = ⌈Ψ / N⌉ · N,    partition size P = padded / N,    rank i owns flat[i·P : (i+1)·P]

Every partition has the same size, so a reduce-scatter or all-gather of the
flat buffer (`par.comm.collectives`, whose `chunk_bounds` cuts equal chunks when N
divides the length) lands exactly on the partitions. Partitions ignore
parameter boundaries: a parameter may straddle two (or more) ranks. The
parameters themselves become views into the buffer, so writing a partition
and all-gathering it updates the model with no copy.

    fp = FlatParams(list(layer.parameters()), n=4, rank=1)
    fp.flat                # the padded buffer; parameters are views of it
    fp.partition(fp.flat)  # rank 1's quarter of it
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def padded_numel(numel: int, n: int) -> int:
    """⌈numel / n⌉ · n: the smallest multiple of n that holds numel elements."""
    if n < 1:
        raise ValueError(f"the data-parallel degree must be >= 1, got {n}")
    return -(-numel // n) * n


def partition_bounds(numel: int, n: int) -> list[tuple[int, int]]:
    """[start, end) of each rank's partition of a flat buffer of `numel` elements padded for n ranks."""
    size = padded_numel(numel, n) // n
    return [(i * size, (i + 1) * size) for i in range(n)]


def param_offsets(numels: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each parameter inside the flat buffer (laid out in order, no gaps)."""
    out, start = [], 0
    for k in numels:
        out.append((start, start + k))
        start += k
    return out


@dataclass(frozen=True)
class Piece:
    """The part of parameter `index` that falls in a partition: param[p0:p1] (flattened) = flat[f0:f1]."""
    index: int
    p0: int
    p1: int
    f0: int
    f1: int


def pieces_in(numels: list[int], n: int, rank: int) -> list[Piece]:
    """Which parameters (and which slices of them) rank `rank` owns; a straddling parameter yields a slice."""
    a, b = partition_bounds(sum(numels), n)[rank]
    out = []
    for i, (s, e) in enumerate(param_offsets(numels)):
        lo, hi = max(s, a), min(e, b)
        if lo < hi:
            out.append(Piece(i, lo - s, hi - s, lo, hi))
    return out


class FlatParams:
    """A list of parameters laid out in one padded flat buffer; they become views into it.

    `n` is the data-parallel degree and `rank` this process's index in the data-parallel group.
    `dtype` (default: the parameters' own) is the buffer's type: fp16/bf16 under mixed precision.
    """

    def __init__(self, params, n: int, rank: int, dtype: torch.dtype | None = None, device=None):
        self.params = list(params)
        if not self.params:
            raise ValueError("FlatParams needs at least one parameter")
        if not 0 <= rank < n:
            raise ValueError(f"rank {rank} is outside the data-parallel group of size {n}")
        self.n, self.rank = n, rank
        self.shapes = [p.shape for p in self.params]
        self.numels = [p.numel() for p in self.params]
        self.offsets = param_offsets(self.numels)
        self.numel = sum(self.numels)
        self.padded = padded_numel(self.numel, n)
        self.part = self.padded // n
        self.dtype = dtype or self.params[0].dtype
        self.device = device or self.params[0].device
        self.flat = self.empty()
        self.flat.zero_()
        for view, p in zip(self.views(self.flat), self.params):
            view.copy_(p.detach())
        self.bind(self.flat)

    def cast_(self, dtype: torch.dtype) -> None:
        """Re-lay the buffer in another dtype (fp16/bf16 for mixed precision); parameters follow."""
        self.flat = self.flat.to(dtype)
        self.dtype = dtype
        self.bind(self.flat)

    def empty(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A new (uninitialised) buffer of the padded size."""
        return torch.empty(self.padded, dtype=dtype or self.dtype, device=self.device)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of `flat` shaped like each parameter."""
        return [flat[s:e].view(shape) for (s, e), shape in zip(self.offsets, self.shapes)]

    def bind(self, flat: torch.Tensor) -> None:
        """Make every parameter's data a view into `flat` (no copy)."""
        for view, p in zip(self.views(flat), self.params):
            p.data = view

    def bounds(self, rank: int | None = None) -> tuple[int, int]:
        """[start, end) of a rank's partition (default: this rank's)."""
        r = self.rank if rank is None else rank
        return r * self.part, (r + 1) * self.part

    def partition(self, flat: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """The view of `flat` that a rank owns (default: this rank)."""
        a, b = self.bounds(rank)
        return flat[a:b]

    def flatten_grads(self, out: torch.Tensor) -> torch.Tensor:
        """Copy each parameter's .grad into `out` (zeros where a grad is missing, and in the padding)."""
        out.zero_()
        for view, p in zip(self.views(out), self.params):
            if p.grad is not None:
                view.copy_(p.grad)
        return out

    def pieces(self, rank: int | None = None) -> list[Piece]:
        return pieces_in(self.numels, self.n, self.rank if rank is None else rank)
