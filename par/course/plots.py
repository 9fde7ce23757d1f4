"""Figures several lectures draw from measured data: timelines, predicted-vs-measured bars, curves. A figure only
one lecture draws is in that lecture's module (`par/course/lectures/`).

Every function takes plain data (lists, dicts) and an optional matplotlib
axis, and returns the axis, so notebooks can put figures side by side.
"""
from __future__ import annotations

import matplotlib.pyplot as plt

from par.pp.schedules import Action, parse_action

COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868", "comm": "#8172B2", "idle": "#DDDDDD"}
# one shade per model chunk of an interleaved schedule (chunk 0 first): forwards blue, backwards orange
CHUNK_COLORS = {"F": ("#4C72B0", "#8CB4E6", "#1D3A6B", "#5FA0C8"), "B": ("#DD8452", "#F4BE8E", "#9A4A16", "#E8A33D")}
NAMES = {"F": "forward", "B": "backward", "W": "other work", "comm": "communication"}


def axis(ax, figsize=(8, 3)):
    """`ax`, or a new figure's axis of `figsize`."""
    return ax if ax is not None else plt.subplots(figsize=figsize)[1]


def pipeline_action(name: str) -> Action | None:
    """The schedule action a span is named after ('F3', 'B2@1', 'I0', 'W3@1': `par.pp.schedules`' grammar), or
    None for any other span."""
    try:
        return parse_action(name)
    except ValueError:
        return None


def color_for(name: str, lane: str) -> str:
    """Forward blue, backward orange (a shade per chunk: 'F3@1' is chunk 1), communication purple,
    anything else green."""
    if lane != "compute":
        return COLORS["comm"]
    action = pipeline_action(name)
    if action and action.kind in CHUNK_COLORS:
        shades = CHUNK_COLORS[action.kind]
        return shades[action.chunk % len(shades)]
    return COLORS.get(name[:1], COLORS["W"])


def _legend_label(name: str, lane: str, chunked: bool) -> str:
    if lane != "compute":
        return NAMES["comm"]
    action = pipeline_action(name)
    if action and action.kind in ("F", "B"):
        return f"{NAMES[action.kind]}, chunk {action.chunk}" if chunked else NAMES[action.kind]
    return NAMES.get(name[:1], NAMES["W"]) if name[:1] in ("F", "B") else NAMES["W"]


def bar_labels(name: str) -> list[str]:
    """The labels to try in a bar, longest first: 'F12@1' -> ['F12@1', 'F12', '12']; 'all-gather 3' ->
    ['all-gather 3', 'all-gather']."""
    action = pipeline_action(name)
    if action:
        mb = str(action.microbatch)
        return [name, f"{action.kind}{mb}", mb] if "@" in name else [name, mb]
    words = name.split()
    return [name] + ([words[0]] if len(words) > 1 else [])


def _text_color(hex_color: str) -> str:
    r, g, b = (int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5))
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.6 else "white"


def _time_scale(spans, unit: str) -> tuple[float, str]:
    """Spans in seconds: unit "s" draws them in ms when the chart is shorter than 2 s, "ms" always in ms
    (give charts that share an axis the same unit); any other unit names the simulation's cost unit."""
    if unit == "ms" or (unit == "s" and max((s["end"] for s in spans), default=0.0) < 2.0):
        return 1e3, "ms"
    return 1.0, unit


def gantt(spans: list[dict], ax=None, title: str = "", label: bool = True, unit: str = "s",
          legend: bool = True, fontsize: float = 7):
    """One row per (rank, lane); each span a bar from start to end, named inside when the name fits.

    `spans` are dicts with rank, lane, name, start, end (what `Recorder.gather()` returns, or a
    simulated schedule). A name too long for its bar is shortened ('F12@1' -> 'F12' -> '12'; the
    chunk is in the colour) or left out, so labels never overlap. `unit` names the time axis:
    "s" for recorded spans (drawn in ms when the chart is short), or e.g. "forward = 1" for a
    simulation in cost units; "ms" draws seconds in ms whatever the length (charts sharing an axis
    must share the unit). The legend names every colour drawn, outside the bars.
    """
    rows = sorted({(s["rank"], s["lane"]) for s in spans}, key=lambda r: (r[0], r[1] != "compute", r[1]))
    ax = axis(ax, (10, 0.9 + 0.42 * len(rows)))
    index = {r: i for i, r in enumerate(rows)}
    scale, shown_unit = _time_scale(spans, unit)
    t0 = min((s["start"] for s in spans), default=0.0)
    t_end = max((s["end"] for s in spans), default=1.0)
    chunked = any((a := pipeline_action(s["name"])) and a.chunk for s in spans)
    seen = {}
    for s in spans:
        y = index[(s["rank"], s["lane"])]
        color = color_for(s["name"], s["lane"])
        ax.barh(y, (s["end"] - s["start"]) * scale, left=s["start"] * scale, height=0.8,
                color=color, edgecolor="white", linewidth=0.5)
        seen.setdefault(_legend_label(s["name"], s["lane"], chunked), color)
    shared = [a for a in ax.get_shared_x_axes().get_siblings(ax) if a is not ax and a.has_data()]
    right = max([t_end * scale * 1.005] + [a.get_xlim()[1] for a in shared])   # sharex: fit every chart
    ax.set_xlim(min(0.0, t0 * scale), right)
    ax.set_ylim(max(len(rows), 1) - 0.5, -0.5)
    if label:
        _label_bars(ax, spans, index, scale, fontsize)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {r}" if lane == "compute" else f"rank {r} {lane}" for r, lane in rows])
    ax.set_xlabel(f"time ({shown_unit})")
    if title:
        ax.set_title(title, fontsize=10)
    if legend and seen:
        order = sorted(seen, key=lambda k: (list(NAMES.values()).index(k.split(",")[0]) if k.split(",")[0] in
                                            NAMES.values() else 9, k))
        handles = [plt.Rectangle((0, 0), 1, 1, color=seen[k]) for k in order]
        ax.legend(handles, order, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False,
                  borderaxespad=0.0)
    return ax


def _label_bars(ax, spans, index, scale, fontsize) -> None:
    """Write each bar's name, shortened or dropped where it would not fit inside the bar."""
    fig = ax.figure
    fig.canvas.draw_idle()
    width_px = 0.85 * (ax.get_window_extent().width or fig.get_figwidth() * fig.dpi * 0.75)  # room for a later tight_layout
    x0, x1 = ax.get_xlim()
    px_per_unit = width_px / (x1 - x0)
    char_px = 0.62 * fontsize * fig.dpi / 72          # a digit or capital letter at this font size
    for s in spans:
        room = (s["end"] - s["start"]) * scale * px_per_unit - 3
        text = next((t for t in bar_labels(s["name"]) if len(t) * char_px <= room), None)
        if text:
            ax.text((s["start"] + s["end"]) / 2 * scale, index[(s["rank"], s["lane"])], text, ha="center",
                    va="center", fontsize=fontsize, color=_text_color(color_for(s["name"], s["lane"])), clip_on=True)


def compare_bars(labels, predicted, measured, ax=None, ylabel: str = "bytes", title: str = ""):
    """Predicted and measured values side by side for each label."""
    ax = axis(ax, (max(5, 0.9 * len(labels) + 2), 3.2))
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
    ax = axis(ax, (6, 3.2))
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
    e.g. `par.memory.accounting.zero_table(...)`; the total is written on top of each bar."""
    ax = axis(ax, (max(5, 1.3 * len(rows) + 2), 3.4))
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


def median_with_spread(ax, x, quartiles, fmt="o", scale=1.0, **kw):
    """Points at the medians with error bars from q1 to q3 (`quartiles`: one [q1, median, q3] per x)."""
    mid = [q[1] * scale for q in quartiles]
    spread = [[(q[1] - q[0]) * scale for q in quartiles], [(q[2] - q[1]) * scale for q in quartiles]]
    return ax.errorbar(x, mid, yerr=spread, fmt=fmt, capsize=3, **kw)


# ---------------------------------------------------------------- ZeRO (lecture 06)


def bars_with_spread(samples: dict, ax=None, ylabel: str = "ms per step", xlabel: str = "", title: str = "",
                     unit: float = 1e-3, extra: dict | None = None, notes: dict | None = None):
    """One bar per name at the median of its samples (seconds), the whiskers spanning min to max.
    `extra` {name: (label, seconds)} stacks a hatched segment on a bar's median (a modelled cost that was not
    measured, labelled in the legend; too thin to see, it is written above the bar instead); `notes`
    {name: text} writes a line under a bar's name."""
    import statistics
    names = list(samples)
    ax = axis(ax, (max(6, 1.2 * len(names) + 2), 3.4))
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
