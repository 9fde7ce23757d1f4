"""Figures the lectures draw from measured data: timelines, predicted-vs-measured bars, curves.

Every function takes plain data (lists, dicts) and an optional matplotlib
axis, and returns the axis, so notebooks can put figures side by side.
"""
from __future__ import annotations

import matplotlib.pyplot as plt

COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868", "comm": "#8172B2", "idle": "#DDDDDD"}


def _ax(ax, figsize=(8, 3)):
    return ax if ax is not None else plt.subplots(figsize=figsize)[1]


def color_for(name: str, lane: str) -> str:
    """Forward blue, backward orange, communication purple, anything else grey-green."""
    if lane != "compute":
        return COLORS["comm"]
    return COLORS.get(name[:1], COLORS["W"])


def gantt(spans: list[dict], ax=None, title: str = "", label: bool = True):
    """One row per (rank, lane); each span a bar from start to end, named inside when it fits.

    `spans` are dicts with rank, lane, name, start, end (what `Recorder.gather()` returns, or a
    simulated schedule).
    """
    ax = _ax(ax, (10, 0.5 + 0.45 * len({(s["rank"], s["lane"]) for s in spans})))
    rows = sorted({(s["rank"], s["lane"]) for s in spans}, key=lambda r: (r[0], r[1] != "compute", r[1]))
    index = {r: i for i, r in enumerate(rows)}
    t_end = max((s["end"] for s in spans), default=1.0)
    for s in spans:
        y = index[(s["rank"], s["lane"])]
        ax.barh(y, s["end"] - s["start"], left=s["start"], height=0.8,
                color=color_for(s["name"], s["lane"]), edgecolor="white", linewidth=0.5)
        if label and (s["end"] - s["start"]) > 0.025 * t_end:
            ax.text((s["start"] + s["end"]) / 2, y, s["name"], ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {r}" if lane == "compute" else f"rank {r} {lane}" for r, lane in rows])
    ax.invert_yaxis()
    ax.set_xlabel("time")
    if title:
        ax.set_title(title)
    return ax


def compare_bars(labels, predicted, measured, ax=None, ylabel: str = "bytes", title: str = ""):
    """Predicted and measured values side by side for each label."""
    ax = _ax(ax, (max(5, 0.9 * len(labels) + 2), 3.2))
    x = range(len(labels))
    w = 0.4
    ax.bar([i - w / 2 for i in x], predicted, w, label="formula", color="#4C72B0")
    ax.bar([i + w / 2 for i in x], measured, w, label="measured", color="#DD8452")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, rotation=20 if max(map(len, map(str, labels))) > 8 else 0)
    ax.set_ylabel(ylabel)
    ax.legend()
    if title:
        ax.set_title(title)
    return ax


def curves(series: dict, ax=None, xlabel: str = "step", ylabel: str = "loss", title: str = "", logy=False):
    """Several named curves on one axis: {"1 rank": [...], "2 ranks": [...]}."""
    ax = _ax(ax, (6, 3.2))
    for name, ys in series.items():
        if isinstance(ys, dict):  # {"x": [...], "y": [...]}
            ax.plot(ys["x"], ys["y"], label=name, marker=".")
        else:
            ax.plot(range(len(ys)), ys, label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    ax.legend()
    if title:
        ax.set_title(title)
    return ax


def curves_with_difference(series: dict, reference: str, axes=None, xlabel: str = "step",
                           ylabel: str = "loss", title: str = "", diff_label: str | None = None):
    """Curves that lie on top of each other, and below them a panel of each one minus `reference`.

    When two runs agree to 1e-6 their curves coincide and the eye sees one line; the lower panel
    shows how far apart they really are. Returns (top axis, difference axis).
    """
    if reference not in series:
        raise ValueError(f"reference {reference!r} is not one of the curves: {', '.join(series)}")
    if axes is None:
        fig, axes = plt.subplots(2, 1, figsize=(6.4, 4.4), sharex=True, gridspec_kw={"height_ratios": [2.2, 1]})
    top, bottom = axes

    def xy(ys):
        return (ys["x"], ys["y"]) if isinstance(ys, dict) else (list(range(len(ys))), list(ys))

    styles = ["-", "--", ":", "-."]
    for i, (name, ys) in enumerate(series.items()):
        x, y = xy(ys)
        top.plot(x, y, styles[i % len(styles)], label=name, marker="." if len(x) < 40 else None)
    rx, ry = xy(series[reference])
    for i, (name, ys) in enumerate(series.items()):
        if name == reference:
            continue
        x, y = xy(ys)
        n = min(len(y), len(ry))
        bottom.plot(x[:n], [a - b for a, b in zip(y[:n], ry[:n])], styles[i % len(styles)],
                    label=name, color=f"C{i}")
    bottom.axhline(0.0, color="grey", lw=0.8)
    top.set_ylabel(ylabel)
    bottom.set_ylabel(diff_label or f"minus {reference}")
    bottom.set_xlabel(xlabel)
    bottom.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    top.legend(fontsize=8, loc="best")
    if title:
        top.set_title(title)
    return top, bottom


def memory_bars(rows: list[dict], ax=None, unit: float = 1e9, ylabel: str = "GB per rank", title: str = "",
                parts=("params", "grads", "optimizer")):
    """Stacked bars of model states, one bar per row ({"name", "params", "grads", "optimizer", ...}),
    e.g. `par.memory.zero_table(...)`; the total is written on top of each bar."""
    ax = _ax(ax, (max(5, 1.3 * len(rows) + 2), 3.4))
    colors = {"params": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868"}
    x = range(len(rows))
    bottom = [0.0] * len(rows)
    for part in parts:
        vals = [r[part] / unit for r in rows]
        ax.bar(x, vals, 0.6, bottom=bottom, label=part, color=colors.get(part))
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, top in enumerate(bottom):
        ax.text(i, top, f"{top:.3g}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x))
    ax.set_xticklabels([r.get("name", str(i)) for i, r in enumerate(rows)], fontsize=8)
    ax.set_ylabel(ylabel)
    ax.legend()
    if title:
        ax.set_title(title)
    return ax


def ring_trace(trace: dict, axes=None, title: str = "ring all-reduce, step by step", per_row: int | None = None):
    """Every rank's chunks after every step of a recorded ring all-reduce (`par.jobs.collectives` trace part).

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


def process_grid(dp: int, pp: int, tp: int, gpus_per_node: int = 8, ax=None, title: str = ""):
    """The 3D grid of `par.grid`: one column per pipeline stage, one row per data-parallel replica,
    tp boxes side by side in each cell; each box names its rank (t + tp·(d + dp·s)) and is
    coloured by node (ranks numbered node by node)."""
    ax = _ax(ax, (max(5, 1.1 * pp * tp + 1.5), max(2.2, 0.8 * dp + 1)))
    cmap = plt.get_cmap("tab20")
    for s in range(pp):
        for d in range(dp):
            for t in range(tp):
                r = t + tp * (d + dp * s)
                x, y = s * (tp + 0.6) + t, (dp - 1 - d) * 1.2
                ax.add_patch(plt.Rectangle((x, y), 0.9, 0.9, color=cmap((r // gpus_per_node) % 20), alpha=0.8))
                ax.text(x + 0.45, y + 0.45, str(r), ha="center", va="center", fontsize=9)
            ax.add_patch(plt.Rectangle((s * (tp + 0.6) - 0.08, (dp - 1 - d) * 1.2 - 0.08), tp - 0.1 + 0.16 + 0.0,
                                       1.06, fill=False, lw=1.2, ls="--", ec="black"))
    ax.set_xlim(-0.4, pp * (tp + 0.6))
    ax.set_ylim(-0.4, dp * 1.2 + 0.2)
    ax.set_xticks([s * (tp + 0.6) + tp / 2 - 0.05 for s in range(pp)])
    ax.set_xticklabels([f"stage {s}" for s in range(pp)])
    ax.set_yticks([(dp - 1 - d) * 1.2 + 0.45 for d in range(dp)])
    ax.set_yticklabels([f"replica {d}" for d in range(dp)])
    ax.set_title(title or f"dp {dp} × pp {pp} × tp {tp}: dashed box = one tp group, colour = node "
                          f"({gpus_per_node} GPUs each)", fontsize=9)
    ax.set_aspect("equal")
    return ax


def benchmark_table(rows: list[dict], axes=None):
    """The lecture-07 benchmark (`par.bench.suite` rows) in four panels: samples/s; memory per rank
    (measured average and peak beside the planner's prediction); bytes sent per rank and step,
    measured and predicted; and the largest model that fits the per-device memory."""
    rows = [r for r in rows if "error" not in r]
    if axes is None:
        axes = plt.subplots(1, 4, figsize=(17, 3.6))[1]
    names = [r["strategy"].replace(" + ", "+\n").replace(" (", "\n(") for r in rows]
    x = range(len(rows))
    axes[0].bar(x, [r["samples_per_s"] for r in rows], color="#4C72B0")
    axes[0].set_ylabel("samples / s")
    w = 0.27
    for i, (key, lab, c) in enumerate((("mem_avg", "measured avg", "#4C72B0"), ("mem_peak", "measured peak", "#DD8452"),
                                       ("pred_mem", "predicted peak", "#BBBBBB"))):
        axes[1].bar([k + (i - 1) * w for k in x], [r[key] / 1e6 for r in rows], w, label=lab, color=c)
    axes[1].set_ylabel("MB per rank")
    axes[1].legend(fontsize=7)
    for i, (key, lab, c) in enumerate((("bytes_per_step", "measured", "#8172B2"),
                                       ("pred_bytes_per_step", "predicted", "#BBBBBB"))):
        axes[2].bar([k + (i - 0.5) * 0.4 for k in x], [r[key] / 1e6 for r in rows], 0.4, label=lab, color=c)
    axes[2].set_ylabel("MB sent per rank per step")
    axes[2].legend(fontsize=7)
    axes[3].bar(x, [r["largest_params"] / 1e9 for r in rows], color="#55A868")
    axes[3].set_ylabel("largest model that fits (B params)")
    for ax in axes:
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, fontsize=7, rotation=60, ha="right")
    return axes


def median_with_spread(ax, x, quartiles, fmt="o", scale=1.0, **kw):
    """Points at the medians with error bars from q1 to q3 (`quartiles`: one [q1, median, q3] per x)."""
    mid = [q[1] * scale for q in quartiles]
    spread = [[(q[1] - q[0]) * scale for q in quartiles], [(q[2] - q[1]) * scale for q in quartiles]]
    return ax.errorbar(x, mid, yerr=spread, fmt=fmt, capsize=3, **kw)


def alpha_beta_fit(timing: dict, alpha: float, beta: float, cores: int, small: int | None = None, axes=None):
    """The ring all-reduce's time against T = 2(N-1)·alpha + 2(N-1)/N·S·beta, fitted on the N <= cores runs.

    `timing`: {N: rows of `par.jobs.collectives` timing part} (each row: numel, ring_q = [q1, median,
    q3] seconds). Left: time vs message size S for every N with a core per rank, the median
    with its q1-q3 spread, and the model's curve. Right: the smallest message's time vs N, which is
    all latency: 2(N-1) steps of alpha. N > cores are drawn hollow, marked oversubscribed, and are
    not in the fit. Returns the two axes.
    """
    from par.collectives import ring_all_reduce_time
    if axes is None:
        axes = plt.subplots(1, 2, figsize=(11, 3.8))[1]
    left, right = axes
    fitted = sorted(n for n in timing if n <= cores)
    for i, n in enumerate(fitted):
        rows = sorted(timing[n], key=lambda t: t["numel"])
        x = [4 * t["numel"] for t in rows]
        median_with_spread(left, x, [t["ring_q"] for t in rows], scale=1e3, color=f"C{i}",
                           label=f"measured, N = {n} (median, q1–q3)")
        grid = [x[0] * (x[-1] / x[0]) ** (k / 60) for k in range(61)]
        left.plot(grid, [ring_all_reduce_time(s, n, alpha, beta) * 1e3 for s in grid], "-", color=f"C{i}",
                  alpha=0.7, label=f"fit, N = {n}")
    left.set_xscale("log")
    left.set_yscale("log")
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
        median_with_spread(right, [n], [t["ring_q"]], scale=1e3, color="C3" if hollow else "C0",
                           mfc="white" if hollow else "C0",
                           label=("oversubscribed: N > cores, not fitted" if hollow else "measured, a core per rank"))
    handles, labels = right.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    right.legend(unique.values(), unique.keys(), fontsize=7, loc="upper left")
    right.set_xticks(grid_n)
    right.set_xlabel("ranks N")
    right.set_ylabel("ms")
    right.set_title(f"all-reduce of {small} floats ({4 * small} B): latency steps, {cores} cores", fontsize=9)
    right.set_ylim(bottom=0)
    return axes
