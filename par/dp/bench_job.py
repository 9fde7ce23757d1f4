"""Time data-parallel variants against torch's DistributedDataParallel, inside one job.

    torchrun --nproc-per-node=2 -m par.dp.bench_job --preset small --batch 8 --bucket-kb 1024

Every variant wraps its own copy of the same GPT-lite (same seed) and trains on the same batches.
Variants take turns in rounds (the order rotates each round), so a change in machine load hits
all of them alike. A step's time is the slowest rank's; each variant reports its median.
Rank 0 saves {"variants": {name: {...}}, "ratios": {"<name>/ddp": ...}}.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import par.runtime.dist
from par.dp.wrap import train_step, wrap
from par.model import build, lm_loss, preset
from par.reference import make_optimizer

# name: (wrap variant, impl)
VARIANTS = {"ddp": ("ddp", "torch"), "bucketed": ("bucketed", "torch"), "naive": ("naive", "torch"),
            "bucketed-ring": ("bucketed", "ring"), "naive-ring": ("naive", "ring")}


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of: {', '.join(VARIANTS)}")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--bucket-kb", type=float, default=1024, help="bucket cap for par and DDP alike (KiB)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per variant per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None):
    args = parse(argv)
    env = par.runtime.dist.init()
    cfg = preset(args.preset)
    names = args.variants.split(",")
    unknown = set(names) - set(VARIANTS)
    if unknown:
        raise ValueError(f"unknown variants {sorted(unknown)}: use {', '.join(VARIANTS)}")
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
            dist.barrier()
            t0 = time.perf_counter()
            train_step(models[name], opts[name], [(x, y)], lm_loss)
            _sync(env.device)
            out.append(time.perf_counter() - t0)
        return out

    for name in names:
        timed_steps(name, args.warmup)
    times = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name] += timed_steps(name, args.steps)
    per_rank = par.runtime.dist.gather_object(times)
    if per_rank is not None:
        slowest = {n: [max(t[n][i] for t in per_rank) for i in range(len(times[n]))] for n in names}
        result = {"world_size": env.world_size, "backend": env.backend, "preset": args.preset,
                  "numel": sum(p.numel() for p in next(iter(models.values())).parameters()),
                  "batch_per_rank": args.batch, "bucket_kb": args.bucket_kb,
                  "variants": {n: {"median_s": statistics.median(ts), "times_s": ts} for n, ts in slowest.items()}}
        if "ddp" in names:
            ddp = result["variants"]["ddp"]["median_s"]
            result["ratios"] = {f"{n}/ddp": result["variants"][n]["median_s"] / ddp for n in names if n != "ddp"}
        par.runtime.dist.save_result(result)
    par.runtime.dist.teardown()


if __name__ == "__main__":
    main()
