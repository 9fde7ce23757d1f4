"""The course on a GPU server: the offline wheelhouse's sets and tags, and gpu-check's plan and its refusal on a
machine without a GPU. Building a wheelhouse needs the network, so `.ci/run` builds one and installs it offline
into a fresh venv; here only what runs without it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from par.course.server import gpu_check, wheelhouse
from par.runtime.checks import CheckError

ROOT = Path(__file__).resolve().parent.parent


def test_neither_set_holds_torch_and_both_can_build_par():
    for which in wheelhouse.SETS:
        reqs = wheelhouse.requirements_of(which)
        assert not [r for r in reqs if r.split("=")[0].split(">")[0].split("<")[0].strip() == "torch"]
        assert not [r for r in reqs if r.startswith("-e")]
        assert any(r.startswith("setuptools") for r in reqs), "installing par offline builds it with setuptools"


def test_the_full_set_is_requirements_txt_less_torch_and_par():
    lines = [line.split("#")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines()]
    lines = [line for line in lines if line]
    assert wheelhouse.course_requirements() == [line for line in lines
                                                if not line.startswith("torch") and not line.startswith("-e")]


def test_the_batch_set_has_papermill_and_pytest_and_no_jupyterlab():
    names = {r.split(">")[0].split("=")[0].split("<")[0] for r in wheelhouse.requirements_of("batch")}
    assert {"papermill", "ipykernel", "pytest", "matplotlib"} <= names
    assert "jupyterlab" not in names and "playwright" not in names


def test_an_unknown_set_is_refused():
    with pytest.raises(CheckError, match="choose one of full, batch"):
        wheelhouse.requirements_of("everything")


def test_a_manylinux_platform_takes_every_older_glibc_floor():
    tags = wheelhouse.platform_tags("manylinux_2_28_x86_64")
    assert tags[0] == "manylinux_2_28_x86_64"
    assert {"manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"} <= set(tags)
    assert "manylinux_2_29_x86_64" not in tags and "manylinux_2_4_x86_64" not in tags
    assert wheelhouse.platform_tags("manylinux_2_12_aarch64")[-2:] == ["manylinux2010_aarch64", "manylinux1_aarch64"]
    assert wheelhouse.platform_tags("macosx_11_0_arm64") == ["macosx_11_0_arm64"]


def test_pip_downloads_binaries_for_another_python_and_builds_for_this_one(tmp_path):
    other = wheelhouse.pip_command(tmp_path, tmp_path / "r.txt", "3.12", "manylinux_2_28_x86_64")
    assert other[3] == "download" and "--only-binary=:all:" in other
    assert other[other.index("--python-version") + 1] == "3.12" and "cp312" in other
    here = wheelhouse.pip_command(tmp_path, tmp_path / "r.txt", None, None)
    assert here[3] == "wheel" and "--only-binary=:all:" not in here


def test_wheels_are_named_by_their_normalised_distribution():
    assert wheelhouse.distribution(Path("Pillow-13.0.0-cp312-cp312-manylinux_2_28_x86_64.whl")) == "pillow"
    assert wheelhouse.distribution(Path("jupyter_client-8.6.0-py3-none-any.whl")) == "jupyter-client"


def test_a_wheelhouse_with_torch_in_it_is_refused(tmp_path):
    (tmp_path / "torch-2.13.0-cp311-cp311-linux_x86_64.whl").write_bytes(b"")
    (tmp_path / "nvidia_cublas_cu12-12.8-py3-none-manylinux_2_27_x86_64.whl").write_bytes(b"")
    (tmp_path / "tqdm-4.66-py3-none-any.whl").write_bytes(b"")
    assert wheelhouse.torch_in(tmp_path) == ["nvidia_cublas_cu12-12.8-py3-none-manylinux_2_27_x86_64.whl",
                                             "torch-2.13.0-cp311-cp311-linux_x86_64.whl"]


def test_the_batch_gets_what_the_budget_leaves_with_steps_scaled_to_it(tmp_path):
    plan = gpu_check.stages(8, gpus=4, gpu_memory=80e9, out=tmp_path)
    assert [s.name for s in plan] == ["gpu tier", "bench mfu", "dry run", "batch"]
    assert sum(s.timeout_s for s in plan) == pytest.approx(8 * 60)
    dry = plan[2].command
    assert dry[dry.index("--world-size") + 1] == "4" and dry[dry.index("--gpu-memory") + 1] == "8e+10"
    batch = plan[3].command
    assert batch[batch.index("--world-size") + 1] == "1" and batch[batch.index("--backend") + 1] == "nccl"
    assert int(batch[batch.index("--steps") + 1]) == gpu_check.batch_steps(plan[3].timeout_s)
    assert gpu_check.batch_steps(1) == 5 and gpu_check.batch_steps(1e6) == 200 and gpu_check.batch_steps(240) == 20


def test_a_stage_that_times_out_or_is_skipped_is_recorded_so(tmp_path):
    slow = gpu_check.Stage("slow", (sys.executable, "-c", "import time; time.sleep(30)"), timeout_s=0.5)
    got = gpu_check.run_stage(slow, tmp_path)
    assert got["status"].startswith("timed out after")
    assert got["seconds"] < 10
    skipped = gpu_check.run_stage(gpu_check.Stage("x", ("false",), 1.0, skipped="no such benchmark"), tmp_path)
    assert skipped["status"] == "skipped" and skipped["skipped"] == "no such benchmark"
    ok = gpu_check.run_stage(gpu_check.Stage("ok", (sys.executable, "-c", "print('hi')"), 30.0), tmp_path)
    assert ok["status"] == "ok" and (tmp_path / "ok.log").read_text() == "hi\n"
    json.dumps(ok)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: gpu-check would run")
def test_gpu_check_refuses_in_one_line_without_a_gpu(tmp_path):
    done = subprocess.run([sys.executable, "-m", "par", "gpu-check", "--minutes", "1", "--out", str(tmp_path / "r")],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: no CUDA GPU here")
    assert not (tmp_path / "r").exists(), "nothing is written before the refusal"
