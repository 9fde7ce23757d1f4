"""Lecture 10, one device used well: the measured roofline, a block's operations placed on it, flash attention's
tiles, MFU and HFU, par's fast path beside a nanoGPT-style reference, activation checkpointing's bytes and time, what
compilation fuses; its key numbers. The notebook computes in its own process (one device, no ranks): it launches
nothing."""
from __future__ import annotations

from par.site.numbers import Key, at_least, at_most, equal

NOTEBOOK = "10_one_device"
CELLS = ()


def launches(W, backend, preset, steps):
    """None: every measurement runs in the notebook's own process, on one device."""
    return []


KEY_NUMBERS = [
    Key("measured matmul rate (GFLOP/s)", "2n³ / t", "matmul_gflops_cpu"),
    Key("measured copy bandwidth (GB/s)", "2·bytes / t", "copy_gb_per_s_cpu"),
    Key("ridge point (FLOP/byte)", "P / B", "ridge_flops_per_byte_cpu"),
    Key("a block's FLOPs listed = FlopCounterMode's", "equal", "block_flops_listed_equal_counted",
        target=equal(True)),
    Key("tiled attention vs SDPA (max |Δ|)", "≤ 1e-5", "tiled_vs_sdpa_max_diff", target=at_most(1e-5)),
    Key("par fast / reference (CPU seconds)", "≥ 0.9", "fast_over_reference_cpu_s", target=at_least(0.9)),
    Key("par fast / par eager (CPU seconds)", "> 1", "fast_over_eager_cpu_s", target=at_least(1.0)),
    Key("selective checkpointing: bytes kept / none's", "(11h + a)/(16h + a) ≈ 0.69 at h = 128, a = 8",
        "checkpoint_selective_kept_over_none", target=at_most(0.70)),
    Key("full checkpointing: bytes kept / none's", "h/(16h + a) < 1/16", "checkpoint_full_kept_over_none",
        target=at_most(1 / 16)),
    Key("selective checkpointing: step time / none's (CPU)", "measured", "checkpoint_step_over_none",
        part="selective"),
    Key("full checkpointing: step time / none's (CPU)", "≈ 4/3: one more forward", "checkpoint_step_over_none",
        part="full"),
    Key("operations in one block's forward + backward (eager, CPU)", "counted by torch.profiler",
        "block_ops_eager_cpu"),
    Key("kernels in one block's forward + backward (eager, GPU)", "counted by torch.profiler", "block_ops_eager_cuda"),
    Key("kernels in one block's forward + backward (compiled, GPU)", "counted by torch.profiler",
        "block_kernels_compiled_cuda"),
]
