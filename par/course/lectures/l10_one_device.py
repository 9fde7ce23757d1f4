"""Lecture 10, one device used well: the measured roofline (one per run, one CPU thread), a block's operations at
their measured rates under it, flash attention's tiles, MFU and HFU, par's fast path beside a nanoGPT-style
reference, activation checkpointing's bytes and time, what compilation fuses; its key numbers. The notebook
computes in its own process (one device, no ranks): it launches nothing."""
from __future__ import annotations

from par.site.numbers import Key, at_least, at_most, equal

NOTEBOOK = "10_one_device"
CELLS = ()


def launches(W, backend, preset, steps):
    """None: every measurement runs in the notebook's own process, on one device."""
    return []


KEY_NUMBERS = [
    Key("the roof: matmul rate, one thread (GFLOP/s)", "2n³ / t, the fastest n of 256–1024, fastest of 9, steady clock",
        "matmul_gflops_cpu"),
    Key("the roof: copy bandwidth, one thread (GB/s)", "2·2 MiB / t, steady clock", "copy_gb_per_s_cpu"),
    Key("ridge point (FLOP/byte)", "P / B", "ridge_flops_per_byte_cpu"),
    Key("a block's FLOPs listed = FlopCounterMode's", "equal", "block_flops_listed_equal_counted",
        target=equal(True)),
    Key("linear layers' matmuls: intensity / ridge (smallest)", "≥ 1: compute-bound",
        "linear_matmul_intensity_over_ridge_min", target=at_least(1.0)),
    Key("attention's batched matmuls: intensity / the linear layers' smallest",
        "(2T²d_h / 4(2Td_h + T²)) / linear's: 5.3 / 28.4 at T = 64, d_h = 16", "attention_bmm_intensity_over_linear_min",
        target=at_most(0.25)),
    Key("attention's batched matmuls: intensity / ridge", "measured: the side is this machine's P/B",
        "attention_bmm_intensity_over_ridge"),
    Key("attention's batched matmuls: share of roof / the linear matmuls' (medians)", "< 1: small matrices run further "
        "below their roof", "attention_bmm_share_of_roof_over_linear", target=at_most(1.0)),
    Key("a block's operations: measured rate / roof (largest)", "≤ 1: under the measured roof",
        "block_op_rate_over_roof_max", target=at_most(1.0)),
    Key("linear layers' matmuls: measured rate / peak (median)", "measured", "linear_matmul_rate_over_peak_median"),
    Key("memory-bound operations: share of the block's measured time", "measured", "memory_bound_share_of_time"),
    Key("tiled attention vs SDPA (max |Δ|)", "≤ 1e-5", "tiled_vs_sdpa_max_diff", target=at_most(1e-5)),
    Key("par fast / reference (CPU seconds)", "≥ 0.9", "fast_over_reference_cpu_s", target=at_least(0.9)),
    Key("par fast / par eager (CPU seconds)", "> 1", "fast_over_eager_cpu_s", target=at_least(1.0)),
    Key("selective checkpointing: bytes kept / none's", "(11h + a)/(16h + a) ≈ 0.69 at h = 128, a = 8",
        "checkpoint_selective_kept_over_none", target=at_most(0.70)),
    Key("full checkpointing: bytes kept / none's", "h/(16h + a) < 1/16", "checkpoint_full_kept_over_none",
        target=at_most(1 / 16)),
    Key("selective checkpointing: step time / none's (steady clock)", "≥ 1: rebuilding costs time",
        "checkpoint_step_over_none", part="selective", target=at_least(1.0)),
    Key("full checkpointing: step time / none's (steady clock)", "≥ 1; 4/3 by FLOPs: one more forward",
        "checkpoint_step_over_none", part="full", target=at_least(1.0)),
    Key("operations in one block's forward + backward (eager, CPU)", "counted by torch.profiler",
        "block_ops_eager_cpu"),
    Key("kernels in one block's forward + backward (eager, GPU)", "counted by torch.profiler", "block_ops_eager_cuda"),
    Key("kernels in one block's forward + backward (compiled, GPU)", "counted by torch.profiler",
        "block_kernels_compiled_cuda"),
]
