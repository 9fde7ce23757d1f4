"""One record per graded exercise, kept in the one module that grades its real-rank part.

    EXERCISE = Exercise("00_ring_chunks", runner=__name__, forbidden=guards.COLLECTIVES, why="...", p2p_only=True,
                        stubs=[("par.comm.collectives", "ring_all_reduce"), ...])

A runner module (`par.course.grading.exercise_*`: what the check launches on real ranks, `rank_io.main`) states its
exercise's `EXERCISE`: the solution notebook it grades, the rules the student's module runs under on the ranks
(`forbidden` names refused, `why` the rule, `p2p_only`: every collective refused but sends and receives), par's own
implementations stubbed in the job's sandbox (`stubs`, `par.course.grading.stubs`) and what grading needs done
once before any submission runs (`prepare`: 07's measured layouts). Nothing else lists exercises: `records()`
finds every module's record, `of_runner` and `of_notebook` look one up. Adding an exercise touches its solution
notebook, its record and its fixtures. What a job module imports before its ranks fork (`PRELOAD`) stays the job
module's own, as for every job (`par.runtime.agent.preload_of` reads it from the source).
"""
from __future__ import annotations

import functools
import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable

import par.course.grading as grading

RUNNERS = "exercise_"        # the grader's modules that hold a record: par/course/grading/exercise_*.py


@dataclass(frozen=True)
class Exercise:
    """A graded exercise and what grading it needs beyond its solution notebook."""
    notebook: str                              # solutions/<notebook>.ipynb (the file's stem)
    runner: str = ""                           # the module its check launches on real ranks ("": none)
    forbidden: tuple = ()                      # (module, name) refused while the student's module runs there
    why: str = ""                              # the rule, as a refusal says it
    p2p_only: bool = False                     # every collective refused on the ranks: sends and receives only
    stubs: tuple = ()                          # (module, name) of par's stubbed in the job's sandbox
    prepare: Callable[[], None] | None = None  # done once before any submission runs

    def __post_init__(self):
        object.__setattr__(self, "forbidden", tuple(map(tuple, self.forbidden)))
        object.__setattr__(self, "stubs", tuple(map(tuple, self.stubs)))


@functools.lru_cache(maxsize=None)
def records() -> tuple[Exercise, ...]:
    """Every record the grader's runner modules state, by notebook."""
    found = []
    for info in pkgutil.iter_modules(grading.__path__):
        if info.name.startswith(RUNNERS):
            record = getattr(importlib.import_module(f"{grading.__name__}.{info.name}"), "EXERCISE", None)
            if isinstance(record, Exercise):
                found.append(record)
    return tuple(sorted(found, key=lambda e: e.notebook))


def of_runner(module: str) -> Exercise | None:
    """The record of the exercise whose real-rank runner is `module`, None for any other module."""
    return next((e for e in records() if e.runner and e.runner == module), None)


def of_notebook(name: str) -> Exercise | None:
    """The record of exercise `name` (a solution notebook's stem), None for an exercise that needs none."""
    return next((e for e in records() if e.notebook == name), None)
