"""The exercises exactly as students get them: the notebooks of the student bundle.

In the course checkout (solutions/ present) the bundle is written by the course's own command,
`python -m par exercises release TMP` (par.course.authoring.release: answers stubbed, hidden checks removed, and the
bundle refused if a marker of either is left), into a temporary folder; the site reads its exercises/ and
nothing else. It is called as a command, not imported: the course tooling stays a layer nothing else imports
(tests/test_imports.py), and the site cannot show an exercise the release would not give a student.

In a student bundle (no solutions/), exercises/ already is what the release wrote, and is read as it is.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from par.site.run import SiteError

from par.runtime.paths import ROOT


def student_exercises(root: Path = ROOT) -> dict[str, str]:
    """{file name: notebook text} of every exercise a student gets, in order."""
    root = Path(root)
    if not (root / "solutions").is_dir():
        return {p.name: p.read_text(encoding="utf-8") for p in sorted((root / "exercises").glob("*.ipynb"))}
    with tempfile.TemporaryDirectory(prefix="par-site-release-") as tmp:
        bundle = Path(tmp) / "bundle"
        done = subprocess.run([sys.executable, "-m", "par", "exercises", "release", str(bundle)], cwd=root,
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            why = (done.stderr.strip().splitlines() or ["(no message)"])[-1].removeprefix("error: ")
            raise SiteError(f"the student bundle could not be written, so the site has no exercises to show: {why} "
                            f"(try `python -m par exercises release /tmp/bundle`)")
        return {p.name: p.read_text(encoding="utf-8") for p in sorted((bundle / "exercises").glob("*.ipynb"))}
