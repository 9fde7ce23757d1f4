"""Lecture 02, data parallelism: the bucketed timeline, par's DP beside DistributedDataParallel, loss curves on
several world sizes, gradient compression; its key numbers."""
from __future__ import annotations

from par.course.batch import cost
from par.course.batch.launches import launch
from par.dp import job as dp_job
from par.memory.accounting import param_count
from par.model import preset as model_preset
from par.site.numbers import Key, at_most

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
    timeline_steps = max(4, steps // 5)              # the third step is drawn; the median of all is printed
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
    Key("communication overlapped with backward", "bucketed", "bucketed_overlap_fraction"),
    Key("loss curves of 1, 2, 4 ranks, largest spread", "float rounding: ≤ 1e-5", "loss_curve_max_spread",
        target=at_most(1e-5)),
    Key("par DP vs DistributedDataParallel (max |Δ|)", "≤ 1e-5", "torch_api_max_diff", "ddp", target=at_most(1e-5)),
    Key("wait on all-reduces after backward, bucketed / naive", "bucketing + overlap: < 1",
        "dp_wait_bucketed_over_naive", target=at_most(0.5)),
]
