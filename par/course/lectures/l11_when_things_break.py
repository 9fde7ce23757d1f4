"""Lecture 11, when things break: a run saved on ZeRO-3 resumed on other layouts (and in one process, and through
DCP) equal to the run that never stopped, the three mistakes that make it differ; the checkpoint interval
(Young/Daly) against a simulation of failures; a straggler setting the pace of synchronous data parallelism; its key
numbers; its figures."""
from __future__ import annotations

from dataclasses import replace

import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from par.course.batch import cost
from par.course.batch.launches import launch, sized
from par.model import preset as model_preset
from par.resilience import job as resilience_job, straggler_job
from par.site.numbers import Key, at_least, at_most, equal, near

NOTEBOOK = "11_when_things_break"
CELLS = ("resume", "stragglers")
MISTAKES = ("data", "rng", "optimizer")


def resume_steps(steps: int) -> tuple[int, int]:
    """(steps of the uninterrupted run, the step after which it saves): the batch's steps, 4 to 12, saved halfway
    (6 Adam steps after the resume at the batch's default: several, as the course's criterion asks)."""
    n = max(4, min(steps, 12))
    return n, n // 2


def launches(W, backend, preset, steps):
    """One launch on W ranks: ZeRO-3 saves halfway (par's format and DCP), ZeRO-1 and ZeRO-3 resume, then one resume
    per mistake. The straggler sweep on W ranks where there are two or more."""
    cfg = model_preset(preset)
    n, save = resume_steps(steps)
    batch = cost.per_rank_batch(cfg, 4) * W
    out = [launch(NOTEBOOK, "resume", W, resilience_job.Args(
        dir="{checkpoint}", preset=preset, steps=n, save_step=save, batch=batch, save_stage=3, resume_stages=(1, 3),
        dcp=True, mistakes=MISTAKES), backend)]
    if W >= 2:
        out.append(launch(NOTEBOOK, "stragglers", W, straggler_job.Args(preset=preset, batch=batch), backend))
    return out


def kernel(W, backend, preset, steps):
    """One process resumes the ZeRO-3 state and trains the second half on the host, as the launch's batches; skipped
    for a long context (on a CPU that would take the batch's time)."""
    cfg = model_preset(preset)
    n, save = resume_steps(steps)
    work = sized(NOTEBOOK, "one process", cfg, cost.per_rank_batch(cfg, 4) * W, "host", shrink=False,
                 optimizer="adam", steps=n - save, label=preset)
    if cfg.block_size > 256:
        work = replace(work, skipped=f"a long context ({cfg.block_size} tokens): the one-process resume on the host "
                                     f"would take longer than the launch; the ranks' resumes stand")
    return [work]


KEY_NUMBERS = [
    Key("resumed on the same layout (ZeRO-3) vs uninterrupted: losses and weights (max |Δ|)", "= 0: bit-equal",
        "resume_same_layout_max_diff", target=equal(0)),
    Key("saved on ZeRO-3, resumed on ZeRO-1: losses and weights (max |Δ|)", "≤ 1e-5", "resume_zero1_max_diff",
        target=at_most(1e-5)),
    Key("saved on ZeRO-3, resumed in one process: losses and weights (max |Δ|)", "≤ 1e-5",
        "resume_one_process_max_diff", target=at_most(1e-5)),
    Key("DCP's load vs par's load: weights, Adam's state, resumed losses (max |Δ|)", "= 0: bit-equal",
        "dcp_vs_par_max_diff", target=equal(0)),
    *[Key(f"resumed forgetting the {what}: loss drift (max |Δ|)", "≥ 1e-4: 10 × the tolerance",
          f"resume_forget_{part}_drift", target=at_least(1e-4))
      for part, what in (("data", "data position"), ("rng", "random state"), ("optimizer", "optimizer shard"))],
    Key("simulated optimal interval / √(2CM)", "τ_fit / √(2·C·M) = 1 ± 0.1", "young_daly_fit_over_formula",
        target=near(1.0, 0.10, "1 ± 0.1")),
    Key("time lost at τ* = √(2CM), simulated (%)", "measured in the simulation", "young_daly_lost_percent",
        "simulated"),
    Key("time lost at τ* = √(2CM), first order (%)", "100·(C/τ* + (τ*/2 + R)/M)", "young_daly_lost_percent",
        "formula"),
    Key("step time added per second of one rank's delay", "1: the slowest rank sets the pace",
        "straggler_step_slope", target=near(1.0, 0.15, "1 ± 0.15")),
    Key("the other ranks' all-reduce time added per second of delay", "1: they wait inside the all-reduce",
        "straggler_wait_slope", target=near(1.0, 0.15, "1 ± 0.15")),
]


# ---------------------------------------------------------------- pure helpers the notebook uses
def max_diff(a, b) -> float:
    """max |a_i − b_i| over two equally long sequences of numbers (0.0 for two empty ones)."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} and {len(b)} values: compare equally long trajectories")
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def slope(xs, ys) -> float:
    """The least-squares slope of ys against xs: Σ(x − x̄)(y − ȳ) / Σ(x − x̄)²."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError("a slope needs two or more (x, y) pairs")
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("a slope needs two different x")
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


# ---------------------------------------------------------------- figures
FLOOR = 1e-9     # a difference of exactly 0 is drawn here on a log axis


def resume_figure(whole: list, resumed: dict, mistakes: dict, save_step: int, tolerance: float = 1e-5):
    """Left: the uninterrupted loss per step (line), each resumed run's (markers) and each mistake's (dashed), from
    the save on. Right: |resumed − uninterrupted| per step after the save, log scale, 0 drawn at FLOOR, the
    tolerance as a line. One legend below both."""
    fig, (ax, ad) = plt.subplots(1, 2, figsize=(12, 4.6))
    steps = list(range(1, len(whole) + 1))
    ax.plot(steps, whole, color="black", lw=2, label="uninterrupted (ZeRO-3)")
    ax.axvline(save_step + 0.5, color="grey", ls=":", lw=1)
    ax.text(save_step + 0.6, max(whole), "saved here", fontsize=8, color="grey", va="top")
    style = [("o", 9, "none"), ("s", 5, None), ("^", 5, None), ("v", 5, None)]
    for k, (name, losses) in enumerate(resumed.items()):
        xs = steps[save_step:save_step + len(losses)]
        marker, size, face = style[k % len(style)]
        ax.plot(xs, losses, marker, ms=size, mfc=face, color=f"C{k}", ls="none")
        ad.plot(xs, [max(abs(a - b), FLOOR) for a, b in zip(losses, whole[save_step:])], marker, ms=size, mfc=face,
                color=f"C{k}", ls="-", lw=1, label=f"resumed: {name}")
    for k, (name, losses) in enumerate(mistakes.items(), start=len(resumed)):
        xs = steps[save_step:save_step + len(losses)]
        ax.plot(xs, losses[:len(xs)], "--", color=f"C{k}")
        ad.plot(xs, [max(abs(a - b), FLOOR) for a, b in zip(losses, whole[save_step:])], "--", color=f"C{k}",
                label=f"forgot the {name}")
    ax.set(xlabel="training step", ylabel="training loss (cross-entropy, nats)",
           title="loss per step: uninterrupted vs resumed")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ad.xaxis.set_major_locator(MaxNLocator(integer=True))
    ad.axhline(tolerance, color="red", lw=1, label=f"tolerance {tolerance:g}")
    ad.set_yscale("log")
    ad.set_ylim(FLOOR / 3, 1)
    ad.set(xlabel="training step (after the save)", ylabel="|loss − uninterrupted loss| (nats)",
           title=f"difference from the uninterrupted run (0 drawn at {FLOOR:g})")
    handles, labels = ad.get_legend_handles_labels()
    fig.legend([ax.get_lines()[0], *handles], [ax.get_lines()[0].get_label(), *labels], loc="lower center",
               ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.13, 1, 1))
    return fig


def interval_figure(sim, checkpoint_s: float, mtbf_s: float, restart_s: float, fitted_s: float, exact_s: float,
                    unit: float = 60.0):
    """Time lost (% of wall time) against the checkpoint interval τ (minutes, log axis): the simulated runs
    (markers), the first-order C/τ + (τ/2 + R)/M (line), Daly's exact 1 − τ/E[segment] (dashed), √(2CM) and the
    fitted optimum as vertical lines, Daly's exact optimum as a star; the legend beside the axes."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    from par.resilience import interval
    fig, ax = plt.subplots(figsize=(10, 4.2))
    taus = [r.interval_s for r in sim]
    grid = [taus[0] * (taus[-1] / taus[0]) ** (i / 200) for i in range(201)]
    ax.plot([t / unit for t in grid], [100 * interval.lost_fraction(t, checkpoint_s, mtbf_s, restart_s) for t in grid],
            color="C0", label="first order: C/τ + (τ/2 + R)/M")
    ax.plot([t / unit for t in grid],
            [100 * interval.exact_lost_fraction(t, checkpoint_s, mtbf_s, restart_s) for t in grid], "--",
            color="C2", label="Daly's exact: 1 − τ / E[segment]")
    ax.plot([t / unit for t in taus], [100 * r.lost_fraction for r in sim], "o", color="black", ms=5,
            label=f"simulated ({min(r.failures for r in sim):,}+ failures per point)")
    tau = interval.young_daly_interval(checkpoint_s, mtbf_s)
    ax.axvline(tau / unit, color="C0", lw=1.2, ls=":", label=f"√(2CM) = {tau / unit:.1f} min")
    ax.axvline(fitted_s / unit, color="black", lw=1.2, ls="-.",
               label=f"optimum fitted to the simulation: {fitted_s / unit:.1f} min")
    ax.plot([exact_s / unit], [100 * interval.exact_lost_fraction(exact_s, checkpoint_s, mtbf_s, restart_s)], "*",
            color="C2", ms=13, label=f"Daly's exact optimum: {exact_s / unit:.1f} min")
    ax.set_xscale("log")
    ax.set_xticks([t for t in (2, 5, 10, 20, 50, 100, 200) if taus[0] / unit <= t <= taus[-1] / unit])
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set(xlabel="checkpoint interval τ (minutes of work)", ylabel="time lost (% of wall time)",
           title=f"C = {checkpoint_s:g} s, M = {mtbf_s / 3600:.1f} h, R = {restart_s / 60:g} min")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1), frameon=False)
    fig.tight_layout()
    return fig


def straggler_figure(runs, slow_rank: int):
    """Left: the step time (slowest rank's median, ms) against the slow rank's delay (ms), with step(0) + d.
    Right: per delay, each rank's compute and all-reduce time (ms), stacked."""
    fig, (ax, ab) = plt.subplots(1, 2, figsize=(12, 4))
    d = [r.delay_ms for r in runs]
    step = [1e3 * r.step_s for r in runs]
    ax.plot(d, [step[0] + x for x in d], color="grey", lw=1, label="step(0) + delay")
    ax.plot(d, step, "o", color="C3", label="measured: the slowest rank's step")
    ax.set(xlabel=f"rank {slow_rank}'s delay after backward (ms)", ylabel="step time (ms, median)",
           title="the slowest rank sets the pace")
    ax.legend(fontsize=8)
    n = len(runs[0].ranks)
    width = 0.8 / n
    for i, r in enumerate(runs):
        for k, rank in enumerate(r.ranks):
            x = i + (k - (n - 1) / 2) * width
            ab.bar(x, 1e3 * rank.compute_s, width, color="C0", label="compute (+ delay)" if i == k == 0 else None)
            ab.bar(x, 1e3 * rank.allreduce_s, width, bottom=1e3 * rank.compute_s, color="C1",
                   label="all-reduce (waiting included)" if i == k == 0 else None)
            if n <= 4:
                ab.text(x, 0, f"r{k}", ha="center", va="bottom", fontsize=7, color="white")
    ab.set_xticks(range(len(runs)), [f"{x:g} ms" for x in d])
    ab.set(xlabel=f"rank {slow_rank}'s delay (bars: ranks 0, 1, ...)", ylabel="time per step (ms, median)",
           title="where each rank's step goes")
    ab.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig

