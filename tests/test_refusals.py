"""Everything checkable is refused before any rank starts: one line `error: ...`, exit 2 (issue 24).

Each case runs `python -m par`'s dispatcher in-process with whatever would start ranks or do the work
(`par.runtime.launch.run`, the batch's notebook loop, the exercises' stubs) replaced by a tripwire: a check
that is removed, or that comes after the work, trips it and the test fails. Two cases run as real
subprocesses, for the whole path and its time. The machine's core count is fixed at 2, so the
oversubscription cases mean the same on any machine.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

import par.__main__ as cli
import par.course.authoring.generate
import par.course.batch.runner
import par.runtime.launch
import par.runtime.preflight

ROOT = Path(__file__).resolve().parents[1]


class Tripwire(AssertionError):
    """Raised where a refused command would have started ranks or done its work."""


@pytest.fixture(autouse=True)
def tripwires(monkeypatch):
    """Ranks, the notebook batch and the exercises' stubs all fail the test if reached; 2 physical cores."""
    def trip(*args, **kwargs):
        raise Tripwire("reached the work: the check did not refuse before it")
    monkeypatch.setattr(par.runtime.launch, "run", trip)
    monkeypatch.setattr(par.course.batch.runner, "run", trip)
    monkeypatch.setattr(par.course.authoring.generate, "exercise_text", trip)
    monkeypatch.setattr(par.runtime.preflight, "physical_cores", lambda: 2)
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("PAR_DEBUG", raising=False)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    """Configs that cannot run, and a path nothing can be written under (its parent is a file)."""
    d = tmp_path_factory.mktemp("refusals")
    configs = {
        "preset": {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "model": {"preset": "gpt5"}},
        "tp3": {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "tensor_parallel": {"tp_size": 3}},
        "pp5": {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, "pipeline": {"stages": 5}},
    }
    for name, cfg in configs.items():
        (d / f"{name}.json").write_text(json.dumps(cfg))
    (d / "a-file").write_text("")
    return {"dir": d, "bad": d / "a-file" / "out"}


CASES = {
    # id: (command line, a piece of the error line)
    "train-unknown-preset": ("train --config {dir}/preset.json --nproc 2", "unknown preset 'gpt5'"),
    "train-tp3-4-heads": ("train --config {dir}/tp3.json --nproc 3", "n_head 4 is not divisible"),
    "train-stages-over-layers": ("train --config {dir}/pp5.json --nproc 5", "cannot cut 4 layers into 5 stages"),
    "train-steps-0": ("train --config configs/ddp.json --steps 0", "--steps: must be at least 1"),
    "train-timeout-negative": ("train --config configs/ddp.json --timeout -5", "--timeout: must be greater than 0"),
    "train-nproc-64": ("train --config configs/ddp.json --nproc 64", "add --oversubscribe"),
    "bench-world-sizes-0": ("bench collectives --world-sizes 0", "every world size must be at least 1"),
    "bench-world-sizes-negative": ("bench dp --world-sizes 2,-1", "every world size must be at least 1"),
    "bench-world-sizes-two": ("bench collectives --world-sizes two", "every world size must be a whole number"),
    "bench-pipeline-world-sizes": ("bench pipeline --world-sizes 0", "every world size must be at least 1"),
    "bench-zero-worlds-0": ("bench zero --worlds 0", "--worlds: every world size must be at least 1"),
    "bench-tp-nproc-0": ("bench tp --nproc 0", "--nproc: must be at least 1"),
    "bench-suite-nproc-0": ("bench suite --nproc 0", "--nproc: must be at least 1"),
    "bench-64-ranks": ("bench collectives --world-sizes 2,64", "64 ranks on 2 physical CPU cores"),
    "bench-json-unwritable": ("bench collectives --world-sizes 2 --json {bad}", "cannot write"),
    "bench-dp-json-unwritable": ("bench dp --world-sizes 2 --json {bad}", "cannot write"),
    "bench-pipeline-json-unwritable": ("bench pipeline --world-sizes 2 --json {bad}", "cannot write"),
    "bench-suite-out-unwritable": ("bench suite --nproc 2 --out {bad}", "cannot write"),
    "bench-typo": ("bench colectives", "unknown benchmark 'colectives': did you mean 'collectives'?"),
    "command-typo": ("tran --config configs/ddp.json", "unknown command 'tran': did you mean 'train'?"),
    "plan-unknown-model": ("plan --model gpt5", "unknown preset 'gpt5'"),
    "plan-model-numbers": ("plan --model 12,x,768", "give L,H,d as three whole numbers"),
    "plan-world-0": ("plan --world 0", "--world: must be at least 1"),
    "plan-memory-negative": ("plan --memory -1", "--memory: must be greater than 0"),
    "plan-seq-0": ("plan --seq 0", "--seq: must be at least 1"),
    "memory-params-negative": ("memory --params -5", "--params: must be greater than 0"),
    "memory-dp-0": ("memory --params 7B --dp 0", "--dp: must be at least 1"),
    "batch-timeout-negative": ("batch --timeout -1", "--timeout: must be greater than 0"),
    "batch-world-size-64": ("batch --world-size 64", "add --oversubscribe"),
    "batch-out-unwritable": ("batch --out {bad}", "cannot write"),
    "batch-dry-run-unknown-backend": ("batch --dry-run --backend mpi --gpu-memory 80e9", "unknown backend 'mpi'"),
    "batch-dry-run-gpu-memory-0": ("batch --dry-run --backend nccl --gpu-memory 0GB", "--gpu-memory: must be greater than 0"),
    "train-nnodes-unknown-backend": ("train --config configs/ddp.json --nnodes 2 --nproc 4 --backend mpi",
                                     "unknown backend 'mpi'"),
    "exercises-check-no-course": ("exercises check --root {dir}/nowhere", "is not the course repository"),
    "exercises-release-unwritable": ("exercises release {bad}", "cannot write"),
}


@pytest.mark.parametrize("line,message", CASES.values(), ids=CASES.keys())
def test_refused_before_any_rank_in_one_line(line, message, files, capsys):
    code = cli.main(line.format(**files).split())
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err, err


def test_writability_is_tried_not_guessed(tmp_path):
    """`check_writable`: a file whose folder is missing, a folder in a read-only file system (/proc, even for
    root) and a file where a folder is wanted are refused; what can be written passes and leaves nothing."""
    from par.runtime.checks import CheckError, check_writable
    with pytest.raises(CheckError, match="does not exist; create it first"):
        check_writable(tmp_path / "new" / "rows.json")
    check_writable(tmp_path / "new" / "rows.json", parents=True)
    check_writable(tmp_path / "runs", directory=True)
    if Path("/proc/self").exists():
        with pytest.raises(CheckError, match="cannot write /proc/par-test"):
            check_writable("/proc/par-test", directory=True)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(CheckError, match="it is a file"):
        check_writable(tmp_path / "a-file", directory=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_oversubscribe_lets_the_ranks_start():
    """The flag the refusal names overrides it: the same line gets as far as starting its ranks."""
    with pytest.raises(Tripwire):
        cli.main(["bench", "tp", "--nproc", "64", "--oversubscribe"])


def test_nnodes_prints_the_commands_of_a_gpu_cluster(capsys):
    """`--nnodes` starts nothing here, so NCCL on a CPU machine is no reason to refuse."""
    assert cli.main(["train", "--config", "configs/ddp.json", "--nnodes", "2", "--nproc", "4",
                     "--backend", "nccl"]) == 0
    assert capsys.readouterr().out.count("torchrun --nnodes=2") == 2


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys):
    def interrupted(argv):
        raise KeyboardInterrupt
    monkeypatch.setitem(sys.modules, "par_test_interrupted", types.SimpleNamespace(main=interrupted))
    monkeypatch.setitem(cli.COMMANDS, "slow", ("par_test_interrupted", "a stand-in"))
    assert cli.main(["slow"]) == 130
    assert capsys.readouterr().err == "error: interrupted\n"
    with pytest.raises(KeyboardInterrupt):          # --debug: the traceback
        cli.main(["slow", "--debug"])


@pytest.mark.parametrize("job,argv", [("par.dp.job", ["--steps", "0"]), ("par.train.job", ["--config", "x", "--steps", "0"]),
                                      ("par.comm.job", ["--sizes", "1024,0"]), ("par.pp.job", ["--microbatches", "4,-1"])])
def test_a_job_refuses_numbers_below_their_minimum_where_its_arguments_are_made(job, argv):
    """`par.runtime.job_args.arg(minimum=1)`: built in the launcher or parsed in a rank, one clear error."""
    import argparse
    import importlib
    Args = importlib.import_module(job).Args
    with pytest.raises(argparse.ArgumentError, match=f"{argv[-2]} must be at least 1, got"):
        Args.parse(argv)
    field, zero = argv[-2][2:].replace("-", "_"), (0,) if "," in argv[-1] else 0
    with pytest.raises(argparse.ArgumentError, match="must be at least 1"):
        dataclasses.replace(Args.parse(argv[:-2]), **{field: zero})      # as a launcher builds them


def test_the_gloo_batch_skips_a_notebook_its_dry_run_fails():
    """On gloo too, a notebook whose launches cannot split (batch 32 over 3 ranks) is not run, with the reason."""
    problems, _ = par.course.batch.runner.known_failures(
        Path("notebooks/02_data_parallel.ipynb"), {"world_size": 3, "backend": "gloo", "preset": "tiny", "steps": 20})
    assert problems and all(p.kind == "layout" for p in problems)
    assert "batch 32 not divisible by dp 3" in str(problems[0])


@pytest.mark.parametrize("args", [["train", "--config", "configs/ddp.json", "--nproc", "100000"],
                                  ["bench", "zero", "--worlds", "2,0"]], ids=["train-too-many", "bench-zero-0"])
def test_a_real_command_line_is_refused_within_seconds(args):
    """The whole path, as a user types it: one line, exit 2, no rank's output, seconds."""
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "par", *args], capture_output=True, text=True, cwd=ROOT,
                         timeout=60, env={**os.environ, "PAR_DEBUG": ""})
    seconds = time.monotonic() - start
    assert out.returncode == 2 and out.stderr.startswith("error: ") and out.stderr.count("\n") == 1, out.stderr
    assert "rank" not in out.stdout and seconds < 10, (out.stdout, seconds)
