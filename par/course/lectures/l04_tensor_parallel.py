"""Lecture 04, tensor parallelism: TP training beside the dense model (and beside DTensor's); its key numbers.

The smallest lecture module: copy it to start a new lecture (see `par/course/lectures/__init__.py`)."""
from __future__ import annotations

from par.course.batch import cost
from par.course.batch.launches import launch
from par.model import preset as model_preset
from par.site.numbers import Key, at_most, equal
from par.tp import job as tp_job
from par.tp.layers import tp_degree

NOTEBOOK = "04_tensor_parallel"
CELLS = ("TP training",)


def launches(W, backend, preset, steps):
    """One job on the largest TP degree the heads and width allow (`tp_degree`); the dense model beside it only
    where it is small."""
    cfg = model_preset(preset)
    dense = cfg.block_size <= 256
    return [launch(NOTEBOOK, "TP training", tp_degree(cfg, W), tp_job.Args(
        preset=preset, steps=steps, batch_size=cost.per_rank_batch(cfg, 8), eps=1e-6, no_reference=not dense,
        torch_api=3), backend)]


KEY_NUMBERS = [
    Key("TP parameters vs one process (max |Δ|)", "≤ 5e-6", "tp_max_param_diff", target=at_most(5e-6)),
    Key("all-reduces per layer (forward + backward)", "2 + 2 = 4", "tp_allreduces_per_layer", target=equal(4)),
    Key("TP bytes per step, measured", "4L · 2(t−1)/t · B·T·d · 4 B", "tp_bytes_per_step"),
    Key("TP / DP bytes, gpt3-small, b = 8", "activations vs gradients", "tp_over_dp_bytes_gpt3_small_b8"),
    Key("par TP vs DTensor parallelize_module (max |Δ|)", "≤ 1e-5", "torch_api_max_diff", "dtensor_tp",
        target=at_most(1e-5)),
]
