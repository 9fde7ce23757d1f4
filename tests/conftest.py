"""Shared by the tests: the repository root, the point-to-point semantics fixture, the `gpu` marker.

`pytest -m gpu` runs the GPU tier (tests/test_gpu.py) on a machine with a CUDA GPU; a plain `pytest`
skips it everywhere, saying how to run it.

`p2p_env` runs a test twice: with gloo's own point-to-point semantics, and with NCCL's emulated on gloo
(`par.runtime.nccl_emulation`: one Work per `batch_isend_irecv`, received data valid only after it is waited).
Pass it to the launcher: `par.runtime.launch.run(WORKER, nproc=3, env=p2p_env)`; results cached per world size
should be cached per (world size, mode): `tuple(p2p_env.items())` is hashable.

`exercise_class(name)` is one exercise's class (tests/classroom.py: the solved, tampered, wrong and cheating
notebooks), graded once per session and shared by every test file that judges that exercise.
"""
import os
from pathlib import Path

import pytest
import torch

from par.runtime import nccl_emulation

ROOT = Path(__file__).resolve().parents[1]

# tests/fixtures holds notebooks and course folders that tests copy and run; never collect them directly
# (e.g. under `pytest --nbval-lax`).
collect_ignore_glob = ["fixtures/*"]


@pytest.fixture
def root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def course():
    """The instructor's course as the grader loads it (solutions/)."""
    from par.course.grading import grade
    return grade.load_course()


@pytest.fixture(scope="session")
def exercise_class(tmp_path_factory, course):
    """grades(name) -> {file stem: Grade} of exercise `name`'s class (tests/classroom.py), graded on first use.

    Under pytest-xdist (`-n 2`) the workers share one grading per exercise: the first worker to ask grades the class
    under a lock and leaves the grades in the session's shared temp folder; a worker asking later (or waiting on
    the lock meanwhile) reads them."""
    import classroom
    graded = {}
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent                   # the folder every worker's basetemp is in

    def grades(name: str) -> dict:
        if name not in graded:
            graded[name] = classroom.grade_class_once(name, shared, lambda: tmp_path_factory.mktemp(f"class-{name}"),
                                                      course)
        return graded[name]
    return grades


P2P_SEMANTICS = {"gloo": {}, "nccl-emulation": {nccl_emulation.ENV: "1"}}


@pytest.fixture(params=list(P2P_SEMANTICS))
def p2p_env(request) -> dict:
    """The environment for `par.runtime.launch.run(..., env=p2p_env)`: {} (gloo) or {"PAR_NCCL_EMULATION": "1"}."""
    return dict(P2P_SEMANTICS[request.param])


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (run them with `pytest -m gpu`; skipped without one)")
    config.addinivalue_line("markers", "slow: only in the full suite; `pytest -m \"not slow\"` is the fast tier "
                                       "(tests/tiers.py)")


CLASS_TIMEOUT_S = 1800   # a test that reads a class may grade it, or wait for the other worker grading it


def pytest_collection_modifyitems(config, items):
    """`gpu` tests run only when asked for (`pytest -m gpu`) and only where torch sees a CUDA device;
    otherwise they are skipped, with the reason. A test that uses `exercise_class` gets CLASS_TIMEOUT_S."""
    for item in items:
        if "exercise_class" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.timeout(CLASS_TIMEOUT_S), append=False)
    asked = "gpu" in (config.getoption("markexpr", "") or "")
    if asked and torch.cuda.is_available():
        return
    why = pytest.mark.skip(reason="the GPU tier runs with `pytest -m gpu`" if not asked else
                           f"needs a CUDA GPU; this torch ({torch.__version__}) sees none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(why)
