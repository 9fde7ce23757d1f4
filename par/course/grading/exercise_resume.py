"""Exercise 11's check on real ranks: the student's `save` and `load` of a ZeRO run's training state, judged by
whether the resumed run equals the run that never stopped.

    par.runtime.launch.run("par.course.grading.exercise_resume", nproc=2, args=["--answer", "my_resume.py"])

Every rank trains a small MLP (units of one Linear layer, tanh after all but the last; widths, initial values
and batches drawn by the grader) under par's `Zero` (stage STAGE, Adam), for STEPS steps. Each step draws noise
for the whole global batch from torch's default CPU generator (x + σ·randn, the same draw on every rank, seeded
by the grader) and keeps its rows r, r+N, ...: the run depends on the model, Adam's state, the data position and
the random state, all four. Two runs on every rank:

    uninterrupted   torch.manual_seed(seed); the model from the grader's initial values; after SAVE_AT steps
                    the student's `save(path, engine, SAVE_AT)`; on to STEPS
    resumed         the student's module imported anew (its globals empty, as in a new process);
                    torch.manual_seed(fresh) and a model of fresh random values (as a new process builds it);
                    `start = load(path, engine)`; the steps start, ..., STEPS - 1

The rank reports, per run, its losses (one per step), and after the last step its partitions of the
parameters and Adam's state (m, v, step). `verify` judges them in the grader's process: the uninterrupted losses
against the grader's own trajectory (`make_inputs`: one process, the gradient averaged over the ranks, Adam
written out: ≤ TOLERANCE); the resumed run's start, losses and final state against the uninterrupted run's, bit
for bit (the same layout: nothing may differ).

par's own resume (`par.resilience.resume`) and sharded checkpoint (`par.zero.checkpoint`) are refused on the
ranks (`EXERCISE.forbidden`) and stubbed in the sandbox's par (`EXERCISE.stubs`). Not covered: state kept in memory
somewhere the fresh import does not reset (an attribute of torch, say), which a real restart would lose.

Result: world_size, backend, and
    losses    {ok, problem, steps, save_at}
    state     {ok, problem}
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from par.course.grading import guards, rank_io
from par.course.grading.exercise import Exercise
from par.course.grading.units import units
from par.runtime.job_args import JobArgs, arg
from par.zero.engine import Zero

EXERCISE = Exercise(
    "11_when_things_break", runner=__name__,
    why=("save and restore the training state yourself: the engine's partitions and Adam's state, the data "
         "position, torch's random state"),
    forbidden=[("par.resilience.resume", n) for n in ("save", "load", "rng_state", "set_rng_state")] +
              [("par.zero.checkpoint", n) for n in ("save", "load", "load_full")],
    p2p_only=False,
    stubs=[("par.resilience.resume", n) for n in (
           "save", "load", "rng_state", "set_rng_state", "full_units", "install", "load_single")] +
           [("par.zero.checkpoint", n) for n in ("save", "load", "load_full", "_partitions_for", "read_file",
                                                  "read_shard", "read_meta")])
STAGE, STEPS, SAVE_AT, LR, NOISE, TOLERANCE = 2, 8, 4, 1e-2, 0.5, 1e-5
MSE, RANDN, SEED = F.mse_loss, torch.randn, torch.manual_seed     # bound before any student module is imported


@dataclass(frozen=True)
class Args(JobArgs):
    answer: str = arg("my_resume.py", "the student's module file")
    io: str = arg("", "the grader's folder of inputs and outputs (par.course.grading.rank_io); none: rank 0 verifies")


# ---------------------------------------------------------------- the model and the grader's trajectory
def mlp(params: list[torch.Tensor]) -> nn.Sequential:
    return nn.Sequential(*units(params))


def rank_rows(x, y, noise: torch.Tensor, rank: int, n: int):
    """Rank r's rows r, r+N, ... of the global batch after the noise (drawn for the whole batch)."""
    return (x + NOISE * noise)[rank::n], y[rank::n]


def adam(p: torch.Tensor, g: torch.Tensor, state: dict, betas=(0.9, 0.999), eps=1e-8) -> None:
    """One step of `torch.optim.Adam` (lr = LR) on `p`, in place:
    m ← β₁m + (1 − β₁)g,  v ← β₂v + (1 − β₂)g²,  p ← p − (lr / (1 − β₁ᵗ)) · m / (√v / √(1 − β₂ᵗ) + ε)."""
    b1, b2 = betas
    t = state["t"] = state.get("t", 0) + 1
    m = state["m"] = state.get("m", torch.zeros_like(p)).lerp(g, 1 - b1)
    v = state["v"] = state.get("v", torch.zeros_like(p)) * b2 + (1 - b2) * g * g
    p.sub_(LR / (1 - b1 ** t) * m / (v.sqrt() / (1 - b2 ** t) ** 0.5 + eps))


def trajectory(params, xs, ys, seed: int, n: int) -> torch.Tensor:
    """[step, rank] losses of N ranks training `params` on the averaged gradient, in one process: the noise of
    each step drawn from a generator seeded with `seed` (the stream of torch's default one after manual_seed)."""
    g = torch.Generator().manual_seed(seed)
    now, states, losses = [p.clone() for p in params], [{} for _ in params], []
    for x, y in zip(xs, ys):
        noise = torch.randn(x.shape, generator=g)
        leaves = [p.clone().requires_grad_() for p in now]
        per_rank = []
        for r in range(n):
            h, target = rank_rows(x, y, noise, r, n)
            for k in range(0, len(leaves), 2):
                h = F.linear(h, leaves[k], leaves[k + 1])
                h = h if k + 2 == len(leaves) else torch.tanh(h)
            per_rank.append(F.mse_loss(h, target))
        sum(per_rank).div(n).backward()
        for p, leaf, st in zip(now, leaves, states):
            adam(p, leaf.grad, st)
        losses.append(torch.stack([v.detach() for v in per_rank]))
    return torch.stack(losses)


def make_inputs(args: Args, n: int, seed: int):
    """(each rank's inputs: initial values, the global batches, the run's seed and the resumed run's; the
    expected losses [step, rank])."""
    g = torch.Generator().manual_seed(seed)
    draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))      # noqa: E731
    widths = [draw(3, 8) for _ in range(draw(2, 3) + 1)]
    params = []
    for fan_in, fan_out in zip(widths, widths[1:]):
        params += [torch.randn(fan_out, fan_in, generator=g) / fan_in ** 0.5, torch.randn(fan_out, generator=g)]
    rows = n * draw(2, 4)
    xs = [torch.randn(rows, widths[0], generator=g) for _ in range(STEPS)]
    ys = [torch.randn(rows, widths[-1], generator=g) for _ in range(STEPS)]
    run_seed, fresh = draw(1, 2 ** 30), draw(1, 2 ** 30)
    mine = {"params": params, "x": xs, "y": ys, "seed": run_seed, "fresh": fresh}
    return [dict(mine) for _ in range(n)], {"losses": trajectory(params, xs, ys, run_seed, n)}


# ---------------------------------------------------------------- what a rank runs
def _state(engine) -> dict:
    """This rank's partitions of the parameters and Adam's m, v and step, per unit (copies)."""
    masters = engine.updater.masters()
    st = [engine.updater.opt.state.get(m, {}) for m in masters]

    def get(s, key):
        v = s.get(key)
        return v.detach().clone() if isinstance(v, torch.Tensor) else torch.tensor(float("nan"))
    return {"params": [m.detach().clone() for m in masters], "m": [get(s, "exp_avg") for s in st],
            "v": [get(s, "exp_avg_sq") for s in st], "step": [get(s, "step") for s in st]}


def _train(engine, inputs, steps, rank, n, device) -> list:
    losses = []
    for s in steps:
        x, y = inputs["x"][s], inputs["y"][s]
        h, target = rank_rows(x, y, RANDN(x.shape), rank, n)
        loss = MSE(engine.model(h.to(device)), target.to(device))
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(loss.detach().reshape(()).clone())
    return losses


def run_rank(module, inputs: dict, rank: int, device, wire: dict) -> dict:
    import torch.distributed as dist

    n = dist.get_world_size()
    box = [tempfile.mkdtemp(prefix="resume-") if rank == 0 else None]
    dist.broadcast_object_list(box)
    path = os.path.join(box[0], "checkpoint")
    try:
        SEED(inputs["seed"])
        engine = Zero(mlp(inputs["params"]).to(device), stage=STAGE, optimizer="adam", lr=LR)
        losses = _train(engine, inputs, range(SAVE_AT), rank, n, device)
        module.save(path, engine, SAVE_AT)
        dist.barrier()
        losses += _train(engine, inputs, range(SAVE_AT, STEPS), rank, n, device)
        final = _state(engine)
        engine.close()

        fresh = guards.load(module.__file__, "student_answer_resumed")     # a new process's import
        SEED(inputs["fresh"])
        params = [RANDN(p.shape) / max(1, p.shape[-1]) ** 0.5 for p in inputs["params"]]
        engine = Zero(mlp(params).to(device), stage=STAGE, optimizer="adam", lr=LR)
        start = fresh.load(path, engine)
        if type(start) is not int or not 0 <= start < STEPS:
            resumed, start = [], start if type(start) is int else -1
        else:
            resumed = _train(engine, inputs, range(start, STEPS), rank, n, device)
        again = _state(engine)
        engine.close()
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(box[0], ignore_errors=True)
    return {"losses": losses, "start": start, "resumed": resumed, "final": final, "again": again}


# ---------------------------------------------------------------- the grader's judgment
def _losses(out, key):
    value = out.get(key) if out is not None else None
    if type(value) is not list or not all(type(v) is torch.Tensor and v.shape == () for v in value):
        return None
    return torch.stack(value).double() if value else torch.zeros(0, dtype=torch.float64)


def _parts(out, key):
    """{name: [tensor per unit]} of a run's final state, or None when malformed."""
    value = out.get(key) if out is not None else None
    if type(value) is not dict or set(value) != {"params", "m", "v", "step"}:
        return None
    if not all(type(v) is list and all(type(t) is torch.Tensor for t in v) for v in value.values()):
        return None
    return value


def loss_problem(r: int, out, want: torch.Tensor) -> str:
    """The first fault of rank r's losses ("" if none): the uninterrupted run off the grader's trajectory; the
    resumed run starting at the wrong step; a resumed loss not bit-equal to the uninterrupted one."""
    mine = _losses(out, "losses")
    if mine is None or mine.shape != want.shape:
        return f"rank {r}: the run that never stopped reported no {len(want)} losses"
    off = (mine - want.double()).abs()
    if not bool((off <= TOLERANCE).all()):
        s = int((~(off <= TOLERANCE)).nonzero()[0])
        return (f"rank {r}: the run that never stopped left the grader's trajectory at step {s + 1} "
                f"(|difference| {off[s].item():.3g}): your save changed the run it was called from")
    start = out.get("start")
    if type(start) is not int or start != SAVE_AT:
        said = start if type(start) is int and start >= 0 else "no step in 0..7"
        return (f"rank {r}: load returned {said}, but the state was saved after step {SAVE_AT}: the resumed run "
                f"must go on with batch {SAVE_AT + 1} (the data position)")
    again = _losses(out, "resumed")
    if again is None or len(again) != STEPS - SAVE_AT:
        return f"rank {r}: the resumed run reported no {STEPS - SAVE_AT} losses"
    for k, (a, b) in enumerate(zip(again, mine[SAVE_AT:])):
        if not bool(a == b):
            step = SAVE_AT + k + 1
            where = ("the parameters, the batch or its noise (torch's random state)" if k == 0 else
                     "the update of the step before: Adam's state (m, v and its step count t)")
            return (f"rank {r}: the resumed run's loss at step {step} differs from the run that never stopped by "
                    f"{abs((a - b).item()):.3g} (bit-equal expected, same layout): look at {where}")
    return ""


def state_problem(outputs: list) -> str:
    """The first difference ("" if none) between the final state of a rank's resumed run and its uninterrupted
    run's: Adam's step count, m, v, then the parameter partitions (the most telling first), per unit, over the
    ranks."""
    runs = [(_parts(out, "final"), _parts(out, "again")) for out in outputs]
    for r, (final, again) in enumerate(runs):
        if final is None or again is None:
            return f"rank {r}: no final state was reported"
    names = {"step": "Adam's step count t", "m": "Adam's m", "v": "Adam's v", "params": "parameter partition"}
    for key, name in names.items():
        for r, (final, again) in enumerate(runs):
            if len(final[key]) != len(again[key]):
                return f"rank {r}: {len(again[key])} units after the resumed run, {len(final[key])} after the other"
            for u, (a, b) in enumerate(zip(again[key], final[key])):
                if a.shape != b.shape or not torch.equal(a, b):
                    one = key == "step" and a.numel() == b.numel() == 1
                    said = f"t = {a.item():g}, against {b.item():g}; " if one else ""
                    return (f"rank {r}, unit {u}: after step {STEPS}, the resumed run's {name} differs from the run "
                            f"that never stopped ({said}bit-equal expected)")
    return ""


def verify(args: Args, context: dict, outputs: list) -> dict:
    want = context["losses"]
    loss = next((p for p in (loss_problem(r, out, want[:, r]) for r, out in enumerate(outputs)) if p), "")
    state = state_problem(outputs)
    return {"world_size": len(outputs), "losses": {"ok": not loss, "problem": loss, "steps": STEPS,
                                                   "save_at": SAVE_AT},
            "state": {"ok": not state, "problem": state}}


if __name__ == "__main__":
    raise SystemExit(rank_io.main(sys.modules[__name__]))
