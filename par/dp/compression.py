"""Lossy gradient compression, with error feedback: send less than the whole gradient.

The lecture's update with a compressor C applied before (and after) the exchange:

    w_{t+1} = w_t − γ · C( Σ_i C(∇f_i(w_t)) )

Three compressors, each a pluggable replacement for "all-reduce the gradient and divide by N":

    TopK(ratio)     keep the k = ⌈ratio·D⌉ largest |g|; all-gather values (fp32) and indices (int32)
                    bytes sent per rank (ring): 2 · (N−1) · k · 4
    RandomK(ratio)  keep k coordinates drawn with a seed all ranks share, so the indices need not be
                    sent: all-reduce the k values        bytes: 2(N−1)/N · k · 4
    Int8()          scale = max|g|/127, q = round(g/scale) as int8; all-gather q and the scales
                    bytes: (N−1) · (D + 4)

Compare with the exact fp32 ring all-reduce, 2(N−1)/N · 4D. Sparse and int8 payloads cannot be
summed on the way round the ring, so TopK and Int8 all-gather them, and their cost grows with N:
TopK sends kN/D of the exact volume, Int8 about N/8 of it (4× less on 2 ranks, no gain at 8).
RandomK keeps the ring's all-reduce because every rank picked the same coordinates.

Error feedback (e starts at 0, one residual per gradient buffer, the size of the gradient):

    c = g + e;   send compress(c);   e ← c − decompress(compress(c))

What is not sent this step is added to the next step's gradient, so no coordinate is dropped for
ever. Every byte goes through `par.comm.collectives` and is counted in the communication log.
"""
from __future__ import annotations

import math
import zlib

import torch

from par.comm import collectives

NAMES = ("none", "topk", "randomk", "int8")


# ---------------------------------------------------------------- pure pieces
def num_kept(numel: int, ratio: float) -> int:
    """k = ⌈ratio · numel⌉, at least 1 and at most numel."""
    if not 0 < ratio <= 1:
        raise ValueError(f"compression ratio must be in (0, 1], got {ratio}")
    return min(numel, max(1, math.ceil(ratio * numel)))


def topk_select(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k entries of the flat `x` with the largest magnitude: (values, int32 indices)."""
    idx = x.abs().topk(k, sorted=False).indices
    return x[idx], idx.to(torch.int32)


def randomk_indices(numel: int, k: int, seed: int, device=None) -> torch.Tensor:
    """k distinct coordinates drawn from `seed` alone, so every rank draws the same ones.

    Drawn on `device` with a generator of that device (on a GPU: no CPU permutation and copy
    every step); ranks on the same kind of device draw the same indices.
    """
    device = torch.device(device if device is not None else "cpu")
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randperm(numel, generator=g, device=device)[:k].to(torch.int32)


def shared_seed(seed: int, key, step: int) -> int:
    """A seed that depends only on (seed, key, step), identical in every process (unlike hash(str))."""
    return (seed * 1_000_003 + zlib.crc32(str(key).encode())) * 1_000_003 + step


def scatter(values: torch.Tensor, indices: torch.Tensor, numel: int) -> torch.Tensor:
    """The dense vector that is `values` at `indices` and zero elsewhere."""
    out = torch.zeros(numel, dtype=values.dtype, device=values.device)
    out[indices.long()] = values
    return out


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric 8-bit quantization: scale = max|x|/127, q = round(x/scale) in [-127, 127]."""
    scale = x.abs().max().clamp(min=torch.finfo(x.dtype).tiny) / 127
    return torch.round(x / scale).clamp(-127, 127).to(torch.int8), scale.reshape(1)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.to(scale.dtype) * scale


def error_feedback_step(grad: torch.Tensor, residual: torch.Tensor, compress) -> tuple[torch.Tensor, torch.Tensor]:
    """One error-feedback step: c = grad + residual, sent = compress(c) (dense), residual' = c − sent.

    `compress` maps a dense vector to the dense vector the receiver will reconstruct.
    """
    corrected = grad + residual
    sent = compress(corrected)
    return sent, corrected - sent


def _all_gather_rows(mine: torch.Tensor, group, impl: str) -> torch.Tensor:
    """(N, k): row r is rank r's `mine` (equal k on every rank), through par's all-gather front door."""
    n = collectives.group_size(group)
    if n == 1:
        return mine.reshape(1, -1)
    rows = torch.zeros(n, mine.numel(), dtype=mine.dtype, device=mine.device)
    rows[collectives.group_rank(group)] = mine
    collectives.all_gather(rows, group, impl)
    return rows


# ---------------------------------------------------------------- compressors
class Compressor:
    """Approximate gradient averaging with error feedback. Subclasses say what is sent and how."""

    name = "base"

    def __init__(self):
        self.residuals: dict = {}   # key (a bucket) -> what was not sent yet
        self.calls: dict = {}       # key -> how many times it was averaged (drives RandomK's shared seed)

    def average(self, flat: torch.Tensor, key="all", group=None, impl: str = "ring") -> torch.Tensor:
        """Replace this rank's gradient `flat` (1-D) in place by the compressed average over ranks."""
        residual = self.residuals.get(key)
        if residual is None:
            residual = torch.zeros_like(flat)
        step = self.calls.get(key, 0)
        self.calls[key] = step + 1
        payload = self.encode(flat + residual, key, step)
        self.residuals[key] = flat + residual - self.decode(payload, flat.numel())
        flat.copy_(self.exchange(payload, flat.numel(), group, impl))
        return flat

    def encode(self, x: torch.Tensor, key, step: int):
        raise NotImplementedError

    def decode(self, payload, numel: int) -> torch.Tensor:
        raise NotImplementedError

    def exchange(self, payload, numel: int, group, impl: str) -> torch.Tensor:
        """Send every rank's payload; return the mean of all ranks' decoded vectors."""
        raise NotImplementedError

    def bytes_formula(self, numel: int, n: int, rank: int | None = None) -> float:
        """Bytes one rank sends to average one buffer of `numel` fp32 values over n ranks
        (exact for rank `rank` where it depends on the rank, the lecture's formula when rank is None)."""
        raise NotImplementedError


class TopK(Compressor):
    name = "topk"

    def __init__(self, ratio: float = 0.01):
        super().__init__()
        self.ratio = ratio

    def encode(self, x, key, step):
        return topk_select(x, num_kept(x.numel(), self.ratio))

    def decode(self, payload, numel):
        return scatter(*payload, numel)

    def exchange(self, payload, numel, group, impl):
        values = _all_gather_rows(payload[0], group, impl)
        indices = _all_gather_rows(payload[1], group, impl)
        out = torch.zeros(numel, dtype=values.dtype, device=values.device)
        for v, i in zip(values, indices):   # rank by rank: the same sum, in the same order, everywhere
            out.index_add_(0, i.long(), v)
        return out / values.size(0)

    def bytes_formula(self, numel, n, rank=None):
        return 2 * (n - 1) * num_kept(numel, self.ratio) * 4


class RandomK(Compressor):
    name = "randomk"

    def __init__(self, ratio: float = 0.01, seed: int = 0):
        super().__init__()
        self.ratio, self.seed = ratio, seed

    def encode(self, x, key, step):
        seed = shared_seed(self.seed, key, step)
        idx = randomk_indices(x.numel(), num_kept(x.numel(), self.ratio), seed, x.device)
        return x[idx.long()], idx

    def decode(self, payload, numel):
        return scatter(*payload, numel)

    def exchange(self, payload, numel, group, impl):
        values, idx = payload[0].clone(), payload[1]
        collectives.all_reduce(values, "avg", group, impl)
        return scatter(values, idx, numel)

    def bytes_formula(self, numel, n, rank=None):
        k = num_kept(numel, self.ratio)
        if rank is None:
            return 2 * (n - 1) / n * k * 4
        return collectives.ring_all_reduce_bytes(k, n, rank, 4)


class Int8(Compressor):
    name = "int8"

    def encode(self, x, key, step):
        return quantize_int8(x)

    def decode(self, payload, numel):
        return dequantize_int8(*payload)

    def exchange(self, payload, numel, group, impl):
        qs = _all_gather_rows(payload[0], group, impl)
        scales = _all_gather_rows(payload[1], group, impl)
        out = torch.zeros(numel, dtype=scales.dtype, device=scales.device)
        for q, s in zip(qs, scales):
            out += dequantize_int8(q, s)
        return out / qs.size(0)

    def bytes_formula(self, numel, n, rank=None):
        return (n - 1) * (numel * 1 + 4)


def make(name: str, ratio: float = 0.01, seed: int = 0) -> Compressor | None:
    """A compressor by name ("none" gives None: exact averaging)."""
    if name == "none":
        return None
    if name == "topk":
        return TopK(ratio)
    if name == "randomk":
        return RandomK(ratio, seed)
    if name == "int8":
        return Int8()
    raise ValueError(f"unknown compression {name!r}: use one of {', '.join(NAMES)}")
