"""The student bundle: the course without its answers, for instructors who keep solutions/ private.

    python -m par exercises release DIR [--force]

DIR receives what a student needs to follow the course and do the exercises:

    README.md, requirements.txt, pyproject.toml   (so `pip install -r requirements.txt` installs par)
    par/                                          the package (caches left out)
    notebooks/                                    the lectures
    exercises/                                    generated from solutions/ right now: answers stubbed,
                                                  hidden checks removed, cell ids kept
    configs/                                      the DeepSpeed-style configs lecture 07 reads
    docs/                                         the instructor, TA and cluster pages the README links to
    par-release.json                              when, from which commit, which exercises

and never solutions/ or tests/ (the answers, and the wrong answers the tests keep). In the bundle,
`python -m par grade exercises/NN_topic.ipynb` finds no solutions/ and gives a practice grade with the
visible checks. Students hand in their exercises/NN_topic.ipynb; the instructor grades them from the
course checkout (`python -m par grade submissions/ --report grades.csv`), where the cell ids of the
bundle's exercises match solutions/.

DIR must be new or empty; with --force a folder holding an earlier bundle (it has par-release.json) is
replaced. Anything else is refused, so a typo never deletes a folder.
"""
from __future__ import annotations

import datetime
import json
import shutil
import subprocess
from pathlib import Path

from par.course.authoring import generate as exercises
from par.course.authoring.markers import LEAKING
from par.runtime.checks import check_writable

FILES = ("README.md", "requirements.txt", "pyproject.toml", ".gitignore")
FOLDERS = {"par": "*", "notebooks": "*.ipynb", "configs": "*.json", "docs": "*.md"}   # docs: the README links there
MARKER = "par-release.json"
NEVER = ("solutions", "tests")


class ReleaseError(ValueError):
    """A bundle that cannot be written (the folder is in the way, or something would leak)."""


def _commit(root: Path) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def prepare(dest: Path, force: bool) -> None:
    """Make `dest` an empty folder, or refuse (see the module docstring)."""
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        if not force:
            raise ReleaseError(f"{dest} exists and is not empty; choose a new folder, or pass --force to replace "
                               f"an earlier bundle")
        if not (dest / MARKER).is_file():
            raise ReleaseError(f"{dest} is not an earlier bundle (no {MARKER}); refusing to delete it")
        shutil.rmtree(dest)
    dest.mkdir(parents=True, exist_ok=True)


def leaks(dest: Path) -> list[str]:
    """Files in the bundle that give answers away: solution folders, answer or hidden-check markers in notebooks."""
    found = [f"{p.relative_to(dest)}/" for p in dest.rglob("*") if p.is_dir() and p.name in NEVER]
    for nb in dest.rglob("*.ipynb"):
        text = nb.read_text(encoding="utf-8")
        found += [f"{nb.relative_to(dest)}: {mark!r}" for mark in LEAKING if mark in text]
    return found


def write_bundle(dest: Path, root: Path = exercises.ROOT, force: bool = False) -> dict:
    """Write the bundle into `dest`; return what par-release.json records."""
    root, dest = Path(root).resolve(), Path(dest).resolve()
    inside = [root / f for f in (*FOLDERS, *NEVER, "exercises")]
    if dest == root or dest in root.parents or any(d == dest or d in dest.parents for d in inside):
        raise ReleaseError(f"{dest} is part of the course itself; write the bundle somewhere else")
    check_writable(dest, directory=True)                                             # before the work
    texts = {p.name: exercises.exercise_text(p) for p in exercises.solutions(root)}  # fails before writing
    if not texts:
        raise ReleaseError(f"no solutions in {root / 'solutions'}: nothing to release")
    prepare(dest, force)
    for name in FILES:
        if (root / name).is_file():
            shutil.copy2(root / name, dest / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints", "*.egg-info")
    for folder, pattern in FOLDERS.items():
        if not (root / folder).is_dir():
            continue
        if pattern == "*":
            shutil.copytree(root / folder, dest / folder, ignore=ignore)
        else:
            (dest / folder).mkdir()
            for p in sorted((root / folder).glob(pattern)):
                shutil.copy2(p, dest / folder / p.name)
    (dest / "exercises").mkdir()
    for name, text in texts.items():
        (dest / "exercises" / name).write_text(text, encoding="utf-8")
    found = leaks(dest)
    if found:
        shutil.rmtree(dest)
        raise ReleaseError("the bundle would give answers away, so it was deleted: " + "; ".join(found))
    info = {"released": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": _commit(root), "exercises": sorted(texts),
            "grading": "students: python -m par grade exercises/NN_topic.ipynb (practice, visible checks); "
                       "instructor: python -m par grade SUBMISSIONS --report grades.csv from the course checkout"}
    (dest / MARKER).write_text(json.dumps(info, indent=2) + "\n")
    return info


def main(dest: Path, root: Path = exercises.ROOT, force: bool = False) -> int:
    info = write_bundle(dest, root, force)
    print(f"wrote the student bundle to {dest}: {len(info['exercises'])} exercises, the lectures, par/, "
          f"README.md and requirements.txt; no solutions/ (commit {info['commit'] or 'unknown'})")
    print("students: pip install -r requirements.txt, then python -m par grade exercises/NN_topic.ipynb "
          "(a practice grade: the visible checks)")
    return 0
