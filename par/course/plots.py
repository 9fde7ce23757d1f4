"""Figures the lectures draw from measured data: timelines, predicted-vs-measured bars, curves.

Every function takes plain data (lists, dicts) and an optional matplotlib
axis, and returns the axis, so notebooks can put figures side by side.
"""
from __future__ import annotations

import re

import matplotlib.pyplot as plt

COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868", "comm": "#8172B2", "idle": "#DDDDDD"}
# one shade per model chunk of an interleaved schedule (chunk 0 first): forwards blue, backwards orange
CHUNK_COLORS = {"F": ("#4C72B0", "#8CB4E6", "#1D3A6B", "#5FA0C8"), "B": ("#DD8452", "#F4BE8E", "#9A4A16", "#E8A33D")}
_PIPELINE_ACTION = re.compile(r"^([FB])(\d+)(?:@(\d+))?$")
NAMES = {"F": "forward", "B": "backward", "W": "other work", "comm": "communication"}


def _ax(ax, figsize=(8, 3)):
    return ax if ax is not None else plt.subplots(figsize=figsize)[1]


def color_for(name: str, lane: str) -> str:
    """Forward blue, backward orange (a shade per chunk: 'F3@1' is chunk 1), communication purple,
    anything else green."""
    if lane != "compute":
        return COLORS["comm"]
    action = _PIPELINE_ACTION.match(name)
    if action:
        kind, _, chunk = action.groups()
        shades = CHUNK_COLORS[kind]
        return shades[int(chunk or 0) % len(shades)]
    return COLORS.get(name[:1], COLORS["W"])


def _legend_label(name: str, lane: str, chunked: bool) -> str:
    if lane != "compute":
        return NAMES["comm"]
    action = _PIPELINE_ACTION.match(name)
    if action:
        kind, _, chunk = action.groups()
        return f"{NAMES[kind]}, chunk {chunk or 0}" if chunked else NAMES[kind]
    return NAMES.get(name[:1], NAMES["W"]) if name[:1] in ("F", "B") else NAMES["W"]


def bar_labels(name: str) -> list[str]:
    """The labels to try in a bar, longest first: 'F12@1' -> ['F12@1', 'F12', '12']; 'all-gather 3' ->
    ['all-gather 3', 'all-gather']."""
    action = _PIPELINE_ACTION.match(name)
    if action:
        kind, mb, chunk = action.groups()
        return [name, f"{kind}{mb}", mb] if chunk else [name, mb]
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
    ax = _ax(ax, (10, 0.9 + 0.42 * len(rows)))
    index = {r: i for i, r in enumerate(rows)}
    scale, shown_unit = _time_scale(spans, unit)
    t0 = min((s["start"] for s in spans), default=0.0)
    t_end = max((s["end"] for s in spans), default=1.0)
    chunked = any((m := _PIPELINE_ACTION.match(s["name"])) and m.group(3) for s in spans)
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
    e.g. `par.memory.accounting.zero_table(...)`; the total is written on top of each bar."""
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


def process_grid(dp: int, pp: int, tp: int, gpus_per_node: int = 8, ax=None, title: str = ""):
    """The 3D grid of `par.runtime.grid`: one column per pipeline stage, one row per data-parallel replica,
    tp boxes side by side in each cell (a dashed frame = one tp group); each box names its rank
    (t + tp·(d + dp·s)) and its tensor slot, and is coloured by node (ranks numbered node by node)."""
    from matplotlib.patches import Patch
    from par.runtime.grid import layout_label
    ax = _ax(ax, (max(5, 1.1 * pp * tp + 3), max(2.4, 0.9 * dp + 1.2)))
    cmap = plt.get_cmap("tab20")
    colour = lambda node: cmap((2 * node) % 20 if node < 10 else (2 * node + 1) % 20)
    for s in range(pp):
        for d in range(dp):
            for t in range(tp):
                r = t + tp * (d + dp * s)
                x, y = s * (tp + 0.6) + t, (dp - 1 - d) * 1.2
                ax.add_patch(plt.Rectangle((x, y), 0.9, 0.9, color=colour(r // gpus_per_node), alpha=0.85))
                ax.text(x + 0.45, y + 0.55, str(r), ha="center", va="center", fontsize=10, weight="bold")
                ax.text(x + 0.45, y + 0.2, f"t{t}", ha="center", va="center", fontsize=7)
            ax.add_patch(plt.Rectangle((s * (tp + 0.6) - 0.08, (dp - 1 - d) * 1.2 - 0.08), tp - 0.1 + 0.16,
                                       1.06, fill=False, lw=1.2, ls="--", ec="black"))
    ax.set_xlim(-0.4, pp * (tp + 0.6) - 0.3)
    ax.set_ylim(-0.4, dp * 1.2 + 0.1)
    ax.set_xticks([s * (tp + 0.6) + tp / 2 - 0.05 for s in range(pp)])
    ax.set_xticklabels([f"stage {s}" for s in range(pp)])
    ax.set_yticks([(dp - 1 - d) * 1.2 + 0.45 for d in range(dp)])
    ax.set_yticklabels([f"replica {d}" for d in range(dp)])
    nodes = range((dp * pp * tp - 1) // gpus_per_node + 1)
    handles = [Patch(color=colour(n), alpha=0.85,
                     label=f"node {n}: ranks {n * gpus_per_node}-{min(dp * pp * tp, (n + 1) * gpus_per_node) - 1}")
               for n in nodes]
    handles.append(Patch(fill=False, ls="--", ec="black", label="one tp group"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.set_title(title or f"{layout_label(dp, pp, tp)}: rank = t + {tp}·(d + {dp}·s), {gpus_per_node} GPUs per node",
                 fontsize=9)
    ax.set_aspect("equal")
    return ax


def _bench_label(r: dict) -> str:
    return f"{r['strategy']}  [{r['nproc']} rank{'s' if r['nproc'] > 1 else ''}{'' if r['timed'] else ', not timed'}]"


def benchmark_table(rows: list[dict], axes=None):
    """The lecture-07 benchmark (`par.train.suite` rows that ran) as five panels side by side, one bar per
    configuration (named once, on the left): samples/s of the timed rows (median of the timed steps,
    whiskers from the slowest to the fastest step); the speed-up over `single` beside its bound, the
    number of ranks; memory per rank (measured average and peak, the planner's prediction); bytes sent per
    rank and step (measured, predicted); the largest model that fits the per-device memory. Memory and
    bytes are on log axes (the rows span kB to GB). Rows with more ranks than cores say "not timed"."""
    import numpy as np
    from par.train.suite import measured, single_seconds, speedups
    from par.memory.accounting import format_bytes
    rows = measured(rows)
    n = len(rows)
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    height = 1.9 + 0.42 * n
    if axes is None:
        fig, axes = plt.subplots(1, 5, figsize=(17, height), sharey=True,
                                 gridspec_kw={"width_ratios": [1.1, 1.1, 1.3, 1.1, 0.9], "wspace": 0.22})
    rate, speed, mem, sent, fits = axes
    y = np.arange(n)
    below = dict(loc="upper center", bbox_to_anchor=(0.5, -0.5 / (0.75 * height)), fontsize=7, ncol=1,
                 frameon=False)
    by_bytes = FuncFormatter(lambda v, _: format_bytes(v).replace(".00 ", " "))

    def log_axis(ax, values):
        positive = [v for v in values if v > 0]
        ax.set_xscale("log")
        if positive:
            ax.set_xlim(min(positive) / 4, max(positive) * 2)
        ax.xaxis.set_major_locator(LogLocator(base=10, numticks=6))
        ax.xaxis.set_major_formatter(by_bytes)
        ax.xaxis.set_minor_formatter(NullFormatter())
    # samples/s
    timed = [i for i, r in enumerate(rows) if r["timed"]]
    med = np.array([rows[i]["samples_per_s"] for i in timed])
    lo = np.array([rows[i]["samples_per_s_range"][0] for i in timed])
    hi = np.array([rows[i]["samples_per_s_range"][1] for i in timed])
    rate.barh(y[timed], med, 0.6, color="#4C72B0", label="median step")
    rate.errorbar(med, y[timed], xerr=[med - lo, hi - med], fmt="none", ecolor="black", capsize=3,
                  label="slowest … fastest step")
    for i, r in enumerate(rows):
        if not r["timed"]:
            rate.text(0.02, i, "not timed: more ranks than cores", transform=rate.get_yaxis_transform(),
                      va="center", fontsize=7, color="#666666")
        elif r["name"] == "single" and r.get("backend") == "gloo":
            rate.plot([r["train_batch_size"] / single_seconds(r)], [i], "D", mfc="white", mec="black", ms=6,
                      label="single at its CPU time (the speed-ups' reference)")
    steps = len(rows[timed[0]]["step_s"]) if timed else 0
    rate.set_xlabel("samples / s")
    rate.set_title(f"throughput\n(median of {steps} timed steps)", fontsize=9)
    rate.legend(**below)
    # speed-up over single, against the number of ranks
    sp = speedups(rows)
    idx = [i for i, r in enumerate(rows) if r["name"] in sp]
    if idx:
        base = single_seconds(next(r for r in rows if r["name"] == "single"))
        s_med = np.array([sp[rows[i]["name"]]["speedup"] for i in idx])
        s_lo = np.array([base / max(rows[i]["step_s"]) if rows[i]["name"] != "single" else 1.0 for i in idx])
        s_hi = np.array([base / min(rows[i]["step_s"]) if rows[i]["name"] != "single" else 1.0 for i in idx])
        speed.barh(y[idx], s_med, 0.6, color="#55A868", label="measured (median step)")
        speed.errorbar(s_med, y[idx], xerr=[np.clip(s_med - s_lo, 0, None), np.clip(s_hi - s_med, 0, None)],
                       fmt="none", ecolor="black", capsize=3, label="slowest … fastest step")
        for k, i in enumerate(idx):
            speed.vlines(sp[rows[i]["name"]]["ranks"], i - 0.38, i + 0.38, colors="#C44E52", lw=2.5,
                         label="bound: number of ranks" if k == 0 else None)
        speed.set_xlim(0, 1.1 * max(max(v["ranks"] for v in sp.values()), float(s_hi.max())))
    for i, r in enumerate(rows):
        if r["name"] not in sp:
            why = "not timed" if not r["timed"] else f"{r['precision']}: other arithmetic"
            speed.text(0.02, i, why, transform=speed.get_yaxis_transform(), va="center", fontsize=7, color="#666666")
    speed.set_xlabel("speed-up over single (×)")
    speed.set_title("speed-up over single\n(n ranks: at most n×)", fontsize=9)
    speed.legend(**below)
    # memory, bytes, largest model
    h = 0.27
    for k, (key, lab, c) in enumerate((("mem_avg", "measured average", "#4C72B0"),
                                       ("mem_peak", "measured peak", "#DD8452"),
                                       ("pred_mem", "predicted peak (planner)", "#BBBBBB"))):
        mem.barh(y + (k - 1) * h, [r[key] for r in rows], h, label=lab, color=c)
    log_axis(mem, [r[k] for r in rows for k in ("mem_avg", "mem_peak", "pred_mem")])
    mem.set_xlabel("bytes per rank")
    mem.set_title(f"memory per rank\n({rows[0]['mem_source'] if rows else ''})", fontsize=9)
    mem.legend(**below)
    for k, (key, lab, c) in enumerate((("bytes_per_step", "measured (par.comm.commlog)", "#8172B2"),
                                       ("pred_bytes_per_step", "predicted (planner)", "#BBBBBB"))):
        vals = [r[key] for r in rows]
        sent.barh(y + (k - 0.5) * 0.4, [v if v > 0 else np.nan for v in vals], 0.4, label=lab, color=c)
    for i, r in enumerate(rows):
        if r["bytes_per_step"] == 0 and r["pred_bytes_per_step"] == 0:
            sent.text(0.02, i, "sends nothing", transform=sent.get_yaxis_transform(), va="center", fontsize=7,
                      color="#666666")
    log_axis(sent, [r[k] for r in rows for k in ("bytes_per_step", "pred_bytes_per_step")])
    sent.set_xlabel("bytes sent per rank and step")
    sent.set_title("communication\n(bytes per rank and step)", fontsize=9)
    sent.legend(**below)
    fits.barh(y, [r["largest_params"] / 1e9 for r in rows], 0.6, color="#55A868",
              label="80 GB per device, the row's layout")
    fits.set_xlabel("billion parameters")
    fits.set_title("largest model that fits\n(planner, same depth, wider)", fontsize=9)
    fits.legend(**below)
    rate.set_yticks(list(y))
    rate.set_yticklabels([_bench_label(r) for r in rows], fontsize=8)
    rate.set_ylim(n - 0.5, -0.5)
    for ax in axes:
        ax.grid(axis="x", alpha=0.3)
    return axes


def prediction_ratios(rows: list[dict], ax=None, band: float = 0.05):
    """Measured / predicted for every benchmark row (`par.train.suite`): memory per rank (model states +
    activations, busiest rank) and bytes sent per rank and step; 1 is a perfect prediction, the grey band
    ±`band`. Rows that send nothing have no bytes marker."""
    from par.train.suite import measured
    rows = measured(rows)
    ax = _ax(ax, (7, 0.9 + 0.38 * len(rows)))
    for i, r in enumerate(rows):
        mem = (r["model_states_max"] + r["activations_peak_max"]) / (r["pred_model_states"] + r["pred_activations"])
        ax.plot(mem, i, "o", color="#DD8452", label="memory per rank" if i == 0 else None)
        if r["pred_bytes_per_step"] > 0:
            ax.plot(r["bytes_per_step"] / r["pred_bytes_per_step"], i, "s", mfc="none", mec="#8172B2", ms=8,
                    label="bytes per rank and step" if "bytes" not in str(ax.get_legend_handles_labels()[1]) else None)
    ax.axvspan(1 - band, 1 + band, color="#EEEEEE", zorder=0, label=f"±{band:.0%}")
    ax.axvline(1.0, color="grey", lw=0.8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{r['strategy']} [{r['nproc']}]" for r in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    lo = min([0.9] + [l.get_xdata()[0] for l in ax.lines if len(l.get_xdata()) == 1])
    hi = max([1.1] + [l.get_xdata()[0] for l in ax.lines if len(l.get_xdata()) == 1])
    ax.set_xlim(lo - 0.02, hi + 0.02)
    ax.set_xlabel("measured / predicted")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.set_title("the planner against the measurements", fontsize=10)
    return ax


def median_with_spread(ax, x, quartiles, fmt="o", scale=1.0, **kw):
    """Points at the medians with error bars from q1 to q3 (`quartiles`: one [q1, median, q3] per x)."""
    mid = [q[1] * scale for q in quartiles]
    spread = [[(q[1] - q[0]) * scale for q in quartiles], [(q[2] - q[1]) * scale for q in quartiles]]
    return ax.errorbar(x, mid, yerr=spread, fmt=fmt, capsize=3, **kw)


def alpha_beta_fit(timing: dict, alpha: float, beta: float, cores: int, small: int | None = None, axes=None,
                   simulated: dict | None = None):
    """The ring all-reduce's time against T = 2(N-1)·alpha + 2(N-1)/N·S·beta, fitted on the N <= cores runs
    (and the `simulated` ones).

    `timing`: {N: rows of `par.comm.job` timing part} (each row: numel, ring_q = [q1, median,
    q3] seconds). Left: time vs message size S for every N with a core per rank, the median
    with its q1-q3 spread, and the model's curve. Right: the smallest message's time vs N, which is
    all latency: 2(N-1) steps of alpha. N > cores are drawn hollow, marked oversubscribed, and are
    not in the fit. `simulated`: {N: rows of numel, ring_s} from `ring_time_from_steps`, drawn as
    diamonds and labelled simulated. Returns the two axes.
    """
    from par.comm.collectives import ring_all_reduce_time
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
    simulated = simulated or {}
    for i, (n, rows) in enumerate(sorted(simulated.items()), start=len(fitted)):
        rows = sorted(rows, key=lambda t: t["numel"])
        x = [4 * t["numel"] for t in rows]
        left.plot(x, [t["ring_s"] * 1e3 for t in rows], "D", color=f"C{i}", mfc="white",
                  label=f"simulated from measured steps, N = {n}")
        grid = [x[0] * (x[-1] / x[0]) ** (k / 60) for k in range(61)]
        left.plot(grid, [ring_all_reduce_time(s, n, alpha, beta) * 1e3 for s in grid], "--", color=f"C{i}",
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
    for n, rows in simulated.items():
        t = next((t for t in rows if t["numel"] == small), None)
        if t is not None:
            right.plot([n], [t["ring_s"] * 1e3], "D", color="C2", mfc="white",
                       label="simulated from steps measured with a core per rank")
    handles, labels = right.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    right.legend(unique.values(), unique.keys(), fontsize=7, loc="upper left")
    right.set_xticks(grid_n)
    right.set_xlabel("ranks N")
    right.set_ylabel("ms")
    right.set_title(f"all-reduce of {small} floats ({4 * small} B): latency steps, {cores} cores", fontsize=9)
    right.set_ylim(bottom=0)
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
    """Per-rank model-state bytes against the data-parallel degree N_d: `par.memory.accounting.model_state_bytes`'
    curve for each stage from N_d = 1 to `nd_max` (lines), the measured bytes as markers (`measured` =
    {N_d: {stage: bytes}}), and a second panel with measured / formula - 1 (in %) at the measured N_d
    (stages side by side). Bytes shown in MB (`unit`), both axes logarithmic."""
    from matplotlib.ticker import FuncFormatter

    from par.memory.accounting import STAGE_NAMES, model_state_bytes
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
