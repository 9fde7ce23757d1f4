"""Coalesced ring collectives: the rings of many flat buffers, run as one ring.

ZeRO stages 0-2 reduce (and all-gather) every unit's flat buffer in one go at the end of a step.
Run one ring per unit and a step costs units × 2(N-1) sequential exchanges, each paying the
network's (or, oversubscribed, the scheduler's) latency α. Run them together and every ring step
sends, in one message, the chunk each unit's own ring would send at that step:

    per unit:   units · (N-1) · (α + chunk/β)       coalesced:   (N-1) · (α + Σ chunks/β)

Same chunks (`par.comm.collectives.chunk_bounds` of each buffer), same order of additions, so the result
is bit for bit what the per-unit rings give, and each buffer is logged to `par.comm.commlog` as its own
collective with the bytes its ring would send. `impl="torch"` (or a single rank, or buffers of
different dtypes or devices) falls back to one `par.comm.collectives` call per buffer.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from par.comm import collectives, commlog
from par.comm.collectives import all_gather_chunks, chunk_bounds, reduce_scatter_chunks, ring_neighbours


def exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, group) -> None:
    """Send to one neighbour while receiving from the other; every Work waited (NCCL: one per batch)."""
    ops = [dist.P2POp(dist.isend, send, dst, group), dist.P2POp(dist.irecv, recv, src, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _can_coalesce(flats, group, impl) -> bool:
    return (impl == "ring" and len(flats) > 1 and dist.is_initialized() and dist.get_world_size(group) > 1
            and len({(f.dtype, f.device) for f in flats}) == 1 and all(f.is_contiguous() for f in flats))


def _steps(flats, n, chunk_at):
    """For each ring step, the (chunk sent, chunk received) slices of every buffer."""
    bounds = [chunk_bounds(f.numel(), n) for f in flats]
    return [[(b[out], b[into]) for b in bounds] for out, into in map(chunk_at, range(n - 1))], bounds


def _buffers(flats, steps):
    """Send and receive buffers as large as the largest step's chunks (sent and received sizes differ
    when a buffer's length is not a multiple of N)."""
    width = max(max(sum(e - s for s, e in (pair[0] for pair in step)),
                    sum(e - s for s, e in (pair[1] for pair in step))) for step in steps)
    like = flats[0]
    return torch.empty(width, dtype=like.dtype, device=like.device), torch.empty(width, dtype=like.dtype, device=like.device)


def _ring_steps(flats, group, chunk_at, land) -> None:
    """The N-1 ring steps: send every buffer's chunk `chunk_at(k)[0]` to the right in one message, receive
    the left neighbour's, and `land(view of my buffer's chunk, received piece)` for each buffer."""
    me, n, right, left = ring_neighbours(group)
    steps, _ = _steps(flats, n, lambda k: chunk_at(me, n, k))
    send, recv = _buffers(flats, steps)
    for step in steps:
        a = 0
        for f, ((s0, s1), _) in zip(flats, step):
            send[a:a + s1 - s0].copy_(f.view(-1)[s0:s1])
            a += s1 - s0
        b = sum(r1 - r0 for _, (r0, r1) in step)
        exchange(send[:a], right, recv[:b], left, group)
        b = 0
        for f, (_, (r0, r1)) in zip(flats, step):
            land(f.view(-1)[r0:r1], recv[b:b + r1 - r0])
            b += r1 - r0


def _ring_reduce_scatter(flats, group, op: str) -> None:
    """Each buffer's ring reduce-scatter, all at once: add (or max) what arrives; "avg" divides my chunk by N."""
    def land(acc, incoming):
        torch.maximum(acc, incoming, out=acc) if op == "max" else acc.add_(incoming)
    _ring_steps(flats, group, reduce_scatter_chunks, land)
    if op == "avg":
        me, n = ring_neighbours(group)[:2]
        for f in flats:
            s, e = chunk_bounds(f.numel(), n)[me]
            f.view(-1)[s:e].div_(n)


def _ring_all_gather(flats, group) -> None:
    """Each buffer's ring all-gather, all at once: what arrives lands in place."""
    _ring_steps(flats, group, all_gather_chunks, lambda mine, incoming: mine.copy_(incoming))


def _log(kind: str, flats, group, sent_by) -> None:
    n = dist.get_world_size(group)
    me = ring_neighbours(group)[0]
    for f in flats:
        commlog.record(kind, f.numel(), sent_by(f.numel(), n, me, f.element_size()), n)


def reduce_scatter(flats: list[torch.Tensor], op: str = "sum", group=None, impl: str = "ring") -> list[torch.Tensor]:
    """`collectives.reduce_scatter` of every buffer, in place; returns this rank's chunk of each."""
    if not _can_coalesce(flats, group, impl):
        return [collectives.reduce_scatter(f, op=op, group=group, impl=impl) for f in flats]
    _ring_reduce_scatter(flats, group, op)
    _log("reduce_scatter", flats, group, collectives.ring_reduce_scatter_bytes)
    me, n = ring_neighbours(group)[:2]
    return [f.view(-1)[slice(*chunk_bounds(f.numel(), n)[me])] for f in flats]


def all_gather(flats: list[torch.Tensor], group=None, impl: str = "ring") -> None:
    """`collectives.all_gather` of every buffer, in place (each rank's chunk is already in place)."""
    if not _can_coalesce(flats, group, impl):
        for f in flats:
            collectives.all_gather(f, group=group, impl=impl)
        return
    _ring_all_gather(flats, group)
    _log("all_gather", flats, group, collectives.ring_all_gather_bytes)


def all_reduce(flats: list[torch.Tensor], op: str = "sum", group=None, impl: str = "ring") -> None:
    """`collectives.all_reduce` of every buffer, in place: the coalesced reduce-scatter, then all-gather."""
    if not _can_coalesce(flats, group, impl):
        for f in flats:
            collectives.all_reduce(f, op=op, group=group, impl=impl)
        return
    _ring_reduce_scatter(flats, group, op)
    _ring_all_gather(flats, group)
    _log("all_reduce", flats, group, collectives.ring_all_reduce_bytes)
