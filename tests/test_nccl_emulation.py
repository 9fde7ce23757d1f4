"""The NCCL-semantics test mode (`PAR_NCCL_EMULATION=1`, `par.runtime.nccl_emulation`), and the helper other tests use.

Under NCCL, `dist.batch_isend_irecv` returns ONE Work for the whole batch and a received buffer is valid
only after it is waited. The emulation makes gloo behave so; tests/workers/nccl_emulation_check.py runs
on 3 ranks in both modes (the `p2p_env` fixture of conftest.py, which other equivalence tests use too):
one Work per batch, poisoned buffers before wait and the right data after, the ring collectives agree
with torch, and the pattern that broke the pipeline on NCCL reads garbage, visibly, only under emulation.

Unbatched `isend` / `send` must find their receive posted, and nobody sends to itself outside a group: lecture
00's old ring (every rank isends, then irecvs) fails under the emulation and its grouped `send_recv` passes;
no p2p call in par is unbatched.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from par.comm import collectives
from par.runtime import launch, nccl_emulation
from tiers import slow

WORKER = str(Path(__file__).parent / "workers" / "nccl_emulation_check.py")
PAR = Path(__file__).resolve().parent.parent / "par"
EMULATED = {nccl_emulation.ENV: "1", nccl_emulation.SEND_TIMEOUT_ENV: "3"}   # a hang shows in 3 s


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
    names = ("batch_isend_irecv", "isend", "irecv")
    original = [getattr(dist, n) for n in names]
    try:
        nccl_emulation.install()
        nccl_emulation.install()
        for n in names:
            assert getattr(dist, n) is getattr(nccl_emulation, n) is getattr(dist.distributed_c10d, n)
        assert dist.P2POp.__new__(dist.P2POp, dist.isend, torch.zeros(1)), "P2POp accepts the emulated isend"
    finally:
        nccl_emulation.uninstall()
    assert [getattr(dist, n) for n in names] == original


@slow
def test_the_emulation_fails_lecture_00s_old_unbatched_ring_and_passes_its_grouped_one():
    with pytest.raises(launch.LaunchError, match="UnmatchedSend: rank [0-2]: an unbatched send to rank"):
        launch.run(WORKER, nproc=3, env=EMULATED, args=["--ring", "isend"], timeout=120, quiet=True)
    show = launch.run("par.comm.job", nproc=3, env=EMULATED, args=["--parts", "show"], timeout=120,
                      quiet=True)["show"]["send_recv"]
    assert show["after"] == [show["before"][(r - 1) % 3] for r in range(3)]


@slow
def test_unbatched_sends_that_gloo_runs_or_hangs_on_fail_under_the_emulation():
    ok = launch.run(WORKER, nproc=3, args=["--ring", "isend"], timeout=120, quiet=True)
    assert ok["correct"] == [True] * 3, "gloo runs the old ring: only the emulation shows the NCCL hang"
    with pytest.raises(launch.LaunchError, match="UnmatchedSend"):      # blocking: gloo itself would hang
        launch.run(WORKER, nproc=3, env=EMULATED, args=["--ring", "send"], timeout=120, quiet=True)
    with pytest.raises(launch.LaunchError, match=r"SelfSend: .*itself outside a group.*ncclInvalidUsage"):
        launch.run(WORKER, nproc=1, env=EMULATED, args=["--ring", "self"], timeout=120, quiet=True)
    assert launch.run(WORKER, nproc=1, env=EMULATED, args=["--ring", "grouped"], timeout=120,
                      quiet=True)["correct"] == [True]
    one = launch.run("par.comm.job", nproc=1, env=EMULATED, args=["--parts", "show"], timeout=120, quiet=True)
    assert one["show"]["send_recv"]["after"] == one["show"]["send_recv"]["before"]


def unbatched_p2p_calls(path: Path) -> list[str]:
    """`<x>.isend(...)`, `.irecv(...)`, `.send(...)`, `.recv(...)` called in a file (a P2POp's `dist.isend` is no call)."""
    tree = ast.parse(path.read_text())
    return [f"{path.relative_to(PAR.parent)}:{n.lineno}" for n in ast.walk(tree) if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute) and n.func.attr in ("isend", "irecv", "send", "recv")]


def talks_to_ranks(path: Path) -> bool:
    """A file that can reach a process group: it uses torch.distributed, par's collectives or par's dist (the
    grader's `session.send` to a Jupyter kernel is no point-to-point call)."""
    text = path.read_text()
    return any(k in text for k in ("torch.distributed", "import distributed", "par.comm", "par.runtime.dist",
                                   "from par.runtime import dist"))


def test_every_point_to_point_path_in_par_is_grouped():
    files = [p for p in sorted(PAR.rglob("*.py")) if p.name != "nccl_emulation.py" and talks_to_ranks(p)]
    assert PAR / "comm" / "collectives.py" in files and PAR / "pp" / "pipeline.py" in files
    found = [c for p in files for c in unbatched_p2p_calls(p)]
    assert found == [], "post sends and receives together: par.comm.collectives.send_recv"
    assert not hasattr(collectives, "send") and not hasattr(collectives, "recv")


def test_a_send_to_oneself_is_a_copy():
    t, got = torch.arange(3.0), torch.zeros(3)
    assert collectives.send_recv(sends=[(t, 0)], recvs=[(got, 0)]) == [] and torch.equal(got, t)
    with pytest.raises(ValueError, match="sends itself 1 tensors but receives 0"):
        collectives.send_recv(sends=[(t, 0)])


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
