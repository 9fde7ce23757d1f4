"""Sequence parallelism (Korthikanti et al. 2022) on top of Megatron tensor parallelism.

Tensor parallelism splits attention and the MLP across t ranks, but the LayerNorms, the residual
adds and the dropouts between them run on the full (B, T, h) activation on every rank: 10·sbh of
the 34·sbh bytes of a layer are not divided by t. Those regions act token by token, so split them
along the sequence instead: each rank keeps T/t tokens there.

The TP all-reduce at the end of a parallel region becomes a reduce-scatter along the sequence, and
the identity at its start becomes an all-gather along the sequence. These are the conjugate pair
(`par.tp.ops`, beside f and g)

    operator                         forward                                backward
    g  gather_from_sequence_region   all-gather the T/t-token slices        reduce-scatter the gradient
    ḡ  reduce_scatter_to_sequence    reduce-scatter the partial sums        all-gather the gradient

and a ring all-reduce *is* a reduce-scatter followed by an all-gather, so a layer still sends
4 · 2(t-1)/t · B·T·h·e bytes per step, exactly as much as TP (`tp_bytes_per_step`).

    x (T/t tokens) ─ LN ─ g ─ column QKV ─ attention ─ row proj ─ ḡ ─ + bias, + x ─ LN ─ g ─ fc ─ GeLU ─ proj ─ ḡ ─ ...

With `regather=True` (Megatron's choice) the column layers keep only the T/t-token slice of their
input for backward and all-gather it again there, so *every* saved activation is divided by t:

    activations per layer = (34 + 5as/h)·s·b·h / t    (`par.memory.accounting.activation_bytes_per_layer(..., sequence_parallel=True)`)

at the price of one more all-gather per column layer in backward (2 per layer: bytes 6·(t-1)/t·S
instead of 4). With `regather=False` the gathered input is kept (bytes as TP, 2·sbh·(1-1/t) more memory).

The sequence length must divide by t (the slices are equal, as in Megatron-LM). Weights are the TP
shards (`from_dense`); LayerNorm weights and the row-parallel biases act on this rank's tokens only,
so their gradients are summed over the group (`sync_grads`). Dropout is not modelled (GPT-lite has none).
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from par.comm import collectives, commlog
from par.comm.collectives import group_size
from par.model import causal_attention, merge_heads, split_heads
from par.tp.layers import TensorParallelBlock, check_tp_degree
from par.tp.ops import (SEQ, all_gather_along, check_sequence, direction_tag, gather_from_sequence_region,
                        gather_to_full, reduce_scatter_along, reduce_scatter_to_sequence_region, scatter_to_sequence)


class _GatherLinear(torch.autograd.Function):
    """y = g(x) Wᵀ + b keeping only x's T/t slice for backward, where it is all-gathered again."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, impl, label):
        ctx.group, ctx.impl, ctx.label, ctx.has_bias = group, impl, label, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(all_gather_along(x.contiguous(), SEQ, group, impl, direction_tag(label, "fwd")), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        full = all_gather_along(x.contiguous(), SEQ, ctx.group, ctx.impl, direction_tag(ctx.label, "bwd/regather"))
        d_weight = grad.reshape(-1, grad.size(-1)).t() @ full.reshape(-1, full.size(-1))
        d_bias = grad.reshape(-1, grad.size(-1)).sum(0) if ctx.has_bias else None
        d_x = reduce_scatter_along(grad @ weight, SEQ, ctx.group, ctx.impl, direction_tag(ctx.label, "bwd"))
        return d_x, d_weight, d_bias, None, None, None


# ---------------------------------------------------------------- the block and the model
def _mark(*params) -> None:
    for p in params:
        if p is not None:
            p.sequence_parallel = True      # sees only this rank's tokens: gradient summed over the group


class SequenceParallelBlock(nn.Module):
    """A TP block whose LayerNorms and residual adds act on T/t tokens; g before, ḡ after each TP region."""

    def __init__(self, tp_block: TensorParallelBlock, group=None, impl: str = "ring", regather: bool = True,
                 label: str = "block"):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = tp_block.ln1, tp_block.attn, tp_block.ln2, tp_block.mlp
        self.group, self.impl, self.regather, self.label = group, impl, regather, label
        _mark(*self.ln1.parameters(), *self.ln2.parameters(), self.attn.proj.bias, self.mlp.proj.bias)

    @classmethod
    def from_dense(cls, block, group=None, impl: str = "ring", regather: bool = True,
                   label: str = "block") -> "SequenceParallelBlock":
        return cls(TensorParallelBlock.from_dense(block, group, impl, label), group, impl, regather, label)

    def column(self, x, linear, label: str):
        """g then the column-parallel linear: (B, T/t, h) -> (B, T, out/t)."""
        if group_size(self.group) == 1:
            return F.linear(x, linear.weight, linear.bias)
        if self.regather:
            return _GatherLinear.apply(x, linear.weight, linear.bias, self.group, self.impl, label)
        return F.linear(gather_from_sequence_region(x, self.group, self.impl, label), linear.weight, linear.bias)

    def row(self, y, linear, label: str):
        """The row-parallel linear's partial sums, then ḡ, then the bias: (B, T, in/t) -> (B, T/t, h)."""
        out = reduce_scatter_to_sequence_region(F.linear(y, linear.weight), self.group, self.impl, label)
        return out + linear.bias if linear.bias is not None else out

    def forward(self, x):
        a, m = f"{self.label}/attn", f"{self.label}/mlp"
        q, k, v = self.column(self.ln1(x), self.attn.qkv, a).chunk(3, dim=-1)
        h = self.attn.n_head
        y = causal_attention(split_heads(q, h), split_heads(k, h), split_heads(v, h), self.attn.kind)
        x = x + self.row(merge_heads(y), self.attn.proj, a)
        return x + self.row(F.gelu(self.column(self.ln2(x), self.mlp.fc, m)), self.mlp.proj, m)


class SequenceParallelGPT(nn.Module):
    """GPT-lite, TP + SP blocks; the embedding and head replicated, the sequence split between them."""

    def __init__(self, cfg, embed, blocks, head, group=None, impl: str = "ring"):
        super().__init__()
        self.cfg, self.embed, self.blocks, self.head = cfg, embed, nn.ModuleList(blocks), head
        self.group, self.impl = group, impl

    @classmethod
    def from_dense(cls, model, group=None, impl: str = "ring", regather: bool = True) -> "SequenceParallelGPT":
        check_tp_degree(model.cfg, group_size(group))
        memo: dict = {}
        embed, head = copy.deepcopy(model.embed, memo), copy.deepcopy(model.head, memo)
        blocks = [SequenceParallelBlock.from_dense(b, group, impl, regather, f"layer {i}")
                  for i, b in enumerate(model.blocks)]
        return cls(model.cfg, embed, blocks, head, group, impl)

    def forward(self, idx):
        check_sequence(idx.size(1), group_size(self.group))
        x = scatter_to_sequence(self.embed(idx), self.group, self.impl, "enter")
        for block in self.blocks:
            x = block(x)
        return self.head(gather_to_full(x, self.group, self.impl, "leave"))


def sum_gradients(params, group=None, impl: str = "ring", tag: str = "grads") -> None:
    """Sum the gradients of `params` over the group in one flat all-reduce (weights that saw only this rank's tokens)."""
    grads = [p.grad for p in params if p.grad is not None]
    if group_size(group) == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    with commlog.tag(tag):
        collectives.all_reduce(flat, "sum", group=group, impl=impl)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def sync_grads(model: nn.Module, group=None, impl: str = "ring") -> None:
    """Sum over the group the gradients of the weights marked `sequence_parallel` (LayerNorms, row biases)."""
    sum_gradients([p for p in model.parameters() if getattr(p, "sequence_parallel", False)], group, impl, "sp/grads")


def sp_bytes_per_layer(batch: int, seq: int, d_model: int, n: int, itemsize: int = 4, regather: bool = True) -> float:
    """Bytes a rank sends per layer and step: 4 (g, ḡ forward and backward) reduce-scatters/all-gathers pairs
    = 4 · 2(t-1)/t · B·T·h·e (the TP all-reduces'), plus 2 all-gathers (t-1)/t · B·T·h·e when regathering."""
    s = batch * seq * d_model * itemsize
    return 4 * collectives.all_reduce_formula_bytes(s, n) + (2 * (n - 1) / n * s if regather else 0)
