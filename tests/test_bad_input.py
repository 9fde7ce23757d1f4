"""Bad input to a command ends in one line, `error: ...`, exit 2, naming the file and the fix: the authoring
commands and the grader on a damaged solution."""
from __future__ import annotations

import json
import shutil

import pytest

from par.__main__ import main as python_m_par

ROOT_FILES = {
    "truncated": b'{"cells": [',
    "empty": b"",
    "binary": bytes(range(128, 256)) * 3,
    "cell-less": json.dumps({"nbformat": 4, "nbformat_minor": 5, "metadata": {}}).encode(),
    "no-checks": json.dumps({"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": []}).encode(),
}


def course(tmp_path, damage: str):
    """A course folder whose one solution (and its exercise) is damaged as `damage` says."""
    root = tmp_path / "course"
    for folder in ("solutions", "exercises"):
        (root / folder).mkdir(parents=True)
        (root / folder / "00_x.ipynb").write_bytes(ROOT_FILES[damage])
    return root


def one_line_error(capsys, argv) -> str:
    code = python_m_par(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "\n" not in err and "Traceback" not in err, (code, err)
    return err


@pytest.mark.parametrize("damage", list(ROOT_FILES))
@pytest.mark.parametrize("action", ["generate", "check", "release"])
def test_the_authoring_commands_name_a_damaged_solution_in_one_line(tmp_path, capsys, monkeypatch, damage, action):
    monkeypatch.delenv("PAR_DEBUG", raising=False)
    root = course(tmp_path, damage)
    extra = [str(tmp_path / "bundle")] if action == "release" else []
    err = one_line_error(capsys, ["exercises", action, *extra, "--root", str(root)])
    assert "00_x.ipynb" in err, err


@pytest.mark.parametrize("damage", ["truncated", "empty", "binary", "cell-less"])
def test_the_grader_names_a_damaged_solution_in_one_line(tmp_path, capsys, monkeypatch, damage):
    monkeypatch.delenv("PAR_DEBUG", raising=False)
    root = course(tmp_path, damage)
    submission = tmp_path / "00_x.ipynb"
    shutil.copy(root / "exercises" / "00_x.ipynb", submission)
    err = one_line_error(capsys, ["grade", str(submission), "--solutions", str(root / "solutions")])
    assert "00_x.ipynb" in err and "checks cannot be read" in err, err


def test_torch_compat_refuses_another_packages_wheel_and_a_damaged_one(tmp_path, capsys):
    import zipfile

    from par.course.server import torch_compat
    other = tmp_path / "six-1.0-py3-none-any.whl"
    with zipfile.ZipFile(other, "w") as z:
        z.writestr("six.py", "x = 1\n")
    assert torch_compat.main([str(other)]) == 2
    assert "holds no torch package" in capsys.readouterr().err
    damaged = tmp_path / "torch-2.11.0-cp311-none-any.whl"
    with zipfile.ZipFile(damaged, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("torch/__init__.py", "x = 1\n")
        z.writestr("torch/nn/functional.py", "def relu(): pass\n" * 1000)
    data = bytearray(damaged.read_bytes())
    at = data.find(b"torch/nn/functional.py") + 40
    data[at:at + 30] = bytes(30)
    damaged.write_bytes(bytes(data))
    assert torch_compat.main([str(damaged)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "is damaged" in err and "\n" not in err, err


def test_batch_takes_a_folder_of_notebooks_and_names_the_one_meant(tmp_path, monkeypatch):
    from par.course.batch.launches import CourseError
    from par.course.batch.runner import matching
    root = __import__("pathlib").Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    assert [p.name for p in matching("notebooks")] == sorted(p.name for p in (root / "notebooks").glob("*.ipynb"))
    with pytest.raises(CourseError, match=r"did you mean notebooks/02_data_parallel\.ipynb\?"):
        matching("notebooks/02_data_paralel.ipynb")


def test_wheelhouse_checks_its_folder_before_pip_runs(monkeypatch, capsys):
    import subprocess
    monkeypatch.delenv("PAR_DEBUG", raising=False)

    def no_pip(*a, **k):
        raise AssertionError("pip ran before the folder was checked")
    monkeypatch.setattr(subprocess, "run", no_pip)
    one_line_error(capsys, ["wheelhouse", "--out", "/proc/par-wheelhouse"])


def test_char_dataset_errors_name_the_file(tmp_path):
    from par.data import CharDataset
    short = tmp_path / "short.txt"
    short.write_text("abc")
    with pytest.raises(ValueError, match=r"short\.txt: text of 3 characters is too short"):
        CharDataset(path=short, block_size=8)
    binary = tmp_path / "data.bin"
    binary.write_bytes(bytes(range(128, 256)))
    with pytest.raises(ValueError, match=r"data\.bin: not UTF-8"):
        CharDataset(path=binary)


@pytest.mark.parametrize("key, value", [("provenance", ["cpu"]), ("parameters", "tiny"), ("provenance", 3)])
def test_site_compare_names_a_summary_whose_provenance_or_parameters_are_not_objects(tmp_path, capsys, monkeypatch,
                                                                                     key, value):
    monkeypatch.delenv("PAR_DEBUG", raising=False)
    runs = []
    for name in ("a", "b"):
        folder = tmp_path / name
        folder.mkdir()
        summary = {"notebooks": [{"notebook": "00_distributed_basics.ipynb", "status": "ok", "duration_s": 1.0,
                                  "records": {}}]}
        if name == "b":
            summary[key] = value
        (folder / "summary.json").write_text(json.dumps(summary))
        runs.append(str(folder))
    err = one_line_error(capsys, ["site", "--compare", *runs, "--out", str(tmp_path / "site")])
    assert f"{key} must be an object" in err and "summary.json" in err, err


@pytest.mark.slow
def test_a_batch_with_home_unwritable_leaves_no_temporary_folder(tmp_path):
    """With HOME unwritable, IPython falls back to a temporary folder of its own each time it is asked for one: the
    batch points it (and matplotlib) into the run's folder instead, so TMPDIR is left as it was."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "HOME": "/proc/no-home-here", "TMPDIR": str(scratch)}
    done = subprocess.run([sys.executable, "-m", "par", "batch", "--notebooks", "tests/fixtures/batch/10_records.ipynb",
                           "--out", str(tmp_path / "runs")], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert not list(scratch.iterdir()), f"left in TMPDIR: {sorted(p.name for p in scratch.iterdir())}"


def test_resume_tp_whose_heads_tp_cannot_split_is_refused_before_training(tmp_path):
    """3 ranks cannot split tiny's heads: the job says so before it trains anything (no state saved)."""
    import par.runtime.launch
    from par.runtime.launch import LaunchError
    with pytest.raises(LaunchError, match=r"error: --resume-tp on 3 ranks: n_head \d+ is not divisible") as e:
        par.runtime.launch.run("par.resilience.job", nproc=3, timeout=120, quiet=True,
                               args=["--dir", str(tmp_path), "--resume-tp", "--resume-stages", "1", "--batch", "6"])
    assert not (tmp_path / "state").exists(), "it trained and saved before refusing"
    assert "\n" not in str(e.value).splitlines()[0]


@pytest.mark.parametrize("model, words", [({"preset": "tiny", "vocab_size": 10}, "vocab_size 10 is smaller"),
                                          ({"preset": "tiny", "block_size": 1_000_000}, "block_size 1000000"),
                                          ({"preset": "gpt3-small", "n_layer": 400, "d_model": 8192, "n_head": 64},
                                           "the planner predicts")])
def test_train_refuses_what_the_data_or_the_memory_cannot_take_before_any_rank(capsys, monkeypatch, model, words):
    """A vocabulary smaller than the data's characters, a window longer than the data, a model of ~320 billion
    parameters: refused in one line before a rank starts (a launch here fails the test)."""
    import par.runtime.launch
    monkeypatch.delenv("PAR_DEBUG", raising=False)
    monkeypatch.setattr(par.runtime.launch, "run", lambda *a, **k: pytest.fail("a rank was started"))
    config = json.dumps({"train_batch_size": 8, "model": model})
    err = one_line_error(capsys, ["train", "--config", config, "--nproc", "1", "--backend", "gloo"])
    assert words in err, err
