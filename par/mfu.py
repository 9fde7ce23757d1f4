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

The peak is the vendor's dense (no 2:4 sparsity) tensor-core number, for the SKU named in `PEAK`, in
the precision the matmuls run in (bf16/fp16, or fp32: TF32 tensor cores when torch allows them, plain
fp32 otherwise).
"""
from __future__ import annotations

# fragment of torch.cuda.get_device_name() -> (the SKU whose datasheet the numbers are, dense peak FLOP/s of
# 16-bit tensor cores with fp32 accumulation, TF32 tensor cores, plain fp32); the first fragment found wins
PEAK = {
    "H200 NVL": ("H200 NVL", 835e12, 418e12, 60e12),
    "H200": ("H200 SXM 141GB", 989e12, 494e12, 67e12),
    "H100 PCIe": ("H100 PCIe 80GB", 756e12, 378e12, 51e12),
    "H100 NVL": ("H100 NVL 94GB", 835e12, 418e12, 60e12),
    "H100": ("H100 SXM5 80GB", 989e12, 494e12, 67e12),
    "A100": ("A100 SXM4 or PCIe, 40 or 80GB", 312e12, 156e12, 19.5e12),
    "A10": ("A10 24GB", 125e12, 62.5e12, 31.2e12),
    "L40S": ("L40S 48GB", 362e12, 183e12, 91.6e12),
    "L4": ("L4 24GB", 121e12, 60e12, 30.3e12),
    "V100": ("V100 SXM2 (fp16 only, no TF32: fp32 runs at the fp32 rate)", 125e12, 15.7e12, 15.7e12),
    "T4": ("T4 (fp16 only)", 65e12, 8.1e12, 8.1e12),
    "RTX 4090": ("GeForce RTX 4090", 165e12, 82.6e12, 82.6e12),
    "RTX 3090": ("GeForce RTX 3090", 71e12, 35.6e12, 35.6e12),
}


def matmul_params(cfg) -> int:
    """N = L·(4·d² + 2·d·f) + d·V: the weights of a GPT-lite config that multiply activations (module docstring)."""
    d = cfg.d_model
    return cfg.n_layer * (4 * d * d + 2 * d * cfg.ffn) + d * cfg.vocab_size


def flops_per_token(cfg, seq: int | None = None) -> float:
    """F = 6·N + 12·L·s·d: forward and backward FLOPs per token of sequences of `seq` tokens (default the
    config's block size); module docstring."""
    s = seq if seq is not None else cfg.block_size
    return 6 * matmul_params(cfg) + 12 * cfg.n_layer * s * cfg.d_model


def peak_of(device_name: str) -> tuple | None:
    """(SKU, 16-bit, TF32, fp32 dense peak FLOP/s) of a GPU named like torch.cuda.get_device_name() (None when
    unknown)."""
    return next((row for fragment, row in PEAK.items() if fragment.lower() in device_name.lower()), None)


def peak_flops(device_name: str, precision: str = "bf16", tf32: bool = False) -> float | None:
    """The dense peak FLOP/s of a GPU named like torch.cuda.get_device_name() (None when unknown)."""
    row = peak_of(device_name)
    if row is None:
        return None
    _, half, tf32_rate, fp32 = row
    if precision in ("bf16", "fp16", "mixed"):
        return half
    return tf32_rate if tf32 else fp32


def mfu(step_flops: float, step_seconds: float, devices: int, peak: float) -> float:
    """Achieved FLOP/s over the peak of all `devices`."""
    return step_flops / step_seconds / (devices * peak)
