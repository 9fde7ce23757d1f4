"""Model FLOPs utilization: how much of the device's peak the training really used.

    MFU = (FLOPs the model needs per step) / (seconds per step) / (peak FLOP/s of the devices)

The FLOPs a step needs: tokens × `flops_per_token`, the matmuls of forward and backward (recomputation
is not useful work and is not counted here; `par.train.planner.step_flops` adds it for the step time):

    F = 6·N + 12·L·s·d                       FLOPs per token
    N = L·(4·d² + 2·d·f) + d·V               the weights that multiply activations

A weight of m×n costs 2·m·n FLOPs per token forward (a multiply and an add each) and 4·m·n backward
(the input's gradient and the weight's): 6 per weight. N holds, per block, the q, k, v and output
projections (4d²) and the MLP's two matrices (2·d·f, f = 4d), plus the LM head (d·V, tied to the token
embedding or not: it is a matmul either way). The token and position embeddings are lookups and count
nothing, nor do biases, LayerNorms, GeLU and the softmax (O(d) per token). Attention itself multiplies
QKᵀ and the scores by V: 2·s·d FLOPs each per token and layer forward, ×3 with backward, 12·L·s·d (the
full s×s scores, causal or not, as the papers count them).

Sources: Kaplan et al. 2020, "Scaling Laws for Neural Language Models", §2.1 and table 1 (N, the
non-embedding parameters, and C ≈ 6N per token); Chowdhery et al. 2022, "PaLM", appendix B (MFU, and
6N + 12·L·H·Q·T per token, H·Q = d); Narayanan et al. 2021, "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", eq. 3: 72·B·s·L·d²·(1 + s/(6d) + V/(12·L·d)) per batch without
recomputation, which is F·B·s above with f = 4d. gpt3-small (L = 12, d = 768, s = 2048, V = 50257):
N = 123.5M of its Ψ = 163.8M parameters, F = 0.97 GFLOP/token, where 6Ψ + 12·L·s·d would say 1.21.

Conventions (lecture 10):
- attention="full" counts all s×s scores as above (PaLM, Megatron, nanoGPT); attention="causal" counts the half
  a causal kernel computes, 6·L·s·d (FlashAttention-2 counts this way). MFU is quoted full unless said.
- MFU counts the FLOPs the model needs; HFU (hardware FLOPs utilization) counts what the device really ran: the
  blocks' forward again when activations are recomputed, and the LM head's padded columns (`padded_vocab`).

The peak is the vendor's dense (no 2:4 sparsity) tensor-core number, for the exact SKU the device reports
(`sku`: the name torch.cuda.get_device_name() gives, read word by word, never by substring: "L4" is not "L40"),
in the precision the matmuls run in (bf16/fp16, or fp32: TF32 tensor cores when torch is told to use them, the
`tf32` flag, plain fp32 otherwise).
"""
from __future__ import annotations

import re

# SKU key -> (the datasheet the numbers come from, dense peak FLOP/s of 16-bit tensor cores with fp32
# accumulation, TF32 tensor cores, plain fp32)
PEAK = {
    "H100 SXM": ("H100 SXM5 80GB", 989e12, 494e12, 67e12),
    "H100 PCIe": ("H100 PCIe 80GB", 756e12, 378e12, 51e12),
    "H100 NVL": ("H100 NVL 94GB", 835e12, 418e12, 60e12),
    "H200 SXM": ("H200 SXM 141GB", 989e12, 494e12, 67e12),
    "H200 NVL": ("H200 NVL 141GB", 835e12, 418e12, 60e12),
    "GH200": ("GH200 Grace Hopper (its GPU is an H100/H200 SXM)", 989e12, 494e12, 67e12),
    "A100": ("A100 SXM4 or PCIe, 40 or 80GB", 312e12, 156e12, 19.5e12),
    "A10": ("A10 24GB", 125e12, 62.5e12, 31.2e12),
    "A10G": ("A10G 24GB (AWS G5; the figures AWS quotes, no NVIDIA datasheet)", 70e12, 35e12, 35e12),
    "L40": ("L40 48GB", 181e12, 90.5e12, 90.5e12),
    "L40S": ("L40S 48GB", 362e12, 183e12, 91.6e12),
    "L4": ("L4 24GB", 121e12, 60e12, 30.3e12),
    "V100": ("V100 SXM2 (fp16 only, no TF32: fp32 runs at the fp32 rate)", 125e12, 15.7e12, 15.7e12),
    "T4": ("T4 (fp16 only)", 65e12, 8.1e12, 8.1e12),
    "RTX 4090": ("GeForce RTX 4090", 165e12, 82.6e12, 82.6e12),
    "RTX 3090": ("GeForce RTX 3090", 71e12, 35.6e12, 35.6e12),
}
_VENDOR = {"NVIDIA", "TESLA", "GEFORCE"}
_FORM = {"PCIE": "PCIe", "NVL": "NVL"}            # any other H100/H200 (SXM5, "80GB HBM3", bare) is the SXM


def sku(device_name: str) -> str | None:
    """The `PEAK` key of a GPU named like torch.cuda.get_device_name(), read as words (split at spaces and
    hyphens, vendor words dropped): the first word is the chip, exactly ("L4" ≠ "L40" ≠ "L40S", "A10" ≠ "A10G",
    "H200" ≠ "GH200"); H100 and H200 take their form factor from a later word (PCIe, NVL, else SXM)."""
    words = [w for w in re.split(r"[\s\-]+", device_name.upper()) if w and w not in _VENDOR]
    if not words:
        return None
    chip = words[0]
    if chip == "RTX" and len(words) > 1:
        chip = f"RTX {words[1]}"
    if chip in ("H100", "H200"):
        form = next((_FORM[w] for w in words[1:] if w in _FORM), "SXM")
        chip = f"{chip} {form}"
    return next((key for key in PEAK if key.upper() == chip.upper()), None)


def matmul_params(cfg) -> int:
    """N = L·(4·d² + 2·d·f) + d·V: the weights of a GPT-lite config that multiply activations (module docstring)."""
    d = cfg.d_model
    return cfg.n_layer * (4 * d * d + 2 * d * cfg.ffn) + d * cfg.vocab_size


def attention_flops_per_token(cfg, seq: int | None = None, attention: str = "full") -> float:
    """QKᵀ and the scores times V, forward and backward, per token: 12·L·s·d (full), 6·L·s·d (causal)."""
    s = seq if seq is not None else cfg.block_size
    if attention not in ("full", "causal"):
        raise ValueError(f"unknown attention convention {attention!r}: use full or causal")
    return (12 if attention == "full" else 6) * cfg.n_layer * s * cfg.d_model


def flops_per_token(cfg, seq: int | None = None, attention: str = "full") -> float:
    """F = 6·N + 12·L·s·d: forward and backward FLOPs per token of sequences of `seq` tokens (default the
    config's block size), attention counted by `attention` ("full" or "causal"); module docstring."""
    return 6 * matmul_params(cfg) + attention_flops_per_token(cfg, seq, attention)


def hardware_flops_per_token(cfg, seq: int | None = None, attention: str = "full", recompute: bool = False) -> float:
    """What the device runs per token: F, plus the head's padded columns (6·d·(V_padded − V)), plus with
    `recompute` (every block checkpointed) the blocks' forward once more, 2·L·(4d² + 2df) + attention / 3."""
    d = cfg.d_model
    padded = 6 * d * (getattr(cfg, "vocab", cfg.vocab_size) - cfg.vocab_size)
    again = (2 * cfg.n_layer * (4 * d * d + 2 * d * cfg.ffn) + attention_flops_per_token(cfg, seq, attention) / 3
             if recompute else 0)
    return flops_per_token(cfg, seq, attention) + padded + again


def peak_of(device_name: str) -> tuple | None:
    """(SKU, 16-bit, TF32, fp32 dense peak FLOP/s) of a GPU named like torch.cuda.get_device_name() (None when
    unknown)."""
    key = sku(device_name)
    return PEAK[key] if key else None


def peak_flops(device_name: str, precision: str = "bf16", tf32: bool = False) -> float | None:
    """The dense peak FLOP/s of a GPU named like torch.cuda.get_device_name() (None when unknown): the 16-bit
    rate for bf16/fp16/mixed; for fp32 the TF32 rate when `tf32` (matmuls allowed on TF32 tensor cores,
    `use_tf32`), the plain fp32 rate otherwise."""
    row = peak_of(device_name)
    if row is None:
        return None
    _, half, tf32_rate, fp32 = row
    if precision in ("bf16", "fp16", "mixed"):
        return half
    return tf32_rate if tf32 else fp32


def use_tf32(on: bool) -> None:
    """Let fp32 matmuls and convolutions run on TF32 tensor cores (10-bit mantissa inputs, fp32 accumulation),
    or not; pass the same flag to `peak_flops`."""
    import torch
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on


def mfu(step_flops: float, step_seconds: float, devices: int, peak: float) -> float:
    """Achieved FLOP/s over the peak of all `devices` (MFU with the model's FLOPs, HFU with the hardware's)."""
    return step_flops / step_seconds / (devices * peak)
