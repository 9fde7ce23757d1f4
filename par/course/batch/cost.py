"""What a launch costs: the planner's predictions for the work a job computes (`par.runtime.job_work`), and the
timeouts scaled with it.

    problems(work, hw)   why a Training layout cannot run (the planner's reason), [] where it can
    memory(work, hw)     bytes per device at the peak: the planner's model states by ZeRO stage + activations,
                         plus the single-process reference kept beside (`reference_batch`); Collectives: the
                         tensor, a copy, the ring's receive buffer and torch's
    seconds(work, hw)    steps × (planner step time + OVERHEAD_S per layer and micro-batch), the reference's too

Timeouts scale with the work: `scaled_timeout(work, backend)` is SAFETY × the time predicted on a deliberately
slow reference device (fp32 without TF32 on a GPU, a few GFLOP/s on a CPU) plus the start-up, never below
MIN_TIMEOUT_S. The predictions are the planner's formulas: upper-bound estimates for a go/no-go check, not a
benchmark (the planner ignores latency and overlaps nothing).
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from par.runtime import preflight
from par.runtime.job_work import Collectives, Training

if TYPE_CHECKING:
    from par.train import planner

CELL_TIMEOUT_S = 600.0      # the batch's cell timeout for a notebook that launches little (or is not a lecture)
NOTEBOOK_S = 60.0           # what a cell does besides its launches (plots, small computations)
STARTUP_S = 30.0            # torchrun, imports, process group (NCCL communicators), CUDA context
SAFETY = 3.0                # a timeout is this many times the predicted time (plus the start-up)
MIN_TIMEOUT_S = 300.0
FP32_FLOPS = 15e12          # achieved fp32 matmul FLOP/s of an A100 without TF32 (19.5 peak): the slow case
OVERHEAD_S = {"gpu": 1e-3, "cpu": 2e-3}   # seconds per layer and micro-batch the FLOP count misses (launches)


def gpu(memory: float = math.inf, gpus_per_node: int = 8) -> planner.Hardware:
    """The GPU the dry run imagines: the planner's A100 links and bf16 FLOP/s, `memory` bytes."""
    from par.train.planner import Hardware   # defers torch (the planner) to a prediction
    return replace(Hardware(), name="GPU", memory=memory, gpus_per_node=gpus_per_node)


def cpu() -> planner.Hardware:
    """The CPU the dry run imagines (the planner's: a few GFLOP/s, its memory bandwidth as the link). The planner
    (and torch) are imported only where a cost is computed: the batch's runner imports this module to start."""
    from par.train.planner import HARDWARE   # defers torch (the planner) to a prediction
    return HARDWARE["cpu"]


def on_gpus(backend: str, world_size: int) -> bool:
    """Whether the launches run on GPUs: "nccl", or "auto" where this machine has a GPU per rank."""
    if backend != "auto":
        return backend == "nccl"
    return preflight.choose_backend(world_size, "auto") == "nccl"


def kernel_device(backend: str, world_size: int) -> str:
    """Where a notebook's own demos run: GPU 0 on a GPU server (the launches on GPUs), else the host."""
    return "gpu" if on_gpus(backend, world_size) else "host"


def cores() -> int:
    """Physical CPU cores of this machine: CPU ranks are timed only where each has one."""
    return preflight.physical_cores()


# ---------------------------------------------------------------- a training run
def workload(t: Training, batch: int | None = None, precision: str | None = None) -> planner.Workload:
    p = precision or t.precision
    from par.train.planner import Workload   # defers torch (the planner) to a prediction
    return Workload(t.model, batch or t.global_batch, "fp32" if p == "fp32" else "mixed", t.optimizer)


def hardware(t: Training, hw: planner.Hardware, precision: str | None = None) -> planner.Hardware:
    """`hw`, its FLOP/s capped at FP32_FLOPS for an fp32 run on a GPU."""
    fp32 = (precision or t.precision) == "fp32" and hw.name != cpu().name
    return replace(hw, flops=min(hw.flops, FP32_FLOPS)) if fp32 else hw


def plan(t: Training, hw: planner.Hardware) -> planner.Plan:
    from par.train.planner import predict   # defers torch (the planner) to a prediction
    return predict(workload(t), t.dp, t.pp, t.tp, t.zero_stage, t.microbatches, hardware(t, hw), t.offload)


def reference_plan(t: Training, hw: planner.Hardware) -> planner.Plan | None:
    if not t.reference_batch:
        return None
    from par.train.planner import predict   # defers torch (the planner) to a prediction
    return predict(workload(t, t.reference_batch, "fp32"), 1, 1, 1, 0, 1, hardware(t, hw, "fp32"))


# ---------------------------------------------------------------- any work
def problems(work: Training | Collectives, hw: planner.Hardware) -> list[str]:
    """Why the work cannot run on `hw` ([] where it can)."""
    if isinstance(work, Collectives):
        return []
    p = plan(work, hw)
    return [] if p.valid else [p.reason]


def memory(work: Training | Collectives, hw: planner.Hardware) -> float:
    """Bytes per device at the peak (NaN for a layout that cannot run: see `problems`)."""
    if isinstance(work, Collectives):
        return 4 * 4 * max(work.numels)        # the tensor, a copy, the ring's receive buffer, torch's
    p, ref = plan(work, hw), reference_plan(work, hw)
    if not p.valid:
        return math.nan
    return p.memory["total"] + (ref.memory["total"] if ref else 0.0)


def seconds(work: Training | Collectives, hw: planner.Hardware) -> float:
    """Predicted seconds of the work on `hw` (NaN for a layout that cannot run)."""
    if isinstance(work, Collectives):
        bw = hw.bw_node if hw.name != cpu().name else cpu().bw_node
        return sum(2 * work.rounds * (2 * 4 * n / bw + 1e-3) for n in work.numels)
    kind = "cpu" if hw.name == cpu().name else "gpu"
    layers = work.model.n_layer + 2
    p = plan(work, hw)
    if not p.valid:
        return math.nan
    per_step = p.time["total"] + OVERHEAD_S[kind] * layers * work.microbatches / work.pp
    ref = reference_plan(work, hw)
    if ref:
        per_step += ref.time["total"] + OVERHEAD_S[kind] * layers
    return work.steps * per_step


def scaled_timeout(work, backend: str, nproc: int = 1) -> float:
    """SAFETY × (time on the slow reference device) + STARTUP_S, at least MIN_TIMEOUT_S, in whole minutes."""
    hw = gpu() if on_gpus(backend, nproc) else cpu()
    predicted = sum(0.0 if math.isnan(s) else s for s in (seconds(w, hw) for w in work))
    return float(max(MIN_TIMEOUT_S, 60 * math.ceil((SAFETY * predicted + STARTUP_S) / 60)))


def per_rank_batch(cfg, small: int) -> int:
    """Sequences per rank: `small` for a short context (tiny, small); 1 for a long one (gpt3-small's 2048)."""
    return small if cfg.block_size <= 256 else 1


def sweep_sizes(candidates, world_size: int, backend: str) -> list[int]:
    """The world sizes of `candidates` a notebook sweeps: any on CPU ranks; on GPUs only those the server has.
    (Not `par.runtime.checks.world_sizes`, which parses a command line's "2,4".)"""
    return sorted(n for n in set(candidates) if not on_gpus(backend, world_size) or n <= world_size)
