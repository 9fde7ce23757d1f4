"""Lecture 06, ZeRO: every stage on W ranks and on the other data-parallel degrees, the stages timed side by side,
ZeRO-R, the recomputation timing the notebook runs in its own kernel; its key numbers; what a timed run shows (step
times, waits, paired ratios); its figures (a stage's timeline, step times on two clocks, memory against N_d)."""
from __future__ import annotations

import math
import statistics
from dataclasses import replace

import matplotlib.pyplot as plt

from par.course import plots
from par.course.batch import cost
from par.course.batch.launches import launch, sized
from par.measure import Measured
from par.memory.accounting import model_state_bytes, param_count, STAGE_NAMES
from par.model import preset as model_preset
from par.site.numbers import at_most, Key, near
from par.tp.layers import tp_degree
from par.zero import activations_job, job as zero_job

NOTEBOOK = "06_zero"
CELLS = ("stages", "timing", "ZeRO-R")
ZERO_STAGES = (0, 1, 2, 3)
TIMED = ("0", "1", "2", "3", "3+prefetch", "3+offload")     # the runs of the timing launch, by label
TIMING_STEPS = 12                                           # the first is left out of every median


def launches(W, backend, preset, steps):
    """ZeRO on `W` ranks (every stage in fp32 and 16 bits, prefetch, offload, FSDP2), then on the other
    data-parallel degrees 2-4: one global batch they all divide, so every degree trains the same thing.
    The 4-rank job saves a sharded checkpoint (`{checkpoint}`: the notebook fills in a directory) that
    the 2-rank job resumes. The timing launch: the runs of TIMED interleaved step by step, every step recorded,
    on a model where compute dominates a step (at least 'small', 16 sequences per rank on a CPU) and at most
    one rank per core."""
    cfg = model_preset(preset)
    long = cfg.block_size > 256
    half = "bf16"        # the CPU, and the GPUs of a course server (Ampere or newer), compute in bf16
    degrees = [n for n in cost.sweep_sizes({2, 3, 4, W}, W, backend) if n == W or not long or W % n == 0]
    batch = W if long else math.lcm(2, 3, 4, W)          # gpt3-small's 2048 tokens: one sequence per rank
    Run, out = zero_job.ZeroRun, []
    for n in sorted(degrees, reverse=True):              # 4 first: it saves the checkpoint 2 loads
        main = n == W
        runs = (*(Run(st) for st in ZERO_STAGES), *(Run(st, precision=half) for st in ZERO_STAGES),
                *((Run(3, prefetch=True), Run(3, offload=True), Run(3, fsdp2=True)) if main else ()))
        n_steps = steps if main else 3
        args = zero_job.Args(runs=runs, preset=preset, steps=n_steps, batch=batch, timeline_runs=())
        if n == 4:
            args = replace(args, checkpoint="{checkpoint}", checkpoint_run=Run(3), checkpoint_step=2)
        if n == 2 and 4 in degrees:
            args = replace(args, runs=(*runs, Run(3, resume=True)), resume="{checkpoint}")
        out.append(launch(NOTEBOOK, "stages", n, args, backend))
    gpus = cost.on_gpus(backend, W)
    timed_preset = preset if param_count(cfg) >= param_count(model_preset("small")) else "small"
    timed_ranks = W if gpus else min(W, cost.cores())
    timed = tuple(Run.parse(label) for label in TIMED)
    out.append(launch(NOTEBOOK, "timing", timed_ranks, zero_job.Args(
        runs=timed, preset=timed_preset, steps=TIMING_STEPS, batch=timed_ranks * (1 if long else 16),
        timeline_runs=tuple(r for r in timed if r.stage == 3), interleave=True), backend))
    out.append(launch(NOTEBOOK, "ZeRO-R", tp_degree(cfg, W), activations_job.Args(preset=preset, batch=4), backend))
    return out


def kernel(W, backend, preset, steps):
    """The recomputation timing: steps on 16 sequences with and without full recomputation, on the preset where a
    GPU computes (on a CPU 'small', where compute dominates the step)."""
    device = cost.kernel_device(backend, W)
    timing = preset if device == "gpu" else "small"
    return [sized(NOTEBOOK, "recomputation", model_preset(timing), 16, device, label=timing)]


KEY_NUMBERS = [
    Key("model states measured / formula, stages 0–3", "(2+2+K)Ψ → 2Ψ+2Ψ+KΨ/N → 2Ψ+(2+K)Ψ/N → (2+2+K)Ψ/N",
        "zero_memory_measured_over_formula", target=near(1.0, 0.01, "1 at every stage (± 0.01)")),
    Key("stage 3 / stage 1 bytes on the wire", "3Ψ / 2Ψ = 1.5", "zero_stage3_over_stage1_bytes",
        target=near(1.5, 0.01, "1.5 ± 0.01")),
    Key("ZeRO losses vs plain DP (max |Δ|)", "≤ 1e-5", "zero_loss_max_diff_vs_dp", target=at_most(1e-5)),
    Key("collectives per step, stages 0–3", "1, 2, one per unit + 1, three per unit", "zero_collectives_per_step"),
    Key("par ZeRO-3 vs FSDP2 fully_shard (max |Δ|)", "≤ 1e-5", "torch_api_max_diff", "fsdp2", target=at_most(1e-5)),
    Key("stage 3 / stage 2 model states, measured / formula", "(w+g+K)Ψ/N ÷ (w + (g+K)Ψ/N)",
        "zero_stage3_over_stage2_memory_vs_formula", target=near(1.0, 0.01, "1 ± 0.01")),
    Key("wait for the gathers prefetch starts ahead, prefetch / no prefetch (steady, worst rank)",
        "exposed = max(0, gather − compute): → 0", "zero_prefetch_parameter_wait_ratio", target=at_most(0.5)),
    Key("step time, offload / ZeRO-3 (steady, median of paired steps)",
        "1 + copies / step (a CPU: host = device)", "zero_offload_over_stage3_time",
        target=near(1.0, 0.1, "1 ± 0.1")),
]


# ---------------------------------------------------------------- what the timing launch shows
def median(xs) -> float:
    xs = list(xs)
    return statistics.median(xs[1:] or xs)      # the first step (allocations, warm-up) left out


def step_ms(run) -> Measured:
    """A run's median step in ms on both clocks, the slowest rank's each step: `.wall`, `.steady`."""
    return Measured({"wall": median(run.step_s) * 1e3, "steady": median(run.step_steady_s) * 1e3})


def paired_ratio(a, b, clock: str = "steady") -> float:
    """The median over the steps of a's step time / b's, step by step: the timing launch interleaves its runs, so
    step i of each ran at about the same time, under the same load."""
    key = "step_steady_s" if clock == "steady" else "step_s"
    return median(x / y for x, y in zip(getattr(a, key), getattr(b, key)))


def shorter_steps(a, b, clock: str = "steady") -> tuple[int, int]:
    """In how many of the paired steps (the first left out) a's step was shorter than b's, and of how many."""
    key = "step_steady_s" if clock == "steady" else "step_s"
    pairs = list(zip(getattr(a, key), getattr(b, key)))[1:]
    return sum(x < y for x, y in pairs), len(pairs)


def part_ms(run, part: str) -> list[Measured]:
    """Per rank, the median over its recorded steps of one part of the step (`par.zero.job.step_parts`: compute,
    parameter_wait, ahead_wait, copies), in ms on both clocks (`.wall`, `.steady`)."""
    return [Measured({c: median(getattr(getattr(p, part), c) for p in rank.parts) * 1e3 for c in ("wall", "steady")})
            for rank in run.ranks]


# ---------------------------------------------------------------- figures
ZERO_KINDS = {  # span name prefix -> (legend label, lane, colour)
    "F": ("forward", "compute", "#4C72B0"),
    "B": ("backward", "compute", "#DD8452"),
    "update": ("optimizer update", "compute", "#55A868"),
    "update on host": ("optimizer update on the host", "compute", "#8C8C3A"),
    "AG": ("all-gather parameters", "comm", "#8172B2"),
    "AG*": ("all-gather, prefetched", "comm", "#C3B6E8"),
    "RS": ("reduce-scatter gradients", "comm", "#C44E52"),
    "AR": ("all-reduce gradients", "comm", "#C44E52"),
    "grads to host": ("gradients device → host", "comm", "#937860"),
    "params to device": ("parameters host → device", "comm", "#DA8BC3"),
    "wait": ("computation waits for a collective", "compute", "#BBBBBB"),
}


def zero_span_kind(name: str) -> str:
    """The ZERO_KINDS key of a recorded ZeRO span name ('AG blocks.1 (prefetched)' -> 'AG*')."""
    if name in ZERO_KINDS:
        return name
    head = name.split(" ", 1)[0]
    if head == "AG" and "prefetched" in name:
        return "AG*"
    return head if head in ZERO_KINDS else "update"


def step_times(runs: dict, notes: dict | None = None, ax=None, title: str = ""):
    """Each run's step (`runs` {label: RunResult}) on the wall clock and on the steady clock side by side: bars at
    the median step, whiskers from the fastest to the slowest (the first step left out), in ms; `notes` {label:
    text} under a run's label."""
    ax = plots.axis(ax, (max(7, 1.4 * len(runs) + 2), 3.6))
    colours = {"wall": "#C7C7C7", "steady": "#4C72B0"}
    labels = list(runs)
    for k, (clock, key) in enumerate((("wall", "step_s"), ("steady", "step_steady_s"))):
        samples = [[t * 1e3 for t in (getattr(runs[l], key)[1:] or getattr(runs[l], key))] for l in labels]
        med = [statistics.median(x) for x in samples]
        xs = [i + (k - 0.5) * 0.38 for i in range(len(labels))]
        ax.bar(xs, med, 0.36, color=colours[clock], label=f"{clock} clock (median)")
        spread = [[m - min(x) for m, x in zip(med, samples)], [max(x) - m for m, x in zip(med, samples)]]
        ax.errorbar(xs, med, yerr=spread, fmt="none", ecolor="black", capsize=2, lw=0.8)
    ax.errorbar([], [], yerr=[], fmt="none", ecolor="black", label="fastest … slowest step")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels([f"{l}\n{notes[l]}" if notes and l in notes else l for l in labels], fontsize=8)
    ax.set_xlabel("ZeRO stage (run)")
    ax.set_ylabel("ms per step (slowest rank)")
    ax.legend(fontsize=7, loc="upper left", ncol=3)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.15)
    if title:
        ax.set_title(title)
    return ax


def _short_unit(name: str) -> str:
    """'AG blocks.1 (prefetched)' -> '1', 'F embed' -> 'emb', 'RS head' -> 'head': what fits in a bar."""
    parts = name.replace(" (prefetched)", "").split(" ")
    unit = parts[1] if len(parts) > 1 else ""
    last = unit.rsplit(".", 1)[-1]
    return last if last.isdigit() else {"embed": "emb"}.get(last, last[:4])


def zero_timeline(spans: list[dict], ax=None, title: str = "", unit: float = 1e-3):
    """One ZeRO step as recorded by `par.timeline.Recorder`: per rank one compute lane (forward, backward,
    update) and one communication lane (gathers, reduce-scatters, offload copies), coloured by kind with
    a legend; a bar is labelled with its unit (a block number, 'emb', 'head') only where the label fits
    inside it, so labels never collide. Times in ms (`unit`) from the step's start."""
    ranks = sorted({s["rank"] for s in spans})
    ax = plots.axis(ax, (11, 0.9 + 0.55 * 2 * len(ranks)))
    fig = ax.figure
    t0 = min(s["start"] for s in spans)
    t1 = max(s["end"] for s in spans)
    rows = {(r, lane): i for i, (r, lane) in enumerate((r, lane) for r in ranks for lane in ("compute", "comm"))}
    used = {}
    for s in spans:
        kind = zero_span_kind(s["name"])
        label, lane, colour = ZERO_KINDS[kind]
        y = rows[(s["rank"], lane)]
        ax.barh(y, (s["end"] - s["start"]) / unit, left=(s["start"] - t0) / unit, height=0.72, color=colour,
                edgecolor="white", linewidth=0.4)
        used[kind] = (label, colour)
    ax.set_xlim(0, (t1 - t0) / unit * 1.005)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    fig.canvas.draw()
    px_per_unit = ax.get_window_extent().width / ((t1 - t0) / unit * 1.005)
    char_px = 6.5 * fig.dpi / 72 * 0.62                      # a 6.5 pt character, roughly
    for s in spans:
        _, lane, _ = ZERO_KINDS[zero_span_kind(s["name"])]
        text = _short_unit(s["name"]) if s["name"].split(" ", 1)[0] in ("F", "B", "AG", "RS", "AR") else ""
        width_px = (s["end"] - s["start"]) / unit * px_per_unit
        if text and width_px > char_px * (len(text) + 1):
            ax.text((s["start"] + s["end"] - 2 * t0) / 2 / unit, rows[(s["rank"], lane)], text, ha="center",
                    va="center", fontsize=6.5, color="white")
    ax.set_yticks(list(rows.values()))
    ax.set_yticklabels([f"rank {r} {'compute' if lane == 'compute' else 'comm'}" for r, lane in rows])
    ax.set_xlabel("time since the step started (ms)" if unit == 1e-3 else "time (s)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for _, c in used.values()]
    ax.legend(handles, [lbl for lbl, _ in used.values()], fontsize=7, ncol=min(4, len(used)),
              loc="upper center", bbox_to_anchor=(0.5, -0.2 if len(ranks) < 3 else -0.12), frameon=False)
    if title:
        ax.set_title(title)
    return ax


def zero_memory_vs_nd(numel: float, measured: dict, precision: str = "fp32", optimizer: str = "adam",
                      nd_max: int = 64, axes=None, title: str = "", unit: float = 1e6):
    """Per-rank model-state bytes against the data-parallel degree N_d: `par.memory.accounting.model_state_bytes`'
    curve for each stage from N_d = 1 to `nd_max` (lines), the measured bytes as markers (`measured` =
    {N_d: {stage: bytes}}), and a second panel with measured / formula - 1 (in %) at the measured N_d
    (stages side by side). Bytes shown in MB (`unit`), both axes logarithmic."""
    from matplotlib.ticker import FuncFormatter

    if axes is None:
        fig, axes = plt.subplots(1, 2, figsize=(12, 3.8), gridspec_kw={"width_ratios": [2.2, 1]})
    left, right = axes
    nds = list(range(1, nd_max + 1))
    stages = sorted({s for per in measured.values() for s in per})
    for k, s in enumerate(stages):
        colour = f"C{s}"
        left.plot(nds, [model_state_bytes(numel, n, s, precision, optimizer).total / unit for n in nds], color=colour,
                  label=STAGE_NAMES[s])
        pts = sorted((int(n), per[s]) for n, per in measured.items() if s in per)
        left.plot([n for n, _ in pts], [b / unit for _, b in pts], "o", color=colour, markersize=6,
                  markeredgecolor="black")
        shift = (k - (len(stages) - 1) / 2) * 0.08
        right.plot([n + shift for n, _ in pts],
                   [100 * (b / model_state_bytes(numel, n, s, precision, optimizer).total - 1) for n, b in pts],
                   "o", color=colour, markeredgecolor="black", label=STAGE_NAMES[s])
    left.plot([], [], "o", color="white", markeredgecolor="black", label="measured (largest rank)")
    left.set_xscale("log")
    left.set_yscale("log")
    ticks = [n for n in (1, 2, 3, 4, 8, 16, 32, 64) if n <= nd_max]
    left.set_xticks(ticks)
    left.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    left.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    left.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    left.set_xlabel("data-parallel degree N_d (ranks)")
    left.set_ylabel(f"model states per rank ({'MB' if unit == 1e6 else 'bytes'})")
    left.legend(fontsize=7, loc="lower left", title="lines: formula", title_fontsize=7)
    right.axhspan(-2, 2, color="#DDDDDD", alpha=0.6, label="±2 %")
    right.axhline(0, color="grey", lw=0.8)
    right.set_xticks(sorted(int(n) for n in measured))
    right.set_xlabel("N_d (measured)")
    right.set_ylabel("measured / formula − 1 (%)")
    right.set_ylim(-3, 3)
    right.legend(fontsize=6, loc="upper right", ncol=2)
    right.set_title("difference", fontsize=9)
    if title:
        left.set_title(title)
    return left, right
