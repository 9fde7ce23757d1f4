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

A step's chunk travels in pieces of `PIECE` elements, so that adding one
received piece overlaps the transfer of the next; the receive buffer is kept
between calls. `reduce_scatter_chunks` / `all_gather_chunks` are the schedule.

Every call is written to the communication log (`par.commlog`) with the bytes
this rank actually sent. The `all_reduce` / `reduce_scatter` / `all_gather` /
`broadcast` / `send` / `recv` front doors choose the ring (`impl="ring"`) or
torch.distributed (`impl="torch"`) and log either way.
"""
from __future__ import annotations

import threading

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


def reduce_scatter_chunks(rank: int, n: int, step: int) -> tuple[int, int]:
    """(chunk sent to the right, chunk received from the left and added) at reduce-scatter step `step`."""
    return (rank - step - 1) % n, (rank - step - 2) % n


def all_gather_chunks(rank: int, n: int, step: int) -> tuple[int, int]:
    """(chunk sent to the right, chunk received from the left) at all-gather step `step`."""
    return (rank - step) % n, (rank - step - 1) % n


PIECE = 1 << 20  # elements: a chunk travels in pieces, so adding piece i overlaps sending piece i+1


def _pieces(numel: int) -> list[tuple[int, int]]:
    return [(a, min(a + PIECE, numel)) for a in range(0, numel, PIECE)] or [(0, 0)]


def _exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, group):
    """Send `send` to one neighbour while receiving `recv` from the other, piece by piece.

    Yields the [start, end) of each received piece once it (and the matching
    send) is done, so the caller can reduce it while later pieces are on the wire.
    """
    out, into = _pieces(send.numel()), _pieces(recv.numel())
    batches = []
    for i in range(max(len(out), len(into))):
        ops = [dist.P2POp(dist.isend, send[a:b], dst, group) for a, b in out[i:i + 1]]
        ops += [dist.P2POp(dist.irecv, recv[a:b], src, group) for a, b in into[i:i + 1]]
        batches.append(dist.batch_isend_irecv(ops))
    for i, reqs in enumerate(batches):
        for req in reqs:
            req.wait()
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


def _ring_reduce_scatter(flat: torch.Tensor, group, op: str, on_step=None) -> int:
    """The N-1 reduce steps on a flat tensor, in place; returns the bytes this rank sent."""
    me, n, ranks = _ring(group)
    bounds = chunk_bounds(flat.numel(), n)
    right, left = ranks[(me + 1) % n], ranks[(me - 1) % n]
    buf = _scratch(max(e - s for s, e in bounds), flat)
    sent = 0
    for k in range(n - 1):
        out, into = reduce_scatter_chunks(me, n, k)
        (s0, s1), (r0, r1) = bounds[out], bounds[into]
        for a, b in _exchange(flat[s0:s1], right, buf[: r1 - r0], left, group):
            _reduce_(flat[r0 + a:r0 + b], buf[a:b], op)
        sent += (s1 - s0) * flat.element_size()
        if on_step:
            on_step("reduce_scatter", k, out, into, flat)
    if op == "avg":
        a, b = bounds[me]
        flat[a:b].div_(n)
    return sent


def _ring_all_gather(flat: torch.Tensor, group, on_step=None) -> int:
    """The N-1 pass-it-on steps on a flat tensor, in place; returns the bytes this rank sent."""
    me, n, ranks = _ring(group)
    bounds = chunk_bounds(flat.numel(), n)
    right, left = ranks[(me + 1) % n], ranks[(me - 1) % n]
    sent = 0
    for k in range(n - 1):
        out, into = all_gather_chunks(me, n, k)
        (s0, s1), (r0, r1) = bounds[out], bounds[into]
        for _ in _exchange(flat[s0:s1], right, flat[r0:r1], left, group):
            pass  # the pieces land in place
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


def ring_all_reduce(tensor: torch.Tensor, group=None, op: str = "sum", on_step=None) -> torch.Tensor:
    """All-reduce = reduce-scatter + all-gather, in place on a contiguous tensor.

    `on_step(phase, step, chunk_sent, chunk_received, flat)`, if given, is called
    after every step (lecture 00 draws the ring from it).
    """
    flat = _flat(tensor, op)
    n = _ring(group)[1]
    sent = _ring_reduce_scatter(flat, group, op, on_step) + _ring_all_gather(flat, group, on_step) if n > 1 else 0
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


# ---------------------------------------------------------------- asynchronous: a communication thread
import queue  # noqa: E402  (this section was appended; its imports stay with it)
import threading  # noqa: E402
import time  # noqa: E402


class Pending:
    """A collective in flight. `wait()` blocks until it is done and re-raises its error.

    `submitted`, `start`, `end` are `time.perf_counter()` readings (the clock of `par.timeline`).
    """

    def __init__(self, timeout: float = 300.0):
        self.submitted, self.start, self.end = time.perf_counter(), None, None
        self.timeout, self.error, self._done = timeout, None, threading.Event()
        self._finish = None  # work the caller's thread does in wait() (e.g. divide for "avg")

    def _run(self, fn) -> None:
        self.start = time.perf_counter()
        try:
            fn()
        except BaseException as e:  # handed to the waiting thread
            self.error = e
        self.end = time.perf_counter()
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


_COMM_QUEUE = None


def _comm_thread_loop(q) -> None:
    while True:
        pending, fn = q.get()
        pending._run(fn)


def run_async(fn) -> Pending:
    """Run `fn()` on this process's communication thread; jobs run one at a time, in submission order.

    While jobs are in flight the calling thread must not communicate itself (one talker per process),
    and every rank must submit the same collectives in the same order.
    """
    global _COMM_QUEUE
    if _COMM_QUEUE is None:
        _COMM_QUEUE = queue.Queue()
        threading.Thread(target=_comm_thread_loop, args=(_COMM_QUEUE,), name="par-comm", daemon=True).start()
    pending = Pending()
    _COMM_QUEUE.put((pending, fn))
    return pending


def all_reduce_async(tensor: torch.Tensor, op: str = "sum", group=None, impl: str = "ring") -> Pending:
    """Start an all-reduce in place and return at once; `.wait()` on the result before using `tensor`.

    impl="ring": par's ring runs on the communication thread. impl="torch": `dist.all_reduce(async_op=True)`.
    Logged like `all_reduce` (the ring when it runs, the torch one when it is started).
    """
    if impl == "ring" or _size(group) == 1:
        return run_async(lambda: all_reduce(tensor, op, group, "ring"))
    if impl != "torch":
        raise ValueError(f"unknown impl {impl!r}: use 'ring' or 'torch'")
    n = _size(group)
    pending = Pending()
    pending.start = pending.submitted
    work = dist.all_reduce(tensor, _TORCH_OPS[op], group=group, async_op=True)
    commlog.record("all_reduce", tensor.numel(),
                   ring_all_reduce_bytes(tensor.numel(), n, _rank(group), tensor.element_size()), n, "torch")

    def done(_fut):  # runs on the backend's thread when the work completes (an error shows in work.wait())
        pending.end = time.perf_counter()
        pending._done.set()

    work.get_future().then(done)

    def finish():
        work.wait()
        if op == "avg":
            tensor.div_(n)
    pending._finish = finish
    return pending


def send_recv(sends=(), recvs=(), group=None) -> list:
    """Post point-to-point sends [(tensor, dst)] and receives [(tensor, src)] together; return their requests.

    Non-blocking; wait on every request. Under NCCL the operations start as one group
    (`batch_isend_irecv`), so two ranks that each send to the other before receiving cannot
    block each other. Ranks are global. Logged as `send` / `recv` events.
    """
    ops = [dist.P2POp(dist.isend, t.contiguous(), dst, group) for t, dst in sends]
    ops += [dist.P2POp(dist.irecv, t, src, group) for t, src in recvs]
    for t, _ in sends:
        commlog.record("send", t.numel(), t.numel() * t.element_size(), 2, "torch")
    for t, _ in recvs:
        commlog.record("recv", t.numel(), 0, 2, "torch")
    return dist.batch_isend_irecv(ops) if ops else []
