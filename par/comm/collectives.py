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

Its time, with alpha the latency of one step and beta the seconds per byte of a link:

    T(N, S) = 2(N-1) * alpha + 2(N-1)/N * S * beta        (`ring_all_reduce_time`, `fit_alpha_beta`)

A reduce-scatter step's chunk travels in pieces of `PIECE` elements, so that adding
one received piece overlaps the transfer of the next; an all-gather step has
nothing to add and sends its chunk whole. The receive buffer is kept between
calls. `reduce_scatter_chunks` / `all_gather_chunks` are the schedule. Every
Work is waited before the data it received is read (under NCCL one Work stands
for a whole `batch_isend_irecv`).

Every call is written to the communication log (`par.comm.commlog`) with the bytes
this rank sent. The `all_reduce` / `reduce_scatter` / `all_gather` /
`broadcast` front doors choose the ring (`impl="ring"`) or torch.distributed
(`impl="torch"`) and log either way; `send_recv` is the one door to point-to-point
(every send and receive in one group, as NCCL needs them). `group_size` and
`group_rank` are the one home of "how many of us, and which one am I";
`ring_neighbours` of "whom do I send to, and receive from, in the ring".
The asynchronous communication thread lives in `par.comm.thread`.
"""
from __future__ import annotations

import math
import threading

import torch
import torch.distributed as dist

from par.comm import commlog

OPS = ("sum", "avg", "max")


# ---------------------------------------------------------------- the group: how many of us, which one am I
def group_size(group=None) -> int:
    """Ranks in `group` (the whole world when None); 1 when no process group is running."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def group_rank(group=None) -> int:
    """My index inside `group` (0 .. group_size - 1); 0 when no process group is running."""
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


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


def padded_chunk_bytes(numel: int, n: int, itemsize: int = 4) -> int:
    """Bytes a rank sends in torch's reduce-scatter or all-gather of `numel` elements over n ranks.

    torch wants equal chunks, so uneven ones are padded to ceil(numel / n) elements; a ring
    moves N-1 of them per rank.
    """
    return (n - 1) * math.ceil(numel / n) * itemsize if n > 1 else 0


# ---------------------------------------------------------------- time: latency and bandwidth
def ring_all_reduce_time(size_bytes: float, n: int, alpha: float, beta: float) -> float:
    """T = 2(N-1)·alpha + 2(N-1)/N·S·beta: 2(N-1) latency steps, 2(N-1)/N·S bytes on each rank's link.

    alpha: seconds one step costs whatever its size (a message's latency plus the software around
    it); beta: seconds per byte (1 / bandwidth).
    """
    return 2 * (n - 1) * alpha + all_reduce_formula_bytes(size_bytes, n) * beta


def ring_time_from_steps(n: int, reduce_step_s: float, gather_step_s: float) -> float:
    """The ring simulated from its steps: T(N, S) = (N-1)·t_rs(S/N) + (N-1)·t_ag(S/N).

    t_rs(b), t_ag(b): the measured seconds of one reduce-scatter step (send b bytes right, receive b from
    the left, add them) and one all-gather step (the same, stored instead of added), with each rank on a
    core of its own. What the sum leaves out: the skew between ranks, which grows with N."""
    return (n - 1) * (reduce_step_s + gather_step_s)


def fit_alpha_beta(samples) -> tuple[float, float]:
    """alpha and beta of `ring_all_reduce_time` fitted to measured (n, size_bytes, seconds) samples
    (`fit_steps_bytes` of each all-reduce's 2(N-1) steps and 2(N-1)/N·S bytes)."""
    rows = [(2 * (n - 1), all_reduce_formula_bytes(s, n), t) for n, s, t in samples if n > 1 and t > 0]
    if len(rows) < 2:
        raise ValueError(f"fitting alpha and beta needs at least 2 timed samples with N > 1, got {len(rows)}")
    return fit_steps_bytes(rows)


def fit_steps_bytes(samples) -> tuple[float, float]:
    """alpha and beta of T = steps·alpha + bytes·beta fitted to measured (steps, bytes, seconds) samples (any
    collective whose latency steps and bytes per rank are known: `par.train.cost.collective_terms`).

    Least squares on the relative error (every sample weighs alike, small or large), with both
    coefficients kept >= 0: a negative one is set to 0 and the other fitted alone.
    """
    rows = [(k / t, b / t) for k, b, t in samples if k > 0 and t > 0]
    if len(rows) < 2:
        raise ValueError(f"fitting alpha and beta needs at least 2 timed samples, got {len(rows)}")
    # minimise sum (x*alpha + y*beta - 1)^2 over the rows (x, y) = (latency steps, bytes) / T
    xx = sum(x * x for x, _ in rows)
    yy = sum(y * y for _, y in rows)
    xy = sum(x * y for x, y in rows)
    sx, sy = sum(x for x, _ in rows), sum(y for _, y in rows)
    det = xx * yy - xy * xy
    alpha, beta = ((sx * yy - sy * xy) / det, (sy * xx - sx * xy) / det) if det > 0 else (-1.0, -1.0)
    if alpha < 0 or beta < 0:   # the data cannot tell the two apart: keep the better one-term fit
        one_alpha, one_beta = (sx / xx, 0.0), (0.0, sy / yy if yy else 0.0)
        err = lambda a, b: sum((x * a + y * b - 1) ** 2 for x, y in rows)  # noqa: E731
        alpha, beta = min(one_alpha, one_beta, key=lambda ab: err(*ab))
    return alpha, beta


# ---------------------------------------------------------------- the ring
def ring_neighbours(group=None) -> tuple[int, int, int, int]:
    """(i, N, right, left): my index i in the ring of `group`, its size N, and the global ranks of my
    neighbours, right = member (i + 1) mod N (I send to it) and left = member (i - 1) mod N (I receive from it)."""
    n, me = group_size(group), group_rank(group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(n))
    return me, n, ranks[(me + 1) % n], ranks[(me - 1) % n]


def reduce_scatter_chunks(rank: int, n: int, step: int) -> tuple[int, int]:
    """(chunk sent to the right, chunk received from the left and added) at reduce-scatter step `step`."""
    return (rank - step - 1) % n, (rank - step - 2) % n


def all_gather_chunks(rank: int, n: int, step: int) -> tuple[int, int]:
    """(chunk sent to the right, chunk received from the left) at all-gather step `step`."""
    return (rank - step) % n, (rank - step - 1) % n


PIECE = 1 << 19  # elements (2 MiB of fp32): adding received piece i overlaps the transfer of piece i+1


def _pieces(numel: int, piece: int) -> list[tuple[int, int]]:
    return [(a, min(a + piece, numel)) for a in range(0, numel, piece)] or [(0, 0)]


def exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, group, piece: int):
    """Send `send` to one neighbour while receiving `recv` from the other, `piece` elements at a time.

    Every piece is posted at once, as its own `batch_isend_irecv` (one send, one receive: under
    NCCL one group, which every rank posts in the same order, so no send waits for a receive
    posted later). Yields the [start, end) of each received piece after its Work is waited, so
    the caller can reduce it while later pieces are still on the wire.
    """
    out, into = _pieces(send.numel(), piece), _pieces(recv.numel(), piece)
    batches = []
    for i in range(max(len(out), len(into))):
        ops = [dist.P2POp(dist.isend, send[a:b], dst, group) for a, b in out[i:i + 1]]
        ops += [dist.P2POp(dist.irecv, recv[a:b], src, group) for a, b in into[i:i + 1]]
        batches.append(dist.batch_isend_irecv(ops))
    for i, works in enumerate(batches):
        for work in works:
            work.wait()
        yield from into[i:i + 1]


_SCRATCH: dict = {}


def _scratch(numel: int, like: torch.Tensor) -> torch.Tensor:
    """A receive buffer kept between calls (per dtype, device and thread): allocating a fresh
    one of many MB each time costs more than the additions it holds (the OS zeroes every page)."""
    key = (like.dtype, like.device, threading.get_ident())
    if key not in _SCRATCH or _SCRATCH[key].numel() < numel:
        _SCRATCH[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return _SCRATCH[key][:numel]


def _reduce_(acc: torch.Tensor, incoming: torch.Tensor, op: str) -> None:
    if op == "max":
        torch.maximum(acc, incoming, out=acc)
    else:
        acc.add_(incoming)


def _ring_reduce_scatter(flat: torch.Tensor, ring, group, op: str, on_step=None) -> int:
    """The N-1 reduce steps on a flat tensor, in place; returns the bytes this rank sent."""
    me, n, right, left = ring
    bounds = chunk_bounds(flat.numel(), n)
    buf = _scratch(max(e - s for s, e in bounds), flat)
    sent = 0
    for k in range(n - 1):
        out, into = reduce_scatter_chunks(me, n, k)
        (s0, s1), (r0, r1) = bounds[out], bounds[into]
        for a, b in exchange(flat[s0:s1], right, buf[: r1 - r0], left, group, PIECE):
            _reduce_(flat[r0 + a:r0 + b], buf[a:b], op)
        sent += (s1 - s0) * flat.element_size()
        if on_step:
            on_step("reduce_scatter", k, out, into, flat)
    if op == "avg":
        a, b = bounds[me]
        flat[a:b].div_(n)
    return sent


def _ring_all_gather(flat: torch.Tensor, ring, group, on_step=None) -> int:
    """The N-1 pass-it-on steps on a flat tensor, in place; returns the bytes this rank sent."""
    me, n, right, left = ring
    bounds = chunk_bounds(flat.numel(), n)
    sent = 0
    for k in range(n - 1):
        out, into = all_gather_chunks(me, n, k)
        (s0, s1), (r0, r1) = bounds[out], bounds[into]
        whole = max(s1 - s0, r1 - r0, 1)   # nothing to add: the chunk goes in one piece, straight into place
        for _ in exchange(flat[s0:s1], right, flat[r0:r1], left, group, whole):
            pass
        sent += (s1 - s0) * flat.element_size()
        if on_step:
            on_step("all_gather", k, out, into, flat)
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
    ring = ring_neighbours(group)
    me, n = ring[:2]
    sent = _ring_reduce_scatter(flat, ring, group, op) if n > 1 else 0
    commlog.record("reduce_scatter", flat.numel(), sent, n)
    a, b = chunk_bounds(flat.numel(), n)[me]
    return flat[a:b]


def ring_all_gather(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Fill every chunk of `tensor` in place, given that chunk `rank` is already correct on each rank."""
    flat = _flat(tensor)
    ring = ring_neighbours(group)
    sent = _ring_all_gather(flat, ring, group) if ring[1] > 1 else 0
    commlog.record("all_gather", flat.numel(), sent, ring[1])
    return tensor


def ring_all_reduce(tensor: torch.Tensor, group=None, op: str = "sum", on_step=None) -> torch.Tensor:
    """All-reduce = reduce-scatter + all-gather, in place on a contiguous tensor.

    `on_step(phase, step, chunk_sent, chunk_received, flat)`, if given, is called
    after every step (lecture 00 draws the ring from it).
    """
    flat = _flat(tensor, op)
    ring = ring_neighbours(group)
    n = ring[1]
    sent = 0
    if n > 1:
        sent = _ring_reduce_scatter(flat, ring, group, op, on_step) + _ring_all_gather(flat, ring, group, on_step)
    commlog.record("all_reduce", flat.numel(), sent, n)
    return tensor


# ---------------------------------------------------------------- front doors (logged either way)
TORCH_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.SUM}
# torch 2.13 renamed reduce_scatter_tensor / all_gather_into_tensor to *_single
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _check_impl(impl: str) -> None:
    if impl not in ("ring", "torch"):
        raise ValueError(f"unknown impl {impl!r}: use 'ring' or 'torch'")


NATIVE_REDUCE_SCATTER = {"nccl"}


def native_reduce_scatter(group=None) -> bool:
    """Does this group's backend reduce-scatter natively (`NATIVE_REDUCE_SCATTER`)? NCCL does.
    gloo's `reduce_scatter_tensor` is slower than its own all-reduce (about 3x at 16M floats,
    measured on 2 ranks), so on gloo the torch path all-reduces and keeps its chunk, and logs the
    all-reduce's bytes, which is what travels. (The tests add "gloo" to run the native path on CPU.)"""
    return dist.get_backend(group) in NATIVE_REDUCE_SCATTER


def _padded(flat: torch.Tensor, n: int) -> torch.Tensor:
    """(n, w) zero-padded copy of `flat` with chunk i (of `chunk_bounds`) in row i: w = ceil(numel / n)."""
    w, extra = math.ceil(flat.numel() / n), flat.numel() % n
    rows = torch.zeros(n, w, dtype=flat.dtype, device=flat.device)
    rows[:extra].copy_(flat[:extra * w].view(extra, w))
    rows[extra:, :w - 1].copy_(flat[extra * w:].view(n - extra, w - 1))
    return rows


def _unpad_(flat: torch.Tensor, rows: torch.Tensor) -> None:
    """The inverse of `_padded`: rows back into the chunks of `flat`, in place."""
    n, w = rows.shape
    extra = flat.numel() % n
    flat[:extra * w].view(extra, w).copy_(rows[:extra])
    flat[extra * w:].view(n - extra, w - 1).copy_(rows[extra:, :w - 1])


def all_reduce(tensor: torch.Tensor, op: str = "sum", group=None, impl: str = "ring") -> torch.Tensor:
    """All-reduce in place with par's ring (`impl="ring"`) or torch.distributed (`impl="torch"`)."""
    _check_impl(impl)
    n = group_size(group)
    if n == 1:
        return tensor
    if impl == "ring":
        return ring_all_reduce(tensor, group, op)
    dist.all_reduce(tensor, TORCH_OPS[op], group=group)
    if op == "avg":
        tensor.div_(n)
    commlog.record("all_reduce", tensor.numel(),
                   ring_all_reduce_bytes(tensor.numel(), n, group_rank(group), tensor.element_size()), n, "torch")
    return tensor


def reduce_scatter(tensor: torch.Tensor, op: str = "sum", group=None, impl: str = "ring") -> torch.Tensor:
    """Reduce the flat `tensor` across ranks; return this rank's chunk (see `chunk_bounds`), a view into it.

    impl="torch": `reduce_scatter_tensor` where the backend has it natively (NCCL; uneven chunks are
    padded), else an all-reduce that keeps this rank's chunk (gloo). Either way the log holds the
    bytes that really travel.
    """
    _check_impl(impl)
    n = group_size(group)
    if n == 1:
        return tensor.view(-1)
    if impl == "ring":
        return ring_reduce_scatter(tensor, group, op)
    flat, me = _flat(tensor, op), group_rank(group)
    a, b = chunk_bounds(flat.numel(), n)[me]
    if native_reduce_scatter(group):
        even = flat.numel() % n == 0
        rows = flat.view(n, flat.numel() // n) if even else _padded(flat, n)
        mine = torch.empty(rows.size(1), dtype=flat.dtype, device=flat.device)
        _REDUCE_SCATTER(mine, rows.view(-1), TORCH_OPS[op], group=group)
        flat[a:b].copy_(mine[:b - a])
        sent = padded_chunk_bytes(flat.numel(), n, flat.element_size())
    else:
        dist.all_reduce(flat, TORCH_OPS[op], group=group)
        sent = ring_all_reduce_bytes(flat.numel(), n, me, flat.element_size())
    if op == "avg":
        flat[a:b].div_(n)
    commlog.record("reduce_scatter", flat.numel(), sent, n, "torch")
    return flat[a:b]


def all_gather(tensor: torch.Tensor, group=None, impl: str = "ring") -> torch.Tensor:
    """Given each rank's chunk in place inside the flat `tensor`, fill in everybody else's.

    impl="torch": `all_gather_into_tensor` straight into the tensor (only this rank's chunk is
    copied, as the input); uneven chunks go through a padded buffer.
    """
    _check_impl(impl)
    n = group_size(group)
    if n == 1:
        return tensor
    if impl == "ring":
        return ring_all_gather(tensor, group)
    flat, me = _flat(tensor), group_rank(group)
    a, b = chunk_bounds(flat.numel(), n)[me]
    if flat.numel() % n == 0:
        _ALL_GATHER(flat, flat[a:b].clone(), group=group)
    else:
        rows = torch.empty(n, math.ceil(flat.numel() / n), dtype=flat.dtype, device=flat.device)
        mine = torch.zeros(rows.size(1), dtype=flat.dtype, device=flat.device)
        mine[:b - a] = flat[a:b]
        _ALL_GATHER(rows.view(-1), mine, group=group)
        _unpad_(flat, rows)
    commlog.record("all_gather", flat.numel(), padded_chunk_bytes(flat.numel(), n, flat.element_size()), n, "torch")
    return tensor


def broadcast(tensor: torch.Tensor, src: int = 0, group=None) -> torch.Tensor:
    """torch.distributed.broadcast from global rank `src`, logged (the root sends S, others 0, in a flat model)."""
    n = group_size(group)
    if n == 1:
        return tensor
    dist.broadcast(tensor, src, group=group)
    nbytes = tensor.numel() * tensor.element_size() if dist.get_rank() == src else 0
    commlog.record("broadcast", tensor.numel(), nbytes, n, "torch")
    return tensor


# ---------------------------------------------------------------- point to point
def _copy_to_self(sends, recvs) -> tuple[list, list]:
    """Sends to this rank copied into its receives from itself, in order (NCCL does so inside a group; gloo
    cannot send to itself); returns the sends and receives that remain, which have other peers."""
    me = dist.get_rank() if dist.is_initialized() else 0
    mine, theirs = [t for t, dst in sends if dst == me], [t for t, src in recvs if src == me]
    if len(mine) != len(theirs):
        raise ValueError(f"rank {me} sends itself {len(mine)} tensors but receives {len(theirs)} from itself")
    with torch.no_grad():
        for t, into in zip(mine, theirs):
            into.copy_(t)
    return [(t, dst) for t, dst in sends if dst != me], [(t, src) for t, src in recvs if src != me]


def send_recv(sends=(), recvs=(), group=None) -> list:
    """Post point-to-point sends [(tensor, dst)] and receives [(tensor, src)] together; return their requests.

    Non-blocking; wait on every request. Under NCCL the operations start as one group
    (`batch_isend_irecv`), so two ranks that each send to the other before receiving cannot
    block each other (an unbatched send may wait until its receive is posted). Ranks are global; a send
    to this rank is a copy into its receive from itself, nothing sent. Logged as `send` / `recv` events.
    """
    sends, recvs = _copy_to_self(sends, recvs)
    for t, _ in sends:
        commlog.record("send", t.numel(), t.numel() * t.element_size(), 2, "torch")
    for t, _ in recvs:
        commlog.record("recv", t.numel(), 0, 2, "torch")
    ops = [dist.P2POp(dist.isend, t.contiguous(), dst, group) for t, dst in sends]
    ops += [dist.P2POp(dist.irecv, t, src, group) for t, src in recvs]
    return dist.batch_isend_irecv(ops) if ops else []
