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


def ring_trace(trace: dict, ax=None, title: str = "ring all-reduce, step by step"):
    """Every rank's chunks after every step of a recorded ring all-reduce (`par.jobs.collectives` trace part).

    Rank r started with 2**r, so a held value's bits name the ranks summed into it. Each square is
    one chunk, its number (and shade) how many ranks it holds; the chunk received at that step has
    a red outline. Columns: start, reduce-scatter steps, all-gather steps.
    """
    n, ranks = trace["world_size"], trace["ranks"]
    bounds = trace["bounds"]
    steps = len(ranks[0])
    ax = _ax(ax, (min(18, 0.55 * steps * (n + 1) + 1), min(8, 0.55 * n + 1.2)))
    cmap = plt.get_cmap("Blues")
    for j in range(steps):
        x0 = j * (n + 1)
        for r in range(n):
            snap = ranks[r][j]
            for c, (a, _) in enumerate(bounds):
                count = bin(int(round(snap["held"][a]))).count("1")
                red = snap["received"] == c
                ax.add_patch(plt.Rectangle((x0 + c, r), 0.9, 0.8, facecolor=cmap(0.15 + 0.8 * count / n),
                                           edgecolor="red" if red else "white", linewidth=2 if red else 0.5))
                ax.text(x0 + c + 0.45, r + 0.4, str(count), ha="center", va="center", fontsize=7,
                        color="white" if count > n / 2 else "black")
        snap = ranks[0][j]
        label = "start" if snap["phase"] == "start" else f"{'RS' if snap['phase'] == 'reduce_scatter' else 'AG'} {snap['step']}"
        ax.text(x0 + n / 2 - 0.05, -0.35, label, ha="center", va="bottom", fontsize=8)
    ax.set_xlim(-0.3, steps * (n + 1) - 0.7)
    ax.set_ylim(n + 0.1, -0.9)
    ax.set_yticks([r + 0.4 for r in range(n)])
    ax.set_yticklabels([f"rank {r}" for r in range(n)])
    ax.set_xticks([])
    ax.set_frame_on(False)
    if title:
        ax.set_title(title)
    return ax


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


# ---------------------------------------------------------------- ZeRO (lecture 06)
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
}


def zero_span_kind(name: str) -> str:
    """The ZERO_KINDS key of a recorded ZeRO span name ('AG blocks.1 (prefetched)' -> 'AG*')."""
    if name in ZERO_KINDS:
        return name
    head = name.split(" ", 1)[0]
    if head == "AG" and "prefetched" in name:
        return "AG*"
    return head if head in ZERO_KINDS else "update"


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
    ax = _ax(ax, (11, 0.9 + 0.55 * 2 * len(ranks)))
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
    """Per-rank model-state bytes against the data-parallel degree N_d: `par.memory.model_state_bytes`'
    curve for each stage from N_d = 1 to `nd_max` (lines), the measured bytes as markers (`measured` =
    {N_d: {stage: bytes}}), and a second panel with measured / formula - 1 (in %) at the measured N_d
    (stages side by side). Bytes shown in MB (`unit`), both axes logarithmic."""
    from matplotlib.ticker import FuncFormatter

    from par.memory import STAGE_NAMES, model_state_bytes
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


def bars_with_spread(samples: dict, ax=None, ylabel: str = "ms per step", xlabel: str = "", title: str = "",
                     unit: float = 1e-3, extra: dict | None = None, notes: dict | None = None):
    """One bar per name at the median of its samples (seconds), the whiskers spanning min to max.
    `extra` {name: (label, seconds)} stacks a hatched segment on a bar's median (a modelled cost that was not
    measured, labelled in the legend; too thin to see, it is written above the bar instead); `notes`
    {name: text} writes a line under a bar's name."""
    import statistics
    names = list(samples)
    ax = _ax(ax, (max(6, 1.2 * len(names) + 2), 3.4))
    med = [statistics.median(samples[n]) / unit for n in names]
    lo = [m - min(samples[n]) / unit for m, n in zip(med, names)]
    hi = [max(samples[n]) / unit - m for m, n in zip(med, names)]
    top = max(m + h for m, h in zip(med, hi)) * 1.3
    ax.bar(range(len(names)), med, 0.6, color="#4C72B0", label="measured (median)")
    ax.errorbar(range(len(names)), med, yerr=[lo, hi], fmt="none", ecolor="black", capsize=3, lw=1,
                label="min … max")
    for name, (label, seconds) in (extra or {}).items():
        i = names.index(name)
        ax.bar(i, seconds / unit, 0.6, bottom=med[i], color="white", edgecolor="#C44E52", hatch="///", label=label)
        if seconds / unit < 0.02 * top:
            ax.text(i, med[i] + hi[i] + 0.02 * top, f"+{seconds / unit:.3g}", ha="center", va="bottom", fontsize=7,
                    color="#C44E52")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([n + (f"\n{notes[n]}" if notes and n in notes else "") for n in names], fontsize=8)
    ax.set_ylabel(ylabel)
    if xlabel:
        ax.set_xlabel(xlabel)
    ax.set_ylim(0, top)
    ax.legend(fontsize=7, loc="upper left", ncol=3)
    if title:
        ax.set_title(title)
    return ax
