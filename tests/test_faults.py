"""Faults and bad input, second round (issue 41): each case ends in one line `error: ...` and exit 2 before any
rank starts, or, for a fault during a run, names the rank or the path; nothing half-written is left.

* config values are checked before any rank starts (`par.train.config`): numbers finite and in range, true/false
  not taken for a number, enumerations, the model's shape, the file a regular UTF-8 file (a FIFO never blocks);
* a full disk (ENOSPC, simulated in-process by a failing fsync or torch.save, and for real on a 1 MiB tmpfs when
  the tests run as root, as CI does) and a read-only folder: writes are atomic (`par.runtime.checks.write_atomic`,
  `par.zero.checkpoint.write_file`), the batch keeps the summary of the notebooks done, the site keeps the old one;
* absurd numbers and text: the planner's bounds, NaN and Infinity, PAR_HANG_S=45s;
* a hang decided from progress, not presence (`par.runtime.hang.Watch`, with a fake clock): a rank that spins while
  the others wait, a rank that is gone while the others wait; and, on real ranks, both named with where they were.

The in-process cases replace whatever would start ranks or run notebooks by a tripwire (as tests/test_refusals.py).
"""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from tiers import slow

import par.__main__ as cli
import par.course.batch.runner as runner
import par.runtime.launch
import par.runtime.preflight
from par.runtime import hang
from par.runtime.checks import CheckError, write_atomic

ROOT = Path(__file__).resolve().parents[1]
BATCH = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2}


class Tripwire(AssertionError):
    """Raised where a refused command would have started ranks."""


@pytest.fixture(autouse=True)
def tripwires(monkeypatch):
    def trip(*args, **kwargs):
        raise Tripwire("reached the work: the check did not refuse before it")
    monkeypatch.setattr(par.runtime.launch, "run", trip)
    monkeypatch.setattr(runner, "run", trip)
    monkeypatch.setattr(par.runtime.preflight, "physical_cores", lambda: 2)
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("PAR_DEBUG", raising=False)
    monkeypatch.delenv(hang.HANG_ENV, raising=False)


def refused(argv, capsys) -> str:
    """The one error line of a command that must be refused with exit 2."""
    code = cli.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


# ---------------------------------------------------------------- config values, before any rank
CONFIGS = {
    # id: (config text, a piece of the error line)
    "lr-negative": ({"optimizer": {"type": "Adam", "params": {"lr": -1}}}, "optimizer.params.lr must be > 0, got -1"),
    "betas-above-1": ({"optimizer": {"type": "Adam", "params": {"betas": [2, 3]}}}, "optimizer.params.betas must be < 1"),
    "betas-one-number": ({"optimizer": {"params": {"betas": 0.9}}}, "betas must be two numbers"),
    "d_model-negative": ({"model": {"preset": "tiny", "d_model": -8}}, "model.d_model must be >= 1, got -8"),
    "heads-do-not-divide": ({"model": {"n_head": 3, "d_model": 32}}, "model.n_head 3 does not divide model.d_model 32"),
    "clipping-text": ({"gradient_clipping": "x"}, 'gradient_clipping must be a number, got "x"'),
    "scheduler-unknown": ({"scheduler": {"type": "Cosine"}}, 'scheduler.type "Cosine" is not supported'),
    "warmup-max-negative": ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": -0.1}}},
                            "scheduler.params.warmup_max_lr must be > 0, got -0.1"),
    "warmup-steps-fraction": ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2.5}}},
                              "warmup_num_steps must be a whole number"),
    "decay-before-warmup": ({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10,
                                                                                "total_num_steps": 5}}},
                            "total_num_steps must be >= 10"),
    "stage-true": ({"zero_optimization": {"stage": True}}, "zero_optimization.stage must be 0, 1, 2 or 3, got true"),
    "fp16-enabled-1": ({"fp16": {"enabled": 1}}, "fp16.enabled must be true or false, got 1"),
    "scale-power-huge": ({"fp16": {"enabled": True, "initial_scale_power": 4000}}, "initial_scale_power must be <= 127"),
    "offload-gpu": ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "gpu"}}},
                    'offload_optimizer.device "gpu" is not supported'),
    "schedule-unknown": ({"pipeline": {"stages": 2, "schedule": "2f2b"}}, 'pipeline.schedule "2f2b" is not supported'),
    "steps-infinity": ('{"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "steps": Infinity}',
                       "steps must be a finite number, got inf"),
    "seed-nan": ('{"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "seed": NaN}',
                 "seed must be a finite number, got nan"),
    "lr-huge-int": ({"optimizer": {"params": {"lr": 10 ** 400}}}, "optimizer.params.lr must be a finite number"),
}


@pytest.mark.parametrize("config,message", CONFIGS.values(), ids=CONFIGS.keys())
def test_a_config_value_is_refused_before_any_rank(config, message, tmp_path, capsys):
    text = config if isinstance(config, str) else json.dumps({**BATCH, **config})
    path = tmp_path / "config.json"
    path.write_text(text)
    assert message in refused(["train", "--config", path, "--nproc", "2"], capsys)


def test_the_course_configs_still_pass():
    """The refusals refuse only what cannot run: every shipped config parses."""
    from par.train.config import load
    def loads(path, world):
        try:
            return load(str(path), world).steps >= 1
        except ValueError:
            return False
    for path in sorted((ROOT / "configs").glob("*.json")):
        assert any(loads(path, world) for world in (1, 2, 4, 8)), path


def test_a_config_file_is_a_regular_utf8_file_of_bounded_size(tmp_path, capsys):
    """Invalid UTF-8, a folder, an oversized file and a FIFO (which would block a plain open for ever) are one
    line each; the FIFO within a second (an alarm fails the test instead of hanging it)."""
    bad = tmp_path / "latin1.json"
    bad.write_bytes(b'{"train_batch_size": 2, "model": {"preset": "t\xefny"}}')
    assert "is not UTF-8 text (byte" in refused(["train", "--config", bad], capsys)
    assert "is a folder, not a regular file" in refused(["train", "--config", tmp_path], capsys)
    big = tmp_path / "big.json"
    big.write_text(json.dumps({**BATCH, "seed": 0}) + " " * (2 << 20))
    assert "is over 1048576 bytes" in refused(["train", "--config", big], capsys)
    fifo = tmp_path / "config.fifo"
    os.mkfifo(fifo)
    previous = signal.signal(signal.SIGALRM, lambda *a: pytest.fail("reading a FIFO config blocked"))
    signal.alarm(10)
    try:
        start = time.monotonic()
        assert "is a FIFO, not a regular file" in refused(["train", "--config", fifo], capsys)
        assert time.monotonic() - start < 10
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# ---------------------------------------------------------------- numbers and environment variables
NUMBERS = {
    "plan-world-huge": (["plan", "--world", "1" + "0" * 21], "--world: must be at most 1,048,576"),
    "plan-model-huge-width": (["plan", "--model", "1" + "0" * 30 + ",1,1"], "at most 256 layers and width 1,048,576"),
    "plan-model-huge-depth": (["plan", "--model", "100000000,1,1"], "at most 256 layers"),
    "plan-model-heads": (["plan", "--model", "12,5,768"], "5 heads do not divide width 768"),
    "plan-memory-inf": (["plan", "--memory", "inf"], "--memory: must be a finite number > 0"),
    "plan-memory-nan": (["plan", "--memory", "nan"], "--memory: must be a finite number > 0"),
    "train-timeout-nan": (["train", "--config", "configs/ddp.json", "--timeout", "nan"], "--timeout: must be a finite"),
    "batch-timeout-inf": (["batch", "--timeout", "inf"], "--timeout: must be a finite number > 0"),
    "bench-warmup-negative": (["bench", "collectives", "--warmup", "-1"], "--warmup: must be at least 0"),
    "bench-warmup-text": (["bench", "tp", "--warmup", "x"], "--warmup: must be a whole number >= 0"),
    "suite-one-step": (["bench", "suite", "--steps", "1"], "--steps: must be at least 2 (the first step is a warm-up)"),
}


@pytest.mark.parametrize("argv,message", NUMBERS.values(), ids=NUMBERS.keys())
def test_an_absurd_number_is_refused_at_once(argv, message, capsys):
    import tempfile
    mine = f"par-grade-{os.getpid()}-*"       # this process's grading folders (another pytest worker has its own)
    before = set(Path(tempfile.gettempdir()).glob(mine))
    start = time.monotonic()
    assert message in refused(argv, capsys)
    assert time.monotonic() - start < 30
    assert set(Path(tempfile.gettempdir()).glob(mine)) <= before, "a refused command left files in /tmp"


def test_the_planner_searches_divisors_not_every_integer():
    from par.train.planner import MAX_WORLD, layouts
    start = time.monotonic()
    found = layouts(MAX_WORLD)                # 2^20: 231 layouts, found by trial division up to 2^10
    assert len(found) == 231 and all(d * p * t == MAX_WORLD for d, p, t in found)
    assert layouts(12) == [(12 // (t * p), p, t) for t in range(1, 13) if 12 % t == 0
                           for p in range(1, 12 // t + 1) if (12 // t) % p == 0]
    assert time.monotonic() - start < 1


@pytest.mark.parametrize("value", ["45s", "nan", "-1", "inf"])
def test_par_hang_s_is_checked_and_named_before_any_rank(value, monkeypatch, capsys):
    monkeypatch.setenv(hang.HANG_ENV, value)
    err = refused(["train", "--config", "configs/ddp.json", "--nproc", "2"], capsys)
    assert f"PAR_HANG_S={value!r} is not a number >= 0" in err


def test_every_par_number_variable_is_checked_with_its_name(monkeypatch):
    from par.runtime import nccl_emulation
    monkeypatch.setenv(nccl_emulation.SEND_TIMEOUT_ENV, "60s")
    with pytest.raises(CheckError, match="PAR_NCCL_EMULATION_SEND_TIMEOUT_S='60s' is not a number >= 0"):
        nccl_emulation.send_timeout_s()
    monkeypatch.setenv(nccl_emulation.SEND_TIMEOUT_ENV, "")
    assert nccl_emulation.send_timeout_s() == 60.0
    monkeypatch.setenv(hang.HANG_ENV, "12.5")
    assert hang.hang_seconds() == 12.5


@pytest.mark.parametrize("name", ["PAR_GRADE_MEMORY", "PAR_GRADE_MAX_PROCESSES"])
def test_the_graders_sandbox_limits_are_checked_with_their_names(name, tmp_path):
    """The sandbox reads them when it is imported: a bad one is one line naming it, before any grading."""
    done = subprocess.run([sys.executable, "-m", "par", "grade", str(ROOT / "solutions" / "00_ring_chunks.ipynb")],
                          capture_output=True, text=True, cwd=ROOT, timeout=120, env={**os.environ, name: "2GB"})
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"error: {name}='2GB' is not a number >= ")


# ---------------------------------------------------------------- full and read-only disks
def enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_an_atomic_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    write_atomic(path, "old\n")
    mask = os.umask(0)
    os.umask(mask)
    assert path.read_text() == "old\n" and (path.stat().st_mode & 0o777) == 0o666 & ~mask
    monkeypatch.setattr(os, "fsync", enospc)
    with pytest.raises(CheckError, match=f"cannot write {path}: No space left on device"):
        write_atomic(path, "new and longer\n")
    assert path.read_text() == "old\n" and os.listdir(tmp_path) == ["summary.json"]


def test_an_os_error_is_one_line_and_exit_2(monkeypatch, capsys):
    """ENOSPC raised anywhere in a command (without a path, as a write() raises it) is a user error."""
    import sys
    import types
    monkeypatch.setitem(sys.modules, "par_test_full", types.SimpleNamespace(main=enospc))
    monkeypatch.setitem(cli.COMMANDS, "full", ("par_test_full", "a stand-in"))
    assert "No space left on device (errno 28)" in refused(["full"], capsys)


def test_a_batch_on_a_full_disk_keeps_the_summary_of_the_notebooks_done(tmp_path, monkeypatch):
    """The summary is replaced atomically after every notebook: when the disk fills during the second, the
    summary of the first stays whole, no temporary file is left, and the error names the path."""
    monkeypatch.setattr(runner, "run", RUN)
    monkeypatch.setattr(runner, "known_failures", lambda nb, p: ([], None))
    monkeypatch.setattr(runner, "provenance", lambda p: {"date": "today"})
    monkeypatch.setattr(runner, "run_one", lambda nb, out, p, t: {"notebook": nb.name, "status": "ok", "error": None,
                                                                    "duration_s": 1.0, "records": {"x": 1}})
    saves = []
    real = os.fsync

    def fsync(fd):
        saves.append(fd)
        if len(saves) > 2:                # summary.json and summary.md of notebook 1, then the disk is full
            enospc()
        real(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(CheckError, match="summary.json: No space left on device"):
        runner.run([Path("01_a.ipynb"), Path("02_b.ipynb")], tmp_path, {"world_size": 2, "backend": "gloo",
                                                                        "preset": "tiny", "steps": 1})
    (folder,) = tmp_path.iterdir()
    assert sorted(os.listdir(folder)) == ["summary.json", "summary.md"]
    summary = json.loads((folder / "summary.json").read_text())
    assert [r["notebook"] for r in summary["notebooks"]] == ["01_a.ipynb"]


RUN = runner.run


def test_a_notebook_saved_truncated_is_not_kept(tmp_path, monkeypatch):
    """papermill writes into a temporary file; one that does not read back as a notebook (the disk filled while
    it was written) is removed and the row says so."""
    import papermill

    def truncated(source, output, **kwargs):
        Path(output).write_text('{"cells": [{"cell_type": "code", "sou')
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(papermill, "execute_notebook", truncated)
    row = runner.run_one(ROOT / "notebooks" / "01_memory.ipynb", tmp_path / "01_memory.ipynb", {}, 10)
    assert row["status"] == "FAILED" and "No space left on device" in row["error"], row
    assert row["output"] is None and os.listdir(tmp_path) == []


def test_a_stopped_notebook_keeps_what_ran_whole_and_the_stop_is_quiet(tmp_path, monkeypatch, caplog):
    """Ctrl-C mid-cell: the partly executed notebook is kept under its name (it reads back whole), no temporary is
    left, the stop goes on; after a stop the kernel's and papermill's messages are dropped, before it they are not."""
    import logging

    import nbformat
    import papermill

    from par.runtime.lifeline import STOPPING

    def stopped(source, output, **kwargs):
        nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1")]), output)
        raise KeyboardInterrupt
    monkeypatch.setattr(papermill, "execute_notebook", stopped)
    with pytest.raises(KeyboardInterrupt):
        runner.run_one(ROOT / "notebooks" / "01_memory.ipynb", tmp_path / "01_memory.ipynb", {}, 10)
    assert os.listdir(tmp_path) == ["01_memory.ipynb"]
    assert nbformat.read(tmp_path / "01_memory.ipynb", as_version=4).cells[0].source == "1"
    try:
        with caplog.at_level(logging.ERROR, logger="papermill"):
            with runner.quiet_after_stop():
                logging.getLogger("papermill").error("before the stop")
                STOPPING.set()
                logging.getLogger("papermill").error("Kernel died while waiting for execute reply.")
        assert [r.getMessage() for r in caplog.records] == ["before the stop"]
    finally:
        STOPPING.clear()
        for name in runner.NOISY_LOGGERS:
            for f in [f for f in logging.getLogger(name).filters if isinstance(f, runner._AfterStop)]:
                logging.getLogger(name).removeFilter(f)


def test_with_home_unwritable_the_kernels_settings_stay_in_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "no-such-home"))
    monkeypatch.delenv("IPYTHONDIR", raising=False)
    monkeypatch.delenv("MPLCONFIGDIR", raising=False)
    with runner.quiet_home(tmp_path):
        inside = Path(os.environ["MPLCONFIGDIR"])
        assert inside.parent.parent == tmp_path and Path(os.environ["IPYTHONDIR"]).parent == inside.parent
    assert "MPLCONFIGDIR" not in os.environ and "IPYTHONDIR" not in os.environ and os.listdir(tmp_path) == []


def test_a_notebook_runs_without_kernel_transport_warnings(tmp_path, capfd):
    """The kernel's own log stays quiet ("Kernel is running over TCP without encryption" was printed per notebook)."""
    import nbformat
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(6 * 7)")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, tmp_path / "10_quiet.ipynb")
    row = runner.run_one(tmp_path / "10_quiet.ipynb", tmp_path / "out.ipynb", {}, 120)
    assert row["status"] == "ok", row
    out, err = capfd.readouterr()
    assert "without encryption" not in out + err and "[IPKernelApp]" not in out + err, out + err
    assert sorted(os.listdir(tmp_path)) == ["10_quiet.ipynb", "out.ipynb"]


@slow
@pytest.mark.parametrize("signals,line,code", [([signal.SIGTERM], "error: stopped by SIGTERM", 128 + signal.SIGTERM),
                                               ([signal.SIGINT, signal.SIGINT], "error: interrupted", 130)],
                         ids=["sigterm", "double-sigint"])
def test_a_batch_stopped_mid_cell_says_one_line_and_keeps_what_ran(signals, line, code, tmp_path):
    """SIGTERM, or Ctrl-C twice within 0.2 s: one line (no kernel traceback, no "Exception ignored in atexit"),
    the shell's exit code, and the notebook as far as it ran."""
    import nbformat
    parameters = nbformat.v4.new_code_cell("world_size = 2\nbackend = 'gloo'\npreset = 'tiny'\nsteps = 1",
                                           metadata={"tags": ["parameters"]})
    nb = nbformat.v4.new_notebook(cells=[parameters, nbformat.v4.new_code_cell(
        "import time\nprint('started', flush=True)\ntime.sleep(300)")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, tmp_path / "10_sleep.ipynb")
    out = tmp_path / "runs"
    proc = subprocess.Popen([os.sys.executable, "-m", "par", "batch", "--notebooks", str(tmp_path / "10_sleep.ipynb"),
                             "--out", str(out)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PAR_DEBUG": ""})
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not list(out.glob("*/.10_sleep.tmp.ipynb")):
            time.sleep(0.5)
        time.sleep(5)                                   # the cell is running
        for sig in signals:
            proc.send_signal(sig)
            time.sleep(0.2)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = [l for l in err.splitlines() if l.strip() and not l.startswith("notebooks:")]
    assert lines == [line] and proc.returncode == code, err
    (run,) = out.iterdir()
    assert os.listdir(run) == ["10_sleep.ipynb"]


def batch_folder(tmp_path, rows, executed: dict | None = None) -> Path:
    run = tmp_path / "runs" / "20260101-120000"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"folder": str(run), "parameters": {}, "notebooks": rows}))
    for name, text in (executed or {}).items():
        (run / name).write_text(text)
    return run


ROW = {"notebook": "01_memory.ipynb", "status": "ok", "error": None, "duration_s": 1.0, "records": {}}


@pytest.mark.parametrize("rows,message", [
    ([{**ROW, "duration_s": "n/a"}], 'duration_s must be a number of seconds, got "n/a"'),
    ([{**ROW, "duration_s": float("inf")}], "duration_s must be a number of seconds, got Infinity"),
    ([{**ROW, "records": [1]}], "records must be an object"),
    (["01_memory.ipynb"], "has no notebook name"),
], ids=["duration-text", "duration-inf", "records-list", "row-text"])
def test_site_refuses_a_summary_row_that_is_not_one(rows, message, tmp_path, capsys):
    run = batch_folder(tmp_path, rows)
    assert message in refused(["site", run, "--out", tmp_path / "site"], capsys)


def test_site_refuses_a_truncated_summary_and_a_truncated_notebook(tmp_path, capsys):
    run = batch_folder(tmp_path, [ROW])
    (run / "summary.json").write_text('{"folder": "x", "notebooks": [{"noteb')
    assert "is not a batch summary" in refused(["site", run, "--out", tmp_path / "site"], capsys)
    from par.site.build import build
    from par.site.run import SiteError
    run2 = batch_folder(tmp_path / "two", [ROW], {"01_memory.ipynb": '{"cells": [{"cell_t'})
    with pytest.raises(SiteError, match="01_memory.ipynb is not a readable notebook"):
        build(run2, tmp_path / "site2", exercises={})
    assert not (tmp_path / "site2").exists() and not list(tmp_path.glob(".site2.building-*"))


def test_a_site_whose_disk_fills_leaves_no_half_site(tmp_path, monkeypatch):
    from par.site import build as site
    run = batch_folder(tmp_path, [])
    calls = []
    real = Path.write_text

    def write_text(self, *args, **kwargs):
        calls.append(self)
        if len(calls) > 1:
            enospc()
        return real(self, *args, **kwargs)
    monkeypatch.setattr(Path, "write_text", write_text)
    with pytest.raises(site.SiteError, match="cannot write the site's .* No space left on device"):
        site.build(run, tmp_path / "site", exercises={})
    assert not (tmp_path / "site").exists() and not list(tmp_path.glob(".site.building-*"))


def test_a_checkpoint_file_is_written_atomically_and_its_folder_checked_first(tmp_path, monkeypatch):
    import torch

    from par.zero import checkpoint
    path = str(tmp_path / "shard_00000_of_00001.pt")
    checkpoint.write_file({"x": torch.ones(3)}, path)
    assert torch.load(path, weights_only=True)["x"].tolist() == [1, 1, 1]

    def full(obj, f):
        f.write(b"PK")
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0")
    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(CheckError, match="cannot write checkpoint file .*shard_00000_of_00001.pt: .*unexpected pos"):
        checkpoint.write_file({"x": torch.zeros(3)}, path)
    assert os.listdir(tmp_path) == ["shard_00000_of_00001.pt"]
    assert torch.load(path, weights_only=True)["x"].tolist() == [1, 1, 1]     # the old file, whole
    if os.path.isdir("/proc/self"):                                            # read-only for root too
        with pytest.raises(CheckError, match="cannot write /proc/par-checkpoint"):
            checkpoint.check_directory("/proc/par-checkpoint")
    with pytest.raises(checkpoint.CheckpointError, match="holds no complete checkpoint"):
        checkpoint.load(None, str(tmp_path))


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="/proc is the read-only folder, even for root")
def test_a_zero_job_with_a_read_only_checkpoint_folder_stops_before_training():
    start = time.monotonic()
    with pytest.raises(par.runtime.launch.LaunchError, match="cannot write /proc/par-ckpt") as e:
        RUN_LAUNCH("par.zero.job", nproc=2, args=["--checkpoint", "/proc/par-ckpt", "--steps", "1000"], timeout=240,
                   quiet=True)
    assert "CheckError" in e.value.root_cause and time.monotonic() - start < 120


@pytest.fixture
def full_disk(tmp_path):
    """A 1 MiB tmpfs: a real ENOSPC. Needs root (CI runs as root); skipped elsewhere, where the monkeypatched
    cases above stand in."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root); the simulated ENOSPC cases cover the code")
    mnt = tmp_path / "full"
    mnt.mkdir()
    got = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if got.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {got.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_on_a_really_full_disk_writes_fail_whole(full_disk):
    import torch

    from par.zero import checkpoint
    write_atomic(full_disk / "small.json", "{}\n")
    with pytest.raises(CheckError, match="No space left on device"):
        write_atomic(full_disk / "small.json", "x" * (2 << 20))
    with pytest.raises(CheckError, match="cannot write checkpoint file"):
        checkpoint.write_file({"w": torch.zeros(1 << 20)}, str(full_disk / "shard_00000_of_00001.pt"))
    assert sorted(os.listdir(full_disk)) == ["small.json"] and (full_disk / "small.json").read_text() == "{}\n"


def test_a_command_whose_output_goes_to_a_full_disk_says_so_in_one_line(full_disk):
    """`python -m par plan > full/plan.txt`: the flush fails with ENOSPC (no path in the error): one line, exit 2."""
    (full_disk / "filler").write_bytes(b"\0" * (1 << 20))
    with open(full_disk / "plan.txt", "w") as out:
        got = subprocess.run([os.sys.executable, "-m", "par", "plan", "--world", "64"], cwd=ROOT, stdout=out,
                             stderr=subprocess.PIPE, text=True, timeout=120, env={**os.environ, "PAR_DEBUG": ""})
    assert got.returncode == 2 and got.stderr.splitlines() == [
        "error: No space left on device (errno 28); free some space or choose another output path"], got.stderr


# ---------------------------------------------------------------- progress, not presence
class FakeWatch(hang.Watch):
    """A Watch driven by hand: `tick` moves the clock, `busy` gives ranks CPU, `leave` removes one."""

    def __init__(self, hang_s: float, nproc: int):
        self.now = 0.0
        super().__init__(hang_s, nproc, clock=lambda: self.now)
        for r in range(nproc):
            self.ranks[r] = hang.RankClock(pid=1000 + r, cpu=0.0, progress_at=0.0, quiet_at=0.0)
        self.first_look = 0.0

    def tick(self, seconds: float, busy=()):
        """`seconds` later, the ranks in `busy` used CPU all along, the others none."""
        self.now += seconds
        for r, c in self.ranks.items():
            if r in busy:
                c.progress_at = self.now
            else:
                c.quiet_at = self.now

    def leave(self, rank: int):
        del self.ranks[rank]
        self.gone[rank] = self.now


def test_a_spinning_rank_is_a_hang_once_the_stacks_agree():
    w = FakeWatch(hang_s=45, nproc=2)
    w.tick(44, busy=[1])
    assert not w.hung()
    w.tick(2, busy=[1])                                 # rank 0 waited 46 s while rank 1 kept the CPU busy
    assert w.hung()
    places = {0: (True, "waiting in all_reduce at job.py:30"), 1: (False, "busy in step at job.py:12")}
    assert w.confirmed(places)
    head, culprits = hang.describe(w.stopped(), w.idle(), places, w.vanished(), w.busy())
    assert culprits == [1] and head.startswith("rank 1 spins in step at job.py:12 (busy for 46 s"), head
    assert "rank 0 waits in all_reduce at job.py:30" in head


def test_a_busy_rank_inside_a_collective_is_not_blamed_and_not_asked_again_at_once():
    """The waiting rank idles, the busy one is in a collective too (e.g. a GPU rank spinning in a sync): not a
    hang by stacks; the watch stays quiet for hang_s before it asks again."""
    w = FakeWatch(hang_s=45, nproc=2)
    w.tick(46, busy=[1])
    assert w.hung()
    assert not w.confirmed({0: (True, "waiting in all_reduce"), 1: (True, "waiting in barrier")})
    w.tick(10, busy=[1])
    assert not w.hung()
    w.tick(40, busy=[1])
    assert w.hung()


def test_every_rank_idle_is_a_hang_as_before():
    """A rank that went quiet a little after the one that waits for it is waited for: the verdict comes when both
    are idle for hang_s, and names the sleeper as idle, not spinning."""
    w = FakeWatch(hang_s=45, nproc=2)
    w.tick(2, busy=[1])
    w.tick(44)
    assert not w.hung()                                 # rank 0 waited 46 s, rank 1 is quiet for 44 s only
    w.tick(1)
    assert w.hung()
    places = {0: (True, "waiting in all_reduce at job.py:30"), 1: (False, "busy in sleep at x.py:3")}
    assert w.confirmed(places)
    head, culprits = hang.describe(w.stopped(), w.idle(), places, w.vanished(), w.busy())
    assert culprits == [1] and head.startswith("rank 1 made no progress for 45 s, last in sleep at x.py:3"), head


def test_a_rank_out_of_file_descriptors_is_named_not_mismatched_collectives():
    """Every rank waits (what reads as mismatched collectives), but one has used up its file descriptors: it is
    the culprit, named with its count and limit (`launch._hang_error` reads them from /proc)."""
    w = FakeWatch(hang_s=45, nproc=2)
    w.tick(46)
    places = {0: (True, "waiting in all_reduce at job.py:30"), 1: (True, "waiting in barrier at job.py:31")}
    head, culprits = hang.describe(w.stopped(), w.idle(), places, w.vanished(), w.busy(), {0: (40, 1024),
                                                                                          1: (1021, 1024)})
    assert culprits == [1] and head.startswith("rank 1 has 1021 of its 1024 file descriptors open (EMFILE"), head
    assert "mismatched" not in head
    head, _ = hang.describe(w.stopped(), w.idle(), places, w.vanished(), w.busy(), {0: (40, 1024), 1: (41, 1024)})
    assert "mismatched collectives" in head, "with file descriptors to spare, the old reading stands"


def test_open_files_reads_this_process(tmp_path):
    from par.runtime import procs
    used, limit = procs.open_files(os.getpid())
    held = [open(tmp_path / f"f{i}", "w") for i in range(5)]
    try:
        assert procs.open_files(os.getpid())[0] >= used + 3 and limit > used      # other threads open files too
    finally:
        for f in held:
            f.close()


def test_a_rank_gone_while_the_others_wait_is_named_within_seconds():
    w = FakeWatch(hang_s=45, nproc=2)
    w.tick(3, busy=[0, 1])
    w.leave(1)                                          # exited with code 0 before joining
    w.tick(hang.GONE_S - 1)
    assert not w.hung()
    w.tick(1)
    assert w.hung()
    places = {0: (True, "waiting in init_process_group at dist.py:82")}
    assert w.confirmed(places)
    head, culprits = hang.describe(w.stopped(), w.idle(), places, w.vanished(), w.busy())
    assert culprits == [1] and head == ("rank 1 exited (its process is gone) while the others still wait for it; "
                                        "rank 0 waits in init_process_group at dist.py:82")


def test_a_rank_gone_while_the_others_still_work_is_not_a_hang():
    w = FakeWatch(hang_s=45, nproc=2)
    w.leave(1)
    w.tick(10, busy=[0])
    assert not w.hung()
    w.tick(hang.GONE_S)                                 # rank 0 idles after its work, outside any collective
    assert w.hung() and not w.confirmed({0: (False, "busy in write_plots at job.py:90")})


def test_a_rank_that_polls_while_it_waits_makes_no_progress(monkeypatch):
    """Rank 0 waiting in init for its store's clients uses about 2 % of a core: summed over seconds that passes
    any fixed amount of CPU, but at no look is it a share of a core that counts as progress; a rank computing
    on a crowded machine (a quarter of a core) is busy at every look."""
    now, cpu = [0.0], {1000: 0.0, 1001: 0.0}
    monkeypatch.setattr(hang, "main_thread_stat", lambda pid: ("S", cpu[pid]))
    w = hang.Watch(45, 2, clock=lambda: now[0])
    for _ in range(60):
        w.look({0: 1000, 1: 1001})
        now[0] += 1.0
        cpu[1000] += 0.02
        cpu[1001] += 0.25
    w.look({0: 1000, 1: 1001})
    assert w.idle()[0] == 60 and w.idle()[1] == 0 and w.busy()[1] == 60


def test_a_rank_never_seen_counts_as_gone_until_it_shows_up():
    """Read from /proc (this process stands in for both ranks): a rank missing GONE_S after the first look is gone;
    one that then appears (slow to start) is not."""
    now = [0.0]
    w = hang.Watch(45, 2, clock=lambda: now[0])
    me = os.getpid()
    w.look({0: me})
    now[0] = hang.GONE_S + 1
    w.look({0: me})
    assert list(w.vanished()) == [1]
    now[0] += 1
    w.look({0: me, 1: me})
    assert w.vanished() == {} and sorted(w.ranks) == [0, 1]
    w.look({0: me})                                      # then it exits
    assert list(w.vanished()) == [1]


STALL = str(Path(__file__).parent / "workers" / "stall.py")


def launch_fails(mode: str, hang_s: float, timeout: float = 240) -> tuple[par.runtime.launch.LaunchError, float]:
    """Run stall.py `mode` on 2 real ranks (the module's tripwire undone); the LaunchError and the seconds it took."""
    from par.runtime import launch
    start = time.monotonic()
    with pytest.raises(launch.LaunchError) as caught:
        RUN_LAUNCH(STALL, nproc=2, args=[mode], timeout=timeout, quiet=True, hang_s=hang_s)
    return caught.value, time.monotonic() - start


RUN_LAUNCH = par.runtime.launch.run


def test_a_rank_spinning_in_a_busy_loop_is_named_not_the_waiting_one():
    e, seconds = launch_fails("spin", hang_s=3)
    assert e.ranks == [1], e.root_cause
    assert e.root_cause.startswith("rank 1 spins in spin_in_step at stall.py:"), e.root_cause
    assert "rank 0 waits in all_reduce at stall.py:" in e.root_cause
    assert seconds < 120, f"named after {seconds:.0f} s"


def test_a_rank_that_exits_0_before_joining_is_named_at_once():
    """Not after init's store timeout (126 s): within seconds of its exit."""
    e, seconds = launch_fails("exit0", hang_s=30)
    assert e.ranks == [1] and e.root_cause.startswith("rank 1 exited (its process is gone)"), e.root_cause
    assert "rank 0 waits in init at stall.py:" in e.root_cause
    assert seconds < 90, f"named after {seconds:.0f} s"


@slow
def test_a_rank_that_exits_0_mid_run_is_named_at_once():
    """gloo's connection breaks at once in the waiting rank: the rank that left is named first, not the one that
    saw its connection reset."""
    e, seconds = launch_fails("leave", hang_s=30)
    assert e.ranks == [1], e.root_cause
    assert e.root_cause.startswith("rank 1 exited with code 0 before the job finished, while the others waited for "
                                   "it; rank 0 failed: RuntimeError:"), e.root_cause
    assert seconds < 90, f"named after {seconds:.0f} s"


def test_a_second_ctrl_c_during_the_teardown_is_held():
    from par.runtime.lifeline import interrupts_held
    before = signal.getsignal(signal.SIGINT)
    with interrupts_held():
        os.kill(os.getpid(), signal.SIGINT)             # ignored: no KeyboardInterrupt here
        time.sleep(0.1)
    assert signal.getsignal(signal.SIGINT) is before
    done = []
    t = threading.Thread(target=lambda: done.append(interrupts_held().__enter__()))
    t.start()
    t.join()
    assert signal.getsignal(signal.SIGINT) is before     # outside the main thread nothing changes


# ---------------------------------------------------------------- the grader's outputs and numbers
GRADE = {
    "grade-timeout-nan": (["grade", "exercises/00_ring_chunks.ipynb", "--timeout", "nan"],
                          "--timeout and --cell-timeout must be finite numbers > 0"),
    "grade-cell-timeout-inf": (["grade", "exercises/00_ring_chunks.ipynb", "--cell-timeout", "inf"],
                               "--timeout and --cell-timeout must be finite numbers > 0"),
}


@pytest.mark.parametrize("argv,message", GRADE.values(), ids=GRADE.keys())
def test_a_grading_number_that_is_no_number_is_refused_and_leaves_nothing(argv, message, capsys):
    test_an_absurd_number_is_refused_at_once(argv, message, capsys)


def test_a_gradebook_that_cannot_be_written_leaves_no_temporary(tmp_path, monkeypatch):
    from par.course.grading.report import write_report
    report = tmp_path / "grades.csv"
    write_report([], report, [{"submission": "a.ipynb", "points": "1"}])
    before = report.read_text()
    monkeypatch.setattr(os, "fsync", enospc)
    with pytest.raises(CheckError, match="grades.csv: No space left on device"):
        write_report([], report, [{"submission": "b.ipynb"}])
    assert os.listdir(tmp_path) == ["grades.csv"] and report.read_text() == before
    assert before.splitlines()[1].startswith("a.ipynb,")


def test_grade_outputs_are_checked_by_the_one_check_writable(tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    err = refused(["grade", "exercises/00_ring_chunks.ipynb", "--report", tmp_path / "a_file" / "g.csv"], capsys)
    assert f"cannot write {tmp_path / 'a_file' / 'g.csv'}: {tmp_path / 'a_file'} is a file, not a folder" in err
    if os.path.isdir("/proc/self"):
        assert "cannot write /proc/par-grades" in refused(["grade", "exercises/00_ring_chunks.ipynb", "--feedback",
                                                           "/proc/par-grades"], capsys)

