"""The two test tiers.

    python -m pytest -n 2 --dist loadfile -m "not slow"
        the fast tier, after every change (under 5 minutes on 2 cores): every pure formula and one-process check,
        and every strategy launched once, on 2 gloo ranks, against the single-process reference
    python -m pytest -n 2 --dist loadfile
        everything (the README's test command, CI): 3 and 4 ranks, NCCL's point-to-point semantics emulated, the
        lecture notebooks executed, the grader's class runs, the emulated cluster, the browser

`-n 2 --dist loadfile` (pytest-xdist) runs two files at a time, each file's tests in order on one worker: the
suite waits on processes starting and ranks meeting about half of its time, which the other worker fills.
Without `-n` the suite runs the same tests one after the other.

A test module marks a whole test `@slow`, or passes its launches through `tiered(...)`: the first case runs
in both tiers, the others only in the full suite.
"""
import pytest

slow = pytest.mark.slow


def tiered(cases, id=str, fast: int = 1) -> list:
    """`cases` as pytest params named by `id(case)`: the first `fast` in the fast tier, the rest marked slow."""
    return [pytest.param(*(c if isinstance(c, tuple) else (c,)), id=id(c), marks=() if i < fast else slow)
            for i, c in enumerate(cases)]


def tiered_one(cases, id=str, fast: int = 1) -> list:
    """`tiered` for a single parameter whose values are tuples (a fixture's `params=`)."""
    return [pytest.param(c, id=id(c), marks=() if i < fast else slow) for i, c in enumerate(cases)]
