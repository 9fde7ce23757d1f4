"""The GPU tier's assertions (tests/gpu_checks.py) on the CPU: the same jobs, on gloo with the `tiny` preset, read
through the same functions, so that a result key or a piece of arithmetic the GPU tier relies on is checked on every
machine (the tier itself runs only where CUDA is: tests/test_gpu.py)."""
import json

import pytest
from tiers import slow

from gpu_checks import finite_losses, sixteen_bit_tracks_fp32, tokens_per_second
from par.model import preset
from par.runtime import launch


@slow
def test_16_bit_check_reads_the_mixed_precision_job():
    result = launch.run("par.precision.job", nproc=1, backend="gloo", timeout=300, quiet=True, args=[
        "--dtype", "fp32,fp16", "--preset", "tiny", "--steps", "12", "--batch", "8", "--init-scale", 2 ** 16])
    assert "fp16: final loss" in sixteen_bit_tracks_fp32(result, "fp16")
    finite_losses(result)


@slow
def test_tokens_per_second_reads_the_training_job():
    config = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4, "steps": 4, "model": {"preset": "tiny"}}
    row = launch.run("par.train.job", nproc=1, backend="gloo", timeout=300, quiet=True,
                     args=["--config", json.dumps(config)])
    step_s, per_s = tokens_per_second(row, 4, preset("tiny").block_size)
    assert min(row["step_s"]) <= step_s <= max(row["step_s"]) and per_s == pytest.approx(4 * preset("tiny").block_size / step_s)
