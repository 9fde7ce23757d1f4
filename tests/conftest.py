"""Shared by the tests: the repository root, and fixtures that are not tests themselves."""
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# tests/fixtures holds notebooks and course folders that tests copy and run; never collect them directly
# (e.g. under `pytest --nbval-lax`).
collect_ignore_glob = ["fixtures/*"]


@pytest.fixture
def root() -> Path:
    return ROOT
