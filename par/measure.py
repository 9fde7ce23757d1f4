"""What every job measures and reports: the result contract, one timed step, the merge over ranks.

A job (`job.py` in each lecture's folder, `main(argv=None)`) only parses its typed `Args`
(`par.runtime.job_args`), builds what it needs from `par`, runs it and reports; the strategies,
formulas and meters live in `par` itself. Notebooks, benchmarks and tests start jobs one way, `par.runtime.launch.run("par.dp.job", nproc=N, args=[...])`, which returns what
rank 0 saved with `par.runtime.dist.save_result`.

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

Every job measures with the same few lines: `timed_step` (one step's wall seconds, the device
synchronized at both ends), then on rank 0 `slowest` (step_s) and `mean_over_ranks` (losses) over
what `par.runtime.dist.gather_object` collected, or `merge_ranks` for both.
"""
from __future__ import annotations

import time
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
