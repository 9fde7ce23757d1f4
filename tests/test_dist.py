"""Process bootstrap rules: which backend, which device, and the one-line error when NCCL cannot run.

Pure functions only; the launched ranks (tests/test_launch.py, tests/test_collectives.py) exercise
`init()` / `teardown()` for real.
"""
from __future__ import annotations

import pytest
import torch

from par import dist as pdist
from par.dist import BackendError, choose_backend


@pytest.mark.parametrize("world_size", [1, 2, 8])
def test_auto_without_gpus_is_gloo(world_size):
    assert choose_backend(world_size, "auto", gpus=0) == "gloo"
    assert choose_backend(world_size, None, gpus=0) == "gloo"


@pytest.mark.parametrize("world_size, gpus, expected", [
    (1, 1, "nccl"), (2, 2, "nccl"), (2, 8, "nccl"), (8, 8, "nccl"),
    (2, 1, "gloo"), (8, 4, "gloo"), (8, 7, "gloo"),  # fewer GPUs than ranks: two ranks would share a GPU
])
def test_auto_uses_nccl_only_with_a_gpu_per_rank(world_size, gpus, expected):
    assert choose_backend(world_size, "auto", gpus=gpus) == expected


@pytest.mark.parametrize("world_size, gpus", [(2, 0), (4, 2), (8, 7)])
def test_explicit_nccl_without_enough_gpus_is_one_line_naming_the_fix(world_size, gpus):
    with pytest.raises(BackendError) as info:
        choose_backend(world_size, "nccl", gpus=gpus)
    message = str(info.value)
    assert "\n" not in message
    assert f"world size {world_size}" in message and f"{gpus} GPU" in message
    assert "backend='gloo'" in message


def test_explicit_choices_are_honoured():
    assert choose_backend(4, "nccl", gpus=4) == "nccl"
    assert choose_backend(4, "gloo", gpus=8) == "gloo"
    assert choose_backend(2, "GLOO", gpus=0) == "gloo"


@pytest.mark.parametrize("name", ["mpi", "ncl", "tcp"])
def test_unknown_backend_is_an_error_listing_the_choices(name):
    with pytest.raises(BackendError, match=f"unknown backend '{name}'.*auto.*gloo.*nccl"):
        choose_backend(2, name, gpus=0)


def test_one_device_per_rank():
    assert pdist.device_for("nccl", 3) == torch.device("cuda", 3)
    assert pdist.device_for("gloo", 3) == torch.device("cpu")


def test_env_before_init_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(pdist, "_ENV", None)
    with pytest.raises(RuntimeError, match=r"par.dist.init\(\) has not been called"):
        pdist.env()
