"""Lecture 07, putting it together: the 3D row and the benchmark table (the launches `par.train.suite` makes), the
3D row's one-process reference in the notebook's kernel; its key numbers and targets (speed-ups within their
bounds, the planner's memory and step times against the measured ones); its figures (the process grid, the
benchmark table, the planner's predictions over the measurements)."""
from __future__ import annotations

from dataclasses import replace

import matplotlib.pyplot as plt

from par.course import plots
from par.course.batch import cost
from par.course.batch.launches import KernelWork, launch, sized
from par.memory.accounting import format_bytes
from par.model import preset as model_preset
from par.runtime.grid import layout_label
from par.site.numbers import at_most, Key, near
from par.train import suite
from par.train.config import model_config, parse

NOTEBOOK = "07_putting_it_together"
CELLS = ("3D", "benchmark table")
ROWS = ("single", "pipeline", "TP", "DDP", "ZeRO-1", "ZeRO-3", "ZeRO-3+offload", "bf16")


def bench_steps(steps: int) -> int:
    """Steps of each benchmark row: the first is a warm-up, the others are timed (4 or 5)."""
    return max(4, min(steps, 5))


def launches(W, backend, preset, steps):
    """The launches `par.train.suite.run_suite` makes, from its own functions (`plan_rows`, `launch_order`,
    `launch_args`): first the 3D row, then the others (bf16 only on GPUs; single's launch before and after)."""
    n_steps, gpus = bench_steps(steps), cost.on_gpus(backend, W)
    out = []
    for cell, names in (("3D", ["3D"]), ("benchmark table", [n for n in ROWS if n != "bf16" or gpus])):
        rows = suite.plan_rows(names, W, preset, 2, n_steps, W if gpus else cost.cores())
        for (n, _), group in suite.launch_order(rows):
            if gpus and n > W:     # a row needing more GPUs than the server has (the 3D row's 8) is skipped
                continue
            out.append(launch(NOTEBOOK, cell, n, suite.launch_args(rows, group), backend))
    return out


def kernel(W, backend, preset, steps):
    """The one-process reference of the 3D row, trained on the host on the row's own global batches (never
    shrunk: it must see what the row saw); skipped where the row does not run (it needs 8 GPUs)."""
    gpus = cost.on_gpus(backend, W)
    row = suite.plan_rows(["3D"], W, preset, 2, bench_steps(steps), W if gpus else cost.cores())["3D"]
    if "error" in row:
        return [KernelWork(notebook=NOTEBOOK, cell="3D reference", model=model_preset(preset), batch=0, tokens=0,
                           device="host", label=preset, skipped=row["error"])]
    tc = parse(row["config"], row["nproc"])
    work = sized(NOTEBOOK, "3D reference", model_config(tc), tc.train_batch_size, "host", shrink=False,
                 label=suite.model_label(row["config"]["model"]), optimizer=tc.optimizer, steps=tc.steps)
    if gpus and row["nproc"] > W:
        work = replace(work, skipped=f"the 3D row needs {row['nproc']} GPUs and this server has {W}: it does not "
                                     f"run, so there is nothing to compare with")
    return [work]


STEP_TIME_BAND = 0.25   # measured / predicted step time, every timed row (single too): the planner on this machine's
                        # measured GEMMs, launch, memory-bound and optimizer bytes/s and collectives (par.train.calibration)
MEMORY_BAND = 0.05      # |predicted - measured| / measured memory per rank

KEY_NUMBERS = [
    Key("3D layouts run (d, p, t)", "d · p · t = N", "layouts_3d_run"),
    Key("speed-up over one process", "benchmark table", "bench_speedup_over_single"),
    Key("speed-up / number of ranks, every timed fp32 row", "≤ 1", "bench_speedup_per_rank", target=at_most(1.0)),
    Key("pipeline speed-up / n·m/(m+p−1)", "≤ 1", "bench_pipeline_speedup_over_bound", target=at_most(1.0)),
    Key("bytes: counted vs formula (relative error)", "→ 0", "bench_bytes_rel_error"),
    Key("planner memory vs measured (relative error)", f"≤ {MEMORY_BAND}", "planner_memory_rel_error",
        target=at_most(MEMORY_BAND)),
    Key("planner step time, measured / predicted (on this machine's measured GEMMs, optimizer and collectives, "
        "their in-step share η fitted on single)", f"1 ± {STEP_TIME_BAND}", "planner_step_time_ratio",
        target=near(1.0, STEP_TIME_BAND)),
]


# ---------------------------------------------------------------- figures
def process_grid(dp: int, pp: int, tp: int, gpus_per_node: int = 8, ax=None, title: str = ""):
    """The 3D grid of `par.runtime.grid`: one column per pipeline stage, one row per data-parallel replica,
    tp boxes side by side in each cell (a dashed frame = one tp group); each box names its rank
    (t + tp·(d + dp·s)) and its tensor slot, and is coloured by node (ranks numbered node by node)."""
    from matplotlib.patches import Patch
    ax = plots.axis(ax, (max(5, 1.1 * pp * tp + 3), max(2.4, 0.9 * dp + 1.2)))
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
    whiskers from the slowest to the fastest step); the speed-up over `single` beside its bound
    (`par.train.suite.speedup_bound`); memory per rank (measured average and peak, the planner's prediction); bytes sent per
    rank and step (measured, predicted); the largest model that fits the per-device memory. Memory and
    bytes are on log axes (the rows span kB to GB). Rows with more ranks than cores say "not timed"."""
    import numpy as np
    rows = suite.measured(rows)
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
    steps = len(rows[timed[0]]["step_s"]) if timed else 0
    rate.set_xlabel("samples / s")
    rate.set_title(f"throughput\n(median of {steps} timed steps)", fontsize=9)
    rate.legend(**below)
    # speed-up over single, against the number of ranks
    sp = suite.speedups(rows)
    idx = [i for i, r in enumerate(rows) if r["name"] in sp]
    if idx:
        base = next(r for r in rows if r["name"] == "single")["median_step_s"]
        s_med = np.array([sp[rows[i]["name"]]["speedup"] for i in idx])
        s_lo = np.array([base / max(rows[i]["step_s"]) if rows[i]["name"] != "single" else 1.0 for i in idx])
        s_hi = np.array([base / min(rows[i]["step_s"]) if rows[i]["name"] != "single" else 1.0 for i in idx])
        speed.barh(y[idx], s_med, 0.6, color="#55A868", label="measured (median step)")
        speed.errorbar(s_med, y[idx], xerr=[np.clip(s_med - s_lo, 0, None), np.clip(s_hi - s_med, 0, None)],
                       fmt="none", ecolor="black", capsize=3, label="slowest … fastest step")
        for k, i in enumerate(idx):
            speed.vlines(sp[rows[i]["name"]]["bound"], i - 0.38, i + 0.38, colors="#C44E52", lw=2.5,
                         label="bound: n ranks, a pipeline n·m/(m+p−1)" if k == 0 else None)
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
    rows = suite.measured(rows)
    ax = plots.axis(ax, (7, 0.9 + 0.38 * len(rows)))
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


PARTS = (("compute", "compute", "#BBBBBB"), ("bubble", "bubble", "#E5C494"), ("tp", "tp all-reduces", "#DD8452"),
         ("pp", "pp sends", "#937860"), ("dp", "dp / ZeRO collectives", "#8172B2"),
         ("buffers", "gradient / gathered buffers", "#DA8BC3"), ("optimizer", "optimizer step", "#55A868"),
         ("offload", "offload copies", "#64B5CD"), ("straggle", "ranks arriving apart", "#C44E52"))


def step_time_predictions(times: dict, ax=None, band: float = STEP_TIME_BAND):
    """The planner's step time beside the measured one for every timed row (`par.train.suite.predicted_step_times`:
    {row: {predicted_s, measured_s, measured_wall_s, ratio, parts}}): per row the measured median step on the
    load-proof clock (blue, `par.clock`; the wall clock's a black tick on it) above the
    prediction, stacked by its parts (compute, bubble, tp, pp, dp, buffers, optimizer, offload, straggle),
    measured / predicted written beside them, green inside 1 ± `band`, red outside, grey for single (it fits the
    run's η). The prediction is on this machine's measured GEMMs, launch, bandwidths and collectives
    (`par.train.calibration`), each row on those measured just before it, at the run's in-step efficiency η."""
    import numpy as np
    names = list(times)
    ax = plots.axis(ax, (8, 1.2 + 0.55 * len(names)))
    y = np.arange(len(names))
    ax.barh(y - 0.2, [times[n]["measured_s"] for n in names], 0.38, color="#4C72B0",
            label="measured (median step, load-proof clock)")
    walls = [times[n].get("measured_wall_s", times[n]["measured_s"]) for n in names]
    ax.plot(walls, y - 0.2, "|", color="black", markersize=11, markeredgewidth=2, label="measured, wall clock")
    left = np.zeros(len(names))
    for key, label, colour in PARTS:
        vals = np.array([times[n].get("parts", {}).get(key, 0.0) for n in names])
        if vals.any():
            ax.barh(y + 0.2, vals, 0.38, left=left, color=colour, label=f"predicted: {label}")
            left += vals
    right = max(max(t["measured_s"], t["predicted_s"], t.get("measured_wall_s", 0.0)) for t in times.values())
    for i, n in enumerate(names):
        ratio = times[n]["ratio"]
        if times[n].get("calibrates"):
            ax.text(right * 1.03, i, f"×{ratio:.2f} fits η", va="center", fontsize=9, color="#666666")
            continue
        ax.text(right * 1.03, i, f"×{ratio:.2f}", va="center", fontsize=9,
                color="#2E7D32" if abs(ratio - 1) <= band else "#C62828")
    ax.set_xlim(0, right * 1.2)
    ax.set_yticks(list(y))
    ax.set_yticklabels(names, fontsize=8)
    ax.set_ylim(len(names) - 0.5, -0.5)
    ax.set_xlabel("seconds per step (upper bar measured on the load-proof clock, tick: wall clock; lower bar "
                  "predicted)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    eta = next(iter(times.values())).get("efficiency", 1.0)
    ax.set_title(f"step time, measured / predicted (target 1 ± {band}): the planner on this machine's measured\n"
                 f"GEMMs, launch, bandwidths and collectives (each row's, just before it), at η = {eta:.2f} of "
                 f"them (fitted on single)", fontsize=9)
    return ax
