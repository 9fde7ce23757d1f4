"""A straggler: one rank slower than the others, and the synchronous step that waits for it.

Data parallelism is synchronous: no rank steps before the all-reduce has every rank's gradients, so a step ends
when the slowest rank's gradients arrive:

    step = max_r compute_r + all-reduce + update

One rank d seconds slower makes *every* rank d seconds slower: the others spend those d seconds waiting inside the
all-reduce. Here rank `--slow-rank` sleeps d seconds after its backward (a slower or throttled device, a busy
neighbour, emulated), for each d of `--delays-ms`; each step starts on a barrier, and every rank times its
compute (forward + backward, + the delay on the slow rank), its all-reduce (every gradient in one flat bucket,
`dist.all_reduce`: the wait included) and the whole step.

    torchrun --nproc-per-node=2 -m par.resilience.straggler_job --delays-ms 0,150,300 --steps 8

Result: {"world_size", "backend", "runs": [{"delay_ms", "step_s", "per_rank": [{"compute_s", "allreduce_s"}]}]},
each time the median over the steps after the first (a warm-up), `step_s` the slowest rank's.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

import par.runtime.dist
from par.comm import collectives
from par.data import CharDataset, global_batches
from par.dp.naive import broadcast_parameters, flatten_grads, trainable_parameters, unflatten_into_grads
from par.measure import JobResult, RankResult, RunResult, sync
from par.model import build, lm_loss, preset
from par.reference import make_optimizer
from par.runtime.job_args import arg, JobArgs
from par.runtime.job_work import Training


@dataclass(frozen=True)
class Args(JobArgs):
    delays_ms: tuple[float, ...] = arg((0.0, 150.0, 300.0), "comma-separated delays of the slow rank (ms)")
    slow_rank: int = arg(1, "the rank that sleeps after its backward (taken modulo the world size)")
    preset: str = arg("tiny")
    batch: int = arg(8, "global batch size (a multiple of the world size)", minimum=1)
    steps: int = arg(8, "steps per delay; the first is a warm-up, not counted", minimum=2)
    lr: float = arg(1e-3)
    seed: int = arg(0)


@dataclass(frozen=True, kw_only=True)
class RankResult(RankResult):
    """One rank's median compute (forward + backward + its delay) and all-reduce (the wait included) seconds."""
    compute_s: float
    allreduce_s: float


@dataclass(frozen=True, kw_only=True)
class RunResult(RunResult):
    """One delay: the slow rank's `delay_ms`, the median step of the slowest rank (`step_s`), each rank's parts."""
    Rank = RankResult
    delay_ms: float
    step_s: float


@dataclass(frozen=True, kw_only=True)
class Result(JobResult):
    """One run per delay, in `--delays-ms` order."""
    Run = RunResult
    runs: tuple


def work(args: Args, nproc: int) -> list:
    """What a launch computes (the course's dry run costs it): one data-parallel training per delay."""
    return [Training(model=preset(args.preset), global_batch=args.batch, dp=nproc, steps=args.steps,
                     label=f"slow rank +{d:g} ms") for d in args.delays_ms]


def median(xs) -> float:
    return statistics.median(xs)


def straggle(delay_s: float, args: Args, env, batches) -> dict:
    """`args.steps` data-parallel steps with rank `slow_rank` sleeping `delay_s` after backward: this rank's
    compute, all-reduce and step seconds per step (the first dropped)."""
    model = build(preset(args.preset), seed=args.seed).to(env.device)
    broadcast_parameters(model)
    params = trainable_parameters(model)
    opt = make_optimizer(params, "adam", args.lr)
    slow = args.slow_rank % env.world_size
    times = {"compute": [], "allreduce": [], "step": []}
    for x, y in batches:
        x, y = x[env.rank::env.world_size].to(env.device), y[env.rank::env.world_size].to(env.device)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()             # every rank starts the step together
        sync(env.device)
        t0 = time.perf_counter()
        lm_loss(model(x), y).backward()
        if env.rank == slow:
            time.sleep(delay_s)
        sync(env.device)
        t1 = time.perf_counter()
        flat = flatten_grads(params)                 # one bucket: one all-reduce of every gradient
        collectives.all_reduce(flat, "avg", impl="torch")
        unflatten_into_grads(flat, params)
        sync(env.device)
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(env.device)
        t3 = time.perf_counter()
        for k, v in (("compute", t1 - t0), ("allreduce", t2 - t1), ("step", t3 - t0)):
            times[k].append(v)
    return {k: v[1:] for k, v in times.items()}


def main(argv=None) -> None:
    args = Args.parse(argv)
    if any(d < 0 for d in args.delays_ms):
        raise SystemExit(f"error: --delays-ms {','.join(map(str, args.delays_ms))}: a delay is >= 0 ms")
    env = par.runtime.dist.init()
    if args.batch % env.world_size:
        raise SystemExit(f"error: --batch {args.batch} is not a multiple of the world size {env.world_size}: "
                         f"use e.g. --batch {env.world_size * max(1, args.batch // env.world_size)}")
    data = CharDataset(block_size=preset(args.preset).block_size)
    batches = list(global_batches(data, args.batch, args.steps, seed=args.seed))
    runs = []
    for d in args.delays_ms:
        mine = straggle(d / 1e3, args, env, batches)
        ranks = par.runtime.dist.gather_object(mine)
        if env.is_rank0:
            step = [max(ts) for ts in zip(*(r["step"] for r in ranks))]      # the slowest rank's, step by step
            runs.append({"delay_ms": d, "step_s": median(step),
                         "per_rank": [{"compute_s": median(r["compute"]), "allreduce_s": median(r["allreduce"])}
                                      for r in ranks]})
    par.runtime.dist.save_result({"world_size": env.world_size, "backend": env.backend, "runs": runs})
    par.runtime.dist.teardown()


if __name__ == "__main__":
    main()
