"""Megatron tensor parallelism through torch's own API, beside par's: DTensor `parallelize_module`.

    mesh = init_device_mesh("cpu", (world_size,))            # "cuda" on GPUs; gloo or NCCL underneath
    model = dtensor_tp(build("tiny"), mesh)                   # the same GPT-lite, its blocks split in place
    loss = lm_loss(model(x), y); loss.backward(); opt.step()  # any optimizer: the split weights are DTensors

Inside every block the plan is par's (`par.tp.layers`): the fused QKV projection and the MLP's first linear
are `ColwiseParallel` (weight Shard(0): this rank's output features; its input Replicate, so the gradient of
the input is summed over ranks in backward: the f operator), the attention's output projection and the MLP's
second linear `RowwiseParallel` (weight Shard(1); the partial sums all-reduced to Replicate in forward: the g
operator; the bias added once, after). Two things torch cannot know and par's `from_dense` also does: the
fused [Q | K | V] weight is first re-laid as [Q_0 K_0 V_0 | Q_1 K_1 V_1 | ...] (`qkv_for_column_split`) so that
a plain Shard(0) hands every rank whole heads, and each attention then runs n_head / N heads.
`compare(dense, mesh, batches)` runs both on the same weights and data and returns the largest differences.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from par.model import lm_loss
from par.tp.layers import qkv_for_column_split, TensorParallelGPT


def block_plan() -> dict:
    """The Megatron plan of one GPT-lite block, in `parallelize_module`'s terms."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    return {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
            "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}


def dtensor_tp(dense: nn.Module, mesh) -> nn.Module:
    """A copy of a dense GPT-lite with every block split over `mesh` by torch (embedding, norms, head replicated)."""
    from torch.distributed.tensor.parallel import parallelize_module
    model, n = copy.deepcopy(dense), mesh.size()
    for block in model.blocks:
        with torch.no_grad():   # whole heads per rank: the re-layout par's TensorParallelAttention makes too
            block.attn.qkv.weight.copy_(qkv_for_column_split(block.attn.qkv.weight, n))
            block.attn.qkv.bias.copy_(qkv_for_column_split(block.attn.qkv.bias, n))
        block.attn.n_head //= n
        parallelize_module(block, mesh, block_plan())
    return model


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a plain tensor is its own)."""
    return t.to_local() if hasattr(t, "to_local") else t


def compare(dense: nn.Module, mesh, batches, lr: float = 3e-3, eps: float = 1e-6) -> dict:
    """par's TensorParallelGPT and torch's `dtensor_tp` from the same dense weights, trained with Adam on the
    same `batches`: this rank's largest |difference| of the logits and the loss (every step), of every
    gradient shard (first step) and of every parameter shard after the last step."""
    ours, theirs = TensorParallelGPT.from_dense(dense, impl="torch"), dtensor_tp(dense, mesh)
    opts = [torch.optim.Adam(m.parameters(), lr=lr, eps=eps, foreach=False) for m in (ours, theirs)]
    out = {"logits": 0.0, "loss": 0.0, "grads": 0.0, "params": 0.0, "steps": len(batches)}
    for step, (x, y) in enumerate(batches):
        logits = [m(x) for m in (ours, theirs)]
        losses = [lm_loss(z, y) for z in logits]
        for loss, opt in zip(losses, opts):
            opt.zero_grad(set_to_none=True)
            loss.backward()
        out["logits"] = max(out["logits"], (logits[0] - logits[1]).abs().max().item())
        out["loss"] = max(out["loss"], abs(losses[0].item() - losses[1].item()))
        if step == 0:
            out["grads"] = max_diff(ours, theirs, grads=True)
        for opt in opts:
            opt.step()
    out["params"] = max_diff(ours, theirs)
    out["max"] = max(out["logits"], out["grads"], out["params"])
    return out


def max_diff(ours: nn.Module, theirs: nn.Module, grads: bool = False) -> float:
    """The largest |difference| between this rank's shards of the same-named parameters (or their gradients)."""
    mine = dict(theirs.named_parameters())
    worst = 0.0
    for name, p in ours.named_parameters():
        a, b = (p.grad, mine[name].grad) if grads else (p, mine[name])
        worst = max(worst, (local(a) - local(b)).abs().max().item())
    return worst
