"""One training loop for every layout: a DeepSpeed-style config names dp × pp × tp, the ZeRO stage and the
precision; this file builds the grid, stacks the strategies and runs the steps.

    python -m par train --config configs/3d.json --nproc 8     # par/train/job.py calls `train` on each rank

Read it top to bottom, as one rank does (every rank runs the same lines on its own part):

    config  = par.train.config.load(file, world_size)      dp = world / (pp · tp); batch = micro × accum × dp
    grid    = Grid(dp, pp, tp)                       par.runtime.grid: this rank's (d, s, t) and its three groups
    model   = build(config, seed)                    the same dense GPT-lite on every rank
    engine  = stack(config, model, grid)             pp = tp = 1: ZeroDataParallel (ZeRO 0-3, offload, 16-bit)
                                                     else Parallel3D: TP in each block, PP over the stages,
                                                     DP or ZeRO-1 over the replicas       (par.train.parallel3d)
    for step, (x, y) in batches(config):             the same global batches on every rank
        lr   = lr_at(config, step)                   DeepSpeed's WarmupLR / WarmupDecayLR
        loss = engine.step(x, y)                     forward, backward, reduce gradients, update
        measure seconds (par.measure.timed_step: wall, and steady on the load-proof clock), bytes sent
        (par.comm.commlog), memory
        (activations: the meter's saved-tensor hooks in the warm-up step only)
    summarize(config, every rank's numbers)          one row: samples/s, memory, bytes, losses

Step 0 is a warm-up (allocations, the pipeline's shape exchange): it trains like the others and its loss is
reported, but its time is not. It is also the step the activation meter measures: its saved-tensor hooks run in
every operation, so the timed steps run without them (the same shapes every step, so the same activations). A
step reads its loss once (the engines add the micro-batches' losses on the device). `check=True` also trains one
process on the same batches (rank 0, then broadcast) and reports the largest parameter difference from it: the
proof that the layout is exact.
"""
from __future__ import annotations

import gc
import statistics

import torch
import torch.distributed as dist

import par.runtime.dist
from par.clock import Waiting
from par.comm import commlog
from par.train.config import TrainConfig, loss_scaler, lr_at, model_config
from par.data import CharDataset, global_batches
from par.runtime.grid import Grid
from par.measure import slowest, timed_step, watch_ranks
from par.memory.accounting import cuda_peak_bytes, reset_cuda_peak
from par.model import build, lm_loss
from par.train.parallel3d import ZeroDataParallel, Parallel3D
from par.reference import train_single

WARMUP_STEPS = 1


def stack(tc: TrainConfig, model, grid: Grid):
    """The engine the config asks for, on this rank's part of the grid."""
    if tc.pp == 1 and tc.tp == 1:
        return ZeroDataParallel(model, grid, microbatches=tc.grad_accum, stage=tc.zero_stage, optimizer=tc.optimizer,
                                lr=tc.lr, offload=tc.offload, precision=tc.precision, scaler=loss_scaler(tc),
                                max_grad_norm=tc.gradient_clipping, prefetch=tc.prefetch, **tc.optimizer_params)
    return Parallel3D(model, grid, microbatches=tc.grad_accum, optimizer=tc.optimizer, lr=tc.lr,
                      zero_stage=tc.zero_stage, schedule=tc.schedule, **tc.optimizer_params)


def batches(tc: TrainConfig):
    """The run's global batches (the same on every rank, and for the single-process reference)."""
    ds = CharDataset(block_size=model_config(tc).block_size)
    return global_batches(ds, tc.train_batch_size, tc.steps, seed=tc.seed)


def train(tc: TrainConfig, check: bool = False) -> dict:
    """Train as `tc` says on this rank (inside a job, after `par.runtime.dist.init()`); return this rank's numbers."""
    device = par.runtime.dist.env().device
    grid = Grid(tc.dp, tc.pp, tc.tp)
    model = build(model_config(tc), seed=tc.seed).to(device)
    engine = stack(tc, model, grid)
    seconds, steady, cpu, losses, sent, allocated = [], [], [], [], [], []
    watch_ranks()
    reset_cuda_peak(device)
    for step, (x, y) in enumerate(batches(tc)):
        for group in engine.optimizer.param_groups:
            group["lr"] = lr_at(tc, step)
        engine.track_memory = step < WARMUP_STEPS        # the meter in the untimed warm-up step only
        waiting = Waiting(others=True)
        with timed_step(device) as clock, commlog.capture() as log:
            loss = engine.step(x.to(device), y.to(device))
        if device.type != "cuda":     # the run-queue wait of what the step waited for (its process's other
                                      # threads, the other ranks)
            clock.waited_s = waiting.done()
        seconds.append(clock.seconds)
        steady.append(clock.steady_s)
        cpu.append(clock.cpu_s)
        sent.append(log.total_bytes())
        if loss is not None:          # pipelines: only the last stage knows the loss
            losses.append(loss)
        if device.type == "cuda":
            allocated.append(torch.cuda.memory_allocated(device))
    mem, act, cuda_peak = engine.memory(), engine.activation_peak(), cuda_peak_bytes(device)
    out = {"rank": grid.rank, "coords": [grid.dp_rank, grid.stage, grid.tp_rank], "losses": losses,
           "step_s": seconds, "steady_s": steady, "cpu_s": cpu,
           "bytes_per_step": statistics.mean(sent[WARMUP_STEPS:] or sent),
           "model_states": mem["model_states"], "params": mem["params"], "grads": mem["grads"],
           "optimizer": mem["optimizer"], "activations_peak": act,
           "mem_avg": statistics.mean(allocated) if allocated else mem["model_states"],
           "mem_peak": cuda_peak if cuda_peak is not None else mem["model_states"] + act,
           "mem_source": "cuda allocator" if cuda_peak is not None else "live tensors"}
    if check:
        out["max_param_diff"] = engine.max_diff_from(reference(tc, device))
    del engine, model
    gc.collect()       # ZeRO's hooks keep the engine in reference cycles: free it before another run
    return out


def reference(tc: TrainConfig, device) -> torch.nn.Module:
    """One process, the whole global batch, the same model, optimizer and learning rates: what every layout
    must equal. Trained on rank 0 and broadcast (the other ranks would only repeat the same arithmetic)."""
    model = build(model_config(tc), seed=tc.seed).to(device)
    state = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        data = [(x.to(device), y.to(device)) for x, y in batches(tc)]
        train_single(model, data, lm_loss, tc.optimizer, tc.lr, lr_at=lambda s: lr_at(tc, s), **tc.optimizer_params)
        state = [{k: v.cpu() for k, v in model.state_dict().items()}]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(state, src=0)
    model.load_state_dict(state[0])
    return model


def summarize(tc: TrainConfig, ranks: list[dict], backend: str) -> dict:
    """One row for all ranks, by the job contract (par/measure.py): the slowest rank sets each step's
    time; samples/s = batch / median step time, with the fastest and slowest timed step beside it.
    steady_s: the same steps on the load-proof clock (`par.clock`; the slowest rank's), what a prediction is
    held to; cpu_s: CPU seconds of each timed step, summed over the ranks (the work, whatever else the machine
    does)."""
    step_s = slowest(r["step_s"] for r in ranks)
    steady = slowest(r["steady_s"] for r in ranks)
    steady = steady[WARMUP_STEPS:] or steady
    cpu_s = [sum(r["cpu_s"][i] for r in ranks) for i in range(len(step_s))]
    timed = step_s[WARMUP_STEPS:] or step_s
    median = statistics.median(timed)
    losses = next((r["losses"] for r in ranks if r["losses"]), [])
    n = len(ranks)
    row = {"world_size": tc.world_size, "backend": backend, "losses": losses, "step_s": timed,
           "warmup_steps": len(step_s) - len(timed), "per_rank": ranks,
           "strategy": tc.strategy, "layout": tc.layout, "precision": tc.precision, "zero_stage": tc.zero_stage,
           "offload": tc.offload, "train_batch_size": tc.train_batch_size, "micro_batch": tc.micro_batch,
           "grad_accum": tc.grad_accum, "model": tc.model, "median_step_s": median,
           "steady_s": steady, "median_steady_s": statistics.median(steady),
           "cpu_s": cpu_s[WARMUP_STEPS:] or cpu_s, "median_cpu_s": statistics.median(cpu_s[WARMUP_STEPS:] or cpu_s),
           "samples_per_s": tc.train_batch_size / median,
           "samples_per_s_range": [tc.train_batch_size / max(timed), tc.train_batch_size / min(timed)],
           "mem_avg": sum(r["mem_avg"] for r in ranks) / n, "mem_peak": max(r["mem_peak"] for r in ranks),
           "model_states_max": max(r["model_states"] for r in ranks),
           "activations_peak_max": max(r["activations_peak"] for r in ranks),
           "bytes_per_step": sum(r["bytes_per_step"] for r in ranks) / n, "mem_source": ranks[0]["mem_source"]}
    if "max_param_diff" in ranks[0]:
        row["max_param_diff"] = max(r["max_param_diff"] for r in ranks)
    return row
