"""Train GPT-lite as a DeepSpeed-style JSON config says: the torchrun job behind `python -m par train`
(`par.train.cli`) and lecture 07's benchmark table (`par.train.suite`).

Every rank parses the config(s) for the world it sees, runs `par.train.loop.train` (read that for what a step
does), and rank 0 saves `par.train.loop.summarize` of all ranks:

    par.runtime.launch.run("par.train.job", nproc=4, args=["--config", "configs/zero1.json"])

Result (the contract of par/measure.py): world_size, backend, losses, step_s (timed steps, the slowest
rank's), per_rank, and the row keys of `par.train.loop.summarize` (strategy, layout, samples_per_s and its range,
memory, bytes per step, max_param_diff with --check). Several --config in one launch (saving the start-up)
give {"world_size", "backend", "runs": [row, ...]}; a config this device cannot run (fp16 without fp16
kernels) becomes a run {"strategy", "error"} and the next one runs. With --calibrate every rank measures this
machine's compute and collectives for each config just before its run (`par.train.calibration.measure`, a second
or two), and each run carries its own as `calibration` (what `par.train.suite` predicts the row from: a machine
whose speed drifts over a launch's seconds is measured when the row runs, not at the launch's start).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import par.runtime.dist
from par.measure import JobResult, RankResult, RunResult
from par.precision.mixed_precision import UnsupportedPrecision
from par.runtime.job_args import arg, JobArgs
from par.runtime.job_work import Training
from par.train import calibration
from par.train.config import load, model_config, parse, read
from par.train.loop import summarize, train


@dataclass(frozen=True)
class Args(JobArgs):
    config: tuple[str, ...] = arg(help="a JSON file, or a JSON object as text; one --config per run", repeat=True)
    steps: int | None = arg(None, "override the configs' steps", minimum=1)
    check: bool = arg(False, "train the single-process model beside and compare")
    calibrate: bool = arg(False, "measure this machine's GEMMs, optimizer and collectives for each config just "
                                 "before its run (par.train.calibration)")


@dataclass(frozen=True, kw_only=True)
class RankResult(RankResult):
    """One rank's numbers (`par.train.loop.train`): its place in the grid, losses, step times, bytes, memory."""
    coords: list
    losses: list
    step_s: list
    steady_s: list
    cpu_s: list
    bytes_per_step: float
    model_states: int
    params: int
    grads: int
    optimizer: int
    activations_peak: int
    mem_avg: float
    mem_peak: int
    mem_source: str
    max_param_diff: float | None = None


@dataclass(frozen=True, kw_only=True)
class RunResult(RunResult):
    """One config's row (`par.train.loop.summarize`), or {strategy, error} for a config this device cannot run."""
    Rank = RankResult
    strategy: str
    error: str | None = None
    world_size: int | None = None
    backend: str | None = None
    losses: list | None = None
    step_s: list | None = None
    warmup_steps: int | None = None
    layout: str | None = None
    precision: str | None = None
    zero_stage: int | None = None
    offload: bool | None = None
    train_batch_size: int | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None
    model: dict | None = None
    median_step_s: float | None = None
    steady_s: list | None = None
    median_steady_s: float | None = None
    cpu_s: list | None = None
    median_cpu_s: float | None = None
    samples_per_s: float | None = None
    samples_per_s_range: list | None = None
    mem_avg: float | None = None
    mem_peak: int | None = None
    model_states_max: int | None = None
    activations_peak_max: int | None = None
    bytes_per_step: float | None = None
    mem_source: str | None = None
    max_param_diff: float | None = None
    calibration: dict | None = None


@dataclass(frozen=True, kw_only=True)
class Result(JobResult, RunResult):
    """The launch: one config's row itself, or with several --config one row per config (`runs`)."""
    Run = RunResult
    strategy: str | None = None
    runs: tuple | None = None

def work(args: Args, nproc: int) -> list:
    """What a launch of these arguments computes (the course's dry run costs it): one run per config, as
    `par.train.config` parses it for nproc ranks."""
    out = []
    for source in args.config:
        tc = parse(read(source), nproc)
        out.append(Training(model=model_config(tc), global_batch=tc.train_batch_size, dp=tc.dp, pp=tc.pp, tp=tc.tp,
                            zero_stage=tc.zero_stage, offload=tc.offload, microbatches=tc.grad_accum,
                            precision=tc.precision, optimizer=tc.optimizer,
                            steps=tc.steps if args.steps is None else args.steps, label=tc.strategy))
    return out


def main(argv=None) -> int:
    """Parse, train, gather, save (on every rank, under torchrun)."""
    args = Args.parse(argv)
    env = par.runtime.dist.init()
    runs = []
    for source in args.config:
        cfg = read(source)
        tc = load({**cfg, "steps": args.steps} if args.steps is not None else cfg, env.world_size)
        machine = calibration.measure([tc], env) if args.calibrate else None
        try:
            mine = train(tc, check=args.check)
        except UnsupportedPrecision as e:   # raised identically on every rank, before any collective
            runs.append({"strategy": tc.strategy, "error": str(e)})
            continue
        ranks = par.runtime.dist.gather_object(mine)
        if env.rank == 0:
            run = summarize(tc, ranks, env.backend)
            runs.append({**run, "calibration": machine} if machine else run)
    if env.rank == 0:
        result = runs[0] if len(runs) == 1 else {"world_size": env.world_size, "backend": env.backend, "runs": runs}
        par.runtime.dist.save_result(result)
    par.runtime.dist.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
