"""NCCL's point-to-point semantics, emulated on gloo, so that CPU tests catch what only NCCL would show.

Under NCCL, `torch.distributed.batch_isend_irecv(ops)` coalesces the whole batch into one
group and returns ONE Work for it (torch's `distributed_c10d.py`: `return cm.works`), not one
per operation. Code that waits "the receives" by position (`reqs[len(sends):]`) then waits
nothing, and reads buffers that NCCL has not written yet. On gloo the same code returns one
Work per operation, and the bug stays invisible.

`install()` replaces `torch.distributed.batch_isend_irecv` in this process by a version that
behaves like NCCL's:

* it returns a list with one Work for the whole batch; its `wait()` completes every operation;
* a receive lands in a private buffer; the tensor the caller passed holds NaN (integers: -1)
  until that Work is waited, and only then gets the data.

Sends complete when their receive is posted (gloo already behaves so for the sizes we send),
which is NCCL's rule for a send that does not fit the peer's buffer. `par.runtime.dist.init()` calls
`install()` when the environment has `PAR_NCCL_EMULATION=1`; the tests run the equivalence
workers both ways.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

ENV = "PAR_NCCL_EMULATION"
_ORIGINAL = None


def enabled() -> bool:
    """True when this process asked for the emulation (`PAR_NCCL_EMULATION=1`)."""
    return os.environ.get(ENV, "") == "1"


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
    works = _ORIGINAL(ops)
    return [CoalescedWork(works, landed)]


def install() -> None:
    """Patch `torch.distributed.batch_isend_irecv` in this process (idempotent)."""
    global _ORIGINAL
    if _ORIGINAL is None:
        _ORIGINAL = c10d.batch_isend_irecv
        dist.batch_isend_irecv = batch_isend_irecv
        c10d.batch_isend_irecv = batch_isend_irecv


def uninstall() -> None:
    """Put torch's own `batch_isend_irecv` back."""
    global _ORIGINAL
    if _ORIGINAL is not None:
        dist.batch_isend_irecv = _ORIGINAL
        c10d.batch_isend_irecv = _ORIGINAL
        _ORIGINAL = None
