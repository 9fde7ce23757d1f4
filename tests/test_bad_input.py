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
