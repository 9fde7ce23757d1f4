"""Train GPT-lite under ZeRO stages (and offload) on every rank; report memory, bytes, time, timeline.

    python -m par.jobs.train_zero --runs 0,1,2,3,3+offload --preset tiny --steps 20

One launch trains the same model from the same seed once per run in `--runs`
(`S` = stage S, `S+offload` = stage S with the optimizer on the CPU, `3+prefetch` =
stage 3 gathering the next unit while this one computes) and rank 0
saves, per run: the losses, the per-rank model-state bytes measured after
backward (params / grads / optimizer) beside `par.memory`'s formula, the
bytes sent in one step by kind beside 2(N-1)/N·Ψ·bytes (3(N-1)/N for stage 3),
the median step time, and (for `--timeline-runs`) the gather / reduce-scatter
sequence of one step as timeline spans. `--checkpoint DIR` also saves a sharded
checkpoint of the last run.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import par.dist
from par import checkpoint, commlog, memory
from par.data import CharDataset, global_batches
from par.model import build, lm_loss, preset
from par.timeline import Recorder
from par.zero import Zero


def parse_run(label: str) -> tuple[int, bool, bool]:
    """'2' -> (2, False, False); '3+offload' -> (3, True, False); '3+prefetch' -> (3, False, True)."""
    stage, *extras = label.split("+")
    if not stage.isdigit() or not set(extras) <= {"offload", "prefetch"}:
        raise ValueError(f"run {label!r}: use a stage 0-3, optionally with '+offload' and/or '+prefetch' "
                         f"(e.g. 3+offload, 3+prefetch)")
    return int(stage), "offload" in extras, "prefetch" in extras


def train_run(label: str, args, env, batches) -> dict:
    stage, offload, prefetch = parse_run(label)
    model = build(preset(args.preset), seed=args.seed).to(env.device)
    rec = Recorder() if label in args.timeline_runs.split(",") else None
    zero = Zero(model, stage=stage, optimizer=args.optimizer, lr=args.lr, offload=offload, impl=args.impl,
                recorder=rec, precision=args.precision, prefetch=prefetch)
    n, r = env.world_size, env.rank
    memory.reset_cuda_peak(env.device)
    losses, times, mem, step_bytes = [], [], {}, {}
    for s, (x, y) in enumerate(batches):
        x, y = x[r::n].to(env.device), y[r::n].to(env.device)
        if rec is not None and s == len(batches) - 1:
            rec.reset()
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        with commlog.capture() as log:
            loss = lm_loss(model(x).float(), y)
            zero.backward(loss)
            if s == min(1, len(batches) - 1):
                mem = zero.memory()      # model states at their peak: grads reduced, optimizer state allocated
            zero.step()
            zero.zero_grad()
        if env.device.type == "cuda":
            torch.cuda.synchronize(env.device)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        step_bytes = {}
        for e in log.events:   # the model's traffic; the 4-byte overflow flag of mixed precision is apart
            key = "overflow flag" if "overflow flag" in e.tag else e.kind
            step_bytes[key] = step_bytes.get(key, 0) + e.bytes_sent
    itemsize = 4 if args.precision == "fp32" else 2
    factor = {0: 2, 1: 2, 2: 2, 3: 3}[stage]
    flag_bytes = step_bytes.pop("overflow flag", 0)
    out = {"label": label, "stage": stage, "offload": offload, "prefetch": prefetch, "losses": losses,
           "memory": mem, "cuda_peak": memory.cuda_peak_bytes(env.device),
           "formula": memory.model_state_bytes(zero.numel, n, stage, args.precision, args.optimizer).to_dict(),
           "skipped": zero.skipped,
           "bytes": step_bytes, "bytes_total": sum(step_bytes.values()), "overflow_flag_bytes": flag_bytes,
           "bytes_formula": factor * (n - 1) / n * zero.numel * itemsize,
           "step_time": statistics.median(times[1:] if len(times) > 1 else times)}
    if offload:
        steps = len(batches)
        out["offload_bytes_per_step"] = {"to_host": zero.updater.to_host_bytes / steps,
                                         "to_device": zero.updater.to_device_bytes / steps}
        out["placement"] = zero.updater.placement()
    if rec is not None:
        out["timeline"] = rec.gather()
    if args.checkpoint and label == args.runs.split(",")[-1]:
        checkpoint.save(zero, args.checkpoint, step=len(batches))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="0,1,2,3,3+offload", help="comma-separated: stage, or stage+offload")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8, help="global batch size (a multiple of the world size)")
    ap.add_argument("--optimizer", default="adam")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--impl", default="ring", choices=("ring", "torch"))
    ap.add_argument("--precision", default="fp32", choices=("fp32", "fp16", "bf16"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeline-runs", default="3,3+offload", help="runs whose last step is recorded as a timeline")
    ap.add_argument("--checkpoint", default="", help="directory for a sharded checkpoint of the last run")
    args = ap.parse_args(argv)
    env = par.dist.init()
    if args.batch % env.world_size:
        raise SystemExit(f"--batch {args.batch} is not a multiple of the world size {env.world_size}: "
                         f"use e.g. --batch {env.world_size * max(1, args.batch // env.world_size)}")
    for label in args.runs.split(","):
        parse_run(label)
    cfg = preset(args.preset)
    data = CharDataset(block_size=cfg.block_size)
    batches = list(global_batches(data, args.batch, args.steps, seed=args.seed))
    runs = [train_run(label, args, env, batches) for label in args.runs.split(",")]
    numel = sum(p.numel() for p in build(cfg, seed=args.seed).parameters())
    par.dist.save_result({"world": env.world_size, "backend": env.backend, "device": str(env.device),
                          "preset": args.preset, "precision": args.precision, "numel": numel, "runs": runs})
    par.dist.teardown()


if __name__ == "__main__":
    main()
