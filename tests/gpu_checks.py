"""What the GPU tier asserts on a job's result, as functions: tests/test_gpu.py applies them to the jobs run on a
CUDA GPU, tests/test_gpu_checks.py to the same jobs on CPU (gloo, `tiny`), so that a renamed key or a wrong
piece of arithmetic fails on every machine, not first on the GPU server."""
from __future__ import annotations

import math
import statistics


def finite_losses(result) -> list[float]:
    """Every number under a key containing "loss" anywhere in a job's result; asserts they are finite."""
    found = []

    def walk(x, key=""):
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, k)
        elif isinstance(x, list):
            if "loss" in key and x and all(isinstance(v, (int, float)) for v in x):
                found.extend(x)
            else:
                for v in x:
                    walk(v, key)
    walk(result)
    assert found and all(math.isfinite(v) for v in found), found[:10]
    return found


def sixteen_bit_tracks_fp32(result: dict, dtype: str, max_skipped: int = 10) -> str:
    """`par.precision.job` run with --dtype fp32,<dtype>: the 16-bit run's losses are finite and fall, fp16 skips
    fewer than `max_skipped` steps (dynamic loss scaling finds a scale), and its last loss is within 10 % of fp32's.
    Returns the line the GPU tier prints."""
    fp32, half = result["runs"]
    assert (fp32["dtype"], half["dtype"]) == ("fp32", dtype)
    losses = half["losses"]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
    if dtype == "fp16":
        assert sum(half["skipped"]) < max_skipped, "dynamic loss scaling found a scale within a few steps"
    assert abs(losses[-1] - fp32["losses"][-1]) < 0.1 * fp32["losses"][-1]
    return (f"{dtype}: final loss {losses[-1]:.4f} (fp32 {fp32['losses'][-1]:.4f}), "
            f"skipped {sum(half['skipped'])} steps")


def tokens_per_second(row: dict, batch: int, block_size: int) -> tuple[float, float]:
    """(seconds per step, tokens per second) of a `par.train.job` result: the median of its timed steps
    (`step_s` is the list of them, the slowest rank's), batch · block_size tokens each."""
    steps = row["step_s"]
    assert isinstance(steps, list) and steps and all(s > 0 for s in steps), steps
    step_s = statistics.median(steps)
    return step_s, batch * block_size / step_s
