"""Lecture 10, one device used well: the measured roofline, a block's operations placed on it, flash attention's
tiles, MFU and HFU, par's fast path beside a nanoGPT-style reference; its key numbers. The notebook computes in its
own process (one device, no ranks): it launches nothing."""
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
]
