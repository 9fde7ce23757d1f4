"""Time par's 1F1B pipeline against torch.distributed.pipelining's Schedule1F1B, inside one job.

    torchrun --nproc-per-node=2 -m par.pp.bench_job --preset small --microbatches 8 --micro-batch-size 4

Both get the same stages (the same layer boundaries, the same initial weights: `par.pp.torch_api`),
the same batch cut into the same micro-batches, and Adam. They take turns in rounds (the order flips
each round) so a change in machine load hits both alike. A step's time is the slowest rank's. The
first step of each is also compared: the gradients must agree. One more par step is recorded to
measure the bubble. Rank 0 saves {"world_size", "backend", "par": {"steps": [...], "rounds": [median of
each round]}, "torch": {...}, "round_ratios": [par / torch per round], "grad_diff", "bubble", ...}.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

import par.runtime.dist
from par.runtime.job_args import JobArgs, arg
from par.pp import sim as pipeline_sim, schedules
from par.measure import slowest, timed_step
from par.model import build, lm_loss, preset
from par.pp.pipeline import Pipeline
from par.reference import make_optimizer
from par.timeline import Recorder
from par.pp.torch_api import TorchPipeline


@dataclass(frozen=True)
class Args(JobArgs):
    preset: str = arg("small")
    microbatches: int = arg(8)
    micro_batch_size: int = arg(4)
    partition: str = arg("parameters", choices=("parameters", "uniform"))
    steps: int = arg(5, "timed steps per runtime per round")
    rounds: int = arg(4)
    warmup: int = arg(2)
    seed: int = arg(0)


def main(argv=None):
    args = Args.parse(argv)
    env = par.runtime.dist.init()
    p, m = env.world_size, args.microbatches
    cfg = preset(args.preset)
    pipe = Pipeline(build(cfg, seed=args.seed).to_layers(), schedules.one_f_one_b(p, m), lm_loss,
                    method=args.partition)
    theirs = TorchPipeline(build(cfg, seed=args.seed).to_layers(), pipe.bounds, lm_loss, m, "1f1b",
                           env.rank, p, env.device)
    opts = {"par": make_optimizer(pipe.parameters(), "adam", 1e-4),
            "torch": make_optimizer(theirs.parameters(), "adam", 1e-4)}
    g = torch.Generator().manual_seed(args.seed)
    batch = m * args.micro_batch_size
    x = torch.randint(cfg.vocab_size, (batch, cfg.block_size), generator=g).to(env.device)
    y = torch.randint(cfg.vocab_size, (batch, cfg.block_size), generator=g).to(env.device)
    steps = {"par": lambda: pipe.step(x, y), "torch": lambda: theirs.step(x, y)}

    def run(name, n):
        out = []
        for _ in range(n):
            opts[name].zero_grad(set_to_none=True)
            with timed_step(env.device, barrier=True) as clock:
                steps[name]()
                opts[name].step()
            out.append(clock.seconds)
        return out

    # same gradients from both runtimes on the first step (before any optimizer step)
    for name in ("par", "torch"):
        opts[name].zero_grad(set_to_none=True)
        steps[name]()
    grad_diff = max((a.grad - b.grad).abs().max().item() for a, b in zip(pipe.parameters(), theirs.parameters()))
    for name in ("par", "torch"):
        run(name, args.warmup)
    times = {"par": [], "torch": []}
    for r in range(args.rounds):
        for name in (("par", "torch") if r % 2 == 0 else ("torch", "par")):
            times[name].append(run(name, args.steps))
    rec = Recorder()
    opts["par"].zero_grad(set_to_none=True)
    pipe.step(x, y, recorder=rec)
    spans = rec.gather()
    parts = par.runtime.dist.gather_object({"times": times, "grad_diff": grad_diff})
    if parts is not None:
        out = {"world_size": p, "backend": env.backend, "preset": args.preset, "m": m,
               "micro_batch_size": args.micro_batch_size, "bounds": pipe.bounds,
               "numel": sum(x.numel() for x in build(cfg).parameters()),
               "grad_diff": max(q["grad_diff"] for q in parts)}
        for name in ("par", "torch"):   # a step lasts as long as its slowest rank
            rounds = [slowest(q["times"][name][r] for q in parts) for r in range(args.rounds)]
            out[name] = {"steps": [t for r in rounds for t in r], "rounds": [statistics.median(r) for r in rounds]}
            out[name]["median_s"] = statistics.median(out[name]["steps"])
        out["round_ratios"] = [a / b for a, b in zip(out["par"]["rounds"], out["torch"]["rounds"])]
        out["ratio"] = statistics.median(out["round_ratios"])
        sched = schedules.one_f_one_b(p, m)
        out["bubble"] = pipeline_sim.bubble_fraction(spans)
        out["bubble_formula"] = pipeline_sim.bubble_formula(p, m)
        out["bubble_simulated"] = pipeline_sim.simulate(sched, *pipeline_sim.stage_costs(spans, sched)).bubble_fraction
        out["spans"] = spans
        par.runtime.dist.save_result(out)
    par.runtime.dist.teardown()


if __name__ == "__main__":
    main()
