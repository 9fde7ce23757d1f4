"""Exercise 01's check on real ranks: the bytes a rank holds for a real model's states under par's ZeRO, measured
by the student's module, against the grader's own count and against the formula, the gap explained.

    par.runtime.launch.run("par.course.grading.exercise_memory", nproc=2, args=["--answer", "my_memory.py"])

A GPT-lite of sizes drawn by the grader (`draw_config`: its vocabulary, width, depth and MLP size, so that some
units' flat buffers need padding to a multiple of N) is built on every rank, and for each ZeRO stage 0-3 wrapped
in `par.zero.engine.Zero(model, stage, "adam")` (fp32), which takes one training step on the rank's own tokens.
On each rank and stage, right after the engine is built and again after the step:

    grader     the grader's count of the storages the engine holds (`held`), taken before the student's code runs
    measured   the student's `measured(zero)`: (params, grads, optimizer) bytes this rank holds

and after the step:

    formula    the student's `formula(psi, n, stage)`: lecture 01's fp32 Adam model states per rank,
               (4Ψ, 4Ψ, 8Ψ) with Ψ/N for what the stage shards (exact division, no padding)
    padding    the student's `padding(zero)`: the bytes of the zeros the flat layout adds, per category

What the grader reproduces is the truth, computed in the grader's process before the job from the layout alone
(`expected`): each unit of Ψ_u parameters is one flat buffer of P_u = ⌈Ψ_u/N⌉·N elements; a rank keeps the whole
buffer (4·ΣP_u bytes) or its partition (4·ΣP_u/N) of the parameters (sharded at stage 3), the gradients (stage
2) and Adam's m and v (8 bytes, stage 1). Before the first step only the parameters and the gradient partitions
of stages 2-3 exist (torch allocates Adam's state at the first step): a module that computes these numbers from
the layout instead of measuring them has to know that too. `verify` judges, from the raw outputs, in the
grader's process:

    measured   every rank's, stage's and moment's three numbers equal to `expected`, to the byte (and the
               grader's own count on the rank equal to it too: otherwise the run held something else)
    formula    equal to (4, 4, 8)·Ψ with the stage's 1/N (≤ 1e-9 relative)
    gap        padding = expected − formula: 4·Σ(P_u − Ψ_u) bytes, divided by N where the category is sharded,
               and the measurement right too (the padding is a few bytes, which a module could guess; the gap
               is explained only beside the measurement it explains)

par's own accounting (`Zero.memory`, `tensor_bytes`, `live_model_state_bytes`) is refused on the ranks
(`EXERCISE.forbidden`) and stubbed in the sandbox's par (`EXERCISE.stubs`); the engine itself is the student's to use.

Result: world_size, backend, and
    measured  {ok, problem, held}        (held: the expected bytes per stage, before and after the step)
    formula   {ok, problem}
    gap       {ok, problem, padding}     (padding: the expected gap per stage, rank 0)
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from par.course.grading import rank_io
from par.course.grading.exercise import Exercise
from par.model import GPTConfig, build, lm_loss
from par.runtime.job_args import JobArgs, arg
from par.zero import units
from par.zero.engine import Zero

EXERCISE = Exercise(
    "01_model_state_bytes", runner=__name__,
    why="count the storages yourself: par's memory accounting is the answer",
    forbidden=[("par.memory.accounting", "tensor_bytes"), ("par.memory.accounting", "live_model_state_bytes"),
               ("par.zero.engine", "tensor_bytes"), ("par.zero.updaters", "tensor_bytes")],
    p2p_only=False,
    stubs=[("par.memory.accounting", n) for n in (
           "tensor_bytes", "live_model_state_bytes", "_optimizer_tensors")] +
           [("par.zero.engine", "Zero.memory"), ("par.zero.updaters", "DeviceUpdate.state_bytes")])
STAGES = (0, 1, 2, 3)
KINDS = ("params", "grads", "optimizer")
MOMENTS = ("before the first step", "after the step")
BYTES = (4, 4, 8)               # fp32 Adam: weights, gradients, m and v
SHARDED_FROM = (3, 2, 1)        # the first stage at which each kind is partitioned
REL = 1e-9                      # the formula and the gap are exact divisions: floats, judged to this relative error


@dataclass(frozen=True)
class Args(JobArgs):
    answer: str = arg("my_memory.py", "the student's module file")
    io: str = arg("", "the grader's folder of inputs and outputs (par.course.grading.rank_io); none: rank 0 verifies")


# ---------------------------------------------------------------- the model and the expected bytes
def draw_config(g: torch.Generator, n: int) -> dict:
    """GPTConfig fields of a small GPT-lite whose units do not all fill a multiple of n (some padding)."""
    draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))      # noqa: E731
    while True:
        heads = draw(1, 2)
        fields = {"vocab_size": draw(17, 61), "block_size": draw(4, 8), "n_layer": draw(1, 2), "n_head": heads,
                  "d_model": heads * draw(3, 6), "d_ff": draw(5, 30)}
        numels = unit_numels(build(GPTConfig(**fields)), units)
        if n == 1 or any(k % n for k in numels):
            return fields


def unit_numels(model, units) -> list[int]:
    """Ψ_u of each unit of par's ZeRO layout (`par.zero.units.plan`)."""
    return [sum(p.numel() for p in params) for _, _, params in units.plan(model, 3)]


def padded(numel: int, n: int) -> int:
    return -(-numel // n) * n


def formula(psi: int, n: int, stage: int) -> list[float]:
    """Lecture 01's fp32 Adam model states per rank: (4Ψ, 4Ψ, 8Ψ), each divided by N from its stage on."""
    return [b * psi / (n if stage >= s else 1) for b, s in zip(BYTES, SHARDED_FROM)]


def expected(numels: list[int], n: int, stage: int, stepped: bool = True) -> list[int]:
    """Bytes a rank holds after a step: the padded flat buffers ΣP_u, or their partitions ΣP_u/N where sharded.
    Before the first step (`stepped` False) the gradients exist only as the partitions stages 2-3 allocate with
    the engine, and Adam's state not at all (torch allocates it at the first step)."""
    total = sum(padded(k, n) for k in numels)
    held = [b * (total // n if stage >= s else total) for b, s in zip(BYTES, SHARDED_FROM)]
    return held if stepped else [held[0], held[1] if stage >= 2 else 0, 0]


def make_inputs(args: Args, n: int, seed: int):
    """(each rank's config and tokens; the expected bytes, formula and gap per stage)."""
    g = torch.Generator().manual_seed(seed)
    fields = draw_config(g, n)
    numels = unit_numels(build(GPTConfig(**fields)), units)
    psi = sum(numels)
    inputs = [{"config": dict(fields), "tokens": torch.randint(0, fields["vocab_size"], (2, fields["block_size"]),
                                                               generator=g)} for _ in range(n)]
    after = [expected(numels, n, s) for s in STAGES]
    want = {"measured": [expected(numels, n, s, stepped) for s in STAGES for stepped in (False, True)],
            "formula": [formula(psi, n, s) for s in STAGES]}
    want["padding"] = [[e - f for e, f in zip(a, b)] for a, b in zip(after, want["formula"])]
    return inputs, want


# ---------------------------------------------------------------- on the rank
def _nbytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a freed storage holds 0)."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            s = t.untyped_storage()
            seen[(s.data_ptr(), s.nbytes())] = s.nbytes()
    return sum(seen.values())


def held(zero) -> list[int]:
    """The grader's count: storages of the parameters and stage-3 shards, of the gradients (.grad, full buffers,
    reduced partitions) and of the optimizer's per-element state, each storage once."""
    params = [p for u in zero.units for p in u.params]
    state = [v for st in zero.updater.opt.state.values() for v in st.values()]
    return [_nbytes(params + [u.shard for u in zero.units]),
            _nbytes([p.grad for p in params] + [m.grad for m in zero.updater.masters()] +
                    [t for u in zero.units for t in (u.grad_full, u.grad_shard)]),
            _nbytes(state)]


def _triple(value) -> list[float] | None:
    """Three real numbers (a tuple or list of int or float), as floats, else None."""
    if type(value) not in (tuple, list) or len(value) != 3:
        return None
    if not all(type(v) in (int, float) or (type(v) is torch.Tensor and v.dim() == 0 and not v.is_complex())
               for v in value):
        return None
    return [float(v) for v in value]


def _call(fn, *args) -> list[float] | str | None:
    """The student's function's three numbers (None if it returned something else), or the error it raised."""
    if not callable(fn):
        return "no such function in your module (run the %%writefile cell after every edit)"
    try:
        return _triple(fn(*args))
    except Exception as e:      # one function's error costs its own check, not the others'
        return f"{type(e).__name__}: {e}"[:300]


def run_rank(module, inputs: dict, rank: int, device, wire: dict) -> dict:
    cfg, tokens = GPTConfig(**inputs["config"]), inputs["tokens"].to(device)
    out = {"grader": [], "measured": [], "formula": [], "padding": []}
    for stage in STAGES:
        model = build(cfg).to(device)
        zero = Zero(model, stage=stage, optimizer="adam", lr=1e-3)
        psi, n = zero.numel, zero.n
        out["grader"].append(held(zero))           # each time before the student's code sees the engine
        out["measured"].append(_call(getattr(module, "measured", None), zero))
        zero.backward(lm_loss(model(tokens), tokens))
        zero.step()
        out["grader"].append(held(zero))
        out["measured"].append(_call(getattr(module, "measured", None), zero))
        out["formula"].append(_call(getattr(module, "formula", None), psi, n, stage))
        out["padding"].append(_call(getattr(module, "padding", None), zero))
        zero.close()
    return out


# ---------------------------------------------------------------- the grader's judgment
def _rows(out, key, count: int) -> list | None:
    value = out.get(key) if out is not None else None
    if type(value) is not list or len(value) != count:
        return None
    if not all(v is None or type(v) is str or (type(v) is list and len(v) == 3 and
                                                all(type(x) in (int, float) for x in v)) for v in value):
        return None
    return value


def _off(got, want, exact: bool) -> int | None:
    """The first kind (0-2) where `got` differs from `want` (to the byte, or REL relative), or None."""
    for k, (a, b) in enumerate(zip(got, want)):
        if not a == a or (a != b if exact else abs(a - b) > REL * max(1.0, abs(b))):
            return k
    return None


def _problem(outputs, key: str, want: list, exact: bool, what: str) -> str:
    """The first rank and moment where `key`'s numbers differ from `want` ("" if none)."""
    moments = [f"stage {s}, {m}" for s in STAGES for m in MOMENTS] if len(want) > len(STAGES) else \
        [f"stage {s}" for s in STAGES]
    for r, out in enumerate(outputs):
        rows = _rows(out, key, len(want))
        if rows is None:
            return f"rank {r}: no {what} came back for the {len(want)} measurements"
        for moment, (got, w) in zip(moments, zip(rows, want)):
            if type(got) is str:
                return f"rank {r}, {moment}: {what}: {got}"
            if got is None:
                return f"rank {r}, {moment}: {what} is not three numbers (params, grads, optimizer)"
            k = _off(got, w, exact)
            if k is not None:
                times = f" ({got[k] / w[k]:.4g} times that)" if w[k] else ""
                return f"rank {r}, {moment}: {what} {KINDS[k]} = {got[k]:g} bytes, against {w[k]:g}{times}"
    return ""


def verify(args: Args, context: dict, outputs: list) -> dict:
    n = len(outputs)
    measured = _problem(outputs, "measured", context["measured"], True, "measured(zero)")
    if not measured:
        found = _problem(outputs, "grader", context["measured"], True, "the grader's count of")
        measured = f"the run itself held other bytes than par's layout: {found}" if found else ""
    formula_problem = _problem(outputs, "formula", context["formula"], False, "formula(psi, n, stage)")
    gap = _problem(outputs, "padding", context["padding"], False, "padding(zero)")
    if not gap and measured:        # a few bytes of padding can be guessed; a measurement cannot
        gap = f"padding(zero) explains the gap only beside a right measurement: {measured}"
    return {"world_size": n,
            "measured": {"ok": not measured, "problem": measured, "held": context["measured"]},
            "formula": {"ok": not formula_problem, "problem": formula_problem},
            "gap": {"ok": not gap, "problem": gap, "padding": context["padding"]}}


if __name__ == "__main__":
    raise SystemExit(rank_io.main(sys.modules[__name__]))
