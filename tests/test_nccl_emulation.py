"""The NCCL-semantics test mode (`PAR_NCCL_EMULATION=1`, `par.runtime.nccl_emulation`), and the helper other tests use.

Under NCCL, `dist.batch_isend_irecv` returns ONE Work for the whole batch and a received buffer is valid
only after it is waited. The emulation makes gloo behave so; tests/workers/nccl_emulation_check.py runs
on 3 ranks in both modes (the `p2p_env` fixture of conftest.py, which other equivalence tests use too):
one Work per batch, poisoned buffers before wait and the right data after, the ring collectives agree
with torch, and the pattern that broke the pipeline on NCCL reads garbage, visibly, only under emulation.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from par.runtime import launch, nccl_emulation

WORKER = str(Path(__file__).parent / "workers" / "nccl_emulation_check.py")


def test_both_modes_are_offered(p2p_env):
    assert p2p_env in ({}, {nccl_emulation.ENV: "1"})


def test_p2p_semantics(p2p_env):
    result = launch.run(WORKER, nproc=3, env=p2p_env, timeout=300, quiet=True)
    emulated = bool(p2p_env)
    assert result["world_size"] == 3
    for r in result["ranks"]:
        assert r["emulated"] is emulated, "par.runtime.dist.init installs the emulation exactly when asked"
        assert r["works"] == ([1, 1] if emulated else [2, 2]), "NCCL: one Work for a whole batch"
        assert r["poisoned"] == [emulated, emulated], "before wait(), a receive buffer holds NaN / -1"
        assert r["correct"] == [True, True], "after wait(), it holds what the left neighbour sent"
        assert all(r["ring"]), "par's ring collectives wait every Work: same result as torch"
        # waiting reqs[len(sends):] waits nothing under NCCL: the old pipeline read a buffer not yet written
        assert r["old_pattern_ok"] is (not emulated)


def test_install_is_idempotent_and_reversible():
    original = dist.batch_isend_irecv
    try:
        nccl_emulation.install()
        nccl_emulation.install()
        assert dist.batch_isend_irecv is nccl_emulation.batch_isend_irecv
    finally:
        nccl_emulation.uninstall()
    assert dist.batch_isend_irecv is original


def test_coalesced_work_writes_the_caller_buffer_only_on_wait():
    class Done:
        def wait(self, timeout=None):
            return True

        def is_completed(self):
            return True
    mine, private = torch.full((3,), float("nan")), torch.arange(3.0)
    work = nccl_emulation.CoalescedWork([Done()], [(mine, private)])
    assert not work.is_completed() and torch.isnan(mine).all()
    assert work.wait() and torch.equal(mine, private) and work.is_completed()
