"""The launcher: results come back, output streams, failures surface with their root cause on the first line,
hangs are killed naming the ranks that did not finish, a SIGKILLed rank ends the job, nothing is retried.

The multi-process cases launch tests/workers/launch_modes.py through `par.runtime.launch.run`, whose ranks
`par.runtime.agent` starts; the same job under torchrun gets the same environment and the same root cause, and
torchrun's restarts (`max_restarts`) bring a failed try back. The parsing of the failure report is also checked on
recorded text.
"""
from __future__ import annotations

import io
import os
import re
import time
import uuid
from contextlib import redirect_stdout
from pathlib import Path

import signal
import threading

import pytest
from tiers import slow

from par.runtime import agent as agent_module
from par.runtime import failure, launch, procs, zygote
from par.runtime.preflight import BackendError

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


def test_failing_rank_raises_with_its_root_cause_first_quickly():
    start = time.monotonic()
    with pytest.raises(launch.LaunchError) as info:
        launch.run(WORKER, nproc=3, args=["raise"], timeout=120, quiet=True)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert info.value.root_cause == "rank 1 failed: ValueError: deliberate failure on rank one (marker 4417)"
    assert message.splitlines()[0] == info.value.root_cause and info.value.ranks == [1]
    assert "Traceback" in message and 'launch_modes.py", line' in message and not info.value.crashed
    assert elapsed < 60, f"failure took {elapsed:.0f}s to surface; the timeout was 120s"


def test_the_agent_writes_a_record_per_rank_and_the_root_causes_error_file(tmp_path):
    """Failures travel as data: each rank writes its exception to its error file, and after a failure the agent
    writes one record per rank (`par.runtime.failure.RECORDS`) and copies the root cause's error file to its own."""
    import json
    import subprocess
    import sys
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(tmp_path / "error.json"), "PYTHONUNBUFFERED": "1"}
    out = subprocess.run([sys.executable, "-m", "par.runtime.agent", "--nproc-per-node=3",
                          f"--master-port={launch.free_port()}", WORKER, "raise"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    records = json.loads((tmp_path / failure.RECORDS).read_text())
    assert [r["rank"] for r in records][0] == 1 and sorted(r["rank"] for r in records) == [0, 1, 2]
    first = records[0]
    assert (first["exitcode"], first["signal"]) == (1, None)
    assert first["exception"] == "ValueError: deliberate failure on rank one (marker 4417)"
    assert re.fullmatch(r"main at launch_modes\.py:\d+", first["where"]), first["where"]
    assert failure.read_error_file(str(tmp_path / "error.json"))["exception"] == first["exception"]


def test_the_launcher_reads_the_records_not_the_text():
    """Rank 0 prints a failure report of its own that names itself; the records name rank 1, the one that raised."""
    with pytest.raises(launch.LaunchError) as info:
        launch.run(WORKER, nproc=2, args=["forged"], timeout=120, quiet=True)
    assert info.value.root_cause == "rank 1 failed: ValueError: the real cause (marker 7781)", str(info.value)
    assert info.value.ranks == [1]


def test_a_rank_exiting_without_traceback_is_named():
    with pytest.raises(launch.LaunchError) as info:
        launch.run(WORKER, nproc=2, args=["exit"], timeout=60, quiet=True)
    assert info.value.root_cause == "rank 0 exited with code 3 without a Python traceback"


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


def assert_all_gone(pids: list[int], token: str) -> None:
    deadline = time.monotonic() + 5
    while (any(map(alive, pids)) or with_token(token)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(alive, pids)), f"ranks {pids} outlived the launcher"
    if os.path.isdir("/proc"):
        assert with_token(token) == [], "torchrun or a rank outlived the launcher"


@slow
def test_hang_is_killed_at_the_timeout_naming_who_did_not_finish():
    """Rank 2 computes forever; ranks 0 and 1 wait for it in a collective (teardown's barrier), forever."""
    token = f"hang-token-{uuid.uuid4().hex}"
    start = time.monotonic()
    out = TimedOutput()
    with pytest.raises(launch.LaunchError, match="timed out after 25s") as info, redirect_stdout(out):
        launch.run(WORKER, nproc=3, args=["hang", token], timeout=25)
    elapsed = time.monotonic() - start
    assert 25 <= elapsed < 45
    first = info.value.root_cause
    assert "ranks 0, 1, 2 did not finish" in first and info.value.ranks == [0, 1, 2]
    assert "rank 2 busy in compute_forever at launch_modes.py:" in first, first
    assert "rank 0 waiting in teardown at launch_modes.py:" in first and "rank 1 waiting in teardown" in first
    assert first.index("rank 2 busy") < first.index("rank 0 waiting"), "the busy rank comes first"
    pids = [int(p) for p in re.findall(r"pid=(\d+)", out.getvalue())]
    assert len(pids) == 3, f"every rank should have started within 25s:\n{info.value}"
    assert_all_gone(pids, token)


def test_a_rank_killed_by_sigkill_ends_the_job_naming_it():
    token = f"kill-token-{uuid.uuid4().hex}"
    start = time.monotonic()
    with pytest.raises(launch.LaunchError) as info:
        launch.run(WORKER, nproc=3, args=["kill", token], timeout=300, quiet=True)
    elapsed = time.monotonic() - start
    assert info.value.root_cause.startswith("rank 1 was killed by SIGKILL (signal 9) without a Python exception")
    assert info.value.crashed and info.value.ranks == [1] and "rank 1 kills itself at step 5" in str(info.value)
    assert elapsed < 60, f"the job took {elapsed:.0f}s to end after a rank was killed"
    assert_all_gone([int(p) for p in re.findall(r"pid=(\d+)", str(info.value))], token)


@pytest.mark.parametrize("starter", ["par.runtime.agent", pytest.param("torch.distributed.run", marks=slow)])
def test_ranks_do_not_outlive_a_killed_starter(starter):
    """The process that started the ranks dies (an OOM killer, a stray kill): its ranks are orphans, and the launcher
    ends them."""
    token = f"orphan-token-{uuid.uuid4().hex}"
    caught = {}

    def launch_it():
        try:   # max_restarts=1: torchrun starts the ranks; it never restarts them here, the job is ended first
            launch.run(WORKER, nproc=2, args=["hang", token], timeout=120, quiet=True,
                       max_restarts=int(starter == "torch.distributed.run"))
        except launch.LaunchError as e:
            caught["error"] = e
    t = threading.Thread(target=launch_it)
    t.start()
    deadline = time.monotonic() + 90
    ranks, agent = [], []
    while len(ranks) < 2 and time.monotonic() < deadline:   # both ranks started; their parent is the starter
        time.sleep(0.5)
        ranks = [p for p in procs.descendants(os.getpid()) if launch.rank_number(p, procs.environ(p)) is not None]
        agent = sorted({procs.parent_of(p) for p in ranks})
    assert len(agent) == 1 and len(ranks) == 2, "the job did not start within 90 s"
    assert starter.encode() in open(f"/proc/{agent[0]}/cmdline", "rb").read() or \
        procs.comm(agent[0]) == zygote.AGENT_NAME, "the ranks' parent is not the process that starts them"
    time.sleep(2)   # let the launcher see the ranks once
    os.kill(agent[0], signal.SIGKILL)
    t.join(60)
    assert not t.is_alive() and "error" in caught
    name = "torchrun" if starter == "torch.distributed.run" else starter
    assert caught["error"].root_cause.startswith(f"{name} itself was killed by SIGKILL")
    assert_all_gone(ranks, token)


AGENT_COMMAND = launch.agent_command
FORKING = lambda target, nproc, args=(), port=None, fork=False: AGENT_COMMAND(target, nproc, args, port, fork=True)  # noqa: E731
STARTERS = {   # how launch.run starts a gloo job's ranks (the command, PAR_ZYGOTE), and the ways it can be told to
    "forked by the zygote's agent": (FORKING, "1"),                                   # start them instead
    "forked by a fresh agent": (FORKING, "0"),
    "fresh under the agent": (lambda target, nproc, args=(), port=None, fork=False: AGENT_COMMAND(
        target, nproc, args, port, fork=False), "1"),
    "torchrun": (lambda target, nproc, args=(), port=None, fork=False: launch.torchrun_command(target, nproc, args,
                                                                                                port), "1"),
}


@slow
def test_the_agent_gives_the_ranks_what_torchrun_gives_them(monkeypatch):
    """The same job with its ranks forked by par.runtime.agent, started fresh by it, and started by torchrun: every
    variable a rank reads is the same (but the port and the run's id), every rank is a process of its own, and the
    same failure is read back as the same root cause and the same rank."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("launch_modes", WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    runs, errors = {}, {}
    monkeypatch.setattr(zygote, "_LAUNCHES", [1])          # this process has launched before: it has a zygote
    for name, (command, zygote_on) in STARTERS.items():
        monkeypatch.setattr(launch, "agent_command", command)
        monkeypatch.setenv("PAR_ZYGOTE", zygote_on)
        runs[name] = launch.run(WORKER, nproc=2, args=["ok"], timeout=120, quiet=True)
        with pytest.raises(launch.LaunchError) as info:
            launch.run(WORKER, nproc=3, args=["raise"], timeout=120, quiet=True)
        errors[name] = info.value
    for name, run in runs.items():
        assert len({r["pid"] for r in run["ranks"]}) == 2, name
        for a, b in zip(run["ranks"], runs["torchrun"]["ranks"]):
            for key in set(worker.TORCHRUN_VARS) - {"MASTER_PORT", "TORCHELASTIC_RUN_ID",
                                                    "TORCHELASTIC_USE_AGENT_STORE"}:
                assert a["env"][key] == b["env"][key], (name, key, a["env"][key], b["env"][key])
        assert errors[name].root_cause == errors["torchrun"].root_cause, name
        assert errors[name].ranks == [1], name
    for name in ("forked by the zygote's agent", "forked by a fresh agent", "fresh under the agent"):
        assert {r["env"]["TORCHELASTIC_USE_AGENT_STORE"] for r in runs[name]["ranks"]} == {"False"}   # rank 0's store
    assert {r["parent"] for r in runs["forked by the zygote's agent"]["ranks"]} == {zygote.AGENT_NAME}
    assert {r["parent"] for r in runs["forked by a fresh agent"]["ranks"]} == {"python"}


@slow
def test_torchrun_restarts_a_failed_try_when_asked():
    """max_restarts=1: the first try fails on rank 1, torchrun starts every rank again, the second try returns."""
    assert launch.run(WORKER, nproc=2, args=["once"], timeout=120, quiet=True, max_restarts=1) == {"restart_count": 1}
    with pytest.raises(launch.LaunchError) as info:      # without restarts the first failure is the end
        launch.run(WORKER, nproc=2, args=["once"], timeout=120, quiet=True)
    assert info.value.root_cause == "rank 1 failed: ValueError: the first try fails on rank one"


def test_nccl_without_gpus_stops_before_starting_anything(monkeypatch):
    monkeypatch.setattr(launch.subprocess, "Popen", lambda *a, **k: pytest.fail("a process was started"))
    start = time.monotonic()
    with pytest.raises(BackendError) as info:
        launch.run(WORKER, nproc=64, args=["ok"], backend="nccl", timeout=120, quiet=True)
    assert time.monotonic() - start < 5
    message = str(info.value)
    assert "\n" not in message and "backend='gloo'" in message
    assert "CPU-only build" in message or "world size 64" in message


def test_no_relaunch_on_crash():
    """A crash is reported, never hidden by a second try: the option that relaunched is gone."""
    with pytest.raises(TypeError):
        launch.run(WORKER, nproc=2, args=["ok"], retries_on_crash=1)


def test_torchrun_command_binds_localhost():
    cmd = launch.torchrun_command("par.comm.job", 4, ["--parts", "show"], port=12345)
    assert "--nproc-per-node=4" in cmd and "--master-addr=127.0.0.1" in cmd and "--master-port=12345" in cmd
    assert "--max-restarts=0" in cmd
    assert cmd[-4:] == ["-m", "par.comm.job", "--parts", "show"]
    assert launch.torchrun_command("x/y.py", 2)[-1] == "x/y.py"
    assert "--max-restarts=2" in launch.torchrun_command("x/y.py", 2, max_restarts=2)


def test_agent_command_runs_the_same_program():
    cmd = launch.agent_command("par.comm.job", 4, ["--parts", "show"], port=12345)
    assert cmd[1:3] == ["-m", "par.runtime.agent"] and "--nproc-per-node=4" in cmd and "--master-port=12345" in cmd
    assert cmd[-4:] == ["-m", "par.comm.job", "--parts", "show"] and "--fork" not in cmd
    assert launch.agent_command("x/y.py", 2)[-1] == "x/y.py"
    assert "--fork" in launch.agent_command("x/y.py", 2, fork=True)


def test_a_gloo_job_forks_its_ranks_and_they_are_found_by_name(monkeypatch):
    """A gloo job's ranks are forked by the agent (`--fork`): processes of their own, named par-rank<N>, found by
    the launcher (which names a hung or killed rank by them), with torch imported before their first line. The
    agent of a process's first launch is a fresh interpreter; from its second launch on, every agent is forked by
    the process's one zygote."""
    commands, agent_command = [], launch.agent_command
    monkeypatch.setattr(launch, "agent_command", lambda *a, **k: commands.append(k) or agent_command(*a, **k))
    found = []
    original = launch._rank_pids
    monkeypatch.setattr(launch, "_rank_pids", lambda *a: found.append(original(*a)) or found[-1])
    monkeypatch.setattr(zygote, "_LAUNCHES", [0])          # this process's first launch: a fresh agent forks
    first = launch.run(WORKER, nproc=2, args=["ok"], timeout=120, quiet=True)
    assert {r["parent"] for r in first["ranks"]} == {"python"}, "a zygote for a process's first launch"
    commands.clear()
    result = launch.run(WORKER, nproc=2, args=["ok"], timeout=120, quiet=True)
    assert commands == [{"fork": True}]
    pids = {r["rank"]: r["pid"] for r in result["ranks"]}
    assert len(set(pids.values())) == 2 and pids in found
    assert [r["comm"] for r in result["ranks"]] == ["par-rank0", "par-rank1"], "the ranks were not forked"
    assert {r["env"]["OMP_NUM_THREADS"] for r in result["ranks"]} == {"1"}
    again = launch.run(WORKER, nproc=2, args=["ok"], timeout=120, quiet=True)     # the same zygote forks its agent
    assert {r["parent"] for r in result["ranks"] + again["ranks"]} == {zygote.AGENT_NAME}, "no agent of the zygote"
    grandparents = {r["grandparent"] for r in result["ranks"] + again["ranks"]}
    assert len(grandparents) == 1 and procs.comm(grandparents.pop()) == zygote.NAME


# ---------------------------------------------------------------- torchrun's report, read back (no launch)
def report(*failures) -> list[str]:
    """torchrun's failure report as it prints it, for (rank, exitcode) pairs, root cause first."""
    def entry(i, rank, code):
        sig = f"  ({signal.Signals(-code).name})" if code < 0 else ""
        return [f"[{i}]:\n", "  time      : 2026-11-23_10:49:20\n", "  host      : localhost\n",
                f"  rank      : {rank} (local_rank: {rank})\n", f"  exitcode  : {code} (pid: 100{rank}){sig}\n",
                "  error_file: <N/A>\n"]
    (root, *others) = failures
    lines = ["=" * 40 + "\n", "x.py FAILED\n", "-" * 40 + "\n", "Failures:\n"]
    for i, (rank, code) in enumerate(others, 1):
        lines += entry(i, rank, code)
    lines += ["-" * 40 + "\n", "Root Cause (first observed failure):\n", *entry(0, *root), "=" * 40 + "\n"]
    return lines


def traceback_of(rank: int, exc: str) -> list[str]:
    return [f"[default{rank}]:[rank{rank}]: Traceback (most recent call last):\n",
            f'[default{rank}]:[rank{rank}]:   File "/x/job.py", line 7, in <module>\n',
            f"[default{rank}]:[rank{rank}]:     step()\n",
            f"[default{rank}]:[rank{rank}]:     ^^^^^^\n",
            f"[default{rank}]:[rank{rank}]: {exc}\n"]


def test_the_cause_leads_not_its_consequences():
    reset = "RuntimeError: [gloo/pair.cc:537] Read error: Connection reset by peer. GLHF"
    # torchrun saw rank 0's connection error first; rank 2 really failed
    lines = traceback_of(0, reset) + traceback_of(2, "KeyError: 'w'") + report((0, 1), (2, 1), (1, -15))
    head, ranks, crashed, _ = failure.describe_failure(lines)
    assert (head, ranks, crashed) == ("rank 2 failed: KeyError: 'w'", [2], False)
    # a rank killed from outside is the cause, whatever the others said afterwards
    lines = traceback_of(0, reset) + report((0, 1), (1, -9), (2, -15))
    head, ranks, crashed, _ = failure.describe_failure(lines)
    assert head.startswith("rank 1 was killed by SIGKILL") and ranks == [1] and crashed


def test_exception_line_skips_the_source_line_and_markers():
    said = ["Traceback (most recent call last):\n", '  File "a.py", line 1, in f\n', "    x = y[0]\n",
            "        ~^^^\n", "IndexError: list index out of range\n"]
    assert failure.exception_line(said) == "IndexError: list index out of range"
    assert failure.exception_line(["no traceback here\n"]) is None


def test_where_a_rank_was():
    waiting = [("/v/torch/distributed/c10d.py", 10, "wait"), ("/w/par/comm/collectives.py", 112, "all_reduce"),
               ("/w/job.py", 46, "main"), ("/w/job.py", 60, "<module>")]
    assert failure.where(waiting) == (True, "waiting in all_reduce at job.py:46")
    assert failure.where([("/w/job.py", 44, "compute"), ("/w/job.py", 60, "<module>")]) == \
        (False, "busy in compute at job.py:44")
    assert failure.where([])[0] is False


def test_the_agents_report_reads_back_as_torchruns():
    """par.runtime.agent's failure report, read by the same parser as torchrun's: the first exit it saw is the
    root cause, the ranks it stopped (SIGTERM) follow; a rank that exited 0 is not in it."""
    from types import SimpleNamespace
    from par.runtime import agent

    def rank(r, code, seen):
        return SimpleNamespace(rank=r, exit_seen_at=seen, proc=SimpleNamespace(returncode=code, pid=100 + r))
    text = agent.report("par.comm.job", [rank(0, -15, 12.0), rank(2, 1, 10.0), rank(3, -9, 11.0)])
    lines = [line + "\n" for line in text.splitlines()]
    assert failure.failures(lines) == [{"rank": 2, "exitcode": 1}, {"rank": 0, "exitcode": -15},
                                      {"rank": 3, "exitcode": -9}]
    assert [f["rank"] for f in failure.cause_first(failure.failures(lines), lines)] == [3, 2, 0]
    assert failure.left_early(lines, 4) == [1]
    assert "exitcode  : -15 (pid: 100) (SIGTERM)" in text and "Signal 15 (SIGTERM) received by PID 100" in text


def test_the_agent_refuses_a_missing_program():
    from par.runtime import agent
    with pytest.raises(SystemExit):
        agent.parse(["--nproc-per-node=2", "--master-port=1"])
    assert agent.parse(["--nproc-per-node=2", "--master-port=7", "-m", "par.x", "--steps", "3"])[3][-4:] == \
        ["-m", "par.x", "--steps", "3"]


# ---------------------------------------------------------------- what the agent imports before it forks
def test_a_job_module_states_what_the_agent_imports_before_forking(tmp_path):
    """`PRELOAD = (...)` at a job module's top level, read from its source: the agent imports that, not PRELOAD."""
    import sys
    (tmp_path / "light.py").write_text('"""A job."""\nimport os\n\nPRELOAD = ("torch",)   # no optimizer here\n')
    (tmp_path / "plain.py").write_text("import os\nX = 1\n")
    (tmp_path / "odd.py").write_text("PRELOAD = [1, 2]\n")
    assert agent_module.preload_of([sys.executable, str(tmp_path / "light.py")]) == ("torch",)
    assert agent_module.preload_of([sys.executable, str(tmp_path / "plain.py")]) == agent_module.PRELOAD
    assert agent_module.preload_of([sys.executable, str(tmp_path / "odd.py")]) == agent_module.PRELOAD
    assert agent_module.preload_of([sys.executable, str(tmp_path / "missing.py")]) == agent_module.PRELOAD
    assert agent_module.preload_of([sys.executable, "-m", "par.course.grading.exercise_ring"]) == ("torch",)
    assert agent_module.preload_of([sys.executable, "-m", "par.train.job"]) == agent_module.PRELOAD
    assert agent_module.preload_of([sys.executable, "-m", "no.such.module"]) == agent_module.PRELOAD


EMULATED = {"PAR_NCCL_EMULATION": "1"}
TORCH_ONLY = [   # (solution notebook, job module, ranks, env as the solution launches it): every job module that
    ("00_ring_chunks", "par.course.grading.exercise_ring", 3, EMULATED),       # states PRELOAD = ("torch",)
    ("02_gradient_buckets", "par.course.grading.exercise_ddp", 2, {}),
    ("04_tensor_parallel", "par.course.grading.exercise_tp", 2, {}),
    ("06_zero", "par.course.grading.exercise_zero3", 2, {}),
    ("09_expert_dispatch", "par.course.grading.exercise_alltoall", 3, EMULATED),
    ("07_layout", "par.runtime.grid", 4, {}),
]


def test_every_job_module_stating_torch_only_is_listed_here():
    import sys
    root = Path(__file__).resolve().parents[1]
    stating = {".".join(p.relative_to(root).with_suffix("").parts) for p in (root / "par").rglob("*.py")
               if agent_module.preload_of([sys.executable, str(p)]) == ("torch",)}
    assert stating == {module for _, module, _, _ in TORCH_ONLY}


@slow
@pytest.mark.parametrize("notebook, module, nproc, env", TORCH_ONLY, ids=[m.rsplit(".", 1)[1] for _, m, _, _ in TORCH_ONLY])
def test_ranks_of_a_torch_only_job_never_import_dynamo(notebook, module, nproc, env, tmp_path, monkeypatch):
    """The solution's job, its ranks forked by a fresh agent that imported torch only, under
    PYTHONPROFILEIMPORTTIME: no rank prints an import of torch._dynamo (an optimizer step or a dispatch mode would
    import it, and every rank would then pay for what the agent left out)."""
    import json
    import nbformat
    root = Path(__file__).resolve().parents[1]
    for cell in nbformat.read(root / "solutions" / f"{notebook}.ipynb", as_version=4).cells:
        if cell.cell_type == "code" and cell.source.startswith("%%writefile "):
            head, body = cell.source.split("\n", 1)
            (tmp_path / head.split()[1]).write_text(body)
    if module == "par.runtime.grid":
        from par.runtime import grid
        lay = grid.check_layout(nproc, 2, 2, 1)
        args = ["--groups", json.dumps({axis: grid.group_ranks(axis, lay) for axis in grid.AXES})]
    else:
        args = ["--answer", next(p.name for p in tmp_path.glob("my_*.py"))]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PAR_ZYGOTE", "0")          # a zygote imports all of agent.PRELOAD: the fresh agent does not
    out = io.StringIO()
    with redirect_stdout(out):
        launch.run(module, nproc=nproc, args=args, backend="gloo", timeout=180,
                   env={"PYTHONPROFILEIMPORTTIME": "1", **env})
    lines = out.getvalue().splitlines()
    assert any(re.search(r"\| +torch$", line) for line in lines), "the agent's imports were not profiled"
    dynamo = [line for line in lines if re.search(r"\| +torch\._dynamo$", line)]
    assert not dynamo, f"{module}'s ranks import torch._dynamo: {dynamo[:2]}"
