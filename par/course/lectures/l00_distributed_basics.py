"""Lecture 00, distributed basics: the ring all-reduce on `world_size` ranks, then the same job on 2, 3 and 4 ranks
(the α–β fit needs several world sizes), every time read on the load-proof clock; its key numbers; its figures (the
ring step by step, the α–β fit)."""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.ticker import LogLocator

from par.comm import job as comm_job
from par.comm.collectives import ring_all_reduce_time
from par.course import plots
from par.course.batch import cost
from par.course.batch.launches import launch
from par.site.numbers import at_least, equal, Key, Target

NOTEBOOK = "00_distributed_basics"
CELLS = ("collectives", "world-size sweep")

COLLECTIVE_SIZES = (64, 1024, 16384, 1 << 18, 1 << 20)   # float32 elements timed: 256 B to 4 MiB
COUNTED_SIZES = (1, 5, 7, 1001, 4096, 65536)                      # bytes counted, uneven chunks included
SWEEP_NUMEL = 4096                                                # bytes counted on every world size
REPS = 15                    # timed calls per size: the fastest on the load-proof clock is the one kept


def ring_step_sizes(sizes=COLLECTIVE_SIZES, ranks=(2, 3, 4)) -> tuple[int, ...]:
    """The chunks (elements) a ring of N ranks sends per step for every timed size S: ceil(S/N), so that
    `ring_time_from_steps` can simulate N = 3 and 4 from steps measured on the ranks there are cores for."""
    return tuple(sorted({-(-s // n) for s in sizes for n in ranks}))


def launches(W, backend, preset, steps):
    """The collectives on W ranks; then the sweep on 2, 3 and 4. On one rank (a one-GPU server) no "show": every
    collective of one rank is the identity, and its send/recv around the ring would have no neighbour but the rank
    itself (the notebook says so)."""
    out = [launch(NOTEBOOK, "collectives", W, comm_job.Args(
        parts=("env", "show", "trace", "bytes", "timing", "steps") if W > 1 else ("env", "trace", "bytes", "timing"),
        sizes=COLLECTIVE_SIZES, bytes_sizes=COUNTED_SIZES, reps=REPS, warmup=2, step_sizes=ring_step_sizes()),
        backend)]
    gpus = cost.on_gpus(backend, W)
    for n in cost.sweep_sizes({2, 3, 4}, W, backend):
        if n != W:          # timings only where each rank has a core (or GPU) of its own, else the latency point
            timed = COLLECTIVE_SIZES if gpus or n <= cost.cores() else (64,)
            out.append(launch(NOTEBOOK, "world-size sweep", n, comm_job.Args(
                parts=("trace", "bytes", "timing") if n == 4 else ("bytes", "timing"), bytes_sizes=(SWEEP_NUMEL,),
                reps=REPS, warmup=2, sizes=timed), backend))
    return out


KEY_NUMBERS = [
    Key("ring all-reduce: bytes counted / formula", "2(N−1)/N · S per rank → 1", "ring_bytes_counted_over_formula",
        target=equal(1)),
    Key("latency per message α (s)", "T = α + β · bytes", "ring_alpha_s"),
    Key("time per byte β (s/B)", "T = α + β · bytes", "ring_beta_s_per_byte"),
    Key("α–β fit over world sizes", "≥ 3 sizes", "ring_alpha_beta_fit_world_sizes"),
    Key("where the fitted times came from", "measured, or simulated from steps", "ring_alpha_beta_source"),
    Key("ring time, 4 KiB / 256 B message (load-proof, fastest call)", "≈ 1: both are 2(N−1)·α",
        "ring_latency_bound_ratio", target=Target("within 2× (0.5–2)", low=0.5, high=2.0)),
    Key("ring time, 4 MiB / 256 B message (load-proof, fastest call)", "≥ 2: the bandwidth term has taken over",
        "ring_bandwidth_over_latency", target=at_least(2)),
    Key("α–β model / measured ring, every size (N with a core per rank)", "T = 2(N−1)α + 2(N−1)/N·S·β",
        "ring_model_over_measured", target=Target("within 2× (0.5–2)", low=0.5, high=2.0)),
    Key("hand-written ring / dist.all_reduce time (load-proof, fastest call)", "largest message",
        "ring_over_torch_time_largest"),
    Key("simulated / measured ring at N = 2, largest message", "Σ steps timed alone ≈ the whole ring",
        "ring_simulator_over_measured_n2_largest", target=Target("within 2× (0.5–2)", low=0.5, high=2.0)),
]


# ---------------------------------------------------------------- figures
def ring_trace(trace: dict, axes=None, title: str = "ring all-reduce, step by step", per_row: int | None = None):
    """Every rank's chunks after every step of a recorded ring all-reduce (`par.comm.job` trace part).

    One small panel per step (start, then the N-1 reduce-scatter steps on the first row, the N-1
    all-gather steps on the second): a row per rank, a column per chunk. Rank r started with 2**r,
    so a held value's bits name the ranks summed into it: the number in a square (and its shade) is
    how many ranks it holds, and it grows by one per reduce-scatter step. A red outline marks the
    chunk received at that step. Returns the array of axes.
    """
    n, ranks, bounds = trace["world_size"], trace["ranks"], trace["bounds"]
    steps = len(ranks[0])
    per_row = per_row or max(1, (steps + 1) // 2)
    rows = -(-steps // per_row)
    if axes is None:
        side = 0.42 * n + 0.6
        fig, axes = plt.subplots(rows, per_row, figsize=(side * per_row + 1.2, side * rows + 0.9), squeeze=False)
    else:
        fig = axes.flat[0].figure
    flat_axes = list(getattr(axes, "flat", axes))
    cmap = plt.get_cmap("Blues")
    for j, ax in enumerate(flat_axes):
        if j >= steps:   # a spare panel holds the key
            ax.set_axis_off()
            if j == steps:
                ax.text(0.02, 0.5, "number, shade: how many\nranks are summed in it\n\nred: received this step\n\n"
                        f"reduce-scatter: 1 → {n}\nall-gather: copies of {n}", transform=ax.transAxes,
                        fontsize=8, va="center")
            continue
        for r in range(n):
            snap = ranks[r][j]
            for c, (a, _) in enumerate(bounds):
                count = bin(int(round(snap["held"][a]))).count("1")
                red = snap["received"] == c
                ax.add_patch(plt.Rectangle((c + 0.05, r + 0.05), 0.9, 0.9, facecolor=cmap(0.15 + 0.8 * count / n),
                                           edgecolor="red" if red else "white", linewidth=2.2 if red else 0.5))
                ax.text(c + 0.5, r + 0.5, str(count), ha="center", va="center", fontsize=9,
                        color="white" if count > n / 2 else "black")
        snap = ranks[0][j]
        phase = {"start": "start", "reduce_scatter": "reduce-scatter", "all_gather": "all-gather"}[snap["phase"]]
        ax.set_title(phase if snap["phase"] == "start" else f"{phase} step {snap['step'] + 1}", fontsize=9)
        ax.set_xlim(0, n)
        ax.set_ylim(n, 0)
        ax.set_aspect("equal")
        ax.set_xticks([c + 0.5 for c in range(n)])
        ax.set_xticklabels([f"c{c}" for c in range(n)] if j + per_row >= steps else [], fontsize=7)
        ax.set_yticks([r + 0.5 for r in range(n)])
        ax.set_yticklabels([f"rank {r}" for r in range(n)] if j % per_row == 0 else [], fontsize=8)
        ax.tick_params(length=0)
        for side in ax.spines.values():
            side.set_visible(False)
    fig.suptitle(f"{title}: {n} ranks, chunks c0…c{n - 1}", fontsize=10)
    fig.tight_layout()
    return axes


def alpha_beta_fit(timing: dict, alpha: float, beta: float, cores: int, small: int | None = None, axes=None,
                   simulated: dict | None = None):
    """The ring all-reduce's time against T = 2(N-1)·alpha + 2(N-1)/N·S·beta, fitted on the N <= cores runs
    (and the `simulated` ones).

    `timing`: {N: rows of `par.comm.job` timing part} (each row: numel, ring_steady_min_s = the fastest call on
    the load-proof clock, ring_s = the wall clock's median). Left: time vs message size S for every N with a
    core per rank, the load-proof time as filled points, the wall clock's median as grey crosses, and the
    model's curve. Right: the smallest message's time vs N, which is all latency: 2(N-1) steps of alpha. N >
    cores are drawn hollow, marked oversubscribed, and are not in the fit. `simulated`: {N: rows of numel,
    ring_s} from `ring_time_from_steps` (of steps timed on the load-proof clock), drawn as diamonds and
    labelled simulated. Returns the two axes.
    """
    if axes is None:
        axes = plt.subplots(1, 2, figsize=(11, 3.8))[1]
    left, right = axes
    fitted = sorted(n for n in timing if n <= cores)
    for i, n in enumerate(fitted):
        rows = sorted(timing[n], key=lambda t: t["numel"])
        x = [4 * t["numel"] for t in rows]
        left.plot(x, [t["ring_steady_min_s"] * 1e3 for t in rows], "o", color=f"C{i}",
                  label=f"measured, N = {n} (load-proof, fastest call)")
        left.plot(x, [t["ring_s"] * 1e3 for t in rows], "x", color="grey", ms=5,
                  label="wall clock (median), not fitted" if i == 0 else None)
        grid = [x[0] * (x[-1] / x[0]) ** (k / 60) for k in range(61)]
        left.plot(grid, [ring_all_reduce_time(s, n, alpha, beta) * 1e3 for s in grid], "-", color=f"C{i}",
                  alpha=0.7, label=f"fit, N = {n}")
    simulated = simulated or {}
    for i, (n, rows) in enumerate(sorted(simulated.items()), start=len(fitted)):
        rows = sorted(rows, key=lambda t: t["numel"])
        x = [4 * t["numel"] for t in rows]
        left.plot(x, [t["ring_s"] * 1e3 for t in rows], "D", color=f"C{i}", mfc="white",
                  label=f"simulated from measured steps, N = {n}")
        grid = [x[0] * (x[-1] / x[0]) ** (k / 60) for k in range(61)]
        left.plot(grid, [ring_all_reduce_time(s, n, alpha, beta) * 1e3 for s in grid], "--", color=f"C{i}",
                  alpha=0.7, label=f"the fit's prediction, N = {n}")
    left.set_xscale("log")
    left.set_yscale("log")
    left.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
    left.yaxis.set_major_formatter(plt.FuncFormatter(lambda y, _: f"{y:g}"))
    left.yaxis.set_minor_formatter(plt.NullFormatter())
    left.set_xlabel("message size S (bytes)")
    left.set_ylabel("ring all-reduce time (ms)")
    left.set_title(f"α = {alpha * 1e6:.0f} µs per step, β = {beta * 1e9:.2f} ns/byte ({1 / beta / 1e9:.2f} GB/s)"
                   if beta > 0 else f"α = {alpha * 1e6:.0f} µs per step, β = 0", fontsize=9)
    left.legend(fontsize=7, loc="upper left")

    small = small or min(min(t["numel"] for t in rows) for rows in timing.values())
    ns = sorted(timing)
    points = {n: next((t for t in timing[n] if t["numel"] == small), None) for n in ns}
    grid_n = list(range(2, max(ns) + 3))
    right.plot(grid_n, [ring_all_reduce_time(4 * small, n, alpha, beta) * 1e3 for n in grid_n], "-", color="grey",
               lw=3, alpha=0.5, label="model: 2(N−1)·α + 2(N−1)/N·S·β")
    right.plot(grid_n, [2 * (n - 1) * alpha * 1e3 for n in grid_n], "k--", lw=1, label="its latency term 2(N−1)·α")
    for n, t in points.items():
        if t is None:
            continue
        hollow = n > cores
        right.plot([n], [t["ring_steady_min_s"] * 1e3], "o", color="C3" if hollow else "C0",
                   mfc="white" if hollow else "C0",
                   label=("oversubscribed: N > cores, not fitted" if hollow else
                          "measured, a core per rank (load-proof, fastest call)"))
    for n, rows in simulated.items():
        t = next((t for t in rows if t["numel"] == small), None)
        if t is not None:
            right.plot([n], [t["ring_s"] * 1e3], "D", color="C2", mfc="white",
                       label="simulated from steps measured with a core per rank")
    handles, labels = right.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    right.legend(unique.values(), unique.keys(), fontsize=7, loc="lower right")
    right.set_xticks(grid_n)
    right.set_xlabel("ranks N")
    right.set_ylabel("ring all-reduce time (ms)")
    right.set_title(f"all-reduce of {small} floats ({4 * small} B): latency steps, {cores} cores", fontsize=9)
    right.set_ylim(bottom=0)
    return axes
