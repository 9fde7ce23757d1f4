"""What every job measures and reports: the result contract, one timed step, the merge over ranks.

A job (`job.py` in each lecture's folder, `main(argv=None)`) only parses its typed `Args`
(`par.runtime.job_args`), builds what it needs from `par`, runs it and reports; the strategies,
formulas and meters live in `par` itself. Notebooks, benchmarks and tests start jobs one way,
`par.runtime.launch.run("par.dp.job", nproc=N, args=[...])`, which returns what rank 0 saved with
`par.runtime.dist.save_result` (a notebook through its lecture's `Launch.run`, which parses it, below).

The result contract: the same key means the same quantity in every job.

    world_size   int           ranks in the job
    backend      str           "gloo" or "nccl"
    losses       [float]       loss of the whole global batch, one per step (warm-up steps included)
    step_s       [float]       wall-clock seconds of each timed step: the slowest rank's
    per_rank     [dict]        one entry per rank, gathered to rank 0 (memory, bytes, spans, ...)

`losses` and `step_s` belong to jobs that train. A job that measures something else (the collectives'
bytes and timings, ZeRO-R's activation bytes, an exercise's check on real ranks, a benchmark's timings)
reports `world_size`, `backend` and what it measured. Further keys are documented in the job's own
docstring. A job that runs several configurations in one launch saves {"world_size", "backend",
"runs": [...]}, each run with the keys above.

Callers never read that dict: a launch (`par.course.batch.launches.Launch.run`) parses it once, with
`parse`, into a `JobResult`, read as attributes: `result.world_size`, `result.losses`, `result.runs[0].step_s`,
`result.find(label="3").memory`, `run.rank(0).bytes`; nested quantities likewise (`run.memory.predicted.total`),
a mapping keyed by data (a run's name, a degree) stays a mapping. `to_json()` gives the JSON back (what
`par.course.batch.record.record` writes to the batch's summary).

Every job measures with the same few lines: `timed_step` (one step's wall seconds, the device
synchronized at both ends), then on rank 0 `slowest` (step_s) and `mean_over_ranks` (losses) over
what `par.runtime.dist.gather_object` collected, or `merge_ranks` for both.
"""
from __future__ import annotations

import keyword
import time
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist


def sync(device) -> None:
    """Wait until `device` has run every kernel queued on it (CUDA runs them asynchronously; the CPU
    queues nothing), so that a clock read next counts them."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Step:
    """What `timed_step` measured."""
    seconds: float = 0.0     # wall clock, the device's work included
    cpu_s: float = 0.0       # this process's CPU seconds


@contextmanager
def timed_step(device, barrier: bool = False):
    """Time the block as one step: seconds = t_end - t_start on the wall clock, with `sync(device)` at both
    ends, so it holds every kernel the step queued and none queued before it; cpu_s likewise on this
    process's CPU clock. barrier=True: every rank starts the step together (`dist.barrier()` first).
    Wrap the block in `par.comm.commlog.capture()` too for the bytes it sent."""
    if barrier and dist.is_initialized():
        dist.barrier()
    sync(device)
    step = Step()
    t0, c0 = time.perf_counter(), time.process_time()
    yield step
    sync(device)
    step.seconds, step.cpu_s = time.perf_counter() - t0, time.process_time() - c0


def slowest(seconds_per_rank) -> list[float]:
    """step_s[i] = max over ranks r of t_r[i]: a step is over when its slowest rank is."""
    return [max(ts) for ts in zip(*seconds_per_rank)]


def mean_over_ranks(values_per_rank) -> list[float]:
    """losses[i] = (1/N) · Σ_r loss_r[i]: each rank's loss is the mean over an equal share of the global
    batch, so their mean is the loss of the whole batch."""
    return [sum(vs) / len(vs) for vs in zip(*values_per_rank)]


def merge_ranks(per_rank: list[dict], losses: str = "losses", step_s: str = "step_s") -> dict:
    """The contract's `losses` (the mean over the ranks) and `step_s` (the slowest rank's) from every rank's
    dict, which holds its own lists under the keys `losses` and `step_s`."""
    return {"losses": mean_over_ranks(r[losses] for r in per_rank), "step_s": slowest(r[step_s] for r in per_rank)}


# ---------------------------------------------------------------- the typed result a launch returns
def typed(value):
    """A result's JSON value as callers read it: a mapping whose keys are all names becomes `Measured`
    (`m.total`), a list of them a list of `Measured`; a mapping keyed by data (a run's name, a sequence
    length, a degree) stays a dict with its values typed; numbers, text and None stay as they are."""
    if isinstance(value, Measured):
        return value
    if isinstance(value, dict):
        if value and all(isinstance(k, str) and k.isidentifier() and not keyword.iskeyword(k) for k in value):
            return Measured(value)
        return {k: typed(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [typed(v) for v in value]
    return value


def plain(value):
    """The JSON form of a typed value: `to_json()` of a result, lists and mappings walked, the rest as is."""
    if hasattr(value, "to_json"):
        return value.to_json()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


class Measured(Mapping):
    """Named quantities one job measured, read as attributes: `m.total`, `m.counted`; nested ones likewise
    (`run.memory.predicted.total`). `to_json()` gives the JSON it was read from; `has(name)` whether a
    quantity is there (a job leaves out what it did not measure, e.g. `max_diff` without a reference).
    Functions that take JSON-shaped records (a timeline's spans for `par.pp.sim.stage_costs` or a plot) read
    it as the read-only mapping it was parsed from; notebooks read attributes (tests/test_notebook_results.py
    checks)."""
    __slots__ = ("_data",)

    def __init__(self, data: dict):
        object.__setattr__(self, "_data", dict(data))

    def __getattr__(self, name: str):
        data = object.__getattribute__(self, "_data")
        if name not in data:
            raise AttributeError(f"{type(self).__name__} has no {name!r} (it has: {', '.join(sorted(data))})")
        return typed(data[name])

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is read-only")

    def __getitem__(self, name: str):
        return typed(self._data[name])

    def __iter__(self):
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __reduce__(self):
        return _rebuilt, (type(self), self._data)        # copy and pickle: the same class over the same JSON

    def has(self, name: str) -> bool:
        return name in self._data

    def names(self) -> list[str]:
        return list(self._data)

    def to_json(self) -> dict:
        return plain(self._data)

    def __eq__(self, other) -> bool:
        return isinstance(other, Mapping) and self.to_json() == plain(dict(other))

    __hash__ = None

    def __dir__(self):
        return sorted({*super().__dir__(), *self._data})

    def __repr__(self) -> str:
        return repr(self.to_json())        # printed as the JSON it holds, as a notebook shows it


def _rebuilt(cls, data: dict) -> Measured:
    """A `Measured` (or subclass) over `data` as it was (what `Measured.__reduce__` names)."""
    out = object.__new__(cls)
    object.__setattr__(out, "_data", data)
    return out


class RankResult(Measured):
    """What one rank measured (an entry of the contract's `per_rank`): `rank` and its own quantities
    (memory, bytes, spans, ...)."""

    def __init__(self, data: dict, rank: int):
        super().__init__({"rank": rank, **data})


class RunResult(Measured):
    """One run of a job, read as attributes (`run.losses`, `run.step_s`, `run.rank(0).memory`): the contract's
    `losses` and `step_s` where the run trained, its ranks' results, and the job's own quantities."""

    @property
    def ranks(self) -> list[RankResult]:
        """The contract's `per_rank`, each as a `RankResult` (rank r at index r)."""
        return [RankResult(d, r) for r, d in enumerate(self._data.get("per_rank", ()))]

    def rank(self, r: int) -> RankResult:
        """What rank `r` measured."""
        ranks = self.ranks
        if not 0 <= r < len(ranks):
            raise IndexError(f"rank {r}: this run reported {len(ranks)} ranks")
        return ranks[r]


class JobResult(RunResult):
    """What a launch returns: rank 0's result, parsed once (`parse`). The contract's `world_size` and
    `backend`, then either one run's quantities (`result.losses`) or, for a job that runs several
    configurations in one launch, `runs` (`result.runs[0].losses`, `result.find(label="3")`)."""

    def __init__(self, data: dict):
        missing = [k for k in ("world_size", "backend") if k not in data]
        if missing:
            raise ValueError(f"a job's result must hold {' and '.join(missing)} (par.measure's contract)")
        super().__init__(data)

    @property
    def world_size(self) -> int:
        return int(self._data["world_size"])

    @property
    def backend(self) -> str:
        return str(self._data["backend"])

    @property
    def runs(self) -> list[RunResult]:
        """Each configuration the job ran, in order."""
        if "runs" not in self._data:
            raise AttributeError("this job ran one configuration: read its quantities on the result itself")
        runs = self._data["runs"]
        return [RunResult(r) for r in (runs.values() if isinstance(runs, dict) else runs)]

    def named(self) -> dict[str, RunResult]:
        """The runs of a job that names them (`runs` saved as {name: run}): {name: RunResult}."""
        return {k: RunResult(r) for k, r in self._data["runs"].items()}

    def find(self, **match) -> RunResult:
        """The one run whose quantities equal `match` (e.g. `find(label="3+offload")`, `find(schedule="1f1b", m=4)`)."""
        found = [r for r in self.runs if all(r.has(k) and getattr(r, k) == v for k, v in match.items())]
        if len(found) != 1:
            raise LookupError(f"{len(found)} runs have {match}")
        return found[0]


def parse(result: dict | None) -> JobResult | None:
    """A launch's result as the typed `JobResult` (None where the job saved nothing)."""
    return None if result is None else JobResult(result)
