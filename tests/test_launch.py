"""The launcher: results come back, output streams, failures surface with their traceback, hangs are killed.

Every case launches tests/workers/launch_modes.py with torchrun through `par.launch.run`.
"""
from __future__ import annotations

import io
import os
import re
import time
import uuid
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

from par import launch

WORKER = str(Path(__file__).parent / "workers" / "launch_modes.py")


class TimedOutput(io.StringIO):
    """stdout that remembers when each piece of text arrived."""

    def __init__(self):
        super().__init__()
        self.arrivals: list[tuple[float, str]] = []

    def write(self, text):
        self.arrivals.append((time.monotonic(), text))
        return super().write(text)

    def first(self, needle: str) -> float:
        return next(t for t, text in self.arrivals if needle in text)


def alive(pid: int) -> bool:
    """True if `pid` is a running process (a zombie waiting to be reaped counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def test_returns_rank0_json_and_streams_output():
    out = TimedOutput()
    with redirect_stdout(out):
        result = launch.run(WORKER, nproc=3, args=["ok"], timeout=120)
    done = time.monotonic()
    ranks = result["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2] and {r["world_size"] for r in ranks} == {3}
    assert len({r["pid"] for r in ranks}) == 3 and {r["backend"] for r in ranks} == {"gloo"}
    for r in ranks:
        e = r["env"]
        assert (e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"]) == (str(r["rank"]), str(r["local_rank"]), "3")
        assert e["MASTER_ADDR"] == "127.0.0.1" and e["MASTER_PORT"].isdigit()
    assert len({r["env"]["MASTER_PORT"] for r in ranks}) == 1
    # streamed: the first line reached us while the job was still running (it sleeps 1.5 s before the second)
    assert out.first("first line") < out.first("second line") - 1.0
    assert out.first("second line") <= done


def test_quiet_prints_nothing():
    out = io.StringIO()
    with redirect_stdout(out):
        with pytest.raises(launch.LaunchError, match="exit code"):
            launch.run(WORKER, nproc=2, args=["exit"], timeout=60, quiet=True)
    assert out.getvalue() == ""


def test_failing_rank_raises_with_its_traceback_quickly():
    start = time.monotonic()
    with pytest.raises(launch.LaunchError) as info:
        launch.run(WORKER, nproc=3, args=["raise"], timeout=120, quiet=True)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "deliberate failure on rank one (marker 4417)" in message
    assert "ValueError" in message and "Traceback" in message and "rank 1" in message
    assert elapsed < 60, f"failure took {elapsed:.0f}s to surface; the timeout was 120s"


def with_token(token: str) -> list[int]:
    """Live processes whose command line contains `token` (torchrun and its ranks carry it as an argument)."""
    found = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if token.encode() in f.read() and alive(int(d)):
                    found.append(int(d))
        except OSError:
            pass
    return found


def test_hanging_job_is_killed_at_the_timeout_with_nothing_left_behind():
    token = f"hang-token-{uuid.uuid4().hex}"
    start = time.monotonic()
    with pytest.raises(launch.LaunchError, match="timed out after 25s") as info:
        launch.run(WORKER, nproc=2, args=["hang", token], timeout=25, quiet=True)
    elapsed = time.monotonic() - start
    assert 25 <= elapsed < 45
    pids = [int(p) for p in re.findall(r"pid=(\d+)", str(info.value))]
    assert len(pids) == 2, f"both ranks should have started within 25s:\n{info.value}"
    deadline = time.monotonic() + 5
    while (any(map(alive, pids)) or with_token(token)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(alive, pids)), f"ranks {pids} outlived the launcher"
    if os.path.isdir("/proc"):
        assert with_token(token) == [], "torchrun or a rank outlived the launcher"


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine can run NCCL on 2 ranks")
def test_nccl_without_gpus_is_one_clear_error():
    with pytest.raises(launch.LaunchError) as info:
        launch.run(WORKER, nproc=2, args=["ok"], backend="nccl", timeout=120, quiet=True)
    message = str(info.value)
    assert "BackendError" in message and "backend='gloo'" in message and "world size 2" in message


def test_torchrun_command_binds_localhost():
    cmd = launch.torchrun_command("par.jobs.collectives", 4, ["--parts", "show"], port=12345)
    assert "--nproc-per-node=4" in cmd and "--master-addr=127.0.0.1" in cmd and "--master-port=12345" in cmd
    assert cmd[-4:] == ["-m", "par.jobs.collectives", "--parts", "show"]
    assert launch.torchrun_command("x/y.py", 2)[-1] == "x/y.py"
