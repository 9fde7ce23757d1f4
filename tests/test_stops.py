"""Stopped any way, a job leaves nothing; a hung rank is named within a minute; nothing is left in /tmp.

* `python -m par train` stopped by SIGTERM, SIGHUP or SIGKILL: no process of the job is alive 30 s later
  (processes are found by a token in their environment, which torchrun and the ranks inherit);
* a rank stopped with SIGSTOP, or sleeping for ever inside a step while the other waits in all_reduce, is
  named with the right reason (`par.runtime.hang`; a small PAR_HANG_S here, the default in one slow test);
* torchrun's log folder and the ranks' temp files live in the run's own folder, which is gone after the run.

The jobs are tests/workers/stall.py and `python -m par train` on the tiny preset.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from tiers import slow, tiered

from par.runtime import hang, launch, lifeline

ROOT = Path(__file__).resolve().parents[1]
WORKER = str(Path(__file__).parent / "workers" / "stall.py")
TOKEN = "PAR_STOPS_TOKEN"

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads processes from Linux's /proc")


def with_token(token: str) -> dict[int, dict]:
    """{pid: environment} of the live processes whose environment carries `token` (zombies are gone)."""
    found = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                env = dict(kv.split("=", 1) for kv in f.read().decode(errors="replace").split("\0") if "=" in kv)
            with open(f"/proc/{d}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if env.get(TOKEN) == token and state != "Z":
            found[int(d)] = env
    return found


def gone(pid: int) -> bool:
    """True once `pid` is no running process (a zombie waiting to be reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def wait_for(condition, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = condition()
        if got:
            return got
        time.sleep(0.2)
    pytest.fail(f"{what} within {seconds:.0f} s")


# ---------------------------------------------------------------- the launcher stopped any way
def train(token: str) -> subprocess.Popen:
    """`python -m par train` on 2 ranks of the tiny preset, for far longer than any test waits."""
    return subprocess.Popen([sys.executable, "-m", "par", "train", "--config", "configs/zero1.json", "--nproc", "2",
                             "--steps", "100000"], cwd=ROOT, env={**os.environ, TOKEN: token},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("sig", tiered([signal.SIGTERM, signal.SIGHUP, signal.SIGKILL], id=lambda s: s.name))
def test_a_stopped_launcher_leaves_no_process(sig):
    token = uuid.uuid4().hex
    parent = train(token)
    try:
        ranks = lambda: [p for p, e in with_token(token).items() if launch.rank_number(p, e) is not None]  # noqa: E731
        wait_for(lambda: len(ranks()) == 2, 120, "the job did not start its 2 ranks")
        time.sleep(1)                       # the ranks are past their imports, training
        parent.send_signal(sig)
        stopped = time.monotonic()
        wait_for(lambda: not with_token(token), 30, f"processes of the job outlived {sig.name} of its launcher")
        gone_after = time.monotonic() - stopped
        out, err = parent.communicate(timeout=30)
    finally:
        if parent.poll() is None:
            parent.kill()
        for pid in with_token(token):
            os.kill(pid, signal.SIGKILL)
    print(f"{sig.name}: every process gone {gone_after:.1f} s after the signal")
    if sig == signal.SIGKILL:                # nothing ran in the launcher: its run folder is swept by the next run
        assert parent.returncode == -signal.SIGKILL
        left = [n for n in os.listdir(tempfile_root()) if n.startswith(f"{lifeline.RUN_PREFIX}{parent.pid}-")]
        assert set(left) <= set(lifeline.sweep_run_dirs())
    else:                                    # handled like Ctrl-C: one line, the shell's exit code for the signal
        assert err.strip().splitlines() == [f"error: stopped by {sig.name}"], err
        assert parent.returncode == 128 + sig
        assert not [n for n in os.listdir(tempfile_root()) if n.startswith(f"{lifeline.RUN_PREFIX}{parent.pid}-")]


def tempfile_root() -> str:
    import tempfile
    return tempfile.gettempdir()


# ---------------------------------------------------------------- a hung rank, named
def launch_in_thread(mode: str, tmp_path, hang_s: float | None) -> tuple[threading.Thread, dict]:
    """Run stall.py `mode` on 2 ranks in a thread; the dict gets the LaunchError and how long the run took."""
    caught = {}

    def go():
        start = time.monotonic()
        try:
            launch.run(WORKER, nproc=2, args=[mode, str(tmp_path / "joined")], timeout=240, quiet=True, hang_s=hang_s)
        except launch.LaunchError as e:
            caught["error"] = e
        caught["end"] = time.monotonic()
        caught["start"] = start
    t = threading.Thread(target=go)
    t.start()
    return t, caught


def joined(tmp_path, rank: int) -> int | None:
    path = tmp_path / f"joined.{rank}"
    return int(path.read_text()) if path.exists() and path.read_text() else None


@slow
def test_a_stopped_rank_is_named_stopped(tmp_path):
    t, caught = launch_in_thread("steps", tmp_path, hang_s=3)
    pid = wait_for(lambda: joined(tmp_path, 0) and joined(tmp_path, 1), 120, "the ranks did not join")
    time.sleep(0.5)
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    t.join(60)
    assert not t.is_alive(), "the hung job was not ended"
    named_after = caught["end"] - stopped
    e = caught["error"]
    assert e.root_cause.startswith("rank 1 is stopped (SIGSTOP"), e.root_cause
    assert "rank 0 waits in all_reduce at stall.py:" in e.root_cause and e.ranks == [1]
    # The watch counts hang_s from the rank's last look with progress, which can come up to one look (1 s)
    # before the SIGSTOP: named no sooner than hang_s minus a look after it.
    assert 3 - 1 <= named_after < 15, f"named {named_after:.1f} s after SIGSTOP with PAR_HANG_S=3"
    wait_for(lambda: gone(pid), 10, "the stopped rank outlived its job")
    print(f"stopped rank named {named_after:.1f} s after SIGSTOP (hang_s=3)")


def check_sleeping_rank(tmp_path, hang_s, limit_s):
    t, caught = launch_in_thread("sleep", tmp_path, hang_s=hang_s)
    wait_for(lambda: joined(tmp_path, 0) and joined(tmp_path, 1), 120, "the ranks did not join")
    joined_at = time.monotonic()
    t.join(limit_s + 60)
    assert not t.is_alive(), "the hung job was not ended"
    e = caught["error"]
    first = e.root_cause
    limit = hang.hang_seconds(hang_s)
    m = re.match(r"rank 1 made no progress for (\d+) s, last in sleep_in_step at stall.py:\d+; ", first)
    assert m and limit <= int(m.group(1)) < limit + 3, first
    assert "; rank 0 waits in all_reduce at stall.py:" in first and e.ranks == [1]
    named_after = caught["end"] - joined_at
    assert named_after < limit_s, f"named {named_after:.1f} s after the ranks joined"
    print(f"sleeping rank named {named_after:.1f} s after the ranks joined (hang_s={limit:g})")


def test_a_rank_sleeping_in_a_step_is_named_with_where_it_was(tmp_path):
    check_sleeping_rank(tmp_path, hang_s=3, limit_s=15)


@slow
def test_with_default_settings_a_hung_rank_is_named_within_a_minute(tmp_path, monkeypatch):
    monkeypatch.delenv(hang.HANG_ENV, raising=False)
    check_sleeping_rank(tmp_path, hang_s=None, limit_s=60)


# ---------------------------------------------------------------- nothing left in /tmp
@pytest.mark.parametrize("max_restarts", [0, pytest.param(1, marks=slow)])
def test_a_run_keeps_its_files_in_its_own_folder_and_removes_it(max_restarts):
    """A rank's temp files (and, under torchrun, torchrun's logs of the ranks' output) land in the run's own folder,
    which goes when the run ends."""
    got = launch.run(WORKER, nproc=2, args=["tmpdir"], timeout=120, quiet=True, max_restarts=max_restarts)
    run_dir = got["tmpdir"]
    assert Path(run_dir).name.startswith(f"{lifeline.RUN_PREFIX}{os.getpid()}-")
    assert got["made"].startswith(run_dir + os.sep), got
    if max_restarts:     # torchrun (the agent's ranks write into a pipe)
        assert got["stdout"].startswith(run_dir + os.sep) and "torchelastic_" in got["stdout"], got
    else:
        assert got["stdout"].startswith("pipe:"), got
    assert not os.path.exists(run_dir), "the run's folder outlived the run"


def test_run_folders_of_a_killed_launcher_are_swept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"{lifeline.RUN_PREFIX}{int(dead.stdout)}-abc"
    mine = tmp_path / f"{lifeline.RUN_PREFIX}{os.getpid()}-abc"
    for d in (stale, mine):
        (d / "torchelastic_x").mkdir(parents=True)
    assert lifeline.sweep_run_dirs(str(tmp_path)) == [stale.name]
    assert not stale.exists() and mine.exists()


# ---------------------------------------------------------------- the emulated cluster's owner SIGKILLed
CLUSTER_JOB = """
import sys
from par.runtime.cluster import Cluster
with Cluster(2, rate=None, prefix=sys.argv[1]) as c:
    c.run(sys.argv[2], ["steps"], nproc_per_node=1, timeout=600, quiet=True)
"""


@slow
def test_a_killed_cluster_leaves_no_rank_and_the_next_one_removes_its_namespaces(capfd):
    from par.runtime import cluster
    if cluster.missing():
        pytest.skip(f"emulated cluster: {cluster.missing()}")
    token, prefix = uuid.uuid4().hex, "parst"
    owner = subprocess.Popen([sys.executable, "-c", CLUSTER_JOB, prefix, WORKER], cwd=ROOT,
                             env={**os.environ, TOKEN: token}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        ranks = lambda: [p for p, e in with_token(token).items() if launch.rank_number(p, e) is not None]  # noqa: E731
        wait_for(lambda: len(ranks()) == 2, 120, "the cluster job did not start its 2 ranks")
        owner.kill()
        owner.wait()
        wait_for(lambda: not with_token(token), 30, "ranks outlived their cluster's SIGKILLed owner")
    finally:
        for pid in with_token(token):
            os.kill(pid, signal.SIGKILL)
    left = [n for n in cluster.ours(prefix) if n.startswith(f"{prefix}-{owner.pid}-")]
    assert len(left) == 3, left                  # two hosts and the switch: nothing ran to delete them
    capfd.readouterr()
    with cluster.Cluster(1, rate=None, prefix=prefix):
        pass
    said = capfd.readouterr().err.strip().splitlines()
    assert said == [f"par.runtime.cluster: removed 3 network namespaces left by a killed run: {', '.join(left)}"], said
    assert not [n for n in cluster.ours(prefix) if n.startswith(f"{prefix}-{owner.pid}-")]


# ---------------------------------------------------------------- the verdict, read back (no launch)
def test_the_culprit_leads_and_the_others_say_what_they_wait_in():
    waits = (True, "waiting in all_reduce at job.py:30")
    head, ranks = hang.describe({}, {0: 45.2, 1: 46.9}, {0: waits, 1: (False, "busy in step at job.py:12")})
    assert (head, ranks) == ("rank 1 made no progress for 47 s, last in step at job.py:12; "
                             "rank 0 waits in all_reduce at job.py:30", [1])
    head, ranks = hang.describe({1: 45.0}, {0: 45.0, 1: 45.0}, {0: waits})
    assert (head, ranks) == ("rank 1 is stopped (SIGSTOP: process state T) for 45 s; "
                             "rank 0 waits in all_reduce at job.py:30", [1])
    head, ranks = hang.describe({}, {0: 45.0, 1: 45.0}, {0: waits, 1: (True, "waiting in broadcast at job.py:9")})
    assert head.startswith("no rank made progress for 45 s, every rank waits") and ranks == [0, 1]


def test_the_hang_limit_and_the_collective_timeout(monkeypatch):
    monkeypatch.delenv(hang.HANG_ENV, raising=False)
    assert hang.hang_seconds() == 45 and hang.collective_timeout() == 60
    monkeypatch.setenv(hang.HANG_ENV, "120")
    assert hang.hang_seconds() == 120 and hang.collective_timeout() == 135
    assert hang.hang_seconds(3) == 3 and hang.collective_timeout(3) == 60
    assert hang.hang_seconds(0) == 0 and hang.collective_timeout(0) is None and not hang.Watch(0, 2).hung()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_sigterm_and_sighup_raise_stopped_like_ctrl_c(sig):
    before = signal.getsignal(sig)
    with pytest.raises(lifeline.Stopped) as e:
        with lifeline.stops_raise():
            os.kill(os.getpid(), sig)
            time.sleep(5)                    # the handler runs at once, in this (the main) thread
    assert isinstance(e.value, KeyboardInterrupt) and str(e.value) == f"stopped by {sig.name}"
    assert e.value.exit_code == 128 + sig and signal.getsignal(sig) is before
