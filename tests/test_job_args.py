"""A job's arguments as one typed object (`par.runtime.job_args`): the command line parses back to the same
object, the options keep the spellings the jobs always had, and ZeRO's runs are typed (`par.zero.job.ZeroRun`)."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from par.runtime.job_args import JobArgs, arg
from par.zero.job import Args as ZeroArgs, ZeroRun


@dataclass(frozen=True)
class Args(JobArgs):
    config: tuple[str, ...] = arg(help="one option per item", repeat=True)
    preset: str = arg("tiny", "a preset")
    micro_batch: int | None = arg(None)
    ratio: float = arg(0.01)
    sizes: tuple[int, ...] = arg((1, 2))
    impl: str = arg("ring", choices=("ring", "torch"))
    check: bool = arg(False)


def test_only_what_differs_from_the_defaults_is_written():
    args = Args(config=('{"a": 1, "b": 2}', "x.json"), micro_batch=4, sizes=(), check=True)
    assert args.to_argv() == ["--config", '{"a": 1, "b": 2}', "--config", "x.json", "--micro-batch", "4",
                              "--sizes", "", "--check"]
    assert Args.parse(args.to_argv()) == args
    assert Args.parse(["--config", "c", "--sizes", "3,4", "--ratio", "0.5"]) == Args(("c",), sizes=(3, 4), ratio=0.5)


def test_bad_values_are_argparse_errors(capsys):
    for argv in (["--config", "c", "--impl", "nccl"], ["--config", "c", "--sizes", "1,x"], []):
        with pytest.raises(SystemExit):
            Args.parse(argv)
    assert "--config" in capsys.readouterr().err


def test_zero_runs_are_typed_and_keep_their_labels():
    labels = ["0", "3+offload", "3+prefetch", "2+bf16", "1+fp16", "3+resume", "fsdp2"]
    assert [str(ZeroRun.parse(label)) for label in labels] == labels
    assert ZeroRun.parse("fsdp2") == ZeroRun(3, fsdp2=True) and ZeroRun.parse("2+bf16") == ZeroRun(2, precision="bf16")
    args = ZeroArgs.parse(["--runs", "0,3+offload", "--checkpoint-run", "3", "--timeline-runs", ""])
    assert args == ZeroArgs(runs=(ZeroRun(0), ZeroRun(3, offload=True)), checkpoint_run=ZeroRun(3), timeline_runs=())
    with pytest.raises(ValueError, match="use a stage 0-3"):
        ZeroRun.parse("4+offload")
