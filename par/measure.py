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
reports `world_size`, `backend` and what it measured. A job that runs several configurations in one launch
saves {"world_size", "backend", "runs": [...]}, each run with the keys above.

Each job declares its keys beside its `Args`, as dataclasses: `Result` (a `JobResult`: what the launch
returns), `RunResult` (one configuration) and `RankResult` (one rank's entry of `per_rank`), e.g.
`par.dp.job.RunResult` with `dp`, `losses`, `bytes_sent_per_step`, `memory`, ... Callers never read the dict: a
launch (`par.course.batch.launches.Launch.run`) parses it once, with `parse(result, job)`, into the job's own
`Result`, read as attributes: `result.world_size`, `result.losses`, `result.runs[0].step_s`,
`result.find(label="3").memory`, `run.rank(0).bytes`. A key the job did not declare stops the parse; a name the
type does not declare raises AttributeError listing the ones it does; a result is no mapping (`run["losses"]` is
a TypeError). Records nested in a quantity read as attributes too (`run.memory.predicted.total`, `Measured`),
a mapping keyed by data (a run's name, a degree) stays a mapping. `to_json()` gives the JSON back from the
typed object (what `par.course.batch.record.record` writes to the batch's summary).

Every job measures with the same few lines: `timed_step` (one step's wall seconds, the device
synchronized at both ends, and its load-proof seconds `steady_s`: less the run-queue wait, `par.clock`), then on rank 0 `slowest` (step_s) and `mean_over_ranks` (losses) over
what `par.runtime.dist.gather_object` collected, or `merge_ranks` for both.
"""
from __future__ import annotations

import importlib
import keyword
import time
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import MISSING, dataclass, fields

import torch
import torch.distributed as dist

from par import clock


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
    ready_s: float = 0.0     # the timing thread's run-queue seconds: waiting for a core other work had
    thread_cpu_s: float = 0.0   # the timing thread's CPU seconds
    waited_s: float = 0.0    # set by a CPU job: run-queue seconds of what the timing thread blocked on (the
                             # communication thread, the other ranks: `par.clock.Waiting`), which ready_s misses

    @property
    def steady_s(self) -> float:
        """The step on a core of its own: wall − ready − waited, never below the timing thread's CPU seconds
        (`par.clock.load_proof`); on a GPU, `seconds` (the device's work)."""
        return clock.load_proof(self.seconds, self.thread_cpu_s, self.ready_s + self.waited_s)


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
    c0, start = time.process_time(), clock.read()
    yield step
    sync(device)
    took = clock.since(start)
    step.seconds, step.cpu_s, step.thread_cpu_s = took.wall, time.process_time() - c0, took.cpu
    step.ready_s = took.ready if torch.device(device).type != "cuda" else 0.0


def watch_ranks() -> None:
    """Tell `par.clock.Waiting` which processes this rank waits for in a collective: the job's other ranks on
    this machine (a rank on another machine's run queue cannot be read). Every rank calls it (a collective)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    import os
    import socket
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, (socket.gethostname(), os.getpid()))
    clock.watch([pid for host, pid in ranks if host == socket.gethostname()])


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
    """A nested JSON value of a result as callers read it: a mapping whose keys are all names becomes `Measured`
    (`m.total`), a list of them a list of `Measured`; a mapping keyed by data (a run's name, a sequence
    length, a degree) stays a dict with its values typed; numbers, text and None stay as they are."""
    if isinstance(value, (Measured, Declared)):
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
    """A record nested in a result (a run's memory breakdown, a timeline's span, a part of a collective's
    trace), read as attributes: `m.total`, `m.counted`; deeper ones likewise (`run.memory.predicted.total`).
    `to_json()` gives the JSON it was read from. It stays a read-only mapping because functions that take
    JSON-shaped records read it so (a timeline's spans in `par.pp.sim.stage_costs`, `par.timeline` and the
    lectures' figures); notebooks read attributes (tests/test_notebook_results.py checks)."""
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
        return Measured, (self._data,)        # copy and pickle: a Measured over the same JSON

    def has(self, name: str) -> bool:
        return name in self._data

    def to_json(self) -> dict:
        return plain(self._data)

    def __eq__(self, other) -> bool:
        return isinstance(other, Mapping) and self.to_json() == plain(dict(other))

    __hash__ = None

    def __dir__(self):
        return sorted({*super().__dir__(), *self._data})

    def __repr__(self) -> str:
        return repr(self.to_json())        # printed as the JSON it holds, as a notebook shows it


@dataclass(frozen=True, kw_only=True)
class Declared:
    """A result whose quantities its job declares as dataclass fields (`par.dp.job.RunResult`: `dp`, `losses`,
    `bytes_sent_per_step`, ...), built from the JSON the job saved by `from_json`: a key the type does not declare,
    or a declared one without a default that is missing, stops the parse (ValueError naming the type). Read as
    attributes; a name it does not declare raises AttributeError listing the names it does. A field with a default
    of None is one the job leaves out where it did not measure it (`has(name)`: whether it is there)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"{type(self).__qualname__} ({type(self).__module__}) has no {name!r} "
                             f"(it declares: {', '.join(self.names())})")

    @classmethod
    def names(cls) -> list[str]:
        """The quantities the type declares, in order."""
        return [f.name for f in fields(cls)]

    @classmethod
    def from_json(cls, data: dict) -> Declared:
        """The typed result of `data`, each value read by `read` (nested records as `Measured`)."""
        if not isinstance(data, dict):
            raise ValueError(f"{cls.__module__}.{cls.__qualname__} is read from a JSON object, not {type(data).__name__}")
        declared = {f.name: f for f in fields(cls)}
        unknown = [k for k in data if k not in declared]
        missing = [n for n, f in declared.items() if n not in data and f.default is MISSING]
        if unknown or missing:
            raise ValueError(f"{cls.__module__}.{cls.__qualname__} "
                             + (f"declares no {', '.join(unknown)}" if unknown else "")
                             + (" and " if unknown and missing else "")
                             + (f"lacks {', '.join(missing)}" if missing else "")
                             + ": the job's result and its declared type differ")
        return cls(**{k: cls.read(k, v) for k, v in data.items()})

    @classmethod
    def read(cls, name: str, value):
        """One quantity's JSON as the field holds it (a subclass reads its runs and ranks as their types)."""
        return typed(value)

    def has(self, name: str) -> bool:
        """Whether the job reported `name` (a declared quantity left out reads None)."""
        return getattr(self, name) is not None

    def to_json(self) -> dict:
        """The JSON of the result: every declared quantity the job reported (each `per_rank` entry with its `rank`)."""
        return {f.name: plain(getattr(self, f.name)) for f in fields(self)
                if not (f.default is None and getattr(self, f.name) is None)}


@dataclass(frozen=True, kw_only=True)
class RankResult(Declared):
    """What one rank measured (an entry of the contract's `per_rank`, rank r at index r); a job's own subclass
    declares its quantities (memory, bytes, step times, ...)."""
    rank: int


@dataclass(frozen=True, kw_only=True)
class RunResult(Declared):
    """One run of a job (`run.losses`, `run.rank(0).memory`): its `per_rank`, each entry read as the job's own
    `RankResult` subclass (`Rank`), and the quantities the job's own subclass declares (a job that trains
    declares the contract's `losses` and `step_s`)."""
    Rank = RankResult                    # the type of each `per_rank` entry: a subclass names its own
    per_rank: tuple | None = None

    @classmethod
    def read(cls, name: str, value):
        if name == "per_rank" and value is not None:
            return tuple(cls.Rank.from_json({"rank": r, **d}) for r, d in enumerate(value))
        return super().read(name, value)

    @property
    def ranks(self) -> list:
        """The contract's `per_rank` (rank r at index r)."""
        return list(self.per_rank or ())

    def rank(self, r: int) -> RankResult:
        """What rank `r` measured."""
        ranks = self.ranks
        if not 0 <= r < len(ranks):
            raise IndexError(f"rank {r}: this run reported {len(ranks)} ranks")
        return ranks[r]


@dataclass(frozen=True, kw_only=True)
class JobResult(Declared):
    """What a launch returns: rank 0's result, parsed once (`parse`) into the job's own subclass (its module's
    `Result`): the contract's `world_size` and `backend`, and what the job declares. A job that runs one
    configuration declares that run's quantities on its `Result` (`class Result(JobResult, RunResult)`:
    `result.losses`, `result.rank(0)`); one that runs several declares `runs`, each read as its `Run`
    (`result.runs[0].losses`, `result.find(label="3")`); runs saved as {name: run} read with `named()`."""
    Run = RunResult                      # the type of each run: a subclass names its own
    world_size: int
    backend: str

    @classmethod
    def read(cls, name: str, value):
        if name == "runs" and value is not None:
            if isinstance(value, dict):
                return {k: cls.Run.from_json(r) for k, r in value.items()}
            return tuple(cls.Run.from_json(r) for r in value)
        return super().read(name, value)

    def every_run(self) -> list:
        """Each configuration the job ran, in order (the values of named runs)."""
        runs = self.runs
        if runs is None:
            raise AttributeError("this job ran one configuration: read its quantities on the result itself")
        return list(runs.values() if isinstance(runs, dict) else runs)

    def named(self) -> dict:
        """The runs of a job that names them (`runs` saved as {name: run}): {name: run}."""
        if not isinstance(self.runs, dict):
            raise AttributeError("this job's runs are a list: read them with `runs` or `find`")
        return dict(self.runs)

    def find(self, **match) -> RunResult:
        """The one run whose quantities equal `match` (e.g. `find(label="3+offload")`, `find(schedule="1f1b", m=4)`)."""
        found = [r for r in self.every_run() if all(getattr(r, k, None) == v for k, v in match.items())]
        if len(found) != 1:
            raise LookupError(f"{len(found)} runs have {match}")
        return found[0]


def parse(result: dict | None, job: str) -> JobResult | None:
    """A launch's result as the typed result the job `job` (its module, "par.dp.job") declares, its `Result`
    (a `JobResult` subclass); None where the job saved nothing."""
    if result is None:
        return None
    declared = getattr(importlib.import_module(job), "Result", None)
    if not (isinstance(declared, type) and issubclass(declared, JobResult)):
        raise TypeError(f"{job} declares no Result (a par.measure.JobResult subclass) beside its Args")
    return declared.from_json(result)
