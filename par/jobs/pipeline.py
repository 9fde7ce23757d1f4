"""Train GPT-lite pipeline-parallel (one stage per rank) and record what every rank did.

    torchrun --nproc-per-node=4 -m par.jobs.pipeline --schedules gpipe,1f1b --microbatches 1,4,8

One launch runs every (schedule, m) combination in turn, each on a fresh copy of the model:
`--warmup` untimed steps, then `--steps` timed ones; the last step's timeline is kept. With a
fixed `--micro-batch-size` the batch grows with m (the GPipe view); with `--batch` the batch is
fixed and the micro-batches shrink as m grows (the micro-batch size trade-off).

With `--check` every rank also trains the single-process model on the same batches and compares
its stage: the first step's gradients (max_grad_diff), every step's loss (max_loss_diff) and the
parameters at the end (max_diff). Rank 0 saves {"runs": [{schedule, m, text, losses, step_s, spans,
bubble, bubble_formula, memory (per rank), max_*diff}, ...]}.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import par.dist
from par import pipeline_sim, schedules
from par.data import CharDataset, global_batches
from par.model import build, lm_loss, preset
from par.pipeline import Pipeline
from par.reference import make_optimizer
from par.timeline import Recorder


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedules", default="1f1b", help="comma-separated: naive, gpipe, 1f1b, interleaved")
    ap.add_argument("--microbatches", default="4", help="comma-separated numbers of micro-batches m")
    ap.add_argument("--virtual", type=int, default=2, help="chunks per rank for 'interleaved'")
    ap.add_argument("--micro-batch-size", type=int, default=4, help="sequences per micro-batch")
    ap.add_argument("--batch", type=int, default=None, help="fixed batch (overrides --micro-batch-size)")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--n-layer", type=int, default=None, help="override the preset's number of blocks")
    ap.add_argument("--partition", default="parameters", choices=["parameters", "uniform"])
    ap.add_argument("--steps", type=int, default=2, help="timed steps per combination")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true", help="compare with single-process training")
    ap.add_argument("--record-comm", action="store_true", help="also record receive waits (lane 'comm')")
    return ap.parse_args(argv)


def run_one(args, cfg, kind, m, env, ds):
    v = args.virtual if kind == "interleaved" else 1
    sched = schedules.make(kind, env.world_size, m, v)
    batch = args.batch if args.batch is not None else m * args.micro_batch_size
    model = build(cfg, seed=args.seed)
    pipe = Pipeline(model.to_layers(), sched, lm_loss, method=args.partition, track_memory=True)
    opt = make_optimizer(pipe.parameters(), "adam", args.lr)
    ref = build(cfg, seed=args.seed).to(env.device) if args.check else None
    ref_opt = make_optimizer(ref.parameters(), "adam", args.lr) if args.check else None
    rec = Recorder()
    losses, times = [], []
    names = ({f"{i}.{n}": p for i, layer in enumerate(ref.to_layers()) for n, p in layer.named_parameters()}
             if ref is not None else {})
    loss_diff = grad_diff = 0.0
    for step, (x, y) in enumerate(global_batches(ds, batch, args.warmup + args.steps, seed=args.seed)):
        x, y = x.to(env.device), y.to(env.device)
        opt.zero_grad(set_to_none=True)
        rec.reset()                                   # a barrier: every rank starts the step together
        t0 = time.perf_counter()
        loss = pipe.step(x, y, recorder=rec, record_comm=args.record_comm)
        if env.device.type == "cuda":
            torch.cuda.synchronize(env.device)
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
        if loss is not None:
            losses.append(loss)
        if ref is not None:
            ref_opt.zero_grad(set_to_none=True)
            ref_loss = lm_loss(ref(x), y)
            ref_loss.backward()
            loss_diff = max(loss_diff, abs(loss - ref_loss.item()) if loss is not None else 0.0)
            if step == 0:
                grad_diff = max(((p.grad - names[n].grad).abs().max().item() for n, p in pipe.named_parameters()),
                                default=0.0)
            ref_opt.step()
        opt.step()
    spans = rec.gather()
    diff = None
    if ref is not None:
        diff = max(((p - names[n]).abs().max().item() for n, p in pipe.named_parameters()), default=0.0)
    parts = par.dist.gather_object({"losses": losses, "times": times, "memory": pipe.memory, "diff": diff,
                                    "grad_diff": grad_diff, "loss_diff": loss_diff, "bounds": pipe.bounds})
    if parts is None:
        return None
    step_s = [max(ts) for ts in zip(*(p["times"] for p in parts))]   # a step lasts as long as its slowest rank
    return {"schedule": kind, "m": m, "v": v, "batch": batch, "micro_batch_size": batch // m,
            "text": sched.text(), "bounds": parts[0]["bounds"],
            "losses": [l for p in parts for l in p["losses"]],
            "step_s": step_s, "median_step_s": statistics.median(step_s) if step_s else None,
            "spans": spans, "bubble": pipeline_sim.bubble_fraction(spans),
            "bubble_formula": pipeline_sim.bubble_formula(env.world_size, m),
            "memory": [p["memory"] for p in parts],
            "max_diff": max(p["diff"] for p in parts) if args.check else None,
            "max_grad_diff": max(p["grad_diff"] for p in parts) if args.check else None,
            "max_loss_diff": max(p["loss_diff"] for p in parts) if args.check else None}


def main(argv=None):
    args = parse(argv)
    env = par.dist.init()
    torch.manual_seed(args.seed)
    overrides = {"n_layer": args.n_layer} if args.n_layer else {}
    cfg = preset(args.preset, **overrides)
    ds = CharDataset(block_size=cfg.block_size)
    runs = []
    for kind in args.schedules.split(","):
        for m in map(int, args.microbatches.split(",")):
            r = run_one(args, cfg, kind, m, env, ds)
            runs.append(r)
            if r is not None:
                print(f"{kind:>11} m={m:<3} step {r['median_step_s'] * 1e3:8.1f} ms   "
                      f"bubble measured {r['bubble']:.2f}, formula {r['bubble_formula']:.2f}", flush=True)
    par.dist.save_result({"world_size": env.world_size, "backend": env.backend, "preset": args.preset,
                          "config": cfg.to_dict(), "runs": runs})
    if dist.is_initialized():
        par.dist.teardown()


if __name__ == "__main__":
    main()
