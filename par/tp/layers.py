"""Tensor parallelism (Megatron-LM): one layer's matrices split across the ranks of a group.

For Y = X Wᵀ + b (nn.Linear keeps W as (out, in)), split W one of two ways over N ranks:

* column parallel: W by output features, W = [W_0; ...; W_{N-1}]. Rank r computes
  Y_r = X W_rᵀ + b_r, its slice of Y's columns. No sum in forward. In backward
  dL/dX = Σ_r dL/dY_r W_r needs a sum: the all-reduce of `copy_to_region` (f).
* row parallel: W by input features, W = [W_0 | ... | W_{N-1}], input already split
  X = [X_0 | ... | X_{N-1}]. Rank r computes the partial X_r W_rᵀ, and
  Y = Σ_r X_r W_rᵀ + b needs a sum in forward: the all-reduce of `reduce_from_region`
  (g); the bias is added once, after it. Backward needs nothing.

MLP = column (no gather) → GeLU (elementwise, stays local) → row: one all-reduce
forward, one backward. Attention splits by heads: the fused QKV projection is
column parallel (re-laid out so that every rank gets whole heads of Q, K and V),
each rank attends with its n_head/N heads, the output projection is row parallel.
So a transformer layer costs 2 all-reduces forward + 2 backward = 4 per step, each
of B·T·d elements.

Choices: layer norms, the embedding and the LM head are replicated (identical on
every rank, fed identical inputs, so their gradients come out identical without
communication; vocabulary-parallel embedding/head is not implemented). Row-parallel
biases are replicated too. Build a TP model from a dense one with `from_dense`,
which shards it exactly, so the two can be compared.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from par.comm.collectives import all_reduce_formula_bytes, group_rank, group_size
from par.memory.accounting import gpt_param_count
from par.model import GPTConfig, GPTLite, causal_attention, merge_heads, split_heads
from par.tp.ops import copy_to_region, gather_from_region, reduce_from_region, scatter_to_region


# ---------------------------------------------------------------- checks and pure shard arithmetic
def check_divisible(what: str, size: int, n: int) -> None:
    """Raise one clear ValueError when `size` cannot be split evenly over `n` tensor-parallel ranks."""
    if size % n:
        ok = [d for d in range(1, size + 1) if size % d == 0 and d <= 64]
        raise ValueError(f"{what} {size} is not divisible by the tensor-parallel degree {n}: "
                         f"use a degree that divides it ({', '.join(map(str, ok))}) or make {what} a multiple of {n}")


def check_tp_degree(cfg: GPTConfig, n: int) -> None:
    """Heads, hidden size and FFN size must all split evenly over the N ranks."""
    check_divisible("n_head", cfg.n_head, n)
    check_divisible("d_model", cfg.d_model, n)
    check_divisible("ffn size", cfg.ffn, n)


def tp_degree(cfg: GPTConfig, world_size: int) -> int:
    """The tensor-parallel degree for `world_size` ranks: the largest divisor of n_head that is <= world_size.

    Heads are split whole, so the degree must divide n_head (and d_model and the FFN size, which
    `check_tp_degree` checks too). GPT-3 Small's 12 heads on 8 GPUs: degree 6, the other 2 GPUs idle
    for TP (or used for another kind of parallelism).
    """
    if world_size < 1:
        raise ValueError(f"world size must be at least 1, got {world_size}")
    return next(d for d in range(min(world_size, cfg.n_head), 0, -1)
                if cfg.n_head % d == 0 and cfg.d_model % d == 0 and cfg.ffn % d == 0)


def column_shard(t: torch.Tensor, n: int, r: int) -> torch.Tensor:
    """Rank r's slice of the output features (dim 0) of a weight (out, in) or bias (out,)."""
    check_divisible("out_features", t.size(0), n)
    k = t.size(0) // n
    return t[r * k:(r + 1) * k]


def row_shard(w: torch.Tensor, n: int, r: int) -> torch.Tensor:
    """Rank r's slice of the input features (dim 1) of a weight (out, in)."""
    check_divisible("in_features", w.size(1), n)
    k = w.size(1) // n
    return w[:, r * k:(r + 1) * k]


def qkv_for_column_split(t: torch.Tensor, n: int) -> torch.Tensor:
    """Re-lay a fused [Q | K | V] weight (3d, in) or bias (3d,) as [Q_0 K_0 V_0 | Q_1 K_1 V_1 | ...].

    Q_r is the r-th N-th of Q's output features, i.e. the heads r·H/N .. (r+1)·H/N - 1, so a plain
    column split of the result hands rank r whole heads of Q, K and V (and its `chunk(3)` still works).
    """
    three_d = t.size(0)
    check_divisible("qkv features/3", three_d // 3, n)
    return t.reshape(3, n, three_d // (3 * n), *t.shape[1:]).transpose(0, 1).reshape(t.shape)


# ---------------------------------------------------------------- parallel linear layers
def _param(shape, like: torch.Tensor | None, device=None, dtype=None) -> nn.Parameter:
    device = like.device if like is not None else device
    dtype = like.dtype if like is not None else (dtype or torch.get_default_dtype())
    return nn.Parameter(torch.zeros(shape, device=device, dtype=dtype))


class ColumnParallelLinear(nn.Module):
    """Y_r = f(X) W_rᵀ + b_r with W split by output features; optionally gather Y = [Y_0 | ... ].

    The constructor allocates this rank's shard (zeros); `from_dense` fills it from a dense layer.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False,
                 group=None, impl: str = "ring", label: str = "", device=None, dtype=None):
        super().__init__()
        n = group_size(group)
        check_divisible("out_features", out_features, n)
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.group, self.impl, self.label = gather_output, group, impl, label
        self.weight = _param((out_features // n, in_features), None, device, dtype)
        self.bias = _param((out_features // n,), None, device, dtype) if bias else None

    @classmethod
    def from_dense(cls, linear: nn.Linear, group=None, gather_output: bool = False, impl: str = "ring",
                   label: str = "") -> "ColumnParallelLinear":
        """This rank's exact shard of `linear`: rows r·out/N .. (r+1)·out/N of W and b."""
        w = linear.weight
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, gather_output, group, impl, label,
                device=w.device, dtype=w.dtype)
        n, r = group_size(group), group_rank(group)
        with torch.no_grad():
            m.weight.copy_(column_shard(w, n, r))
            if m.bias is not None:
                m.bias.copy_(column_shard(linear.bias, n, r))
        return m

    def forward(self, x):
        x = copy_to_region(x, self.group, self.impl, self.label)
        y = F.linear(x, self.weight, self.bias)
        return gather_from_region(y, self.group, self.impl, self.label) if self.gather_output else y

    def extra_repr(self):
        return f"in={self.in_features}, out={self.out_features} (local {self.weight.size(0)}), " \
               f"gather_output={self.gather_output}"


class RowParallelLinear(nn.Module):
    """Y = g(Σ_r X_r W_rᵀ) + b with W split by input features; the bias is added once, after the sum.

    With `input_is_parallel=False` the full input is first cut to this rank's features (scatter).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = True,
                 group=None, impl: str = "ring", label: str = "", device=None, dtype=None):
        super().__init__()
        n = group_size(group)
        check_divisible("in_features", in_features, n)
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.group, self.impl, self.label = input_is_parallel, group, impl, label
        self.weight = _param((out_features, in_features // n), None, device, dtype)
        self.bias = _param((out_features,), None, device, dtype) if bias else None

    @classmethod
    def from_dense(cls, linear: nn.Linear, group=None, input_is_parallel: bool = True, impl: str = "ring",
                   label: str = "") -> "RowParallelLinear":
        """This rank's exact shard of `linear`: columns r·in/N .. (r+1)·in/N of W; b replicated."""
        w = linear.weight
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, input_is_parallel, group, impl,
                label, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            m.weight.copy_(row_shard(w, group_size(group), group_rank(group)))
            if m.bias is not None:
                m.bias.copy_(linear.bias)
        return m

    def forward(self, x):
        if not self.input_is_parallel:
            x = scatter_to_region(x, self.group, self.impl, self.label)
        y = reduce_from_region(F.linear(x, self.weight), self.group, self.impl, self.label)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self):
        return f"in={self.in_features} (local {self.weight.size(1)}), out={self.out_features}, " \
               f"input_is_parallel={self.input_is_parallel}"


# ---------------------------------------------------------------- transformer pieces
class TensorParallelMLP(nn.Module):
    """column(d → ffn/N) → GeLU → row(ffn/N → d): one all-reduce forward, one backward."""

    def __init__(self, fc: ColumnParallelLinear, proj: RowParallelLinear):
        super().__init__()
        self.fc, self.proj = fc, proj

    @classmethod
    def from_dense(cls, mlp, group=None, impl: str = "ring", label: str = "mlp") -> "TensorParallelMLP":
        check_divisible("ffn size", mlp.fc.out_features, group_size(group))
        return cls(ColumnParallelLinear.from_dense(mlp.fc, group, impl=impl, label=label),
                   RowParallelLinear.from_dense(mlp.proj, group, impl=impl, label=label))

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class TensorParallelAttention(nn.Module):
    """Causal self-attention with the heads split: rank r owns heads r·H/N .. (r+1)·H/N - 1."""

    def __init__(self, qkv: ColumnParallelLinear, proj: RowParallelLinear, n_head_local: int, kind: str = "sdpa"):
        super().__init__()
        self.qkv, self.proj, self.n_head, self.kind = qkv, proj, n_head_local, kind   # kind: the dense model's

    @classmethod
    def from_dense(cls, attn, group=None, impl: str = "ring", label: str = "attn") -> "TensorParallelAttention":
        n = group_size(group)
        check_divisible("n_head", attn.n_head, n)
        relaid = nn.Linear(attn.qkv.in_features, attn.qkv.out_features, bias=attn.qkv.bias is not None,
                           device=attn.qkv.weight.device, dtype=attn.qkv.weight.dtype)
        with torch.no_grad():
            relaid.weight.copy_(qkv_for_column_split(attn.qkv.weight, n))
            if relaid.bias is not None:
                relaid.bias.copy_(qkv_for_column_split(attn.qkv.bias, n))
        return cls(ColumnParallelLinear.from_dense(relaid, group, impl=impl, label=label),
                   RowParallelLinear.from_dense(attn.proj, group, impl=impl, label=label), attn.n_head // n, attn.kind)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)          # my heads of Q, K, V: (B, T, d/N) each
        h = self.n_head
        y = causal_attention(split_heads(q, h), split_heads(k, h), split_heads(v, h), self.kind)
        return self.proj(merge_heads(y))


class TensorParallelBlock(nn.Module):
    """x + Attn_TP(LN(x)), then x + MLP_TP(LN(x)); layer norms replicated. 4 all-reduces per step."""

    def __init__(self, ln1, attn, ln2, mlp):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = ln1, attn, ln2, mlp

    @classmethod
    def from_dense(cls, block, group=None, impl: str = "ring", label: str = "block") -> "TensorParallelBlock":
        return cls(copy.deepcopy(block.ln1),
                   TensorParallelAttention.from_dense(block.attn, group, impl, f"{label}/attn"),
                   copy.deepcopy(block.ln2),
                   TensorParallelMLP.from_dense(block.mlp, group, impl, f"{label}/mlp"))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TensorParallelGPT(nn.Module):
    """GPT-lite with every block tensor parallel; embedding and head replicated on each rank."""

    def __init__(self, cfg: GPTConfig, embed, blocks, head):
        super().__init__()
        self.cfg, self.embed, self.blocks, self.head = cfg, embed, nn.ModuleList(blocks), head

    @classmethod
    def from_dense(cls, model, group=None, impl: str = "ring") -> "TensorParallelGPT":
        """Shard a dense `par.model.GPTLite` exactly over `group` (every rank passes the same dense model)."""
        check_tp_degree(model.cfg, group_size(group))
        memo: dict = {}  # one memo keeps a tied embedding/head tied
        embed, head = copy.deepcopy(model.embed, memo), copy.deepcopy(model.head, memo)
        blocks = [TensorParallelBlock.from_dense(b, group, impl, f"layer {i}") for i, b in enumerate(model.blocks)]
        return cls(model.cfg, embed, blocks, head)

    to_layers = GPTLite.to_layers     # the same layers in the same order as the dense model: one definition
    forward = GPTLite.forward


def shard_like(tp_module: nn.Module, dense: nn.Module, group=None) -> dict:
    """The state dict this rank's `tp_module` must equal: `dense` sharded the same way (no communication).

    Works for any of the classes above; pass a dense module holding gradients to get gradient shards.
    """
    builder = type(tp_module).from_dense
    return builder(dense, group).state_dict()


# ---------------------------------------------------------------- formulas
def allreduces_per_step(n_layer: int) -> dict:
    """Megatron TP: per transformer layer 2 all-reduces in forward (attn, MLP) and 2 in backward."""
    return {"forward": 2 * n_layer, "backward": 2 * n_layer}


def activation_bytes(batch: int, seq: int, d_model: int, itemsize: int = 4) -> int:
    """S = B·T·d·itemsize: the size of the one tensor every TP all-reduce sums."""
    return batch * seq * d_model * itemsize


def tp_bytes_per_step(cfg: GPTConfig, batch: int, seq: int, n: int, itemsize: int = 4) -> float:
    """Bytes a rank sends per training step: 4 all-reduces per layer, each 2(N-1)/N · B·T·d·itemsize."""
    return 4 * cfg.n_layer * all_reduce_formula_bytes(activation_bytes(batch, seq, cfg.d_model, itemsize), n)


def tp_param_count(cfg: GPTConfig, n: int = 1) -> int:
    """Parameters held by one rank of an N-way TP GPT-lite (replicated embedding, head, norms, row biases).

    Per layer: (3d² + 3d)/N qkv + d²/N + d proj + (d·f + f)/N fc + f·d/N + d proj + 4d norms
    (`par.memory.accounting.gpt_block_params(d, f, N)`, the formula's one home).
    """
    check_tp_degree(cfg, n)
    return gpt_param_count(cfg, tp=n)


def param_bytes(module: nn.Module) -> int:
    """Live parameter bytes of a module on this rank (shared tensors counted once)."""
    seen = {}
    for p in module.parameters():
        seen[id(p)] = p.numel() * p.element_size()
    return sum(seen.values())
