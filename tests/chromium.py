"""Debian's Chromium for the browser tests, in one place: finding it, skipping without it, launching it headless.

The tests never download a browser: they drive the system's `chromium` through Playwright's `executable_path`.
Without Chromium a browser test is skipped with the reason in pytest's summary, except on CI (CI=true, as .ci/run
sets it): there a missing browser or Playwright fails the test, because CI machines install it (.ci/run does, as
root) and a skipped browser test would pass unseen.
"""
from __future__ import annotations

import os
import shutil
from contextlib import contextmanager

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
MISSING = "Chromium not installed: `apt-get install chromium` to run the browser tests"

# a test (or module: pytestmark) that needs the browser; on CI it runs, and fails in `launched()` without one
needs_chromium = pytest.mark.skipif(CHROMIUM is None and not IN_CI, reason=MISSING)


@contextmanager
def launched():
    """A headless Chromium (a Playwright Browser); skips or, on CI, fails when Chromium or Playwright is missing."""
    if CHROMIUM is None:
        if IN_CI:
            pytest.fail(f"CI={os.environ.get('CI')}: the browser test must run here. {MISSING} (.ci/run does it as "
                        f"root)")
        pytest.skip(MISSING)
    if IN_CI:
        import playwright.sync_api as sync_api   # CI: a missing package fails too
    else:
        sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (see requirements.txt)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()
