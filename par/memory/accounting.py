"""Memory accounting: where the bytes of training go, predicted and measured.

Training memory splits in two (Rajbhandari et al., ZeRO, 2020):

* **model states**: parameters, gradients and optimizer states. They live for the
  whole run, and their size is (bytes per parameter) × Ψ, Ψ the parameter count.
* **residual states**: activations kept for the backward pass, temporary buffers,
  and fragments of memory too small to use.

Bytes per parameter (`bytes_per_param`), the optimizer part called K:

    precision   weights  grads  optimizer state K                         total (Adam)
    fp32           4       4    Adam: m + v = 4+4 = 8                     16
    mixed          2       2    Adam: fp32 master + m + v = 4+4+4 = 12    16
    pure16         2       2    Adam: m + v in fp32 = 8 (no master copy)  12

Model states per rank under ZeRO with data-parallel degree N_d (`model_state_bytes`),
mixed precision shown (fp32: 4Ψ weights and 4Ψ grads instead of 2Ψ):

    stage 0 (plain DP)      2Ψ + 2Ψ + KΨ
    stage 1 (P_os)          2Ψ + 2Ψ + KΨ/N_d
    stage 2 (P_os+g)        2Ψ + (2+K)Ψ/N_d
    stage 3 (P_os+g+p)      (2+2+K)Ψ/N_d

As DeepSpeed keeps them (`deepspeed_state_bytes`, its estimators' formulas): + fp32 gradients 4Ψ (/N_d with
ZeRO), ZeRO-3's gathered largest layer 4·L and no 16-bit gradient partition: 2Ψ + 18Ψ/N_d for stage 2,
18Ψ/N_d + 4L for stage 3; offload moves the fp32 and optimizer part (and, for stage 3, the weights) to the host.

Activations of one transformer layer (`activation_bytes_per_layer`, Korthikanti
et al. 2022): s·b·h·(34 + 5·a·s/h) bytes with 16-bit activations and dropout, s·b·h·34 with
selective recomputation (the attention core rebuilt), or 2·s·b·h bytes (the layer input) with
full recomputation; with flash attention e·(17·sbh + a·s·b); with tensor + sequence parallelism all of it
divided by t, with ring attention over c ranks e·(17·sbh + a·s·b)/c. At the peak (`activation_peak_bytes`) full
recomputation holds every layer's input *plus* one layer rebuilt in full during backward:
L·2·s·b·h + s·b·h·(34 + 5·a·s/h), not L·2·s·b·h alone.

The fp32 gradients of mixed precision (`mixed_precision_peak_bytes`) exist only during the
update, when the activations are gone: they leave the peak alone only while the activations
are at least the 4Ψ they add.

Measured counterparts: `live_model_state_bytes(model, optimizer)` (bytes of the
tensors actually alive), `saved_activation_bytes(fn, *inputs)` (what autograd keeps
for backward) and `cuda_peak_bytes()`.

Units: bytes everywhere; GB means 1e9 bytes, GiB 2**30 bytes.
"""
from __future__ import annotations

import argparse
import math
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch

from par.model import PRESETS
from par.runtime.checks import positive_float, positive_int

GB = 1e9
GiB = 2 ** 30

PRECISIONS = ("fp32", "mixed", "pure16")
ALIASES = {"fp16": "mixed", "bf16": "mixed", "amp": "mixed", "mixed-fp16": "mixed", "mixed-bf16": "mixed"}
OPTIMIZERS = ("sgd", "momentum", "adam")
STAGES = (0, 1, 2, 3)
STAGE_NAMES = {0: "stage 0 (DP)", 1: "stage 1 (P_os)", 2: "stage 2 (P_os+g)", 3: "stage 3 (P_os+g+p)"}


# ---------------------------------------------------------------- parameter counts
@dataclass(frozen=True)
class LlamaConfig:
    """A LLaMA-style decoder: RMSNorm (weight only, no biases), SwiGLU MLP, rotary positions
    (no parameters), an untied LM head unless `tie_embeddings`."""
    vocab_size: int = 32000
    d_model: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    ffn_hidden: int = 11008
    n_kv_heads: int | None = None   # grouped-query attention; None means n_heads
    tie_embeddings: bool = False


LLAMA_PRESETS = {
    # Touvron et al. 2023, Table 2
    "llama-7b": LlamaConfig(d_model=4096, n_layers=32, n_heads=32, ffn_hidden=11008),
    "llama-13b": LlamaConfig(d_model=5120, n_layers=40, n_heads=40, ffn_hidden=13824),
    "llama-33b": LlamaConfig(d_model=6656, n_layers=60, n_heads=52, ffn_hidden=17920),
    "llama-65b": LlamaConfig(d_model=8192, n_layers=80, n_heads=64, ffn_hidden=22016),
}


def gpt_block_params(d: int, ffn: int, tp: int = 1) -> int:
    """One GPT-lite block: 2 LayerNorms (2·2d) + qkv (3d² + 3d) + attention proj (d² + d)
    + MLP fc (d·ffn + ffn) + MLP proj (ffn·d + d)  =  4d² + 2·d·ffn + 9d + ffn.

    On one of `tp` tensor-parallel ranks (Megatron): the matrices and the column-parallel biases (qkv,
    fc) split over tp, the LayerNorms (4d) and the two row-parallel biases (2d, added after the
    all-reduce) replicated: (4d² + 2·d·ffn + 3d + ffn)/tp + 6d (a float when tp does not divide)."""
    replicated = 4 * d + 2 * d
    split, rest = divmod(4 * d * d + 2 * d * ffn + 3 * d + ffn, tp)
    return split + replicated if rest == 0 else (4 * d * d + 2 * d * ffn + 3 * d + ffn) / tp + replicated


def gpt_param_count(cfg, tp: int = 1) -> int:
    """Ψ of GPT-lite = token emb (V·d) + position emb (T·d) + L blocks + final LayerNorm (2d)
    + LM head (d·V, no bias; 0 when tied to the token embedding). `tp`: on one tensor-parallel rank
    (embeddings, final LayerNorm and head replicated, the blocks as `gpt_block_params`)."""
    d, v = cfg.d_model, getattr(cfg, "vocab", cfg.vocab_size)      # V: the table's rows, padded ones included
    head = 0 if cfg.tie_embeddings else d * v
    return v * d + cfg.block_size * d + cfg.n_layer * gpt_block_params(d, cfg.ffn, tp) + 2 * d + head


def expert_params(d: int, ffn: int) -> int:
    """One expert of a MoE layer: a GPT-lite MLP, fc (d·ffn + ffn) + proj (ffn·d + d)."""
    return 2 * d * ffn + ffn + d


def moe_block_params(d: int, ffn: int, n_experts: int, ep: int = 1) -> int:
    """One MoE block on the busiest of `ep` expert-parallel ranks (`par.moe.router.MoEBlock`): the dense block
    without its MLP, the router (d·E, no bias) and ceil(E/ep) experts (`par.moe.experts.expert_range`)."""
    return gpt_block_params(d, ffn) - expert_params(d, ffn) + d * n_experts + \
        math.ceil(n_experts / ep) * expert_params(d, ffn)


def moe_param_count(cfg, n_experts: int, ep: int = 1) -> tuple[int, int]:
    """(replicated, expert) parameters one rank of a MoE GPT-lite holds with ep-way expert parallelism:
    Ψ = replicated + expert; the experts are ceil(E/ep) per layer."""
    experts = cfg.n_layer * math.ceil(n_experts / ep) * expert_params(cfg.d_model, cfg.ffn)
    dense = gpt_param_count(cfg) - cfg.n_layer * expert_params(cfg.d_model, cfg.ffn)
    return dense + cfg.n_layer * cfg.d_model * n_experts, experts


def llama_block_params(cfg: LlamaConfig) -> int:
    """One LLaMA block: q and o (d² each) + k and v (d·d_kv each, d_kv = n_kv_heads·d/n_heads)
    + SwiGLU gate, up, down (3·d·ffn) + 2 RMSNorm weights (2d)."""
    d = cfg.d_model
    d_kv = (cfg.n_kv_heads or cfg.n_heads) * (d // cfg.n_heads)
    return 2 * d * d + 2 * d * d_kv + 3 * d * cfg.ffn_hidden + 2 * d


def llama_param_count(cfg: LlamaConfig) -> int:
    """Ψ of a LLaMA-style model = embedding (V·d) + L blocks + final RMSNorm (d) + LM head (d·V unless tied).
    LLaMA-7B: 131,072,000 + 32 × 202,383,360 + 4,096 + 131,072,000 = 6,738,415,616."""
    head = 0 if cfg.tie_embeddings else cfg.d_model * cfg.vocab_size
    return cfg.vocab_size * cfg.d_model + cfg.n_layers * llama_block_params(cfg) + cfg.d_model + head


def named_config(name: str):
    """A GPT-lite preset ("tiny", "small", "gpt3-small") or a LLaMA one ("llama-7b", ...)."""
    if name in PRESETS:
        return PRESETS[name]
    if name in LLAMA_PRESETS:
        return LLAMA_PRESETS[name]
    raise ValueError(f"unknown model {name!r}: use one of {', '.join([*PRESETS, *LLAMA_PRESETS])}")


def param_count(cfg) -> int:
    """Ψ of a GPTConfig, a LlamaConfig, or a named preset."""
    cfg = named_config(cfg) if isinstance(cfg, str) else cfg
    return llama_param_count(cfg) if isinstance(cfg, LlamaConfig) else gpt_param_count(cfg)


# ---------------------------------------------------------------- bytes per parameter
@dataclass(frozen=True)
class BytesPerParam:
    """Bytes each parameter costs in model states: weights + grads + K (optimizer state)."""
    weights: int
    grads: int
    optimizer: int                 # K
    optimizer_parts: tuple = ()    # ((name, bytes), ...) summing to K

    @property
    def K(self) -> int:
        return self.optimizer

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer


def canonical_precision(precision: str) -> str:
    p = precision.lower()
    p = ALIASES.get(p, p)
    if p not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}: use fp32, mixed (or fp16/bf16) or pure16")
    return p


def canonical_optimizer(optimizer: str) -> str:
    o = optimizer.lower()
    o = "adam" if o == "adamw" else o
    if o not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}: use sgd, momentum, adam (or adamw)")
    return o


def bytes_per_param(precision: str = "mixed", optimizer: str = "adam") -> BytesPerParam:
    """weights + grads + K bytes per parameter.

    fp32:   4 + 4 + K, K = sgd 0, momentum 4 (velocity), adam 8 (m, v)            -> Adam 16
    mixed:  2 + 2 + K, K = fp32 master 4 + the fp32 states: sgd 4, momentum 8, adam 12 -> Adam 16
    pure16: 2 + 2 + K, 16-bit weights updated directly (no master), states in fp32:
            sgd 0, momentum 4, adam 8                                                -> Adam 12
    """
    p, o = canonical_precision(precision), canonical_optimizer(optimizer)
    states = {"sgd": (), "momentum": (("momentum", 4),), "adam": (("momentum", 4), ("variance", 4))}[o]
    if p == "fp32":
        return BytesPerParam(4, 4, sum(b for _, b in states), states)
    if p == "mixed":
        parts = (("fp32 master", 4), *states)
        return BytesPerParam(2, 2, sum(b for _, b in parts), parts)
    return BytesPerParam(2, 2, sum(b for _, b in states), states)


def bytes_per_param_table() -> list[dict]:
    """One row per (precision, optimizer): weights, grads, K, total."""
    return [{"precision": p, "optimizer": o, **{k: getattr(b, k) for k in ("weights", "grads", "K", "total")}}
            for p in PRECISIONS for o in OPTIMIZERS for b in [bytes_per_param(p, o)]]


# ---------------------------------------------------------------- model states per rank (ZeRO)
@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of model states on one rank, split the way ZeRO partitions them."""
    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def shard_numel(numel: float, dp: int, padded: bool = False) -> float:
    """Elements of one rank's partition: Ψ/N_d, or ⌈Ψ/N_d⌉ when the flat buffer is padded to a multiple of N_d."""
    return math.ceil(numel / dp) if padded else numel / dp


def model_state_bytes(numel: float, dp: int = 1, stage: int = 0, precision: str = "mixed",
                      optimizer: str = "adam", padded: bool = False) -> ModelStateBytes:
    """Per-rank bytes of params, grads and optimizer state for Ψ = `numel` parameters under ZeRO `stage`
    with data-parallel degree N_d = `dp` (w, g, K = `bytes_per_param`):

        stage 0:  wΨ,      gΨ,      KΨ
        stage 1:  wΨ,      gΨ,      KΨ/N_d
        stage 2:  wΨ,      gΨ/N_d,  KΨ/N_d
        stage 3:  wΨ/N_d,  gΨ/N_d,  KΨ/N_d

    Paper example (mixed Adam, K = 12, Ψ = 7.5e9, N_d = 64): 120, 31.4, 16.6, 1.88 GB.
    `padded=True` uses ⌈Ψ/N_d⌉ per partition (a flat buffer padded to a multiple of N_d).
    """
    if stage not in STAGES:
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    if dp < 1 or int(dp) != dp:
        raise ValueError(f"data-parallel degree must be a positive integer, got {dp}")
    if numel < 0:
        raise ValueError(f"parameter count must be >= 0, got {numel}")
    b = bytes_per_param(precision, optimizer)
    shard = shard_numel(numel, dp, padded)
    return ModelStateBytes(params=b.weights * (shard if stage >= 3 else numel),
                           grads=b.grads * (shard if stage >= 2 else numel),
                           optimizer=b.optimizer * (shard if stage >= 1 else numel))


def zero_table(numel: float, dp: int, precision: str = "mixed", optimizer: str = "adam",
               padded: bool = False) -> list[dict]:
    """Rows stage 0..3, columns params / grads / optimizer / total (bytes per rank)."""
    return [{"stage": s, "name": STAGE_NAMES[s],
             **model_state_bytes(numel, dp, s, precision, optimizer, padded).to_dict()} for s in STAGES]


def deepspeed_state_bytes(numel: float, dp: int = 1, stage: int = 0, largest_layer: float = 0.0,
                          offload_optimizer: bool = False, offload_params: bool = False) -> dict:
    """Per-GPU and per-GPU-host bytes of model states under ZeRO `stage` as DeepSpeed keeps them, mixed-precision
    Adam, Ψ = `numel`, N_d = `dp`, L = `largest_layer` (the parameters of the largest module):

        stage 0     2Ψ + 2Ψ + 4Ψ + 12Ψ            16-bit weights and gradients, fp32 gradients, fp32 master + Adam
        stage 1     2Ψ + 2Ψ + (4 + 12)Ψ/N_d        the fp32 gradients with the optimizer partition
        stage 2     2Ψ + (2 + 4 + 12)Ψ/N_d         = DeepSpeed's estimate_zero2_model_states_mem_needs, 2Ψ + 18Ψ/N_d
        stage 3     (2 + 4 + 12)Ψ/N_d + 4L         = estimate_zero3_model_states_mem_needs, 18Ψ/N_d + 4L: the 16-bit
                                                   gradients live only in the gathered layer's buffer, 16-bit weights
                                                   and gradients of the largest layer (2L + 2L)
        offload_optimizer (stages 1-3): the fp32 gradients, master and Adam states (16Ψ/N_d) and the 16-bit
                    gradient partition of stages 2-3 go to the host; stage 2 keeps 2Ψ on the GPU, stage 3 2Ψ/N_d + 4L
        offload_params (stage 3, with the optimizer): the 16-bit weight partition too; the GPU keeps 4L

    Returns {"params", "grads", "fp32_grads", "optimizer", "gathered", "total", "host"} (host: what one GPU's
    states take in CPU memory; DeepSpeed's estimator multiplies it by gpus_per_node and a buffer factor 1.5).
    The ZeRO paper's count (`model_state_bytes`) has no fp32 gradients and no gathered buffer."""
    if stage not in STAGES:
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    if dp < 1 or int(dp) != dp or numel < 0 or largest_layer < 0:
        raise ValueError(f"need dp >= 1 (an integer), numel >= 0, largest_layer >= 0: "
                         f"got {dp}, {numel}, {largest_layer}")
    if (offload_optimizer and stage == 0) or (offload_params and (stage != 3 or not offload_optimizer)):
        raise ValueError("offload needs ZeRO >= 1, and parameter offload ZeRO-3 with the optimizer offloaded")
    shard = numel / dp
    params = 2 * (shard if stage == 3 else numel)
    grads = 2 * (numel if stage <= 1 else shard) if stage < 3 else 0.0
    fp32_grads = 4 * (numel if stage == 0 else shard)
    optimizer = 12 * (numel if stage == 0 else shard)
    gathered = 4 * largest_layer if stage == 3 else 0.0
    host = 0.0
    if offload_optimizer:
        host, fp32_grads, optimizer = fp32_grads + optimizer, 0.0, 0.0
        if stage >= 2:
            host, grads = host + grads, 0.0
    if offload_params:
        host, params = host + params, 0.0
    total = params + grads + fp32_grads + optimizer + gathered
    return {"params": params, "grads": grads, "fp32_grads": fp32_grads, "optimizer": optimizer, "gathered": gathered,
            "total": total, "host": host}


def format_bytes(n: float | None) -> str:
    """Human units with 1e9 = GB (as the ZeRO paper counts): '31.41 GB', '12.50 MB', '512 B'."""
    if n is None:
        return "n/a"
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def format_table(rows: list[dict], title: str = "") -> str:
    """The per-rank table as text, one line per ZeRO stage."""
    cols = ("params", "grads", "optimizer", "total")
    head = f"{'':<20}" + "".join(f"{c:>12}" for c in cols)
    lines = [title] if title else []
    lines += [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['name']:<20}" + "".join(f"{format_bytes(r[c]):>12}" for c in cols))
    return "\n".join(lines)


def calculator(params: float, dp: int = 1, precision: str = "mixed", optimizer: str = "adam",
               stage: int = 0) -> str:
    """What the notebook's widget shows: per-rank model-state bytes for one setting, as text."""
    b = bytes_per_param(precision, optimizer)
    m = model_state_bytes(params, dp, stage, precision, optimizer)
    return (f"Ψ = {params:,.0f} parameters, N_d = {dp}, {canonical_precision(precision)} {canonical_optimizer(optimizer)}"
            f" ({b.weights}+{b.grads}+{b.K} = {b.total} bytes/param), ZeRO {STAGE_NAMES[stage]}\n"
            f"per rank: params {format_bytes(m.params)}, grads {format_bytes(m.grads)}, "
            f"optimizer {format_bytes(m.optimizer)}, total {format_bytes(m.total)} "
            f"({m.total / GiB:.2f} GiB)")


# ---------------------------------------------------------------- activations
def activation_bytes_per_layer(seq: int, batch: int, d_model: int, n_heads: int, recompute: str = "none",
                               bytes_per_value: int = 2, dropout: bool = True, tp: int = 1,
                               partitioned: bool = False, sequence_parallel: bool = False, cp: int = 1,
                               flash: bool = False) -> float:
    """Bytes of activations one transformer layer keeps for backward (Korthikanti et al. 2022, "Reducing
    Activation Recomputation in Large Transformer Models"). s = seq, b = batch, h = d_model, a = n_heads,
    e = bytes_per_value, t = tp (the tensor-parallel degree).

    recompute="none", dropout=True (the paper's layer):
        e·(16·sbh + 2·as²b) + dropout masks of 1 byte (sbh + sbh + as²b);
        with e = 2 that is  s·b·h·(34 + 5·a·s/h).
        16·sbh values: 2 LayerNorm inputs, 2 LayerNorm outputs, Q, K, V, the attention output (1 each),
        the MLP's GeLU input and output (4 each); 2·as²b: the softmax output and its dropout.
    recompute="none", dropout=False (GPT-lite): e·(16·sbh + as²b), the softmax output once.
    tp = t > 1: the LayerNorm inputs and outputs (4·sbh values) and the two dropout masks after the
        row-parallel layers (2·sbh bytes) are replicated on every rank, the rest is split by heads or
        columns:  e·(4 + 12/t)·sbh + 2·sbh + (2e + 1)·as²b/t  (paper: sbh·(10 + 24/t + 5as/(ht))).
    recompute="selective" (the paper's selective recomputation: the attention core, softmax and its dropout,
        is recomputed in backward): the same without the as²b terms, e·(4 + 12/t)·sbh + 2·sbh with dropout
        (paper: sbh·(10 + 24/t); 34·sbh on one device).
    recompute="full": only the layer input is kept, e·sbh (= 2·sbh for 16-bit), replicated on the t
        ranks, or e·sbh/t when `partitioned` (ZeRO-R: each rank keeps a 1/t slice and they all-gather
        it before recomputing). The rest is rebuilt during backward at the cost of one more forward.
    sequence_parallel=True (Megatron SP on TP, `par.tp.sequence`): the LayerNorm/dropout regions
        are split along the sequence too, so everything is divided by t: s·b·h·(34 + 5as/h) / t
        (selective: 34·sbh/t).
    flash=True (scores never kept, `par.cp.ring_attention.flash_attention`): the as²b score matrix is replaced
        by one log-sum-exp per row, and the attention keeps its own output beside the projection's input:
        e·(17·sbh + a·s·b) on one device; with tp = t, e·(4 + 13/t)·sbh + e·a·s·b/t; with sequence parallelism,
        all of it / t; dropout adds its two 1-byte masks after the row-parallel layers, 2·sbh (/t with sequence
        parallelism; the attention's own dropout is regenerated from its seed). Selective recomputation keeps
        the same (flash already recomputes the core). The s² term is the attention kernel's, not a parallelism's.
    cp = c > 1 (ring attention `par.cp.ring_attention` or Ulysses `par.cp.ulysses`, no dropout): every per-token
        tensor is divided by c and the scores are never kept: the flash form of the same layer / c
        (e·(17·sbh + a·s·b)/c on one device); full recomputation e·sbh/c.
    """
    s, b, h, a, e, t = seq, batch, d_model, n_heads, bytes_per_value, tp
    if t < 1 or int(t) != t:
        raise ValueError(f"the tensor-parallel degree must be a positive integer, got {tp}")
    if cp < 1 or int(cp) != cp:
        raise ValueError(f"the context-parallel degree must be a positive integer, got {cp}")
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}")
    if cp > 1:
        if dropout:
            raise ValueError("the context-parallel formula covers dropout=False only (par's ring attention and "
                             "Ulysses have none)")
        return activation_bytes_per_layer(s, b, h, a, recompute, e, False, t, partitioned, sequence_parallel,
                                          flash=True) / cp
    if recompute == "full":
        return e * s * b * h / (t if partitioned or sequence_parallel else 1)
    if flash:
        masks = 2 * s * b * h if dropout else 0
        if sequence_parallel or t == 1:
            return (e * (17 * s * b * h + a * s * b) + masks) / t
        return e * (4 + 13 / t) * s * b * h + e * a * s * b / t + masks
    if sequence_parallel:
        return activation_bytes_per_layer(s, b, h, a, recompute, e, dropout) / t
    scores = 0 if recompute == "selective" else 1
    if t == 1:   # the single-device form, exactly as the paper writes it
        if not dropout:
            return e * (16 * s * b * h + scores * a * s * s * b)
        return e * (16 * s * b * h + scores * 2 * a * s * s * b) + (2 * s * b * h + scores * a * s * s * b)
    if not dropout:
        return e * (4 + 12 / t) * s * b * h + scores * e * a * s * s * b / t
    return e * (4 + 12 / t) * s * b * h + 2 * s * b * h + scores * (2 * e + 1) * a * s * s * b / t


def activation_peak_bytes(seq: int, batch: int, d_model: int, n_heads: int, layers: int, recompute: str = "none",
                          bytes_per_value: int = 2, dropout: bool = True, tp: int = 1, partitioned: bool = False,
                          in_flight: float = 1, flash: bool = False, sequence_parallel: bool = False,
                          cp: int = 1) -> float:
    """Activation bytes of `layers` transformer layers at their peak, the start of the backward pass, with
    `in_flight` micro-batches whose backward has not run yet (1 without pipelining); A = one layer's
    `activation_bytes_per_layer` without recomputation, K = with it:

        recompute="none":       in_flight · L · A
        recompute="selective":  in_flight · L · K  +  (A - K)     (one layer's attention core rebuilt)
        recompute="full":       in_flight · L · K  +  A           (K = e·sbh, /t when partitioned)

    Recomputation does not bring the peak down to what is kept alone: during backward each layer is run
    forward again and its activations, A, live until that layer's backward is done, one layer at a time.
    (Embedding, final norm and logits are not included.)
    """
    kw = dict(bytes_per_value=bytes_per_value, dropout=dropout, tp=tp, sequence_parallel=sequence_parallel, cp=cp,
              flash=flash)
    full = activation_bytes_per_layer(seq, batch, d_model, n_heads, "none", **kw)
    if recompute == "none":
        return in_flight * layers * full
    kept = activation_bytes_per_layer(seq, batch, d_model, n_heads, recompute, partitioned=partitioned, **kw)
    return in_flight * layers * kept + ((full if recompute == "full" else full - kept) if layers else 0)


def activation_bytes(cfg, batch: int, seq: int | None = None, recompute: str = "none",
                     bytes_per_value: int = 2, dropout: bool = True) -> float:
    """Activation bytes at the peak for all L transformer layers of a GPT or LLaMA config (one device,
    no pipelining): `activation_peak_bytes`, i.e. L × A, or with full recomputation L·e·sbh + A
    (the layer inputs, plus the one layer rebuilt during backward). seq defaults to the config's context."""
    cfg = named_config(cfg) if isinstance(cfg, str) else cfg
    if isinstance(cfg, LlamaConfig):
        layers, d, a, s = cfg.n_layers, cfg.d_model, cfg.n_heads, seq
        if s is None:
            raise ValueError("a LlamaConfig has no context length: pass seq")
    else:
        layers, d, a, s = cfg.n_layer, cfg.d_model, cfg.n_head, seq or cfg.block_size
    return activation_peak_bytes(s, batch, d, a, layers, recompute, bytes_per_value, dropout)


def mixed_precision_peak_bytes(numel: float, activations: float, optimizer: str = "adam") -> dict:
    """Peak of one mixed-precision step on one device (no ZeRO), in the order `par.precision.mixed_precision` runs it,
    with the gradients set to None between steps (torch's default):

        forward ends   2Ψ weights + KΨ (fp32 masters, m, v) + A activations            (no gradients yet)
        backward ends  2Ψ + KΨ + 2Ψ 16-bit gradients                                   (activations freed)
        update         2Ψ + KΨ + 4Ψ fp32 gradients   (step 5 frees each 16-bit gradient as it copies it)

    so the fp32 gradients raise the peak above max((2+K)Ψ + A, (4+K)Ψ) unless A ≥ 4Ψ: the claim that
    they do not count holds only while the activations are at least the 4Ψ bytes the fp32 gradients add.
    """
    k = bytes_per_param("mixed", optimizer).K
    phases = {"forward_end": (2 + k) * numel + activations, "backward_end": (4 + k) * numel,
              "update": (6 + k) * numel}
    peak = max(phases.values())
    return {**phases, "peak": peak, "peak_without_fp32_grads": max(phases["forward_end"], phases["backward_end"]),
            "fp32_grads_raise_peak": phases["update"] > max(phases["forward_end"], phases["backward_end"]),
            "extra_fp32_grad_bytes": 4 * numel}


# ---------------------------------------------------------------- measurement
def tensor_bytes(tensors) -> int:
    """Bytes of the storages behind `tensors`, each storage counted once (views share storage)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        st = t.untyped_storage()
        key = (st.data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += st.nbytes()
    return total


def _optimizer_tensors(optimizer) -> tuple[list, list]:
    """Per-element state tensors of a torch optimizer, and its 0-dim bookkeeping scalars (Adam's `step`)."""
    states, scalars = [], []
    for st in getattr(optimizer, "state", {}).values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                (scalars if v.dim() == 0 else states).append(v)
    return states, scalars


def live_model_state_bytes(model, optimizer=None, include_scalars: bool = False) -> ModelStateBytes:
    """Bytes of model states alive on this rank, measured from the tensors themselves:

    params    = storages of the model's parameters
    grads     = storages of their .grad (plus .grad of optimizer-only parameters)
    optimizer = storages of the optimizer's per-element state (Adam m and v, momentum buffers) plus
                parameters the optimizer holds that the model does not (fp32 master weights).

    Each storage is counted once. Adam's 0-dim `step` counters (4 bytes per parameter tensor) are
    bookkeeping, not per-parameter state, and are left out unless `include_scalars`.
    """
    model_params = list(model.parameters()) if hasattr(model, "parameters") else list(model)
    model_keys = {(p.untyped_storage().data_ptr(), p.device) for p in model_params}
    extra = []
    if optimizer is not None:
        for group in getattr(optimizer, "param_groups", []):
            extra += [p for p in group["params"]
                      if (p.untyped_storage().data_ptr(), p.device) not in model_keys]
    states, scalars = _optimizer_tensors(optimizer) if optimizer is not None else ([], [])
    return ModelStateBytes(
        params=tensor_bytes(model_params),
        grads=tensor_bytes([p.grad for p in model_params + extra]),
        optimizer=tensor_bytes(states + extra + (scalars if include_scalars else [])))


@contextmanager
def saved_tensors_seen(see):
    """Inside the block, call `see(t)` for every tensor autograd saves for backward.

    The hook hands autograd a detached alias of t (same storage, same version counter), not t itself: an op
    that saves its own output (ReLU) would otherwise hold tensor → node → tensor, a reference cycle that only
    Python's garbage collector breaks. A backward without retain_graph frees it anyway; a split backward
    (I, then W) retains the graph, so every micro-batch's activations outlived its W: +330 MB of RSS a step
    for ZB-V on 24 layers of 1024 in one process, +2 GiB a step on an H200."""
    def pack(t):
        see(t)
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def saved_activation_bytes(fn, *inputs, exclude=()):
    """Run `fn(*inputs)` and measure what autograd keeps for backward: the bytes of every tensor
    saved in the graph (each storage once), leaving out the storages of `exclude` (pass the
    module's parameters: weights are model states, not activations). Returns (output, bytes);
    keep the output alive as long as you want the graph. `exclude` is matched by storage, not by
    address, so a parameter whose storage is re-allocated inside `fn` (ZeRO-3 gathers it) stays out."""
    skip = {t.untyped_storage()._cdata for t in exclude}
    seen: dict[int, int] = {}

    def see(t):
        st = t.untyped_storage()
        if st._cdata not in skip:
            seen[st.data_ptr()] = st.nbytes()

    with saved_tensors_seen(see):
        out = fn(*inputs)
    return out, sum(seen.values())


def cuda_peak_bytes(device=None) -> int | None:
    """torch.cuda.max_memory_allocated on a CUDA device; None on the CPU."""
    device = torch.device(device) if device is not None else None
    if not torch.cuda.is_available() or (device is not None and device.type != "cuda"):
        return None
    return int(torch.cuda.max_memory_allocated(device))


def reset_cuda_peak(device=None) -> None:
    """Start a fresh peak measurement (no-op on the CPU)."""
    device = torch.device(device) if device is not None else None
    if torch.cuda.is_available() and (device is None or device.type == "cuda"):
        torch.cuda.reset_peak_memory_stats(device)


def free_device_memory() -> None:
    """Give back what dropped tensors held: collect reference cycles, then (on a GPU) return the caching
    allocator's free blocks to the driver, so that a job launched next finds the memory free. Drop your
    own references first (`del model, optimizer, ...`); a tensor still referenced stays."""
    import gc
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- command line
def parse_count(text: str) -> float:
    """'7.5e9', '7.5B', '350M', '1.3b' -> a number of parameters (> 0: argparse.ArgumentTypeError otherwise)."""
    t = text.strip().replace(",", "").replace("_", "")
    scale = {"k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}.get(t[-1:].lower())
    return positive_float(t[:-1]) * scale if scale else positive_float(t)


def main(argv=None) -> int:
    """`python -m par memory --params 7.5e9 --dp 64 [--precision mixed --optimizer adam]` or `--model llama-7b`."""
    ap = argparse.ArgumentParser(prog="python -m par memory",
                                 description="Per-rank model-state memory for each ZeRO stage.")
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=parse_count, help="parameter count Ψ, e.g. 7.5e9 or 7.5B")
    what.add_argument("--model", "--preset", dest="model",
                      help="a named model: tiny, small, gpt3-small, llama-7b, llama-13b, llama-33b, llama-65b")
    ap.add_argument("--dp", type=positive_int, default=1, help="data-parallel degree N_d (default 1)")
    ap.add_argument("--precision", default="mixed", help="fp32, mixed (= fp16, bf16) or pure16 (default mixed)")
    ap.add_argument("--optimizer", default="adam", help="sgd, momentum or adam (default adam)")
    args = ap.parse_args(argv)
    try:
        numel = param_count(args.model) if args.model else args.params
        b = bytes_per_param(args.precision, args.optimizer)
    except ValueError as e:
        ap.error(str(e))
    label = f"{args.model}: " if args.model else ""
    title = (f"{label}Ψ = {numel:,.0f} parameters, N_d = {args.dp}, {canonical_precision(args.precision)} "
             f"{canonical_optimizer(args.optimizer)}: {b.weights} + {b.grads} + K={b.K} = {b.total} bytes/param"
             f"\nmodel states per rank (GB = 1e9 bytes)")
    print(format_table(zero_table(numel, args.dp, args.precision, args.optimizer), title))
    return 0
