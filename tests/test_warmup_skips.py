"""Lecture 05's fix: the learning-rate warm-up counts the steps the optimizer took, so a step skipped on
overflow does not advance it (`par.precision.job`, as DeepSpeed skips its scheduler's step on overflow)."""
from __future__ import annotations

from par.precision.mixed_precision import warmup_cosine_lr
from par.runtime import launch


def test_skipped_steps_do_not_advance_the_warmup():
    out = launch.run("par.precision.job", nproc=1, timeout=300, quiet=True, args=[
        "--dtype", "fp16", "--steps", "5", "--batch", "2", "--init-scale", 2 ** 12, "--window", 100,
        "--hysteresis", 1, "--inject", "1,2", "--warmup", 3, "--max-grad-norm", 100.0])
    run = out["runs"][0]
    assert run["skipped"] == [False, True, True, False, False]
    taken = [0, 1, 1, 1, 2]                            # optimizer steps before each step
    assert run["lr"] == [warmup_cosine_lr(t, 3e-3, 3, 5) for t in taken]
