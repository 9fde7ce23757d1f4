"""Lecture 02, data parallelism: the bucketed timeline, par's DP beside DistributedDataParallel, loss curves on
several world sizes, gradient compression; its key numbers; the medians of a timed run's steps; what compression
leaves of dense training's progress."""
from __future__ import annotations

import statistics

from par.course.batch import cost
from par.course.batch.launches import launch
from par.dp import job as dp_job
from par.measure import Measured
from par.memory.accounting import param_count
from par.model import preset as model_preset
from par.site.numbers import Key, at_least, at_most, near

NOTEBOOK = "02_data_parallel"
CELLS = ("bucketed timeline", "torch DDP", "loss curves", "compression")


def bucket_kb(cfg) -> float:
    """A bucket cap of a quarter of the fp32 gradients (about 4 buckets, whatever the model), in KiB."""
    return round(max(1.0, 4 * param_count(cfg) / 4 / 1024), 1)


def launches(W, backend, preset, steps):
    """Every run trains the same global batch; a long context (gpt3-small's 2048 tokens) in micro-batches of one
    sequence. The timeline needs a model large enough that backward outlasts the all-reduces, and a core (or
    GPU) per rank."""
    cfg = model_preset(preset)
    gpus = cost.on_gpus(backend, W)
    long = cfg.block_size > 256
    batch = 2 * W if long else 32                    # the global batch of every run
    micro = 1 if long else None                      # a long context trains micro-batches of one sequence
    timed_preset = preset if param_count(cfg) >= param_count(model_preset("small")) else "small"
    timed_ranks = W if gpus else min(W, cost.cores())
    timeline_steps = max(10, steps // 5)             # every step recorded, the third drawn, the first left out
    out = [launch(NOTEBOOK, "bucketed timeline", timed_ranks, dp_job.Args(
        dp=("naive", "bucketed"), impl="ring", bucket_kb=bucket_kb(model_preset(timed_preset)), preset=timed_preset,
        steps=timeline_steps, batch=batch, micro_batch=micro), backend)]
    out.append(launch(NOTEBOOK, "torch DDP", W, dp_job.Args(
        dp=("bucketed", "ddp"), impl="ring", bucket_kb=bucket_kb(cfg), preset=preset, steps=steps, batch=batch,
        micro_batch=micro, compare=True, profile_dir="{trace_dir}"), backend))   # the notebook fills in a folder
    for n in cost.sweep_sizes({1, 2, 4}, W, backend):
        if n != W and batch % n == 0:    # the same micro-batches on every world size: the same losses
            out.append(launch(NOTEBOOK, "loss curves", n, dp_job.Args(
                dp=("none",) if n == 1 else ("bucketed",), impl="torch", preset=preset, steps=steps, batch=batch,
                micro_batch=micro or batch // max(n, W)), backend))
    out.append(launch(NOTEBOOK, "compression", W, dp_job.Args(
        dp=("bucketed",), impl="torch", bucket_kb=bucket_kb(cfg), preset=preset, steps=steps, batch=batch,
        micro_batch=micro, compression=("none", "topk", "randomk", "int8"), ratio=0.05), backend))
    return out


KEY_NUMBERS = [
    Key("all-reduce bytes per step, counted", "2(N−1)/N · 4Ψ", "bytes_per_step_counted"),
    Key("all-reduce bytes per step, formula", "2(N−1)/N · 4Ψ", "bytes_per_step_formula"),
    Key("mean of shard gradients − big-batch gradient", "→ 0", "shard_average_max_error"),
    Key("communication overlapped with backward, worst rank (wall clock)", "bucketed",
        "bucketed_overlap_fraction"),
    Key("loss curves of 1, 2, 4 ranks, largest spread", "float rounding: ≤ 1e-5", "loss_curve_max_spread",
        target=at_most(1e-5)),
    Key("par DP vs DistributedDataParallel (max |Δ|)", "≤ 1e-5", "torch_api_max_diff", "ddp", target=at_most(1e-5)),
    Key("wait on all-reduces after backward, bucketed / naive (steady, worst rank)", "bucketing + overlap: < 1",
        "dp_wait_bucketed_over_naive", target=at_most(0.5)),
    Key("top-k's loss progress / dense's (5 % kept)", "(L₀ − L_T) / (L₀ − L_T,dense)", "compression_progress_topk",
        target=at_least(0.75)),
    Key("random-k's loss progress / dense's (5 % kept)", "delay model: 1 − (1−p)(1 − (1−p)^T)/(pT)",
        "compression_progress_randomk", target=at_most(0.5)),
    Key("8-bit's loss progress / dense's", "(L₀ − L_T) / (L₀ − L_T,dense)", "compression_progress_int8",
        target=near(1.0, 0.02)),
]


# ---------------------------------------------------------------- what a timed run and a compressed run show
PARTS = ("forward", "backward", "optimizer", "wait")


def median_parts(run) -> list[Measured]:
    """Each rank's median step of a timed run (`par.dp.job` RunResult, every step recorded: `parts`), the first step
    left out, in ms on both clocks: `.forward.wall`, `.backward.steady`, ... for forward, backward, optimizer and
    the wait after backward, and `.step` (that rank's `step_s` and `step_steady_s`)."""
    out = []
    for rank in run.ranks:
        steps = rank.parts[1:] or rank.parts
        med = {part: {c: statistics.median(getattr(getattr(p, part), c) for p in steps) * 1e3
                      for c in ("wall", "steady")} for part in PARTS}
        med["step"] = {"wall": statistics.median(rank.step_s[1:] or rank.step_s) * 1e3,
                       "steady": statistics.median(rank.step_steady_s[1:] or rank.step_steady_s) * 1e3}
        out.append(Measured(med))
    return out


def progress(losses: list[float], dense: list[float]) -> float:
    """How much of dense training's loss reduction a run made in the same steps: (L₀ − L_T) / (L₀ − L_T,dense)."""
    return (losses[0] - losses[-1]) / (dense[0] - dense[-1])


def delivered(ratio: float, steps: int) -> float:
    """The share of the gradients error feedback has delivered after `steps` steps when each coordinate is sent with
    probability `ratio` per step (random-k): a gradient computed j steps before the end has arrived with probability
    1 − (1 − p)^j, so the mean over the steps is 1 − (1 − p)(1 − (1 − p)^T) / (pT)."""
    p, t = ratio, steps
    return 1 - (1 - p) * (1 - (1 - p) ** t) / (p * t)
