"""Train GPT-lite as a DeepSpeed-style JSON config says: `python -m par train --config configs/zero1.json --nproc 4`.

Two ways in, one file:
* under torchrun (LOCAL_RANK is set) this is the job: every rank parses the config for the world
  size it sees (`par.config`), builds the `par.grid.Grid`, picks the engine and trains;
* from a shell or `python -m par train`, it launches itself on `--nproc` ranks with `par.launch.run`
  and prints the result table.

Engines: pp = tp = 1 -> `par.zero.Zero` (stage 0 is plain data parallelism; fp16/bf16 and offload
live there); otherwise `par.parallel3d.Parallel3D` (DP or ZeRO-1 × 1F1B × TP, fp32).

Measured per rank (rank 0 saves them all): step times and samples/s (steps after the first),
the loss of every step, bytes this rank sent per step (`par.commlog`), live model-state bytes,
the activation bytes autograd kept at the peak, and on CUDA the allocator's average and peak.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager

import torch

import par.dist
from par import collectives, commlog
from par.config import TrainConfig, ignored_keys, load, lr_at, model_config
from par.data import CharDataset, global_batches
from par.grid import Grid
from par.memory import cuda_peak_bytes, reset_cuda_peak
from par.mixed_precision import UnsupportedPrecision
from par.model import build, lm_loss
from par.parallel3d import Parallel3D, replica_rows


@contextmanager
def saved_activations(model, meter: dict):
    """Count the bytes of the tensors autograd saves inside the block (parameters excluded)."""
    storages = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in storages and ptr not in {p.untyped_storage().data_ptr() for p in model.parameters()}:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield
    meter["peak"] = max(meter.get("peak", 0), sum(storages.values()))


class ZeroEngine:
    """pp = tp = 1: ZeRO stage 0-3 (+ offload, fp16/bf16) over the dp group, with gradient accumulation."""

    def __init__(self, tc: TrainConfig, model, grid: Grid):
        from par.zero import Zero
        self.tc, self.model, self.grid = tc, model, grid
        self.zero = Zero(model, stage=tc.zero_stage, optimizer=tc.optimizer, lr=tc.lr, offload=tc.offload,
                         group=grid.dp_group, precision=tc.precision, max_grad_norm=tc.gradient_clipping,
                         scaler=loss_scaler(tc), prefetch=tc.prefetch, **tc.optimizer_params)
        self.optimizer = self.zero.updater.opt
        self.activations = {}

    def step(self, x, y) -> float:
        x, y = replica_rows(x, self.grid.dp_rank, self.grid.dp), replica_rows(y, self.grid.dp_rank, self.grid.dp)
        k, total = self.tc.grad_accum, 0.0
        for xm, ym in zip(x.chunk(k), y.chunk(k)):
            with saved_activations(self.model, self.activations):
                loss = lm_loss(self.model(xm).float(), ym) / k
            self.zero.backward(loss)   # stages 2-3 reduce now; stages 0-1 once, in step()
            total += loss.item()
        self.zero.step()
        self.zero.zero_grad()
        if self.grid.dp > 1:   # the mean over the replicas is the loss of the whole batch
            t = torch.tensor([total], device=x.device)
            with commlog.tag("loss"):
                collectives.all_reduce(t, op="avg", group=self.grid.dp_group)
            total = t.item()
        return total

    def memory(self) -> dict:
        """Model states on this device (under offload the optimizer's host bytes are reported apart)."""
        m = self.zero.memory()
        return {**m, "model_states": m["params"] + m["grads"] + m["optimizer_device"]}


def loss_scaler(tc: TrainConfig):
    """The fp16 loss scaler the config asks for (None: par.zero's default for the precision)."""
    if tc.precision != "fp16" or not tc.loss_scale:
        return None
    from par.loss_scaler import DynamicLossScaler, StaticLossScaler
    if "static" in tc.loss_scale:
        return StaticLossScaler(tc.loss_scale["static"])
    return DynamicLossScaler(**tc.loss_scale)


def make_engine(tc: TrainConfig, model, grid: Grid):
    if tc.pp == 1 and tc.tp == 1:
        return ZeroEngine(tc, model, grid)
    return Parallel3D(model, grid, microbatches=tc.grad_accum, optimizer=tc.optimizer, lr=tc.lr,
                      zero_stage=tc.zero_stage, schedule=tc.schedule, track_memory=True, **tc.optimizer_params)


def activation_peak(engine) -> int:
    if isinstance(engine, ZeroEngine):
        return engine.activations.get("peak", 0)
    return engine.pipe.memory.get("peak_bytes", 0)


def train(tc: TrainConfig) -> dict:
    """Run the configured training on this rank; return this rank's measurements."""
    env = par.dist.env()
    grid = Grid(tc.dp, tc.pp, tc.tp)
    mcfg = model_config(tc)
    model = build(mcfg, seed=tc.seed).to(env.device)
    engine = make_engine(tc, model, grid)
    ds = CharDataset(block_size=mcfg.block_size)
    times, losses, sent, allocated = [], [], [], []
    reset_cuda_peak(env.device)
    for step, (x, y) in enumerate(global_batches(ds, tc.train_batch_size, tc.steps, seed=tc.seed)):
        for group in engine.optimizer.param_groups:
            group["lr"] = lr_at(tc, step)
        _sync(env.device)
        t0 = time.perf_counter()
        with commlog.capture() as log:
            loss = engine.step(x.to(env.device), y.to(env.device))
        _sync(env.device)
        times.append(time.perf_counter() - t0)
        sent.append(log.total_bytes())
        if loss is not None:
            losses.append(loss)
        if env.device.type == "cuda":
            allocated.append(torch.cuda.memory_allocated(env.device))
    mem = engine.memory()
    timed = times[1:] or times
    act = activation_peak(engine)
    cuda_peak = cuda_peak_bytes(env.device)
    return {"rank": env.rank, "coords": [grid.dp_rank, grid.stage, grid.tp_rank], "losses": losses,
            "step_s": sum(timed) / len(timed), "bytes_per_step": sum(sent[1:] or sent) / len(sent[1:] or sent),
            "model_states": mem["model_states"], "params": mem["params"], "grads": mem["grads"],
            "optimizer": mem["optimizer"], "activations_peak": act,
            "mem_avg": sum(allocated) / len(allocated) if allocated else mem["model_states"],
            "mem_peak": cuda_peak if cuda_peak is not None else mem["model_states"] + act,
            "mem_source": "cuda allocator" if cuda_peak is not None else "live tensors"}


def summarize(tc: TrainConfig, ranks: list[dict]) -> dict:
    """One row: samples/s (the slowest rank sets the pace), memory and bytes per rank, losses."""
    step_s = max(r["step_s"] for r in ranks)
    losses = next((r["losses"] for r in ranks if r["losses"]), [])
    n = len(ranks)
    return {"strategy": tc.strategy, "layout": tc.layout, "world_size": tc.world_size, "precision": tc.precision,
            "zero_stage": tc.zero_stage, "offload": tc.offload, "train_batch_size": tc.train_batch_size,
            "micro_batch": tc.micro_batch, "grad_accum": tc.grad_accum, "model": tc.model,
            "samples_per_s": tc.train_batch_size / step_s, "step_s": step_s,
            "mem_avg": sum(r["mem_avg"] for r in ranks) / n, "mem_peak": max(r["mem_peak"] for r in ranks),
            "model_states_max": max(r["model_states"] for r in ranks),
            "activations_peak_max": max(r["activations_peak"] for r in ranks),
            "bytes_per_step": sum(r["bytes_per_step"] for r in ranks) / n,
            "mem_source": ranks[0]["mem_source"], "losses": losses, "ranks": ranks}


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def job(argv=None) -> int:
    """The torchrun side: parse, train, gather, save. Several --config run one after the other in the
    same job (saving the launch start-up); a config that fails before training starts (a precision
    this device lacks) becomes {"error": ...} and the next one runs."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", action="append", required=True, help="a JSON file, or a JSON object as text")
    ap.add_argument("--steps", type=int, default=None)
    args = ap.parse_args(argv)
    env = par.dist.init()
    rows = []
    for text in args.config:
        source = json.loads(text) if text.lstrip().startswith("{") else json.loads(open(text).read())
        if args.steps is not None:
            source = {**source, "steps": args.steps}
        tc = load(source, env.world_size)
        try:
            mine = train(tc)
        except UnsupportedPrecision as e:   # raised identically on every rank, before any collective
            rows.append({"strategy": tc.strategy, "error": str(e)})
            continue
        ranks = par.dist.gather_object(mine)
        rows.append(summarize(tc, ranks) if env.rank == 0 else None)
    if env.rank == 0:
        par.dist.save_result(rows[0] if len(rows) == 1 else rows)
    par.dist.teardown()
    return 0


def format_row(row: dict) -> str:
    from par.memory import format_bytes
    return (f"{row['strategy']:<28} {row['samples_per_s']:>10.1f} {format_bytes(row['mem_avg']):>11} "
            f"{format_bytes(row['mem_peak']):>11} {format_bytes(row['bytes_per_step']):>11}  "
            f"loss {row['losses'][0]:.3f} -> {row['losses'][-1]:.3f}")


def main(argv=None) -> int:
    """`python -m par train --config FILE --nproc N [--backend auto] [--steps S]`; under torchrun: the job."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "LOCAL_RANK" in os.environ:
        return job(argv)
    ap = argparse.ArgumentParser(prog="python -m par train", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--timeout", type=int, default=600)
    args = ap.parse_args(argv)
    tc = load(args.config, args.nproc)     # fail here, before starting ranks, with the config's own error
    skipped = ignored_keys(json.loads(open(args.config).read()) if not args.config.lstrip().startswith("{")
                           else json.loads(args.config))
    if skipped:
        print(f"note: accepted for DeepSpeed compatibility, no effect in par: {', '.join(skipped)}")
    print(f"{tc.strategy} on {args.nproc} rank(s): batch {tc.train_batch_size} = micro {tc.micro_batch} × "
          f"accum {tc.grad_accum} × dp {tc.dp}")
    from par.launch import run
    extra = ["--steps", str(args.steps)] if args.steps is not None else []
    row = run("par.jobs.train", nproc=args.nproc, args=["--config", args.config, *extra], backend=args.backend,
              timeout=args.timeout)
    print(f"{'strategy':<28} {'samples/s':>10} {'mem avg':>11} {'mem peak':>11} {'bytes/step':>11}")
    print(format_row(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
