"""Lecture 03b, interleaved and zero-bubble pipelines: 1F1B, ZB-H1 and ZB-V executed in one launch on lecture 03's
equal stages (`PipelineSetup`, imported from `l03_pipelines`), and the key numbers with their targets (the bubble as
idle / step time, measured on the load-proof clock and simulated with the run's costs, each within a factor 2 of
its schedule's formula: `l03_pipelines.RELATIVE`; ZB-H1's and ZB-V's over 1F1B's against the formulas' ratio)."""
from __future__ import annotations

from par.course.batch.launches import launch
from par.course.lectures.l03_pipelines import RELATIVE, pipeline_setup, square_args
from par.site.numbers import Key, near

NOTEBOOK = "03b_zero_bubble"
CELLS = ("zero bubble measured",)


def microbatches(p: int) -> tuple[int, ...]:
    """The m of the executed runs: the smallest where ZB-V's formula holds (m >= 2p - 1), and 2p: the largest
    bubbles, so the smallest of them (ZB-V's, (p-1)/(6m+p-1): 0.053 and 0.040 on 2 ranks) stays above what a
    shared core's own slowdowns add (ZB-V's at m = 4p, 0.020 on 2 ranks, measured 1.3 to 3.3 × in the runs that
    chose these m)."""
    return (2 * p - 1, 2 * p)


def launches(W, backend, preset, steps):
    """1F1B, ZB-H1 and ZB-V executed on `p_time` ranks of equal stages (F = I = W), each at `microbatches(p)`, the
    median of `timed_steps` + 4 steps."""
    s = pipeline_setup(W, backend, preset, steps)
    return [launch(NOTEBOOK, "zero bubble measured", s.p_time,
                   square_args(s, ("1f1b", "zb_h1", "zb_v"), microbatches(s.p_time), more_steps=4, record_comm=True),
                   s.backend)]


KEY_NUMBERS = [
    Key("interleaved 1F1B bubble, p = 4, m = 8, v = 2 (simulated, equal costs)", "(p−1)/(vm+p−1) = 3/19",
        "interleaved_bubble_p4_m8_v2", target=near(3 / 19, 1e-9, "= 3/19")),
    Key("bubble on the load-proof clock (idle / step), by schedule and m (F = I = W)",
        "1F1B (p−1)/(m+p−1), ZB-H1 (p−1)/(3m+p−1), ZB-V (p−1)/(6m+p−1)", "bubble_measured_vs_m"),
    Key("bubble on the wall clock, by schedule and m", "as above", "bubble_wall_vs_m"),
    Key("bubble simulated with this run's costs, by schedule and m", "as above", "bubble_simulated_vs_m"),
    Key("bubble formula, by schedule and m (ZB-H1 with this run's F, I, W)", "as above", "bubble_formula_vs_m"),
    Key("1F1B, ZB-H1 and ZB-V bubble measured / formula, by m", "1", "bubble_measured_over_formula",
        target=RELATIVE),
    Key("1F1B, ZB-H1 and ZB-V bubble simulated with this run's costs / formula, by m", "1",
        "bubble_simulated_over_formula", target=RELATIVE),
    Key("ZB-H1 and ZB-V bubble over 1F1B's, measured in one launch, divided by the formulas' ratio, by m",
        "1", "zero_bubble_over_1f1b_vs_formula", target=RELATIVE),
]
