"""NCCL's point-to-point semantics, emulated on gloo, so that CPU tests catch what only NCCL would show.

Batched (`torch.distributed.batch_isend_irecv(ops)`). Under NCCL the whole batch is one group and returns
ONE Work (torch's `distributed_c10d.py`: `return cm.works`), not one per operation. Code that waits "the
receives" by position (`reqs[len(sends):]`) then waits nothing, and reads buffers that NCCL has not written
yet. On gloo the same code returns one Work per operation, and the bug stays invisible. The emulation's
`batch_isend_irecv`:

* returns a list with one Work for the whole batch; its `wait()` completes every operation;
* lets a receive land in a private buffer; the tensor the caller passed holds NaN (integers: -1)
  until that Work is waited, and only then gets the data.

Unbatched (`isend`, `irecv`, and `send` / `recv`, which call them). Outside a group NCCL queues a send on
the stream it shares with the same peer's receives, and the send may not finish before the peer posts its
receive; so a ring in which every rank sends before it receives can hang. A send to oneself outside a
group NCCL refuses (ncclInvalidUsage); inside one it is a local copy. The emulation's

* `isend` returns only once the peer has posted the matching receive (gloo's send completes exactly then),
  and raises `UnmatchedSend` after `PAR_NCCL_EMULATION_SEND_TIMEOUT_S` seconds (default 60) without one:
  a program that passes cannot hang on this under NCCL (blocking the caller is stricter than blocking a
  stream, so it is conservative);
* `isend` to oneself and `irecv` from oneself raise `SelfSend`.

Inside `batch_isend_irecv` the operations keep gloo's own behaviour (one NCCL group: sends and receives
start together; a send to oneself there is a copy, which `par.comm.collectives.send_recv` makes itself, since
gloo cannot send to its own rank). `par.runtime.dist.init()` calls `install()` when
the environment has `PAR_NCCL_EMULATION=1`; the tests run the equivalence workers both ways.
"""
from __future__ import annotations

import os
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from par.runtime.checks import env_number

ENV = "PAR_NCCL_EMULATION"
SEND_TIMEOUT_ENV = "PAR_NCCL_EMULATION_SEND_TIMEOUT_S"
_ORIGINAL = None               # torch's own functions, by name, while the emulation is installed
_GROUP = threading.local()     # .open: this thread is inside batch_isend_irecv (one NCCL group)


class UnmatchedSend(RuntimeError):
    """An unbatched send whose receive was not posted in time: under NCCL, a hang."""


class SelfSend(ValueError):
    """An unbatched send to (or receive from) this very rank: ncclInvalidUsage under NCCL."""


def enabled() -> bool:
    """True when this process asked for the emulation (`PAR_NCCL_EMULATION=1`)."""
    return os.environ.get(ENV, "") == "1"


def send_timeout_s() -> float:
    """Seconds an unbatched send waits for its receive before `UnmatchedSend` (`PAR_NCCL_EMULATION_SEND_TIMEOUT_S`)."""
    return env_number(SEND_TIMEOUT_ENV, 60.0)


def _poison(t: torch.Tensor) -> None:
    """What a buffer holds before NCCL wrote it: NaN for floats, -1 for integers."""
    t.fill_(float("nan") if (t.is_floating_point() or t.is_complex()) else -1)


class CoalescedWork:
    """One Work for a whole batch of sends and receives, as NCCL returns it."""

    def __init__(self, works, landed):
        self._works = list(works)
        self._landed = landed          # [(caller's tensor, private buffer)] copied on wait()

    def wait(self, timeout=None) -> bool:
        for work in self._works:
            work.wait() if timeout is None else work.wait(timeout)
        with torch.no_grad():          # NCCL writes the memory, whatever autograd thinks of it
            for mine, private in self._landed:
                mine.copy_(private)
        self._landed = []
        return True

    def is_completed(self) -> bool:
        return not self._landed and all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        return self.is_completed()


class SentWork:
    """The Work of an unbatched send that has completed (gloo's own must not be waited twice)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True


def batch_isend_irecv(p2p_op_list):
    """`dist.batch_isend_irecv` with NCCL's semantics: one Work, received data valid only after it."""
    ops, landed = [], []
    for op in p2p_op_list:
        if op.op is dist.irecv or getattr(op.op, "__name__", "") == "irecv":
            private = torch.empty_like(op.tensor)
            _poison(op.tensor)
            landed.append((op.tensor, private))
            op = dist.P2POp(op.op, private, group=op.group, tag=op.tag, group_peer=op.group_peer)
        ops.append(op)
    _GROUP.open = True
    try:
        works = _ORIGINAL["batch_isend_irecv"](ops)
    finally:
        _GROUP.open = False
    return [CoalescedWork(works, landed)]


def _peer(group, rank, group_rank) -> int | None:
    """The global rank of the peer named by `rank` (global) or `group_rank` (in `group`); None: any source."""
    if rank is None and group_rank is None:
        return None
    g = c10d._group_or_default_group(group)
    return c10d.get_global_rank(g, c10d._canonicalize_group_rank(g, rank, group_rank))


def _refuse_self(what: str, peer: int | None) -> None:
    if peer == dist.get_rank():
        raise SelfSend(f"rank {peer}: {what} itself outside a group, which NCCL refuses (ncclInvalidUsage): post "
                       "it with its receive in one dist.batch_isend_irecv (par.comm.collectives.send_recv)")


def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
    """`dist.isend` with NCCL's rules outside a group: never to oneself, and done only once its receive is posted."""
    if getattr(_GROUP, "open", False):
        return _ORIGINAL["isend"](tensor, dst=dst, group=group, tag=tag, group_dst=group_dst)
    peer = _peer(group, dst, group_dst)
    _refuse_self("a send to", peer)
    work = _ORIGINAL["isend"](tensor, dst=dst, group=group, tag=tag, group_dst=group_dst)
    if work is None:               # this rank is not in the group
        return None
    try:
        work.wait(timedelta(seconds=send_timeout_s()))
    except RuntimeError as e:
        raise UnmatchedSend(
            f"rank {dist.get_rank()}: an unbatched send to rank {peer} found no posted receive in "
            f"{send_timeout_s():.0f}s. Under NCCL such a send may not finish before its receive is posted, so "
            "ranks that all send before they receive hang: post sends and receives together in one "
            "dist.batch_isend_irecv (par.comm.collectives.send_recv)") from e
    return SentWork()


def irecv(tensor, src=None, group=None, tag=0, group_src=None):
    """`dist.irecv` with NCCL's rule outside a group: never from oneself."""
    if not getattr(_GROUP, "open", False):
        _refuse_self("a receive from", _peer(group, src, group_src))
    return _ORIGINAL["irecv"](tensor, src=src, group=group, tag=tag, group_src=group_src)


_EMULATED = {"batch_isend_irecv": batch_isend_irecv, "isend": isend, "irecv": irecv}


def install() -> None:
    """Patch `batch_isend_irecv`, `isend` and `irecv` of `torch.distributed` in this process (idempotent);
    torch's `send` and `recv` call the patched `isend` and `irecv`."""
    global _ORIGINAL
    if _ORIGINAL is None:
        _ORIGINAL = {name: getattr(c10d, name) for name in _EMULATED}
        for module in (dist, c10d):
            for name, fn in _EMULATED.items():
                setattr(module, name, fn)


def uninstall() -> None:
    """Put torch's own functions back."""
    global _ORIGINAL
    if _ORIGINAL is not None:
        for module in (dist, c10d):
            for name, fn in _ORIGINAL.items():
                setattr(module, name, fn)
        _ORIGINAL = None
