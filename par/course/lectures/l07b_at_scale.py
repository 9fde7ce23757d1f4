"""Lecture 07b, at scale: the planner for models no course server holds, held to published runs, and TP inside a
node or across nodes.

It launches nothing through the batch: its planner cells are pure, and its measurement across nodes
(`par.train.placement.measure`) starts its own 2 hosts x 2 gloo ranks in network namespaces (root only, on the
CPU), which no GPU server's dry run has to check."""
from __future__ import annotations

import matplotlib.pyplot as plt

from par.course import plots
from par.site.numbers import Key, at_least, equal, near

NOTEBOOK = "07b_at_scale"
CELLS = ()

THROUGHPUT_BAND = 0.15     # predicted / published TFLOP/s per GPU − 1, Megatron-LM SC21 Table 1 (issue 50's target)


def launches(W, backend, preset, steps):
    return []


KEY_NUMBERS = [
    Key("best layout for 180B", "planner", "plan_180b_best"),
    Key("Megatron-LM SC21 Table 1, TFLOP/s per GPU, predicted / published − 1 (A100 calibrated on row 1 only)",
        f"0 ± {THROUGHPUT_BAND}", "published_table1_error", target=near(0.0, THROUGHPUT_BAND)),
    Key("published layouts held to their memory: the planner's fit ≠ the source's (ran or did not)", "= 0",
        "published_memory_mismatches", target=equal(0)),
    Key("step time vs planner, TP inside / across nodes (rel. error)", "→ 0", "across_nodes_step_rel_error"),
    Key("measured step, TP across nodes / TP inside", "the link is the step: ≫ 1", "across_nodes_tp_across_over_in_node",
        target=at_least(2)),
]


def short(run_id: str) -> str:
    """A published run's id in a few characters: 'megatron-sc21-table2-ZeRO-3-174.6B-384' -> 'SC21 T2 ZeRO-3 174.6B 384'."""
    words = (run_id.replace("megatron-sc21-table", "SC21 T").replace("llama3-405b-table4-row", "Llama 3 T4 row ")
             .replace("opt-175b", "OPT-175B").replace("ZeRO-3", "ZeRO3").replace("PTD-P", "PTDP").replace("-", " "))
    return words.replace("ZeRO3", "ZeRO-3").replace("PTDP", "PTD-P")


GROUPS = (("SC21 T1", "Megatron-LM SC21 Table 1 (PTD-P)", "o", "#4C72B0"),
          ("SC21 T2 PTD", "Megatron-LM SC21 Table 2, PTD-P", "s", "#55A868"),
          ("SC21 T2 ZeRO", "Megatron-LM SC21 Table 2, ZeRO-3", "^", "#C44E52"),
          ("Llama 3", "Llama 3 405B Table 4 (H100)", "D", "#8172B2"),
          ("OPT", "OPT-175B (FSDP + TP8)", "P", "#937860"))


def group_of(run_id: str) -> tuple:
    name = short(run_id)
    return next(g for g in GROUPS if name.startswith(g[0]) or (g[0] == "OPT" and "OPT" in name))


def published_runs_figure(throughput: list[dict], memory: list[dict], axes=None, band: float = THROUGHPUT_BAND):
    """The planner held to published runs (`par.train.planner.published_error()` and `published_memory()`), three
    panels: predicted against published TFLOP/s per GPU (the diagonal is a perfect prediction, the band
    ±`band`; a star: the run that calibrates its GPU's η); the error of each run (predicted / published − 1,
    green inside the band, red outside, calibrating runs grey); and each published layout's predicted memory per
    GPU against its capacity (filled: the source ran it, hollow: the source says it did not fit; red where the
    planner's verdict differs from the source's)."""
    import numpy as np
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    if axes is None:
        fig, axes = plt.subplots(1, 3, figsize=(17, 8.5), gridspec_kw={"width_ratios": [1.1, 1.0, 1.1], "wspace": 0.55})
    fit_ax, err_ax, mem_ax = axes
    handles, seen = [], set()
    for r in throughput:
        key, label, marker, colour = group_of(r["run"])
        star = bool(r["calibrates"])
        fit_ax.scatter(r["published"], r["predicted"], marker="*" if star else marker, s=160 if star else 45,
                       color=colour, edgecolor="black" if star else "none", zorder=3)
        if key not in seen:
            handles.append(Line2D([], [], ls="", marker=marker, color=colour, label=label))
            seen.add(key)
    top = 1.1 * max(max(r["published"], r["predicted"]) for r in throughput)
    line = np.array([0.0, top])
    fit_ax.plot(line, line, color="grey", lw=0.8)
    fit_ax.fill_between(line, line * (1 - band), line * (1 + band), color="#EEEEEE", zorder=0)
    handles += [Patch(color="#EEEEEE", label=f"±{band:.0%} of published"),
                Line2D([], [], ls="", marker="*", ms=12, color="white", mec="black", label="calibrates its GPU's η")]
    fit_ax.set_xlim(0, top)
    fit_ax.set_ylim(0, top)
    fit_ax.set_xlabel("published TFLOP/s per GPU")
    fit_ax.set_ylabel("predicted TFLOP/s per GPU (planner)")
    fit_ax.set_title("throughput: predicted against published", fontsize=10)
    fit_ax.legend(handles=handles, fontsize=7, loc="upper left", frameon=False)
    fit_ax.grid(alpha=0.3)
    # the error of each run
    y = np.arange(len(throughput))
    errors = [100 * r["error"] for r in throughput]
    colours = ["#AAAAAA" if r["calibrates"] else ("#2E7D32" if abs(r["error"]) <= band else "#C62828")
               for r in throughput]
    err_ax.barh(y, errors, 0.7, color=colours)
    err_ax.axvspan(-100 * band, 100 * band, color="#EEEEEE", zorder=0)
    err_ax.axvline(0, color="grey", lw=0.8)
    for i, (e, r) in enumerate(zip(errors, throughput)):
        err_ax.text(e + (1 if e >= 0 else -1), i, f"{e:+.1f}%" + (" (calibrates)" if r["calibrates"] else ""),
                    va="center", ha="left" if e >= 0 else "right", fontsize=6.5)
    err_ax.set_yticks(list(y))
    err_ax.set_yticklabels([short(r["run"]) for r in throughput], fontsize=7)
    err_ax.set_ylim(len(y) - 0.5, -0.5)
    lo, hi = min(errors + [-100 * band]), max(errors + [100 * band])
    err_ax.set_xlim(lo - 12, hi + 22)
    err_ax.set_xlabel("predicted / published − 1 (%)")
    err_ax.set_title(f"throughput error per run (band ±{band:.0%})", fontsize=10)
    err_ax.grid(axis="x", alpha=0.3)
    # memory
    y = np.arange(len(memory))
    for i, r in enumerate(memory):
        gb, cap = r["predicted"] / 1e9, r["capacity"] / 1e9
        wrong = r["fits"] != r["ran"]
        colour = "#C62828" if wrong else "#4C72B0"
        mem_ax.barh(i, gb, 0.7, color=colour if r["ran"] else "white", edgecolor=colour, hatch=None if r["ran"] else "//")
        mem_ax.plot([cap, cap], [i - 0.4, i + 0.4], color="black", lw=1.5)
    legend = [Patch(color="#4C72B0", label="ran (source), fits (planner)"),
              Patch(facecolor="white", edgecolor="#4C72B0", hatch="//", label="did not fit (source), nor (planner)"),
              Patch(color="#C62828", label="ran (source), does not fit (planner)"),
              Patch(facecolor="white", edgecolor="#C62828", hatch="//", label="did not fit (source), fits (planner)"),
              Line2D([], [], color="black", lw=1.5, label="capacity per GPU")]
    mem_ax.set_yticks(list(y))
    mem_ax.set_yticklabels([short(r["run"]) for r in memory], fontsize=7)
    mem_ax.set_ylim(len(y) - 0.5, -0.5)
    mem_ax.set_xlabel("predicted GB per GPU (planner)")
    mem_ax.set_title("memory: predicted per GPU against capacity", fontsize=10)
    mem_ax.legend(handles=legend, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.07), frameon=False)
    mem_ax.grid(axis="x", alpha=0.3)
    return axes
