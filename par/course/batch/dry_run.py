"""The dry run: every launch and the in-kernel work of every lecture checked for a GPU server before any GPU is
rented (`python -m par batch --dry-run`).

`dry_run(world_size, backend, preset, steps, gpu_memory)` checks every launch of every notebook (the lectures'
`launches`, `par.course.batch.launches.launches`) for a server of `world_size` GPUs with `gpu_memory` bytes each,
without touching a GPU:

    layout   the degrees divide what they split (heads and width for tp, the layer list for pp,
             the batch for dp × micro-batches: `par.train.planner.predict`), and a launch under NCCL
             asks for at most `world_size` ranks (one GPU each)
    memory   predicted bytes per GPU at the peak (`par.course.batch.cost.memory`: model states by ZeRO stage +
             activations, plus a single-process reference kept beside) <= gpu_memory
    time     predicted seconds = STARTUP_S + Σ steps × (planner step time + per-layer overhead)
             <= the launch's timeout <= the batch's cell timeout; the launches of one cell
             together <= the cell timeout
    kernel   what a notebook computes in its own process (`KernelWork`, the lectures' `kernel`), sized by the
             same four parameters to at most KERNEL_MEMORY or skipped with the reason: its predicted
             bytes <= gpu_memory (on GPU 0) or <= host_memory (on the host)

The batch's cell timeout for a notebook (`notebook_timeout`) is its largest cell's launch timeouts added up, plus
NOTEBOOK_S, at least CELL_TIMEOUT_S: a launch's own timeout (which names the ranks that hang) always fires first.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from par.course.batch import cost
from par.course.batch.cost import STARTUP_S, cpu, gpu
from par.course.batch.launches import (CourseError, KernelWork, Launch, kernel_work, launches, lectures,  # noqa: F401
                                       notebook_timeout)
from par.memory.accounting import format_bytes
from par.runtime import preflight


def host_memory_here() -> float:
    """Bytes of physical memory of this machine."""
    import os
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


@dataclass(frozen=True)
class Problem:
    where: str       # the launch (or cell) it concerns
    kind: str        # layout | memory | time
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


@dataclass
class Estimate:
    launch: Launch
    backend: str          # resolved: nccl or gloo
    memory: float         # bytes per device at the peak
    seconds: float        # predicted, start-up included


def resolve_backend(requested: str, nproc: int, gpus: int) -> str:
    """The backend a launch gets on the imagined server (auto: NCCL with a GPU per rank)."""
    try:
        return preflight.choose_backend(nproc, requested, gpus=gpus)
    except preflight.BackendError:
        return "nccl"       # reported by check() as a layout problem


def check(launch_: Launch, world_size: int, gpu_memory: float, cell_timeout: float,
          gpu_flops: float | None = None) -> tuple[Estimate, list[Problem]]:
    """Predicted memory and time of one launch on `world_size` GPUs of `gpu_memory` bytes (and
    `gpu_flops` achieved FLOP/s, default the planner's A100); its problems."""
    backend = resolve_backend(launch_.backend, launch_.nproc, world_size)
    hw = gpu(gpu_memory, world_size) if backend == "nccl" else cpu()
    if gpu_flops and backend == "nccl":
        hw = replace(hw, flops=gpu_flops)
    where = launch_.name()
    problems = []
    if backend == "nccl" and launch_.nproc > world_size:
        problems.append(Problem(where, "layout", f"needs {launch_.nproc} GPUs, the server has {world_size}"))
    for w in launch_.work:
        problems += [Problem(where, "layout", f"{w.describe()}: {reason}") for reason in cost.problems(w, hw)]
    if problems:
        return Estimate(launch_, backend, float("nan"), float("nan")), problems
    memory = max((cost.memory(w, hw) for w in launch_.work), default=0.0)
    seconds = STARTUP_S + sum(cost.seconds(w, hw) for w in launch_.work)
    if backend == "nccl" and memory > gpu_memory:
        worst = max(launch_.work, key=lambda w: cost.memory(w, hw))
        problems.append(Problem(where, "memory", f"predicted {format_bytes(memory)} per GPU > "
                                                 f"{format_bytes(gpu_memory)} ({worst.describe()})"))
    if seconds > launch_.timeout:
        device = "GPU" if backend == "nccl" else "CPU"
        problems.append(Problem(where, "time", f"predicted {seconds:.0f} s on {device} > its timeout "
                                               f"{launch_.timeout:.0f} s"))
    if launch_.timeout > cell_timeout:
        problems.append(Problem(where, "time", f"its timeout {launch_.timeout:.0f} s > the batch's cell timeout "
                                               f"{cell_timeout:.0f} s: pass --timeout {launch_.timeout:.0f}"))
    return Estimate(launch_, backend, memory, seconds), problems


def check_kernel(work: KernelWork, gpu_memory: float, host_memory: float) -> list[Problem]:
    """The problem of one piece of in-kernel work: its predicted memory above GPU 0's (device "gpu") or the
    host's (device "host"). A skipped one has none: the notebook says why and goes on."""
    if work.skipped:
        return []
    need = work.memory()
    if work.device == "gpu" and need > gpu_memory:
        return [Problem(work.name(), "memory", f"predicted {format_bytes(need)} per GPU > {format_bytes(gpu_memory)} "
                                              f"({work.describe()})")]
    if work.device == "host" and need > host_memory:
        return [Problem(work.name(), "memory", f"predicted {format_bytes(need)} of host memory > "
                                               f"{format_bytes(host_memory)} ({work.describe()})")]
    return []


def dry_run(world_size: int, backend: str = "nccl", preset: str = "gpt3-small", steps: int = 200,
            gpu_memory: float = 80e9, cell_timeout: float | None = None, notebooks=None, known: dict | None = None,
            gpu_flops: float | None = None, host_memory: float | None = None):
    """(estimates, problems) for every launch of every notebook (default: every lecture of `known`, {notebook:
    module}, default `lectures()`), in order, then the notebook's in-kernel work (`kernel_work`: against GPU 0's memory
    or `host_memory`, default this machine's: the dry run is meant to run on the server).

    `cell_timeout` None: each notebook gets the batch's automatic one (`notebook_timeout`). Backend
    "auto" is NCCL there: the imagined server has a GPU per rank."""
    backend = "nccl" if backend == "auto" else backend     # the imagined server has a GPU per rank
    host = host_memory_here() if host_memory is None else host_memory
    estimates, problems = [], []
    known = lectures() if known is None else known
    for nb in (notebooks or list(known)):
        cells: dict = {}
        found_ = launches(nb, world_size, backend, preset, steps, known)
        timeout = cell_timeout or notebook_timeout(found_)
        for launch_ in found_:
            est, found = check(launch_, world_size, gpu_memory, timeout, gpu_flops)
            estimates.append(est)
            problems += found
            cells.setdefault(launch_.cell, []).append(est)
        for cell, ests in cells.items():
            total = sum(e.seconds for e in ests)
            if len(ests) > 1 and total > timeout:
                problems.append(Problem(f"{nb} [{cell}]", "time", f"its {len(ests)} launches together are predicted "
                                        f"{total:.0f} s > the batch's cell timeout {timeout:.0f} s: "
                                        f"pass --timeout {60 * math.ceil(total / 60):.0f}"))
        for work_ in kernel_work(nb, world_size, backend, preset, steps, known):
            problems += check_kernel(work_, gpu_memory, host)
    return estimates, problems


def format_estimates(estimates: list[Estimate]) -> str:
    """A table: one launch per line, predicted memory per device and time beside its timeout."""
    head = f"{'launch':<72} {'backend':>7} {'mem/device':>11} {'predicted':>10} {'timeout':>8}"
    lines = [head, "-" * len(head)]
    for e in estimates:
        mem = "?" if math.isnan(e.memory) else format_bytes(e.memory)
        sec = "?" if math.isnan(e.seconds) else f"{e.seconds:.0f} s"
        lines.append(f"{e.launch.name()[:72]:<72} {e.backend:>7} {mem:>11} {sec:>10} {e.launch.timeout:>6.0f} s")
    return "\n".join(lines)


def format_kernel(works: list[KernelWork]) -> str:
    """A table of the in-kernel work: one per line, its size and predicted memory on its device, or why it is skipped."""
    head = f"{'in-kernel work':<66} {'device':>6} {'memory':>11}  size"
    lines = [head, "-" * len(head)]
    for k in works:
        size = f"skipped: {k.skipped}" if k.skipped else f"{k.batch} x {k.tokens} tokens of {k.label}"
        mem = "-" if k.skipped else format_bytes(k.memory())
        lines.append(f"{k.name()[:66]:<66} {k.device:>6} {mem:>11}  {size}")
    return "\n".join(lines)


def every_kernel_work(world_size: int, backend: str, preset: str, steps: int,
                      known: dict | None = None) -> list[KernelWork]:
    """The in-kernel work of every lecture, in notebook order (what `format_kernel` lists)."""
    known = lectures() if known is None else known
    return [k for nb in known for k in kernel_work(nb, world_size, backend, preset, steps, known)]
