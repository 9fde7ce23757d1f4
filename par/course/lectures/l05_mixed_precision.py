"""Lecture 05, mixed precision: dynamic loss scaling with injected overflows, fp32 / fp16 / bf16 side by side, the
fp16 demos the notebook runs in its own kernel; its key numbers."""
from __future__ import annotations

from par.course.batch import cost
from par.course.batch.launches import launch, sized
from par.model import preset as model_preset
from par.precision import job as precision_job
from par.site.numbers import Key, at_least, at_most, near

NOTEBOOK = "05_mixed_precision"
CELLS = ("loss scaling", "fp32 / fp16 / bf16")


def launches(W, backend, preset, steps):
    """Overflows injected at steps 2, 3 and the middle (the scaler skips them and halves its scale); then the three
    formats (bf16 is dropped by the notebook on a GPU without it)."""
    batch = cost.per_rank_batch(model_preset(preset), 8) * W
    inject = sorted({s for s in (2, 3, steps // 2, steps // 2 + 1) if s < steps})
    dtypes = ("fp32", "fp16", "bf16")
    return [
        launch(NOTEBOOK, "loss scaling", W, precision_job.Args(
            dtype=("fp16",), preset=preset, steps=steps, batch=batch, window=5, inject=tuple(inject), inject_rank=0,
            warmup=4, max_grad_norm=2.0), backend),   # above the norms of a trained step: clips the first ones only
        launch(NOTEBOOK, "fp32 / fp16 / bf16", W, precision_job.Args(
            dtype=dtypes, preset=preset, steps=steps, batch=batch, init_scale=2.0 ** 13), backend),
    ]


def kernel(W, backend, preset, steps):
    """Sections 3-5: an fp32 model's gradients on 16 sequences, fp16 copies (MixedPrecision: fp16 weights and
    gradients, fp32 masters and their gradients) on the same batch, then the eight steps with Adam on at most 8
    of them. The fp32 model and the last fp16 copy stay alive until the launches: 8 + 12 bytes per parameter."""
    return [sized(NOTEBOOK, "fp16 demos", model_preset(preset), 16, cost.kernel_device(backend, W),
                  label=preset, optimizer="adam", states=8.0 + 12.0)]


KEY_NUMBERS = [
    Key("max loss difference to fp32", "small, bf16 > fp16", "max loss difference to fp32"),
    Key("steps skipped on overflow", "dynamic loss scaling", "skipped steps"),
    Key("final loss scale", "halved on overflow, doubled after a window", "final loss scale"),
    Key("model-state bytes per parameter, fp16", "2 + 2 + 12 = 16", "model-state bytes/param fp16"),
    Key("activations fp16 / fp32", "½ (ids, masks, fp32 logits do not shrink)", "activation ratio fp16/fp32",
        target=near(0.5, 0.05, "½ ± 0.05")),
    Key("largest loss difference to fp32, bf16 / fp16", "bf16 has 3 fewer mantissa bits: > 1",
        "loss difference bf16 / fp16", target=at_least(1)),
    Key("autocast + GradScaler vs par (max |Δ|)", "≤ 1e-5", "torch_api_max_diff", "autocast", target=at_most(1e-5)),
]
