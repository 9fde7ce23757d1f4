"""A job owns its whole tree and every wait has a limit (issue 54): what a rank forks or daemonises ends with the
job, under par's agent and under torchrun; a launch whose zygote is stopped still ends within its timeout."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

import par.runtime.launch


def _alive(pid: int) -> bool:
    from par.runtime import procs
    return procs.state(pid) not in (None, "Z")


@pytest.mark.parametrize("max_restarts", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_what_a_rank_forks_or_daemonises_ends_with_the_job(tmp_path, max_restarts):
    """Each rank starts a child it never waits for and double-forks a daemon (parent 1 once its parent exits):
    within 5 s of the job's end none is left, under par's agent (forked ranks) and under torchrun."""
    import uuid
    mark = f"par-leftover-{uuid.uuid4().hex[:8]}"
    worker = str(Path(__file__).parent / "workers" / "leaves_children.py")
    par.runtime.launch.run(worker, nproc=2, args=[str(tmp_path), mark], timeout=120,
                           quiet=True, max_restarts=max_restarts)
    pids = [int(p) for r in range(2) for p in (tmp_path / f"pids-{r}").read_text().split()]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    left = [p for p in pids if _alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"processes a rank left outlived the job: {left}"


def test_a_launch_whose_zygote_is_stopped_ends_within_its_timeout(monkeypatch):
    """The zygote (which forks the agent and reports its exit) is SIGSTOPped right after it forked the job's agent:
    the launch still returns (the agent's exit read from /proc), well within its timeout plus 10 s, and a stopped
    zygote serves no later launch."""
    from par.runtime import zygote
    if not zygote.enabled():
        pytest.skip("no zygote off Linux or with PAR_ZYGOTE=0")
    args = ["--steps", "2", "--batch", "8", "--dp", "bucketed"]
    par.runtime.launch.run("par.dp.job", nproc=2, args=args, timeout=120, quiet=True)       # the first: no zygote
    stopped, start_agent = [], zygote.Zygote.start

    def start_then_stop(self, *a, **k):
        agent = start_agent(self, *a, **k)
        os.kill(self.proc.pid, signal.SIGSTOP)
        stopped.append(self.proc.pid)
        return agent
    monkeypatch.setattr(zygote.Zygote, "start", start_then_stop)
    begin = time.monotonic()
    try:
        result = par.runtime.launch.run("par.dp.job", nproc=2, args=args, timeout=60, quiet=True)
        took = time.monotonic() - begin
        assert stopped and result is not None and took < 70, (stopped, took)
        assert not any(z.alive for z in zygote._ZYGOTES if z.proc is not None and z.proc.pid in stopped)
    finally:
        for pid in stopped:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
