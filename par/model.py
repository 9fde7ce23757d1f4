"""GPT-lite: a small decoder-only transformer; a small MLP for tests; a stack of equal square layers for timing.

    tokens ─▶ Embedding (token + position) ─▶ Block × n_layer ─▶ Head (LayerNorm, LM head) ─▶ logits
    Block(x) = x + Attention(LN(x));  then  x + MLP(LN(x))
    Attention = softmax(Q Kᵀ / √d_head + causal mask) V, heads concatenated, projected
    MLP = Linear(d, 4d) ─▶ GeLU ─▶ Linear(4d, d)

`model.to_layers()` gives the forward as a plain list of modules whose
composition is the model; pipeline parallelism cuts this list into stages.

The fast path (lecture 10), each part a config field or a function, the same numbers either way:
- attention="sdpa" (the default): `F.scaled_dot_product_attention(is_causal=True)`, one fused kernel that never
  writes the T × T scores to memory (flash attention where the device has it); attention="math" is the
  lecture's explicit softmax(Q Kᵀ / √d + mask) V, equal in outputs and gradients (fp32, ≤ 1e-6);
- padded_vocab: the embedding and LM-head tables get more rows than tokens (50304 = 64·786 for 50,257), so
  the head's matmul has a width the tensor cores tile evenly; the extra rows are never a target;
- tie_embeddings: the LM head multiplies by the token embedding's table (one weight, not two);
- `compile_blocks(model)`: `torch.compile` per block, in place, so `to_layers()` still lists the same modules.
Activation checkpointing, checkpoint="none" (the default), "selective" or "full": each block's forward under
`par.recompute.checkpointed` (keep every activation, only the matmuls' outputs, or only the block's input).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from par.recompute import MODES as CHECKPOINT_MODES, checkpointed


def pad_to_multiple(n: int, multiple: int = 64) -> int:
    """The smallest multiple of `multiple` that is ≥ n: ⌈n / m⌉·m (50,257 -> 50,304)."""
    return -(-n // multiple) * multiple


def fast(cfg: GPTConfig) -> GPTConfig:
    """`cfg` on the fast path: SDPA attention, the vocabulary padded to a multiple of 64, the head tied to the
    token embedding (what nanoGPT does). Same widths, depth and context; one table of V_padded·d fewer weights."""
    return replace(cfg, attention="sdpa", padded_vocab=pad_to_multiple(cfg.vocab_size), tie_embeddings=True)


def math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(Q Kᵀ / √d + mask) V for (batch, heads, time, d_head) tensors, every step written out: the
    (time × time) scores are materialised, scaled, masked and normalised one operation after another."""
    t = q.size(-2)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return F.softmax(scores, dim=-1) @ v


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The same softmax(Q Kᵀ / √d + mask) V as one call, `F.scaled_dot_product_attention(is_causal=True)`: torch
    picks a fused kernel (flash or memory-efficient attention) that keeps the scores in tiles on chip."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


ATTENTION = {"sdpa": sdpa_attention, "math": math_attention}


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: str = "sdpa") -> torch.Tensor:
    """softmax(Q Kᵀ / √d + mask) V for (batch, heads, time, d_head) tensors, by `kind`: "sdpa" or "math"."""
    return ATTENTION[kind](q, k, v)


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 65
    block_size: int = 32     # context length (tokens)
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 32
    d_ff: int | None = None  # MLP hidden size; None means 4 * d_model
    dropout: float = 0.0
    tie_embeddings: bool = False
    padded_vocab: int | None = None   # rows of the embedding and LM-head tables; None: vocab_size
    attention: str = "sdpa"           # "sdpa" (one fused kernel) or "math" (the lecture's explicit attention)
    checkpoint: str = "none"          # activation checkpointing per block: "none", "selective" or "full"

    def __post_init__(self):
        if self.attention not in ATTENTION:
            raise ValueError(f"unknown attention {self.attention!r}: use one of {', '.join(ATTENTION)}")
        if self.checkpoint not in CHECKPOINT_MODES:
            raise ValueError(f"unknown checkpoint {self.checkpoint!r}: use one of {', '.join(CHECKPOINT_MODES)}")
        if self.padded_vocab is not None and self.padded_vocab < self.vocab_size:
            raise ValueError(f"padded_vocab {self.padded_vocab} is smaller than vocab_size {self.vocab_size}: "
                             f"use at least {self.vocab_size}, e.g. {pad_to_multiple(self.vocab_size)}")

    @property
    def ffn(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def vocab(self) -> int:
        """Rows of the token tables: padded_vocab when set, else vocab_size."""
        return self.padded_vocab or self.vocab_size

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS = {
    # trains on a laptop CPU in seconds; every test and CPU notebook uses it
    "tiny": GPTConfig(vocab_size=65, block_size=32, n_layer=4, n_head=4, d_model=32, attention="math"),
    # a little bigger, for CPU benchmarks where compute should dominate
    "small": GPTConfig(vocab_size=65, block_size=64, n_layer=6, n_head=8, d_model=128, attention="math"),
    # GPT-3 Small (Brown et al. 2020, Table 2.1): for accounting and GPU runs
    "gpt3-small": GPTConfig(vocab_size=50257, block_size=2048, n_layer=12, n_head=12, d_model=768, attention="math"),
    # tiny's widths with a long context (block_size > 256): the course's long-context path (no single-process
    # reference beside the parallel model, one sequence per rank) that gpt3-small takes, run on a CPU in seconds
    "tiny-long": GPTConfig(vocab_size=65, block_size=512, n_layer=2, n_head=4, d_model=32, attention="math"),
}
# The presets keep the lecture's attention="math": lectures 01-08 measure the activations a block saves against
# Korthikanti's formula, whose a·s²·b term is the materialised scores. `fast(cfg)` is the same model on the fast
# path (lecture 10).


def preset(name: str, **overrides) -> GPTConfig:
    """A named configuration, optionally with some fields changed."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}: use one of {', '.join(PRESETS)}")
    return replace(PRESETS[name], **overrides)


def split_heads(x: torch.Tensor, n_head: int) -> torch.Tensor:
    """(B, T, H*D) -> (B, H, T, D)"""
    b, t, c = x.shape
    return x.view(b, t, n_head, c // n_head).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) -> (B, T, H*D)"""
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)


class Attention(nn.Module):
    """Causal multi-head self-attention with a fused QKV projection laid out as [Q | K | V]."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.d_model % cfg.n_head:
            raise ValueError(f"d_model {cfg.d_model} is not divisible by n_head {cfg.n_head}")
        self.n_head, self.kind = cfg.n_head, cfg.attention
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        h = self.n_head
        y = causal_attention(split_heads(q, h), split_heads(k, h), split_heads(v, h), self.kind)
        return self.proj(merge_heads(y))


class MLP(nn.Module):
    """Linear(d, ffn) -> GeLU -> Linear(ffn, d)"""

    def __init__(self, d_model: int, ffn: int):
        super().__init__()
        self.fc = nn.Linear(d_model, ffn)
        self.proj = nn.Linear(ffn, d_model)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + Attn(LN(x)), then x + MLP(LN(x)); under cfg.checkpoint's recomputation."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg.d_model, cfg.ffn)
        self.checkpoint = cfg.checkpoint

    def forward(self, x):
        return checkpointed(self.residual, x, self.checkpoint)

    def residual(self, x):
        """x + Attn(LN(x)), then x + MLP(LN(x))."""
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embedding(nn.Module):
    """Token embedding plus learned position embedding: (B, T) ints -> (B, T, d)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.block_size, cfg.d_model)

    def forward(self, idx):
        t = idx.size(1)
        return self.tok(idx) + self.pos(torch.arange(t, device=idx.device))


class Head(nn.Module):
    """Final LayerNorm and the LM head: (B, T, d) -> (B, T, vocab) logits (cfg.vocab columns: padded ones too)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, x):
        return self.lm_head(self.ln(x))


class GPTLite(nn.Module):
    def __init__(self, cfg: GPTConfig = PRESETS["tiny"]):
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.head = Head(cfg)
        if cfg.tie_embeddings:
            self.head.lm_head.weight = self.embed.tok.weight
        self.apply(init_weights)

    def to_layers(self) -> list[nn.Module]:
        """The forward pass as a list of modules: [Embedding, Block, ..., Block, Head]."""
        return [self.embed, *self.blocks, self.head]

    def forward(self, idx):
        x = idx
        for layer in self.to_layers():
            x = layer(x)
        return x


def compile_blocks(model: nn.Module, **options) -> nn.Module:
    """`torch.compile` each block of `model` in place (`nn.Module.compile`): every block's forward and backward
    become fused kernels, while `to_layers()`, the parameters and the hooks others put on the modules stay
    where they were. `options` go to torch.compile (mode, dynamic, ...). Returns `model`."""
    for block in model.blocks:
        block.compile(**options)
    return model


def init_weights(m: nn.Module) -> None:
    """GPT-2 style: normal(0, 0.02) weights, zero biases."""
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, mean=0.0, std=0.02)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.zeros_(m.bias)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of next-token prediction over every position."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def build(cfg: GPTConfig | str = "tiny", seed: int = 0) -> GPTLite:
    """The same GPT-lite on every rank: weights depend only on the config and the seed."""
    cfg = preset(cfg) if isinstance(cfg, str) else cfg
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPTLite(cfg)


class TinyMLP(nn.Module):
    """A stack of Linear+Tanh layers (sizes[0] -> ... -> sizes[-1]); the small model of many tests."""

    def __init__(self, sizes=(10, 33, 17, 5), seed: int = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            layers = []
            for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
                layers.append(nn.Linear(a, b))
                if i < len(sizes) - 2:
                    layers.append(nn.Tanh())
            self.net = nn.Sequential(*layers)

    def to_layers(self) -> list[nn.Module]:
        return list(self.net)

    def forward(self, x):
        return self.net(x)


class SquareStack(nn.Module):
    """`n_layer` square Linear layers of width d without bias, each followed by a ReLU: the model whose forward
    and both halves of the backward cost the same, for the zero-bubble pipeline formulas (F = I = W).

        F: y = x Wᵀ      I: ∂L/∂x = g W      W: ∂L/∂W = gᵀ x      each one matmul of 2·rows·d² FLOPs

    The ReLU and its gradient touch rows·d numbers, under 1 % of a matmul's time at d = 1024. No embedding and
    no head: every stage of a cut into equal numbers of layers costs the same."""

    def __init__(self, d: int, n_layer: int, seed: int = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, d, bias=False), nn.ReLU()) for _ in range(n_layer))
            for layer in self.layers:           # He's std √(2/d) keeps the activations' scale through the ReLUs
                nn.init.normal_(layer[0].weight, std=(2.0 / d) ** 0.5)

    def to_layers(self) -> list[nn.Module]:
        return list(self.layers)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def square_batches(d: int, rows: int, steps: int, seed: int = 0):
    """`steps` batches (x, y) of `rows` random rows of width d, the target of the mean-squared error loss."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        yield torch.randn(rows, d, generator=g), torch.randn(rows, d, generator=g)
