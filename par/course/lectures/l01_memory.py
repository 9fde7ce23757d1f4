"""Lecture 01, memory: where a training step's bytes go, measured on every rank beside the formulas; its key
numbers."""
from __future__ import annotations

from par.course.batch import cost
from par.course.batch.launches import launch
from par.memory import job as memory_job
from par.model import preset as model_preset
from par.site.numbers import Key, Target, equal

NOTEBOOK = "01_memory"
CELLS = ("measured model states",)


def launches(W, backend, preset, steps):
    """One job on W ranks measures the model states of every optimizer × precision."""
    b = cost.per_rank_batch(model_preset(preset), 8)
    return [launch(NOTEBOOK, "measured model states", W, memory_job.Args(
        preset=preset, steps=steps, optimizers=("adam", "momentum", "sgd"), precisions=("fp32", "bf16"), batch=b),
                   backend)]


KEY_NUMBERS = [
    Key("bytes per parameter, fp32 + Adam", "4 + 4 + 8 = 16", "bytes_per_param_fp32_adam", target=equal(16)),
    Key("bytes per parameter, mixed precision + Adam", "2 + 2 + 12 = 16", "bytes_per_param_mixed_adam",
        target=equal(16)),
    Key("measured bytes per parameter, fp32 + Adam", "16", "measured_bytes_per_param_fp32_adam", target=equal(16)),
    Key("predicted model-state bytes = measured", "equal", "predicted_equals_measured", target=equal(True)),
    Key("block activations measured / formula", "a little above 1 (LayerNorm statistics, causal mask)",
        "block_act_measured_over_formula", target=Target("a little above 1 (1–1.05)", low=1.0, high=1.05)),
    Key("7B model, fp32 + Adam (GB)", "16 · 7·10⁹ B", "gb_7b_fp32_adam"),
]
