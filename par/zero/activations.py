"""ZeRO-R: the residual states. Activation recomputation, and its checkpoints partitioned across TP ranks.

Activation recomputation (full checkpointing) keeps only each transformer layer's input during the
forward pass and runs the layer's forward again in backward to rebuild the rest. Memory: the layer
inputs, e·s·b·h each, plus the one layer being rebuilt (`par.memory.accounting.activation_peak_bytes`).
Compute: one more forward of the layers (the whole forward: `early_stop=False`; torch's default stops
recomputing once backward has what it needs, a little earlier), so with backward ≈ 2 forwards a step costs

    t_recompute = t_step + t_forward(layers)  ≈  (1 + 2 + 1) / (1 + 2) · t_step = 4/3 · t_step.

Under tensor parallelism every rank of the TP group holds the same layer input (it is replicated),
so the checkpoints are replicated t times. ZeRO-R's *partitioned activation checkpointing* keeps a
1/t slice of each checkpoint per rank and all-gathers it right before the recomputation:

    kept per rank and layer:  e·s·b·h      ->   e·s·b·h / t        (one all-gather of (t-1)/t·e·s·b·h in backward)

    y = partitioned_checkpoint(block, x, group)      # forward without keeping block's activations

`checkpointed_forward(model, x, mode, group)` runs GPT-lite (dense or `par.tp.layers`) with every
transformer layer in mode "none", "full" (torch.utils.checkpoint) or "partitioned" (the above).
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from par.comm import collectives, commlog
from par.measure import sync, typed
from par.tp.ops import group_rank, group_size

MODES = ("none", "full", "partitioned")


class PartitionedCheckpoint(torch.autograd.Function):
    """Forward without a graph, keeping only this rank's 1/t slice of the input; backward all-gathers the
    input, runs the forward again with a graph and back-propagates through it (Megatron/DeepSpeed's
    `partition_activations`). The layer's parameters receive their gradients from that inner backward."""

    @staticmethod
    def forward(ctx, x, layer, group, impl):
        ctx.layer, ctx.group, ctx.impl, ctx.shape = layer, group, impl, x.shape
        n, r = group_size(group), group_rank(group)
        flat = x.detach().reshape(-1)
        part = -(-flat.numel() // n)
        mine = torch.zeros(part, dtype=x.dtype, device=x.device)
        a, b = min(r * part, flat.numel()), min((r + 1) * part, flat.numel())
        mine[:b - a] = flat[a:b]
        ctx.save_for_backward(mine)       # the only thing kept: 1/t of the input
        with torch.no_grad():
            return layer(x)

    @staticmethod
    def backward(ctx, grad):
        (mine,) = ctx.saved_tensors
        n, r = group_size(ctx.group), group_rank(ctx.group)
        full = torch.zeros(n * mine.numel(), dtype=mine.dtype, device=mine.device)
        full[r * mine.numel():(r + 1) * mine.numel()] = mine
        with commlog.tag("checkpoint all-gather"):
            collectives.all_gather(full, group=ctx.group, impl=ctx.impl)
        x = full[:ctx.shape.numel()].view(ctx.shape).detach().requires_grad_(True)
        with torch.enable_grad():
            y = ctx.layer(x)
        torch.autograd.backward(y, grad)
        return x.grad, None, None, None


def partitioned_checkpoint(layer: nn.Module, x: torch.Tensor, group=None, impl: str = "ring") -> torch.Tensor:
    """`layer(x)` keeping 1/t of `x` for backward (t = size of the TP `group`); see PartitionedCheckpoint."""
    return PartitionedCheckpoint.apply(x, layer, group, impl)


def run_layers(layers, x: torch.Tensor, mode: str = "none", group=None, impl: str = "ring") -> torch.Tensor:
    """x through `layers` one after the other, each run plainly ("none"), under full recomputation
    ("full"), or with its checkpoint partitioned over the TP `group` ("partitioned")."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: use one of {', '.join(MODES)}")
    for layer in layers:
        if mode == "full":      # the whole layer forward again (no early stop: recomputation = one forward)
            x = checkpoint(layer, x, use_reentrant=False, early_stop=False)
        elif mode == "partitioned":
            x = partitioned_checkpoint(layer, x, group, impl)
        else:
            x = layer(x)
    return x


def checkpointed_forward(model: nn.Module, idx: torch.Tensor, mode: str = "none", group=None,
                         impl: str = "ring") -> torch.Tensor:
    """GPT-lite's forward through `model.to_layers()` = [embedding, layer, ..., layer, head], the
    transformer layers in between run by `run_layers` in `mode`."""
    layers = model.to_layers()
    return layers[-1](run_layers(layers[1:-1], layers[0](idx), mode, group, impl))


def recompute_cost(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor, loss_fn, repeats: int = 3,
                   threads: int = 1) -> dict:
    """Seconds of one training step (forward + backward) without and with full recomputation, and of one
    forward of the transformer layers (with autograd recording, as the recomputation runs); medians of
    `repeats`, with every sample and the prediction t_step + t_forward(layers); typed (`par.measure.typed`:
    `cost.ratio`, `cost.samples.full`).

    On the CPU: this process's CPU time (time.process_time) on `threads` threads, which other programs
    on the machine do not inflate. On a GPU: wall time between synchronizations."""
    device = idx.device
    cuda = device.type == "cuda"

    def clock():
        if cuda:
            sync(device)
            return time.perf_counter()
        return time.process_time()

    def step(mode):
        model.zero_grad(set_to_none=True)
        t0 = clock()
        loss_fn(checkpointed_forward(model, idx, mode), targets).backward()
        return clock() - t0

    def forward_layers():
        layers = model.to_layers()
        x = layers[0](idx)
        t0 = clock()
        for layer in layers[1:-1]:
            x = layer(x)
        return clock() - t0

    before = torch.get_num_threads()
    if not cuda:
        torch.set_num_threads(threads)
    try:
        step("none"), step("full")          # warm-up: the first calls allocate
        samples = {"none": [], "full": [], "forward_layers": []}
        for _ in range(repeats):
            samples["none"].append(step("none"))
            samples["full"].append(step("full"))
            samples["forward_layers"].append(forward_layers())
    finally:
        torch.set_num_threads(before)
        model.zero_grad(set_to_none=True)
    med = {k: statistics.median(v) for k, v in samples.items()}
    return typed({"step_s": med["none"], "step_recompute_s": med["full"], "forward_layers_s": med["forward_layers"],
                  "predicted_recompute_s": med["none"] + med["forward_layers"], "ratio": med["full"] / med["none"],
                  "predicted_ratio": (med["none"] + med["forward_layers"]) / med["none"],
                  "clock": "wall (CUDA synchronized)" if cuda else f"CPU time, {threads} thread(s)", "samples": samples})
