"""NCCL's point-to-point semantics on gloo (`par.runtime.nccl_emulation`), checked on real ranks in both modes.

Launched by tests/test_nccl_emulation.py with and without PAR_NCCL_EMULATION=1. Every rank sends to its
right neighbour and receives from its left one, and reports (rank 0 saves them all):

works          how many Work objects dist.batch_isend_irecv returned for a batch of 2 operations
poisoned       what the receive buffers held before the Work was waited: float NaN / int -1 under emulation
correct        the buffers after wait() equal what the left neighbour sent
ring           par's ring all-reduce / reduce-scatter / all-gather equal torch's (they wait every Work)
old_pattern_ok the pre-issue-18 pipeline pattern (wait only `reqs[len(sends):]`, then read) read the right data

With `--ring PATTERN` it runs one exchange around the ring instead and saves {"world_size", "correct"}:
`isend` (lecture 00's old code: every rank isends right, then irecvs from the left, unbatched), `send` (the
same with blocking dist.send / dist.recv), `grouped` (par.comm.collectives.send_recv: one group) or `self`
(an unbatched isend to this very rank). Under the emulation the unbatched ones fail, as NCCL may hang.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import par.runtime.dist
from par.comm import collectives as C
from par.runtime import nccl_emulation


def exchange(env, dtype):
    """One batch: send my tensor right, receive from the left; return (reqs, received, expected)."""
    n, r = env.world_size, env.rank
    mine = torch.arange(5, dtype=dtype) + 10 * r
    got = torch.zeros(5, dtype=dtype)
    ops = [dist.P2POp(dist.isend, mine, (r + 1) % n), dist.P2POp(dist.irecv, got, (r - 1) % n)]
    return dist.batch_isend_irecv(ops), got, torch.arange(5, dtype=dtype) + 10 * ((r - 1) % n)


def exchange_around_the_ring(env, pattern: str) -> bool:
    """One exchange around the ring by `pattern` (module docstring); True when the left neighbour's data arrived."""
    n, r = env.world_size, env.rank
    mine, got = torch.arange(5.0) + 10 * r, torch.zeros(5)
    right, left = (r + 1) % n, (r - 1) % n
    if pattern == "isend":
        for req in [dist.isend(mine, right), dist.irecv(got, left)]:
            req.wait()
    elif pattern == "send":
        dist.send(mine, right)
        dist.recv(got, left)
    elif pattern == "grouped":
        for work in C.send_recv(sends=[(mine, right)], recvs=[(got, left)]):
            work.wait()
    else:
        dist.isend(mine, r).wait()
    return torch.equal(got, torch.arange(5.0) + 10 * left)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ring", choices=["isend", "send", "grouped", "self"])
    pattern = parser.parse_args().ring
    env = par.runtime.dist.init()
    if pattern:
        correct = par.runtime.dist.gather_object(exchange_around_the_ring(env, pattern))
        par.runtime.dist.save_result({"world_size": env.world_size, "correct": correct})
        par.runtime.dist.teardown()
        return
    out = {"emulated": dist.batch_isend_irecv is nccl_emulation.batch_isend_irecv}
    poisoned, correct, works = [], [], []
    for dtype in (torch.float32, torch.int64):
        reqs, got, expected = exchange(env, dtype)
        works.append(len(reqs))
        before = got.clone()
        poisoned.append(bool(torch.isnan(before).all()) if dtype.is_floating_point else bool((before == -1).all()))
        for req in reqs:
            req.wait()
        correct.append(torch.equal(got, expected))
    out.update(works=works, poisoned=poisoned, correct=correct)
    # the pattern issue 18 found in the pipeline: sends first in the batch, then wait "the receives" by index
    dist.barrier()
    reqs, got, expected = exchange(env, torch.float32)
    for req in reqs[1:]:        # reqs[len(outbox):]
        req.wait()
    out["old_pattern_ok"] = torch.equal(got, expected)
    for req in reqs[:1]:        # the "sends", waited later
        req.wait()
    # par's ring collectives wait every Work: they agree with torch under both semantics
    ring = []
    for numel in (1, 7, 1001):
        x = torch.randn(numel, generator=torch.Generator().manual_seed(env.rank + numel), dtype=torch.float64)
        ring.append(torch.allclose(C.all_reduce(x.clone()), C.all_reduce(x.clone(), impl="torch"), atol=1e-12))
        ring.append(torch.allclose(C.reduce_scatter(x.clone()), C.reduce_scatter(x.clone(), impl="torch"),
                                   atol=1e-12))
        ring.append(torch.equal(C.all_gather(x.clone()), C.all_gather(x.clone(), impl="torch")))
    out["ring"] = ring
    par.runtime.dist.save_result({"world_size": env.world_size, "ranks": par.runtime.dist.gather_object(out)})
    par.runtime.dist.teardown()


if __name__ == "__main__":
    main()
