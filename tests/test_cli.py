"""`python -m par`: a user's mistake is one line `error: ...` and exit 2, fast; --debug shows the traceback.

Real subprocesses for what a user types (the preflight must answer before torch is even imported), and
the dispatcher in-process with stand-in command modules for the error kinds.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import par.__main__ as cli
from par.runtime.launch import LaunchError

ROOT = Path(__file__).resolve().parents[1]
NO_NCCL_HERE = torch.cuda.device_count() < 2


def par_cli(*args, env=None) -> tuple[int, str, str, float]:
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "par", *args], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, **(env or {})}, timeout=120)
    return out.returncode, out.stdout, out.stderr, time.monotonic() - start


@pytest.mark.skipif(not NO_NCCL_HERE, reason="this machine can run NCCL on 2 ranks")
@pytest.mark.parametrize("args", [
    ["batch", "--backend", "nccl", "--world-size", "2", "--out", "{out}"],
    ["train", "--config", "configs/ddp.json", "--nproc", "2", "--backend", "nccl"],
    ["bench", "collectives", "--backend", "nccl", "--world-sizes", "2,4", "--json", "{out}"],
    ["bench", "zero", "--worlds", "2", "--backend", "nccl"],
], ids=["batch", "train", "bench-collectives", "bench-zero"])
def test_nccl_without_gpus_stops_at_once_in_one_line(args, tmp_path):
    code, out, err, seconds = par_cli(*[a.format(out=tmp_path / "x") for a in args])
    assert code == 2, (out, err)
    assert err.count("\n") == 1 and err.startswith("error: backend 'nccl' needs"), err
    assert "backend='gloo'" in err and "Traceback" not in err + out
    assert seconds < 5, f"the preflight took {seconds:.1f}s"
    assert not (tmp_path / "x").exists()


def test_unknown_backend_and_unknown_command():
    code, _, err, _ = par_cli("batch", "--backend", "mpi")
    assert code == 2 and err.strip() == "error: unknown backend 'mpi': use one of auto, gloo, nccl"
    code, _, err, _ = par_cli("frobnicate")
    assert code == 2 and err.startswith("error: unknown command 'frobnicate'") and err.count("\n") == 1


def test_bad_argument_is_one_line_with_the_help_to_read():
    code, out, err, _ = par_cli("batch", "--world-size", "two")
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("error: python -m par batch: argument --world-size: must be a whole number >= 1, got 'two'")
    assert "python -m par batch --help" in err


def test_debug_shows_the_traceback():
    for env, args in (({}, ["--debug"]), ({"PAR_DEBUG": "1"}, [])):
        code, _, err, _ = par_cli(*args, "batch", "--backend", "mpi", env=env)
        assert code == 1 and "Traceback (most recent call last)" in err and "BackendError" in err


def test_debug_reaches_train(tmp_path):
    """`train` follows the one policy: a bad config is one line and exit 2; --debug (before or after the
    command) or PAR_DEBUG=1 shows its traceback."""
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"train_batch_size": 20, "train_micro_batch_size_per_gpu": 2,
                               "gradient_accumulation_steps": 4}))
    train = ["train", "--config", str(bad), "--nproc", "2"]
    code, out, err, _ = par_cli(*train, env={"PAR_DEBUG": ""})
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err + out, err
    assert err.startswith("error: batch sizes: train_batch_size 20 != micro_batch 2")
    for env, args in (({"PAR_DEBUG": ""}, ["--debug", *train]), ({"PAR_DEBUG": ""}, [*train, "--debug"]),
                      ({"PAR_DEBUG": "1"}, train)):
        code, _, err, _ = par_cli(*args, env=env)
        assert code == 1 and "Traceback (most recent call last)" in err and "ConfigError" in err, err


def test_debug_is_exported_while_the_command_runs(command, monkeypatch):
    """What a command starts (ranks, notebooks, another `python -m par`) inherits PAR_DEBUG=1 from --debug;
    afterwards the environment is as it was."""
    monkeypatch.delenv("PAR_DEBUG", raising=False)
    with pytest.raises(RuntimeError, match="PAR_DEBUG=1"):
        command("RuntimeError('PAR_DEBUG=' + os.environ.get('PAR_DEBUG', ''))", "--debug")
    assert "PAR_DEBUG" not in os.environ


@pytest.fixture
def command(monkeypatch, tmp_path):
    """Register a stand-in command `fake` whose main() raises what the test puts in FAKE_ERROR."""
    (tmp_path / "fake_command.py").write_text(
        "import os\nfrom par.runtime.launch import LaunchError\nfrom par.train.config import ConfigError\n"
        "def main(argv):\n    raise eval(os.environ['FAKE_ERROR'])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.COMMANDS, "fake", ("fake_command", "a stand-in"))

    def run(error: str, *args):
        monkeypatch.setenv("FAKE_ERROR", error)
        return cli.main(["fake", *args])
    return run


def test_user_errors_are_one_line_and_exit_2(command, capsys):
    assert command("ConfigError('train_batch_size 24 != 2 x 4 x 2:\\n use 16')") == 2
    assert capsys.readouterr().err == "error: train_batch_size 24 != 2 x 4 x 2: use 16\n"
    assert command("FileNotFoundError(2, 'No such file or directory', 'configs/nope.json')") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: No such file or directory: configs/nope.json") and err.count("\n") == 1


def test_a_failed_launch_prints_its_root_cause(command, capsys):
    assert command("LaunchError('rank 1 failed: ValueError: x\\nTraceback ...', streamed=True)") == 1
    assert capsys.readouterr().err == "error: rank 1 failed: ValueError: x\n"   # the ranks' output is above
    assert command("LaunchError('rank 1 failed: ValueError: x\\nTraceback ...', streamed=False)") == 1
    assert capsys.readouterr().err == "error: rank 1 failed: ValueError: x\nTraceback ...\n"


def test_a_bug_in_par_keeps_its_traceback(command):
    with pytest.raises(ZeroDivisionError):
        command("ZeroDivisionError('a bug')")
    with pytest.raises(LaunchError):
        command("LaunchError('x')", "--debug")


def test_every_user_error_type_exists():
    """USER_ERRORS names classes by module:name; a rename must not silently turn errors into tracebacks."""
    import importlib
    for spec in cli.USER_ERRORS:
        module, name = spec.split(":")
        assert isinstance(getattr(importlib.import_module(module), name), type), spec


def test_a_missing_dependency_is_one_line_naming_the_environment(monkeypatch, capsys):
    """`python -m par batch` from a Python without torch (not the course's venv): one line, exit 2."""
    def no_torch(name, rest, oversubscribe=False):
        raise ModuleNotFoundError("No module named 'torch'", name="torch")
    monkeypatch.setattr(cli, "preflight", no_torch)
    assert cli.main(["batch"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: torch is not installed") and "pip install -r requirements.txt" in err
    with pytest.raises(ModuleNotFoundError):          # --debug shows the traceback
        cli.main(["--debug", "batch"])


def test_a_reader_that_leaves_early_ends_the_command_quietly():
    """`python -m par plan | head`: the pipe closes before par writes; no traceback, the shell's SIGPIPE status."""
    proc = subprocess.Popen([sys.executable, "-m", "par", "plan", "--model", "100,96,12288", "--world", "800"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()               # the reader is gone before the first line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
