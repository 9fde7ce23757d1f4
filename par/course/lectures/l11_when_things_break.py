"""Lecture 11, when things break: a run saved on ZeRO-3 resumed on other layouts (and in one process, and through
DCP) equal to the run that never stopped, the three mistakes that make it differ; the checkpoint interval
(Young/Daly) against a simulation of failures; a rank killed and the job brought back by torchrun's restart from its
last checkpoint, the time lost against R + (k − c)·t; a straggler setting the pace of synchronous data parallelism;
DiLoCo's H inner steps against DP's bytes and loss; its key numbers; its figures."""
from __future__ import annotations

from dataclasses import replace

import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from par.comm.collectives import all_reduce_formula_bytes
from par.course.batch import cost
from par.course.batch.launches import launch, sized
from par.model import preset as model_preset
from par.resilience import diloco_job, elastic_job, interval, job as resilience_job, straggler_job
from par.site.numbers import at_least, at_most, equal, Key, near
from par.tp.layers import check_tp_degree

NOTEBOOK = "11_when_things_break"
CELLS = ("resume", "elastic", "stragglers", "diloco")
MISTAKES = ("data", "rng", "optimizer")


def resume_steps(steps: int) -> tuple[int, int]:
    """(steps of the uninterrupted run, the step after which it saves): the batch's steps, 4 to 12, saved halfway
    (6 Adam steps after the resume at the batch's default: several, as the course's criterion asks)."""
    n = max(4, min(steps, 12))
    return n, n // 2


ELASTIC = {"steps": 16, "every": 8, "kill_step": 14, "step_ms": 300.0}   # 6 steps redone, each padded to 0.3 s
RESTARTS = 1                    # torchrun's --max-restarts for the killed run
DILOCO_H = (4, 16)              # DiLoCo's inner steps per outer step, against DP on the same 48 steps
DILOCO_STEPS = 48


def tp_fits(cfg, W: int) -> bool:
    """Whether tensor parallelism over all W ranks splits this model (heads and widths divisible by W)."""
    try:
        check_tp_degree(cfg, W)
    except ValueError:
        return False
    return True


def launches(W, backend, preset, steps):
    """One launch on W ranks: ZeRO-3 saves halfway (par's format and DCP), ZeRO-1 and ZeRO-3 resume, then one resume
    per mistake. The straggler sweep on W ranks where there are two or more."""
    cfg = model_preset(preset)
    n, save = resume_steps(steps)
    batch = cost.per_rank_batch(cfg, 4) * W
    out = [launch(NOTEBOOK, "resume", W, resilience_job.Args(
        dir="{checkpoint}", preset=preset, steps=n, save_step=save, batch=batch, save_stage=3, resume_stages=(1, 3),
        dcp=True, mistakes=MISTAKES, resume_tp=tp_fits(cfg, W)), backend)]
    for kill in (0, ELASTIC["kill_step"]):      # the uninterrupted run, then the killed one (torchrun restarts it)
        out.append(launch(NOTEBOOK, "elastic", W, elastic_job.Args(
            dir="{checkpoint}", preset=preset, batch=batch, **{**ELASTIC, "kill_step": kill}), backend))
    if W >= 2:
        out.append(launch(NOTEBOOK, "stragglers", W, straggler_job.Args(preset=preset, batch=batch), backend))
        out.append(launch(NOTEBOOK, "diloco", W, diloco_job.Args(preset=preset, batch=batch, h=DILOCO_H,
                                                                 steps=DILOCO_STEPS), backend))
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
    Key("saved on ZeRO-3, resumed on TP over the same ranks: losses and weight shards (max |Δ|)", "≤ 5e-6",
        "resume_tp_max_diff", target=at_most(5e-6)),
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
    Key("killed rank, restarted by torchrun: resumed losses vs uninterrupted (max |Δ|)", "= 0: bit-equal",
        "elastic_resumed_max_diff", target=equal(0)),
    Key("time lost to the kill / (R + (k − c)·t)", "measured from the kill to k steps done again; 1 ± 0.1",
        "elastic_lost_over_formula", target=near(1.0, 0.10, "1 ± 0.1")),
    Key("restart cost R: kill → first step of the next attempt (s)", "measured", "elastic_time_s", "restart"),
    Key("time lost to the kill, measured (s)", "kill → k steps done again", "elastic_time_s", "lost"),
    Key("time lost to the kill, formula (s)", "R + (k − c)·t", "elastic_time_s", "formula"),
    Key("wall time of the killed launch − the uninterrupted one's (s)", "two launches' wall clocks (load-noisy)",
        "elastic_time_s", "wall_difference"),
    Key("step time added per second of one rank's delay", "1: the slowest rank sets the pace",
        "straggler_step_slope", target=near(1.0, 0.15, "1 ± 0.15")),
    Key("the other ranks' all-reduce time added per second of delay", "1: they wait inside the all-reduce",
        "straggler_wait_slope", target=near(1.0, 0.15, "1 ± 0.15")),
    *[Key(f"DiLoCo H = {h}: DP's bytes per step / DiLoCo's (commlog)", f"H = {h}: one all-reduce of Ψ per H steps",
          "diloco_bytes_ratio", str(h), target=near(float(h), 0.01 * h, f"{h} ± 1 %")) for h in DILOCO_H],
    *[Key(f"DiLoCo H = {h}: held-out loss − DP's at the same tokens (nats)", "≤ 0.1: no worse than DP by 0.1",
          "diloco_loss_gap", str(h), target=at_most(0.1)) for h in DILOCO_H],
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


def elastic_times(result) -> dict:
    """The killed run's log read as the lecture's terms (seconds): the kill before step k, the checkpoint c it
    resumed from, t (attempt 0's median step), R (kill → the next attempt's first step: the agent's restart, the
    new processes' imports and rendezvous, the load), lost (kill → k steps done again) and the formula
    R + (k − c)·t."""
    import statistics
    k, kill = result.kill["step"], result.kill["time"]
    first = [s for s in result.steps if s["attempt"] == 0]
    again = [s for s in result.steps if s["attempt"] == 1]
    if not again or not result.loads:
        raise ValueError("the killed run has no second attempt that loaded a checkpoint: was it restarted?")
    c = result.loads[0]["step"]
    t = statistics.median(s["end"] - s["start"] for s in first)
    restart = again[0]["start"] - kill
    back = next(s["end"] for s in again if s["step"] == k - 1)
    return {"k": k, "c": c, "step": t, "restart": restart, "lost": back - kill, "formula": restart + (k - c) * t,
            "spawn": result.starts[1]["time"] - kill, "load": result.loads[0]["end"] - result.loads[0]["start"]}


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


def elastic_figure(whole, killed, times: dict):
    """Left: steps done against wall time since each run's first step started, the uninterrupted run (line) and the
    killed one (markers: attempt 0, attempt 1), the kill, the restart R and the rework shaded, the time lost as an
    arrow. Right: the loss per step of both runs, the steps redone after the restart drawn again."""
    fig, (ax, al) = plt.subplots(1, 2, figsize=(12, 4.4))
    t0u, t0k = whole.steps[0]["start"], killed.steps[0]["start"]
    ax.plot([0] + [s["end"] - t0u for s in whole.steps], [0] + [s["step"] + 1 for s in whole.steps], color="black",
            lw=2, label="uninterrupted")
    for a, marker in ((0, "o"), (1, "s")):
        mine = [s for s in killed.steps if s["attempt"] == a]
        ax.plot([s["end"] - t0k for s in mine], [s["step"] + 1 for s in mine], marker, ms=5, color=f"C{a}",
                label=f"killed run, attempt {a}")
    kill = killed.kill["time"] - t0k
    ax.axvspan(kill, kill + times["restart"], color="C3", alpha=0.15, label=f"restart R = {times['restart']:.1f} s")
    ax.axvspan(kill + times["restart"], kill + times["lost"], color="C1", alpha=0.15,
               label=f"rework: {times['k'] - times['c']} steps from checkpoint {times['c']}")
    ax.axvline(kill, color="C3", lw=1, ls=":")
    ax.text(kill, 0.5, f" SIGKILL before step {times['k'] + 1}", color="C3", fontsize=8, rotation=90, va="bottom")
    ax.annotate("", xy=(kill + times["lost"], times["k"]), xytext=(kill, times["k"]),
                arrowprops={"arrowstyle": "<->", "color": "C3"})
    ax.text(kill + times["lost"] / 2, times["k"] + 0.3, f"lost {times['lost']:.1f} s", color="C3", ha="center",
            fontsize=8)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="wall time since the first step started (s)", ylabel="steps done",
           title=f"time lost {times['lost']:.1f} s  vs  R + (k − c)·t = {times['formula']:.1f} s")
    ax.legend(fontsize=8, loc="lower right")
    al.plot([s["step"] + 1 for s in whole.steps], [s["loss"] for s in whole.steps], color="black", lw=2,
            label="uninterrupted")
    for a, marker, face in ((0, "o", "none"), (1, "s", None)):
        mine = [s for s in killed.steps if s["attempt"] == a]
        al.plot([s["step"] + 1 for s in mine], [s["loss"] for s in mine], marker, ms=8 if a == 0 else 4,
                mfc=face, color=f"C{a}", ls="none", label=f"killed run, attempt {a}")
    al.axvline(times["c"] + 0.5, color="grey", ls=":", lw=1)
    al.text(times["c"] + 0.6, max(s["loss"] for s in whole.steps), "checkpoint", fontsize=8, color="grey", va="top")
    al.xaxis.set_major_locator(MaxNLocator(integer=True))
    al.set(xlabel="training step", ylabel="training loss (nats)", title="the same losses, to the bit")
    al.legend(fontsize=8)
    fig.tight_layout()
    return fig


def diloco_figure(result, tokens_per_step: int):
    """Left: the held-out loss against the tokens seen, DP (line) and DiLoCo per H (markers at its outer steps).
    Right: bytes sent per step by rank 0 (commlog, log scale) per run, with DP's 2(N−1)/N·4Ψ divided by H."""
    fig, (ax, ab) = plt.subplots(1, 2, figsize=(12, 4))
    for k, run in enumerate(result.runs):
        xs = [s * tokens_per_step for s in run.eval_steps]
        ax.plot(xs, run.eval_losses, "-" if run.h == 0 else "o--", color="black" if run.h == 0 else f"C{k}",
                lw=2 if run.h == 0 else 1, ms=5, label="DP (all-reduce every step)" if run.h == 0
                else f"DiLoCo H = {run.h} (outer steps)")
    ax.set(xlabel="tokens seen (all ranks)", ylabel="held-out loss (nats)", title="loss at the same tokens")
    ax.legend(fontsize=8)
    steps = len(result.runs[0].losses)
    full = all_reduce_formula_bytes(4 * result.psi, result.world_size)
    labels = [run.label for run in result.runs]
    ab.bar(range(len(labels)), [run.bytes_sent / steps for run in result.runs], color="C0", label="measured (commlog)")
    ab.plot(range(len(labels)), [full / max(1, run.h) for run in result.runs], "_", ms=40, mew=2, color="C3",
            label="2(N−1)/N·4Ψ / H")
    ab.set_xticks(range(len(labels)), labels)
    ab.set_yscale("log")
    ab.set(ylabel="bytes sent per step by a rank", title="communication per step")
    ab.legend(fontsize=8, loc="lower left")
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

