"""Model FLOPs utilization: how much of the device's peak the training really used.

    MFU = (FLOPs the model needs per step) / (seconds per step) / (peak FLOP/s of the devices)

The FLOPs a step needs are the lecture's count, `par.train.planner.step_flops`: 6·Ψ·tokens for the
matmuls of forward and backward, plus 12·L·B·s²·d for the attention scores (Chinchilla /
Megatron-LM's accounting; recomputation is not counted as useful work here). The peak is the
vendor's dense tensor-core number for the precision the matmuls run in (bf16/fp16, or fp32:
TF32 tensor cores when torch allows them, plain fp32 otherwise).
"""
from __future__ import annotations

# dense peak FLOP/s per GPU: (16-bit tensor cores, TF32 tensor cores, plain fp32), by a name fragment
PEAK = {
    "H200": (989e12, 494e12, 67e12),
    "H100 PCIe": (756e12, 378e12, 51e12),
    "H100": (989e12, 494e12, 67e12),        # SXM
    "A100": (312e12, 156e12, 19.5e12),
    "A10": (125e12, 62.5e12, 31e12),
    "L40S": (362e12, 183e12, 91.6e12),
    "L4": (121e12, 60e12, 30e12),
    "V100": (125e12, 15.7e12, 15.7e12),      # no TF32: fp32 runs at the fp32 rate
    "T4": (65e12, 8.1e12, 8.1e12),
    "RTX 4090": (165e12, 82.6e12, 82.6e12),
    "RTX 3090": (71e12, 35.6e12, 35.6e12),
}


def peak_flops(device_name: str, precision: str = "bf16", tf32: bool = False) -> float | None:
    """The dense peak FLOP/s of a GPU named like torch.cuda.get_device_name() (None when unknown)."""
    for fragment, (half, tf32_rate, fp32) in PEAK.items():
        if fragment.lower() in device_name.lower():
            if precision in ("bf16", "fp16", "mixed"):
                return half
            return tf32_rate if tf32 else fp32
    return None


def mfu(step_flops: float, step_seconds: float, devices: int, peak: float) -> float:
    """Achieved FLOP/s over the peak of all `devices`."""
    return step_flops / step_seconds / (devices * peak)
