"""Exercise 07's last part: the student chooses a layout of 2 CPU ranks under a memory budget; the grader runs
every layout that fits and ranks them by measured throughput.

    scenario = drawn()                           # drawn once per grading process (cached)
    mine = my_layout(scenario.model, scenario.budget)        # the student's answer: plain data
    plan = check_fits(mine, scenario)            # AssertionError naming what was compared, else the plan
    scenario, runs = measured()                  # every layout that fits, measured once per grading process
    check_fastest(mine, scenario, runs)          # the same, against the measured ranking

The scenario (`draw`): GPT-lite `tiny` with 3 heads of width 96 or 5 of width 80 (so tensor parallelism over 2
ranks never divides the heads), global batch BATCH, fp32 Adam, on 2 gloo ranks; the budget per rank lies in the
middle (geometric) of the gap just above the predicted memory of data parallelism with ZeRO-2 and one micro-batch
(`budget_for`): plain DDP and ZeRO-1 without accumulation do not fit, ZeRO-2, pipelines, accumulation and
ZeRO-3 do. The memory of a layout is the planner's formula (`par.train.planner.predict`'s
`memory["total"]`: model states plus activations per rank), which the measured bytes of `par.train.job`
follow within a few per cent; the gap of at least GAP keeps both on the same side of the budget.

The measurement (`measure`): one launch of `par.train.job` on 2 gloo ranks with one --config per layout that
fits (`feasible`: every (dp, pp, tp) of 2 ranks, ZeRO stage 0-3, micro-batches MICROBATCHES, valid for the
planner; with dp = 1 the ZeRO stage changes nothing and only stage 0 runs, `canonical`), STEPS steps each, the
list twice (forward, then reversed). A layout's throughput is its fastest timed step of both passes
(samples/s): on 2 shared cores another process only ever slows a step down, so the fastest step is the least
disturbed estimate of what the layout can do.

When. `par.course.grading.grade` calls `measured()` before any submission of the batch runs (its
record's `prepare`), so no student's kernel or process shares the cores with the measurement; the check cells then
find it cached, and every student is ranked on the same numbers. Anything else measures on its first call.

The judgement (`check_fastest`): the student's layout, if it fits, is within BAND of the measured best
(samples/s ≥ best / BAND). BAND is wide because timings on 2 shared CPU cores vary by tens of per cent between
runs, enough to reorder the top layouts and to put nearly equal work almost BAND apart; the slowest layouts that
fit (ZeRO-3, or ZeRO-2 with 4 micro-batches of one sample) run several times slower than the best, outside it.
A failed judgement's message holds the measured ranking and the planner's choice beside it, never the drawn model
or budget; an official grade shows it by its type only, as every error after a check with hidden cases (07's
part 1 has some: `par.course.grading.checks.withheld`).

The answer is data: a dict {"dp", "pp", "tp", "zero_stage", "microbatches"} of ints, checked for type before
anything uses it (`parse`); nothing of the student's runs in the grader's process or on the ranks.
"""
from __future__ import annotations

import json
import random
import threading
from dataclasses import dataclass, replace

import par.runtime.launch
from par.course.grading.exercise import Exercise
from par.model import GPTConfig, preset
from par.train import planner

WORLD, BATCH, STEPS = 2, 8, 8
MICROBATCHES = (1, 2, 4)
STAGES = (0, 1, 2, 3)
MODELS = ((3, 96), (5, 80))     # (heads, width): odd heads, so tensor parallelism over 2 ranks is never valid
GAP = 1.06          # the budget's gap: the next layout up needs at least GAP times the memory of the one below
BAND = 2.0          # the student's layout passes at best / BAND samples/s or more
KEYS = ("dp", "pp", "tp", "zero_stage", "microbatches")
TIMEOUT = 240.0


@dataclass(frozen=True)
class Scenario:
    """What the grader draws: the model, the global batch and the budget in bytes per rank."""
    model: GPTConfig
    budget: float
    batch: int = BATCH

    def workload(self) -> planner.Workload:
        return planner.Workload(self.model, self.batch, precision="fp32", optimizer="adam")

    def hardware(self) -> planner.Hardware:
        return replace(planner.HARDWARE["cpu"], memory=self.budget)


def predict(scenario: Scenario, layout: tuple) -> planner.Plan:
    """The planner's plan of one layout (dp, pp, tp, zero_stage, microbatches) on the scenario's budget."""
    dp, pp, tp, stage, m = layout
    return planner.predict(scenario.workload(), dp, pp, tp, stage, m, scenario.hardware())


def budget_for(model: GPTConfig, batch: int = BATCH) -> float:
    """√(a·b): a the predicted memory of dp 2, ZeRO-2, one micro-batch; b the smallest predicted above it."""
    w = planner.Workload(model, batch, precision="fp32", optimizer="adam")
    a = planner.predict(w, WORLD, 1, 1, 2, 1, planner.HARDWARE["cpu"]).memory["total"]
    above = [p.memory["total"] for p in planner.enumerate_plans(w, WORLD, planner.HARDWARE["cpu"],
                                                                microbatches=MICROBATCHES, offload=(False,))
             if p.valid and p.memory["total"] > a]
    b = min(above)
    if b < GAP * a:
        raise ValueError(f"no budget with a {GAP}x gap above ZeRO-2's {a:.4g} bytes (next {b:.4g})")
    return (a * b) ** 0.5


def draw(rng: random.Random | None = None) -> Scenario:
    """A scenario at random: one of MODELS, the budget of `budget_for`."""
    heads, width = (rng or random.SystemRandom()).choice(MODELS)
    model = preset("tiny", n_head=heads, d_model=width, block_size=64)
    return Scenario(model, budget_for(model))


def canonical(layout: tuple) -> tuple:
    """The layout that runs for it: with one data-parallel replica every ZeRO stage is stage 0."""
    dp, pp, tp, stage, m = layout
    return (dp, pp, tp, stage if dp > 1 else 0, m)


def feasible(scenario: Scenario) -> list[tuple]:
    """Every layout of WORLD ranks that the planner finds valid and that fits the budget (canonical, once each)."""
    plans = planner.enumerate_plans(scenario.workload(), WORLD, scenario.hardware(), stages=STAGES,
                                    microbatches=MICROBATCHES, offload=(False,))
    keys = [canonical((p.dp, p.pp, p.tp, p.zero_stage, p.microbatches)) for p in plans if p.valid and p.fits]
    return sorted(set(keys))


def label(layout: tuple) -> str:
    dp, pp, tp, stage, m = layout
    return f"dp {dp} pp {pp} tp {tp} ZeRO-{stage} m={m}"


def config(scenario: Scenario, layout: tuple, steps: int = STEPS) -> dict:
    """The DeepSpeed-style config of one layout (`par.train.config`)."""
    dp, pp, tp, stage, m = layout
    cfg = scenario.model
    return {"train_batch_size": scenario.batch, "gradient_accumulation_steps": m,
            "zero_optimization": {"stage": stage}, "pipeline": {"stages": pp}, "tensor_parallel": {"tp_size": tp},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "steps": steps,
            "model": {"preset": "tiny", "n_head": cfg.n_head, "d_model": cfg.d_model, "block_size": cfg.block_size,
                      "n_layer": cfg.n_layer, "vocab_size": cfg.vocab_size}}


def measure(scenario: Scenario, layouts: list[tuple], steps: int = STEPS) -> dict:
    """{layout: {"samples_per_s": its fastest timed step, "memory": measured model states + activations, max over
    ranks}}: one launch of `par.train.job` on WORLD gloo ranks, every layout twice (in order, then in reverse:
    a slow spell of the machine then falls on different layouts in the two passes)."""
    order = list(layouts) + list(reversed(layouts))
    args = [a for lay in order for a in ("--config", json.dumps(config(scenario, lay, steps)))]
    result = par.runtime.launch.run("par.train.job", nproc=WORLD, args=args, backend="gloo", timeout=TIMEOUT,
                                    quiet=True)
    out = {}
    for lay, row in zip(order, result["runs"], strict=True):
        if row.get("error"):
            raise RuntimeError(f"{label(lay)} did not run: {row['error']}")
        fastest = float(max(row["samples_per_s_range"]))
        seen = out.setdefault(lay, {"samples_per_s": fastest,
                                    "memory": int(row["model_states_max"] + row["activations_peak_max"])})
        seen["samples_per_s"] = max(seen["samples_per_s"], fastest)
    return out


_LOCK = threading.Lock()
_DRAWN: dict = {}


def drawn() -> Scenario:
    """The scenario of this grading process: drawn on first use, the same for every later notebook."""
    with _LOCK:
        if "scenario" not in _DRAWN:
            _DRAWN["scenario"] = draw()
        return _DRAWN["scenario"]


def measured() -> tuple[Scenario, dict]:
    """(the scenario, its measurements): measured on first use, the same for every later notebook this grading
    process grades (one launch per process; every student is ranked on the same numbers)."""
    scenario = drawn()
    with _LOCK:
        if "runs" not in _DRAWN:
            _DRAWN["runs"] = measure(scenario, feasible(scenario))
        return scenario, _DRAWN["runs"]


def before_grading() -> None:
    """Every layout that fits measured once, before any submission runs (`grade.prepare`: the record's)."""
    measured()


EXERCISE = Exercise("07_layout", prepare=before_grading)


# ---------------------------------------------------------------- the judgement, on plain data
def parse(answer) -> tuple:
    """The answer as a layout tuple, or AssertionError saying what is wrong with its type or fields."""
    assert type(answer) is dict, f"return a dict with the keys {', '.join(KEYS)}; got {type(answer).__name__}"
    assert set(answer) == set(KEYS), f"the keys must be exactly {', '.join(KEYS)}; got {sorted(map(str, answer))}"
    for k in KEYS:
        assert type(answer[k]) is int, f"{k} must be an int, got {type(answer[k]).__name__}"
    layout = tuple(answer[k] for k in KEYS)
    dp, pp, tp, stage, m = layout
    assert min(dp, pp, tp, m) >= 1 and dp * pp * tp == WORLD, \
        f"dp x pp x tp must be the {WORLD} ranks (each at least 1): {dp} x {pp} x {tp}"
    assert stage in STAGES, f"zero_stage must be one of {STAGES}, got {stage}"
    assert m in MICROBATCHES, f"microbatches must be one of {MICROBATCHES}, got {m}"
    return layout


def check_fits(answer, scenario: Scenario) -> planner.Plan:
    """The answer's plan, after checking it is a valid layout whose predicted memory per rank fits the budget."""
    layout = parse(answer)
    plan = predict(scenario, layout)
    assert plan.valid, f"{label(layout)} cannot run: {plan.reason}"
    used = plan.memory["total"]
    assert plan.fits, f"{label(layout)} needs {used / 1e6:.2f} MB per rank (model states + activations, the " \
                      f"planner's formula): more than the budget"
    return plan


def ranking(runs: dict) -> list[tuple]:
    """The measured layouts, fastest first."""
    return sorted(runs, key=lambda lay: -runs[lay]["samples_per_s"])


def planner_choice(scenario: Scenario) -> tuple | None:
    """The layout the planner predicts fastest among those that fit."""
    ranked = planner.rank_plans(planner.enumerate_plans(scenario.workload(), WORLD, scenario.hardware(),
                                                        stages=STAGES, microbatches=MICROBATCHES, offload=(False,)))
    if not ranked or not ranked[0].fits:
        return None
    p = ranked[0]
    return canonical((p.dp, p.pp, p.tp, p.zero_stage, p.microbatches))


def describe(runs: dict, scenario: Scenario, mark: tuple | None = None) -> str:
    """The measured ranking, one layout per line (samples/s, its ratio to the best), the planner's choice and
    `mark` flagged."""
    order = ranking(runs)
    best = runs[order[0]]["samples_per_s"]
    chosen = planner_choice(scenario)
    lines = []
    for i, lay in enumerate(order):
        s = runs[lay]["samples_per_s"]
        flags = [f for f, on in (("yours", lay == mark), ("the planner's", lay == chosen)) if on]
        lines.append(f"  {i + 1:2d}. {label(lay):28s} {s:7.1f} samples/s  x{best / s:4.2f}"
                     + (f"  <- {', '.join(flags)}" if flags else ""))
    return "\n".join(lines)


def check_fastest(answer, scenario: Scenario, runs: dict) -> str:
    """The answer fits and its measured samples/s is at least best / BAND; returns the ranking as text."""
    check_fits(answer, scenario)
    mine = canonical(parse(answer))
    assert mine in runs, f"{label(mine)} fits but was not measured (the grader's list of layouts lacks it)"
    order = ranking(runs)
    best, got = runs[order[0]]["samples_per_s"], runs[mine]["samples_per_s"]
    assert got * BAND >= best, \
        f"{label(mine)} fits but ran at {got:.1f} samples/s, {best / got:.2f} times slower than the fastest " \
        f"layout that fits ({label(order[0])}, {best:.1f} samples/s; within {BAND}x passes). Measured on " \
        f"{WORLD} gloo ranks:\n{describe(runs, scenario, mine)}"
    return describe(runs, scenario, mine)
