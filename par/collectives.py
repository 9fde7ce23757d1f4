"""Collectives written by hand from point-to-point sends and receives.

A tensor of S bytes is cut into N chunks (N = ranks in the ring; sizes differ
by at most one element, so any S works). The ranks stand in a ring and each
one only ever talks to its two neighbours:

* ring reduce-scatter: N-1 steps; at step k rank r sends chunk (r-k-1) mod N to
  rank r+1 and adds the chunk (r-k-2) mod N it receives from rank r-1. After the
  last step rank r holds chunk r summed over all ranks. Sent: (N-1)/N * S.
* ring all-gather: N-1 steps; rank r first sends its own chunk r, then passes
  on whatever it just received. Sent: (N-1)/N * S.
* ring all-reduce = reduce-scatter + all-gather. Sent: 2(N-1)/N * S bytes per
  rank, in 2(N-1) latency steps.

Every call is written to the communication log (`par.commlog`) with the bytes
this rank actually sent. The `all_reduce` / `reduce_scatter` / `all_gather` /
`broadcast` / `send` / `recv` front doors choose the ring (`impl="ring"`) or
torch.distributed (`impl="torch"`) and log either way.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from par import commlog

OPS = ("sum", "avg", "max")


# ---------------------------------------------------------------- chunk arithmetic
def chunk_bounds(numel: int, n: int) -> list[tuple[int, int]]:
    """[start, end) of each of n chunks; the first numel % n chunks get one extra element."""
    base, extra = divmod(numel, n)
    bounds, start = [], 0
    for i in range(n):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def ring_reduce_scatter_bytes(numel: int, n: int, rank: int, itemsize: int = 4) -> int:
    """Bytes rank `rank` sends in a ring reduce-scatter: every chunk except its own."""
    if n == 1:
        return 0
    a, b = chunk_bounds(numel, n)[rank]
    return (numel - (b - a)) * itemsize


def ring_all_gather_bytes(numel: int, n: int, rank: int, itemsize: int = 4) -> int:
    """Bytes rank `rank` sends in a ring all-gather: every chunk except the one after its own."""
    if n == 1:
        return 0
    a, b = chunk_bounds(numel, n)[(rank + 1) % n]
    return (numel - (b - a)) * itemsize


def ring_all_reduce_bytes(numel: int, n: int, rank: int, itemsize: int = 4) -> int:
    """Exact bytes per rank of ring all-reduce; equals 2(N-1)/N * S when N divides numel."""
    return ring_reduce_scatter_bytes(numel, n, rank, itemsize) + ring_all_gather_bytes(numel, n, rank, itemsize)


def all_reduce_formula_bytes(size_bytes: float, n: int) -> float:
    """The lecture's formula: ring all-reduce sends 2(N-1)/N * S bytes per rank."""
    return 2 * (n - 1) / n * size_bytes


# ---------------------------------------------------------------- the ring
def _ring(group):
    """(my index in the ring, ring size, global rank of every member)."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    return ranks.index(dist.get_rank()), len(ranks), ranks


def _exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, group) -> None:
    """Send to one neighbour while receiving from the other; wait for both."""
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, dst, group),
                                   dist.P2POp(dist.irecv, recv, src, group)])
    for req in reqs:
        req.wait()


def _reduce_(acc: torch.Tensor, incoming: torch.Tensor, op: str) -> None:
    if op == "max":
        torch.maximum(acc, incoming, out=acc)
    else:
        acc.add_(incoming)


def _ring_reduce_scatter(flat: torch.Tensor, group, op: str) -> int:
    """The N-1 reduce steps on a flat tensor, in place; returns the bytes this rank sent."""
    me, n, ranks = _ring(group)
    bounds = chunk_bounds(flat.numel(), n)
    right, left = ranks[(me + 1) % n], ranks[(me - 1) % n]
    buf = torch.empty(max(e - s for s, e in bounds), dtype=flat.dtype, device=flat.device)
    sent = 0
    for k in range(n - 1):
        s0, s1 = bounds[(me - k - 1) % n]
        r0, r1 = bounds[(me - k - 2) % n]
        incoming = buf[: r1 - r0]
        _exchange(flat[s0:s1], right, incoming, left, group)
        _reduce_(flat[r0:r1], incoming, op)
        sent += (s1 - s0) * flat.element_size()
    if op == "avg":
        a, b = bounds[me]
        flat[a:b].div_(n)
    return sent


def _ring_all_gather(flat: torch.Tensor, group) -> int:
    """The N-1 pass-it-on steps on a flat tensor, in place; returns the bytes this rank sent."""
    me, n, ranks = _ring(group)
    bounds = chunk_bounds(flat.numel(), n)
    right, left = ranks[(me + 1) % n], ranks[(me - 1) % n]
    sent = 0
    for k in range(n - 1):
        s0, s1 = bounds[(me - k) % n]
        r0, r1 = bounds[(me - k - 1) % n]
        _exchange(flat[s0:s1], right, flat[r0:r1], left, group)
        sent += (s1 - s0) * flat.element_size()
    return sent


def _flat(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}: use one of {OPS}")
    if not tensor.is_contiguous():
        raise ValueError("ring collectives work in place on a contiguous tensor: call .contiguous() first")
    return tensor.view(-1)


def ring_reduce_scatter(tensor: torch.Tensor, group=None, op: str = "sum") -> torch.Tensor:
    """Reduce `tensor` across the ring, in place; return the view of this rank's (fully reduced) chunk.

    Only that chunk is meaningful afterwards; the others hold partial sums.
    """
    flat = _flat(tensor, op)
    me, n, _ = _ring(group)
    sent = _ring_reduce_scatter(flat, group, op) if n > 1 else 0
    commlog.record("reduce_scatter", flat.numel(), sent, n)
    a, b = chunk_bounds(flat.numel(), n)[me]
    return flat[a:b]


def ring_all_gather(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Fill every chunk of `tensor` in place, given that chunk `rank` is already correct on each rank."""
    flat = _flat(tensor)
    n = _ring(group)[1]
    sent = _ring_all_gather(flat, group) if n > 1 else 0
    commlog.record("all_gather", flat.numel(), sent, n)
    return tensor


def ring_all_reduce(tensor: torch.Tensor, group=None, op: str = "sum") -> torch.Tensor:
    """All-reduce = reduce-scatter + all-gather, in place on a contiguous tensor."""
    flat = _flat(tensor, op)
    n = _ring(group)[1]
    sent = _ring_reduce_scatter(flat, group, op) + _ring_all_gather(flat, group) if n > 1 else 0
    commlog.record("all_reduce", flat.numel(), sent, n)
    return tensor


# ---------------------------------------------------------------- front doors (logged either way)
_TORCH_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.SUM}


def _size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _rank(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def all_reduce(tensor: torch.Tensor, op: str = "sum", group=None, impl: str = "ring") -> torch.Tensor:
    """All-reduce in place with par's ring (`impl="ring"`) or torch.distributed (`impl="torch"`)."""
    n = _size(group)
    if n == 1:
        return tensor
    if impl == "ring":
        return ring_all_reduce(tensor, group, op)
    if impl != "torch":
        raise ValueError(f"unknown impl {impl!r}: use 'ring' or 'torch'")
    dist.all_reduce(tensor, _TORCH_OPS[op], group=group)
    if op == "avg":
        tensor.div_(n)
    commlog.record("all_reduce", tensor.numel(),
                   ring_all_reduce_bytes(tensor.numel(), n, _rank(group), tensor.element_size()), n, "torch")
    return tensor


def reduce_scatter(tensor: torch.Tensor, op: str = "sum", group=None, impl: str = "ring") -> torch.Tensor:
    """Reduce the flat `tensor` across ranks; return this rank's chunk (see `chunk_bounds`)."""
    n = _size(group)
    if n == 1:
        return tensor.view(-1)
    if impl == "ring":
        return ring_reduce_scatter(tensor, group, op)
    # gloo has no reduce-scatter: all-reduce and keep our chunk; log the reduce-scatter volume
    dist.all_reduce(tensor, _TORCH_OPS[op], group=group)
    a, b = chunk_bounds(tensor.numel(), n)[_rank(group)]
    mine = tensor.view(-1)[a:b]
    if op == "avg":
        mine.div_(n)
    commlog.record("reduce_scatter", tensor.numel(),
                   ring_reduce_scatter_bytes(tensor.numel(), n, _rank(group), tensor.element_size()), n, "torch")
    return mine


def all_gather(tensor: torch.Tensor, group=None, impl: str = "ring") -> torch.Tensor:
    """Given each rank's chunk in place inside the flat `tensor`, fill in everybody else's."""
    n = _size(group)
    if n == 1:
        return tensor
    if impl == "ring":
        return ring_all_gather(tensor, group)
    flat = tensor.view(-1)
    parts = [flat[a:b] for a, b in chunk_bounds(flat.numel(), n)]
    gathered = [p.clone() for p in parts]
    if len({p.numel() for p in parts}) == 1:
        dist.all_gather(gathered, parts[_rank(group)].clone(), group=group)
    else:
        _all_gather_uneven(gathered, parts[_rank(group)], group)
    for p, g in zip(parts, gathered):
        p.copy_(g)
    commlog.record("all_gather", flat.numel(),
                   ring_all_gather_bytes(flat.numel(), n, _rank(group), flat.element_size()), n, "torch")
    return tensor


def _all_gather_uneven(out: list[torch.Tensor], mine: torch.Tensor, group) -> None:
    """torch's all_gather wants equal sizes: pad every chunk to the largest, then trim."""
    width = max(o.numel() for o in out)
    padded = [torch.zeros(width, dtype=mine.dtype, device=mine.device) for _ in out]
    src = torch.zeros(width, dtype=mine.dtype, device=mine.device)
    src[: mine.numel()] = mine
    dist.all_gather(padded, src, group=group)
    for o, p in zip(out, padded):
        o.copy_(p[: o.numel()])


def broadcast(tensor: torch.Tensor, src: int = 0, group=None) -> torch.Tensor:
    """torch.distributed.broadcast from global rank `src`, logged (the root sends S, others 0, in a flat model)."""
    n = _size(group)
    if n == 1:
        return tensor
    dist.broadcast(tensor, src, group=group)
    nbytes = tensor.numel() * tensor.element_size() if dist.get_rank() == src else 0
    commlog.record("broadcast", tensor.numel(), nbytes, n, "torch")
    return tensor


def send(tensor: torch.Tensor, dst: int, group=None):
    """Non-blocking point-to-point send to global rank `dst`; returns the request (wait on it)."""
    req = dist.isend(tensor.contiguous(), dst, group=group)
    commlog.record("send", tensor.numel(), tensor.numel() * tensor.element_size(), 2, "torch")
    return req


def recv(tensor: torch.Tensor, src: int, group=None):
    """Non-blocking receive from global rank `src` into `tensor`; returns the request (wait on it)."""
    req = dist.irecv(tensor, src, group=group)
    commlog.record("recv", tensor.numel(), 0, 2, "torch")
    return req
