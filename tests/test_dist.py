"""Process bootstrap rules: which backend, which device, the one-line error when NCCL cannot run, and a rank's exit.

The backend rule (`par.runtime.preflight`) as pure functions; `teardown()` and a failing rank's exit on real ranks
with tests/workers/exit_race.py (a thread coming back from torch's C++ while Python finalizes).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from par.runtime import dist as pdist
from par.runtime import launch, preflight
from par.runtime.dist import BackendError, choose_backend

EXIT_RACE = str(Path(__file__).parent / "workers" / "exit_race.py")


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


@pytest.mark.parametrize("world_size, per_node, gpus, expected", [
    (16, 8, 8, "nccl"), (64, 8, 8, "nccl"), (16, 8, 4, "gloo"), (16, None, 8, "gloo")])
def test_gpus_are_counted_per_node(world_size, per_node, gpus, expected):
    """Two nodes of 8 GPUs run 16 NCCL ranks: compare with the ranks on this node, not the world size."""
    assert choose_backend(world_size, "auto", gpus=gpus, local_world_size=per_node) == expected


def test_too_few_gpus_on_a_node_names_ranks_per_node():
    with pytest.raises(BackendError) as info:
        choose_backend(16, "nccl", gpus=4, local_world_size=8)
    assert "8 ranks per node (world size 16) but 4 GPU(s) visible" in str(info.value)
    assert choose_backend(16, "nccl", gpus=8, local_world_size=8) == "nccl"


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch is a CUDA build")
def test_nccl_with_a_cpu_only_torch_says_so():
    with pytest.raises(BackendError) as info:
        choose_backend(1, "nccl")
    message = str(info.value)
    assert "\n" not in message and "CPU-only build" in message and torch.__version__ in message
    assert "backend='gloo'" in message


def test_cuda_build_is_read_without_importing_torch_and_agrees_with_it():
    assert preflight.cuda_build() == torch.version.cuda
    assert preflight.visible_gpus() == torch.cuda.device_count()


def test_ranks_and_backend_read_from_a_command_line():
    assert preflight.ranks_requested(["--nproc", "8", "--backend", "nccl"]) == 8
    assert preflight.ranks_requested(["--world-sizes=2,4"]) == 4
    assert preflight.ranks_requested(["--worlds", "2,16", "--x", "3"]) == 16
    assert preflight.ranks_requested(["--steps", "3"]) is None
    assert preflight.option(["--backend=nccl"], "--backend") == "nccl"
    assert preflight.option(["--steps", "3"], "--backend", "auto") == "auto"


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
    with pytest.raises(RuntimeError, match=r"par.runtime.dist.init\(\) has not been called"):
        pdist.env()


def test_teardown_exits_cleanly_while_a_thread_is_inside_torch():
    """The cause of the rare abort at exit ("terminate called without an active exception"): a thread that
    returns from torch's C++ during interpreter finalization. teardown() ends a torchrun rank before it.
    (Without teardown's os._exit this launch aborts with SIGABRT: exit_race.py's `raw` mode shows it.)"""
    assert launch.run(EXIT_RACE, nproc=1, args=["teardown"], timeout=120, quiet=True) is None


def test_a_failing_rank_keeps_its_python_error_not_a_sigabrt():
    with pytest.raises(launch.LaunchError) as info:
        launch.run(EXIT_RACE, nproc=1, args=["raise"], timeout=120, quiet=True)
    assert info.value.root_cause == "rank 0 failed: ValueError: deliberate failure with a C++ thread running " \
                                    "(marker 5521)", str(info.value)
    assert not info.value.crashed


def test_a_rank_has_glibc_keep_the_memory_it_frees():
    """`par.runtime.dist.init` asks glibc to keep freed memory (`par.runtime.heap`), and glibc accepts. How many page
    faults that saves is measured in lecture 08's ring attention, not here: this course's VM runs DAMON with a
    pageout scheme, which reclaims idle pages on its own schedule, so a fault count in a test would depend on it."""
    import subprocess
    import sys
    code = ("import par.runtime.dist, par.runtime.heap as heap\n"
            "asked = []\n"
            "real = heap.keep_freed_memory\n"
            "heap.keep_freed_memory = lambda: asked.append(real()) or asked[-1]\n"
            "par.runtime.dist.init()\n"
            "print(asked)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split("\n")[-2:] == ["[True]", ""], out.stdout[-500:] + out.stderr[-2000:]
