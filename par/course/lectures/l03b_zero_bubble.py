"""Lecture 03b, interleaved and zero-bubble pipelines: the executed ZB-H1 and ZB-V runs on lecture 03's equal
stages (`PipelineSetup`, imported from `l03_pipelines`), and the key numbers with their targets (the measured and
the simulated bubble within 0.05 of the formulas, the bubble as idle / step time)."""
from __future__ import annotations

from par.course.batch.launches import launch
from par.course.lectures.l03_pipelines import pipeline_setup, square_args
from par.site.numbers import Key, at_most, near

NOTEBOOK = "03b_zero_bubble"
CELLS = ("zero bubble measured",)


def launches(W, backend, preset, steps):
    """ZB-H1 and ZB-V executed on `p_time` ranks of equal stages (F = I = W), on the three smallest of m = 4, 8,
    16, 32 where ZB-V's formula holds (m >= 2p - 1)."""
    s = pipeline_setup(W, backend, preset, steps)
    ms = tuple(m for m in (4, 8, 16, 32) if m >= 2 * s.p_time - 1)[:3]
    return [launch(NOTEBOOK, "zero bubble measured", s.p_time, square_args(s, ("zb_h1", "zb_v"), ms), s.backend)]


KEY_NUMBERS = [
    Key("interleaved 1F1B bubble, p = 4, m = 8, v = 2 (simulated, equal costs)", "(p−1)/(vm+p−1) = 3/19",
        "interleaved_bubble_p4_m8_v2", target=near(3 / 19, 1e-9, "= 3/19")),
    Key("ZB-H1 bubble measured (idle / step), by m (F = I = W)", "(p−1)/(3m+p−1)", "bubble_measured_vs_m", "zb_h1"),
    Key("ZB-V bubble measured (idle / step), by m (F = I = W)", "(p−1)/(6m+p−1)", "bubble_measured_vs_m", "zb_v"),
    Key("largest |bubble measured − formula| (ZB-H1, ZB-V)", "≤ 0.05", "bubble_measured_minus_formula_max",
        target=at_most(0.05)),
    Key("largest |bubble simulated with this run's costs − formula| (ZB-H1, ZB-V)", "≤ 0.05",
        "bubble_simulated_minus_formula_max", target=at_most(0.05)),
]
