"""Time data-parallel variants against torch's DistributedDataParallel, inside one job.

    torchrun --nproc-per-node=2 -m par.dp.bench_job --preset small --batch 8 --bucket-kb 1024

Every variant wraps its own copy of the same GPT-lite (same seed) and trains on the same batches.
Variants take turns in rounds (the order rotates each round), so a change in machine load hits
all of them alike. A step's time is the slowest rank's; each variant reports its median.
Rank 0 saves {"variants": {name: {...}}, "ratios": {"<name>/ddp": ...}}.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

import par.runtime.dist
from par.runtime.job_args import JobArgs, arg
from par.dp.wrap import train_step, wrap
from par.measure import slowest, timed_step
from par.model import build, lm_loss, preset
from par.reference import make_optimizer

# name: (wrap variant, impl)
VARIANTS = {"ddp": ("ddp", "torch"), "bucketed": ("bucketed", "torch"), "naive": ("naive", "torch"),
            "bucketed-ring": ("bucketed", "ring"), "naive-ring": ("naive", "ring")}


@dataclass(frozen=True)
class Args(JobArgs):
    variants: tuple[str, ...] = arg(tuple(VARIANTS), f"comma-separated, of: {', '.join(VARIANTS)}",
                                    choices=tuple(VARIANTS))
    preset: str = arg("small")
    batch: int = arg(8, "sequences per rank per step")
    bucket_kb: float = arg(1024.0, "bucket cap for par and DDP alike (KiB)")
    steps: int = arg(5, "timed steps per variant per round")
    rounds: int = arg(3)
    warmup: int = arg(2)
    seed: int = arg(0)


def main(argv=None):
    args = Args.parse(argv)
    env = par.runtime.dist.init()
    cfg = preset(args.preset)
    names = list(args.variants)
    models, opts = {}, {}
    for name in names:
        variant, impl = VARIANTS[name]
        model = build(cfg, seed=args.seed).to(env.device)
        models[name] = wrap(model, variant, impl, int(args.bucket_kb * 1024))
        opts[name] = make_optimizer(model.parameters(), "adam", 1e-4)
    g = torch.Generator().manual_seed(args.seed * 1000 + env.rank)  # this rank's shard of the batch
    x = torch.randint(cfg.vocab_size, (args.batch, cfg.block_size), generator=g).to(env.device)
    y = torch.randint(cfg.vocab_size, (args.batch, cfg.block_size), generator=g).to(env.device)

    def timed_steps(name, steps):
        out = []
        for _ in range(steps):
            with timed_step(env.device, barrier=True) as clock:
                train_step(models[name], opts[name], [(x, y)], lm_loss)
            out.append(clock.seconds)
        return out

    for name in names:
        timed_steps(name, args.warmup)
    times = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name] += timed_steps(name, args.steps)
    per_rank = par.runtime.dist.gather_object(times)
    if per_rank is not None:
        step_s = {n: slowest(t[n] for t in per_rank) for n in names}
        result = {"world_size": env.world_size, "backend": env.backend, "preset": args.preset,
                  "numel": sum(p.numel() for p in next(iter(models.values())).parameters()),
                  "batch_per_rank": args.batch, "bucket_kb": args.bucket_kb,
                  "variants": {n: {"median_s": statistics.median(ts), "times_s": ts} for n, ts in step_s.items()}}
        if "ddp" in names:
            ddp = result["variants"]["ddp"]["median_s"]
            result["ratios"] = {f"{n}/ddp": result["variants"][n]["median_s"] / ddp for n in names if n != "ddp"}
        par.runtime.dist.save_result(result)
    par.runtime.dist.teardown()


if __name__ == "__main__":
    main()
