"""Where things are: the repository that holds `par/` (notebooks, exercises, solutions, runs)."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]   # the folder that holds par/
