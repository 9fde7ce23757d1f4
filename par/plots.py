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
