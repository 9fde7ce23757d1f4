"""Exercise 06's check on real ranks: the student's ZeRO-3 (each unit gathered before its use and freed after
it, its gradients reduce-scattered into the local shard, Adam on the shard), judged by the grader.

    par.runtime.launch.run("par.course.grading.exercise_zero3", nproc=2, args=["--answer", "my_zero3.py"])

A small MLP is given to every rank as a list of units (`Layer`: one Linear layer, tanh after all but the last;
widths drawn at random, so that some units' flat size divides N and some do not), each rank its own batches.
On every rank the student's `Zero3(units, lr)` shards the units and registers its hooks; then, for each of
STEPS steps, the rank runs forward and backward of the MSE loss through the units, reads the student's
gradient shards (`zero.grads`), calls `zero.step()`, and measures what it holds. After the last step it reads
the student's parameter shards (`zero.shards`). The expected values are computed by the grader before the job
starts: each step's gradient averaged over the ranks (flat, padded, per unit) and the parameters after STEPS
steps of Adam (`adam`: torch.optim.Adam's step) on that average, in one process.

What happened is recorded outside the student's module, in the rank's own log (hooks of the grader's registered
after the student's, so on each module, output and parameter they run right after the student's):

    FORWARD u, 0        unit u's forward starts (after the student's gather)
    FREED u, f          unit u's forward returned; f = 1 when its parameters then held no memory
    BACKWARD u, 0       the gradient of unit u's output is ready: unit u's backward starts (after a re-gather)
    READY u, i          parameter i of unit u has its gradient
    GATHER c, k         an all-gather whose output holds k elements (every ProcessGroup all-gather, wrapped)
    SCATTER c, k        a reduce-scatter whose input holds k elements
    ALLREDUCE c, k      an all-reduce of k elements
    END 0, 0            loss.backward() returned

and the bytes held at rest: after the last step, every tensor the rank made since the units were built and still
alive (of at least one dimension; `gc`, frozen before: `held_bytes`, `at_rest`), the units' parameters and their .grad, and the tensors at the top level
of the student's module, each storage once, less the grader's inputs and records. (A tensor the student's module
allocated when it was imported and keeps out of sight is not counted: the guarantee is for what it builds.)

`verify` judges, in the grader's process from the raw outputs: the gradient shards and the parameters (max
|yours − expected| over ranks, steps and units); the memory (every unit freed after its forward; the bytes at
rest equal to 4·(1 + 1 + 2)·Σ padded/N: the parameter shard, its gradient and Adam's m and v, fp32); the
communication (per unit and step one all-gather of its padded flat size before its forward and one before its
backward, one reduce-scatter of it during its backward, before the previous unit's gradients; no all-reduce).

par's `Zero` is refused on the ranks (FORBIDDEN) and stubbed in the sandbox's par (`references.RANKS`); torch's
collectives are allowed and recorded. Torch's FSDP is not refused by name (importing it costs each rank over a
second): it shards each parameter along its first dimension, not the unit's flat buffer, so neither its shards,
its collectives' sizes nor its bytes at rest are what the checks expect.

Result: world_size, backend, and
    params    {ok, max_error, grad_error}
    memory    {ok, problem, held, formula}
    gathers   {ok, problem, all_gathers, reduce_scatters, units, ring_bytes}
"""
from __future__ import annotations

import gc
import sys
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from par.course.grading import rank_io
from par.runtime.job_args import JobArgs, arg

PRELOAD = ("torch",)    # what par.runtime.agent imports before it forks the ranks: no optimizer step, no dispatch
#                         mode here, so the ranks never import torch._dynamo

WHY = "write the gather, the free and the reduce-scatter yourself with torch.distributed's collectives"
FORBIDDEN = [("par.zero.engine", "Zero")]      # par's ZeRO (stubbed in the sandbox's par too: references.RANKS)
P2P_ONLY = False                # torch's collectives allowed (and recorded, `recording`)
STEPS, LR, TOLERANCE = 2, 1e-2, 1e-5
FORWARD, FREED, BACKWARD, READY, GATHER, SCATTER, ALLREDUCE, END = range(8)
REGISTER = torch.Tensor.register_post_accumulate_grad_hook    # bound before any student module is imported
KIND = {"allgather": GATHER, "all_gather_single": GATHER, "_allgather_base": GATHER,
        "allgather_into_tensor_coalesced": GATHER, "all_gather_single_coalesced": GATHER,
        "allgather_coalesced": GATHER, "reduce_scatter": SCATTER, "reduce_scatter_single": SCATTER,
        "_reduce_scatter_base": SCATTER, "reduce_scatter_tensor_coalesced": SCATTER,
        "reduce_scatter_single_coalesced": SCATTER, "allreduce": ALLREDUCE, "allreduce_coalesced": ALLREDUCE}


@dataclass(frozen=True)
class Args(JobArgs):
    answer: str = arg("my_zero3.py", "the student's module file")
    io: str = arg("", "the grader's folder of inputs and outputs (par.course.grading.rank_io); none: rank 0 verifies")


# ---------------------------------------------------------------- the model and its expected values
class Layer(nn.Module):
    """One unit: y = tanh(x Wᵀ + b) (no tanh on the last unit)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, last: bool):
        super().__init__()
        self.weight, self.bias, self.last = nn.Parameter(weight), nn.Parameter(bias), last

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        return y if self.last else torch.tanh(y)


def padded(numel: int, n: int) -> int:
    return -(-numel // n) * n


def loss_of(params, x, y):
    """MSE of the MLP whose units are (params[0], params[1]), (params[2], params[3]), ..."""
    h = x
    for k in range(0, len(params), 2):
        h = F.linear(h, params[k], params[k + 1])
        h = h if k + 2 == len(params) else torch.tanh(h)
    return F.mse_loss(h, y)


def flat(tensors, n: int) -> torch.Tensor:
    """The tensors laid end to end, padded with zeros to a multiple of n."""
    out = torch.cat([t.reshape(-1) for t in tensors])
    return torch.cat([out, out.new_zeros(padded(out.numel(), n) - out.numel())])


def draw_widths(g: torch.Generator, n: int) -> list[int]:
    """Widths of 3 or 4 units, with at least one unit whose flat size n divides and one it does not."""
    draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))      # noqa: E731
    while True:
        widths = [draw(3, 8) for _ in range(draw(3, 4) + 1)]
        sizes = [o * (i + 1) for i, o in zip(widths, widths[1:])]
        if any(s % n == 0 for s in sizes) and any(s % n for s in sizes):
            return widths


def adam(p: torch.Tensor, g: torch.Tensor, state: dict, betas=(0.9, 0.999), eps=1e-8) -> None:
    """One step of `torch.optim.Adam` (its defaults, lr = LR) on `p`, in place:
    m ← β₁m + (1 − β₁)g,  v ← β₂v + (1 − β₂)g²,  p ← p − (lr / (1 − β₁ᵗ)) · m / (√v / √(1 − β₂ᵗ) + ε).
    (Written out: torch's first optimizer step imports its compiler, seconds on every rank.)"""
    b1, b2 = betas
    t = state["t"] = state.get("t", 0) + 1
    m = state["m"] = state.get("m", torch.zeros_like(p)).lerp(g, 1 - b1)
    v = state["v"] = state.get("v", torch.zeros_like(p)) * b2 + (1 - b2) * g * g
    p.sub_(LR / (1 - b1 ** t) * m / (v.sqrt() / (1 - b2 ** t) ** 0.5 + eps))


def make_inputs(args: Args, n: int, seed: int):
    """(each rank's initial units and batches; the expected gradient per step and unit, the final parameters)."""
    g = torch.Generator().manual_seed(seed)
    widths = draw_widths(g, n)
    params = []
    for fan_in, fan_out in zip(widths, widths[1:]):
        params += [torch.randn(fan_out, fan_in, generator=g) / fan_in ** 0.5, torch.randn(fan_out, generator=g)]
    batch = int(torch.randint(3, 7, (1,), generator=g))
    data = [[(torch.randn(batch, widths[0], generator=g), torch.randn(batch, widths[-1], generator=g))
             for _ in range(STEPS)] for _ in range(n)]
    now, state, grads = [p.clone() for p in params], [{} for _ in params], []
    for step in range(STEPS):
        leaves = [p.clone().requires_grad_() for p in now]
        sum(loss_of(leaves, *data[r][step]) for r in range(n)).div(n).backward()
        grads.append([flat([leaves[k].grad, leaves[k + 1].grad], n) for k in range(0, len(leaves), 2)])
        for p, leaf, st in zip(now, leaves, state):
            adam(p, leaf.grad, st)
    final = [flat([now[k], now[k + 1]], n) for k in range(0, len(now), 2)]
    inputs = [{"params": params, "x": [x for x, _ in data[r]], "y": [y for _, y in data[r]]} for r in range(n)]
    return inputs, {"grads": grads, "final": final, "padded": [f.numel() for f in final]}


# ---------------------------------------------------------------- what the rank records
def _numel(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, (list, tuple)):
        return sum(_numel(v) for v in value)
    return 0


@contextmanager
def recording(log: list):
    """Within the block, every all-gather, reduce-scatter and all-reduce of a ProcessGroup is logged: its kind,
    its call number and the elements of its full side (an all-gather's output, a reduce-scatter's input)."""
    from torch._C import _distributed_c10d as c10d
    calls, saved = [0], []

    def make(name, original):
        kind = KIND[name]

        def collective(self, *args, **kwargs):
            full = args[0] if kind != SCATTER else args[1] if len(args) > 1 else None
            log.append((kind, calls[0], _numel(full)))
            calls[0] += 1
            return original(self, *args, **kwargs)
        collective.__name__ = name
        return collective
    try:
        for name in KIND:
            original = c10d.ProcessGroup.__dict__.get(name)
            if original is not None:
                saved.append((name, original))
                setattr(c10d.ProcessGroup, name, make(name, original))
        yield
    finally:
        for name, original in reversed(saved):
            setattr(c10d.ProcessGroup, name, original)


def _storage(t) -> tuple[int, int] | None:
    try:
        if t is None or not isinstance(t, torch.Tensor) or t.dim() == 0 or t.is_meta:
            return None
        s = t.untyped_storage()
        return (s.data_ptr(), s.nbytes()) if s.nbytes() else None
    except Exception:       # a sparse or wrapper tensor: no storage of its own
        return None


def held_bytes(units, module, records) -> int:
    """Bytes of the storages of every tensor (of at least one dimension) made since `gc.freeze()` (the garbage
    collector lists only those: what the rank built after the student's module was imported) and still alive,
    the units' parameters and their .grad, and what the student's module holds at its top level, each storage
    once, less the storages of the grader's `records`."""
    gc.collect()
    found = {_storage(o) for o in gc.get_objects() if issubclass(type(o), torch.Tensor)}
    for m in units:
        for p in m.parameters():
            found |= {_storage(p), _storage(p.grad)}
    found |= {_storage(t) for t in _tensors(list(vars(module).values()))}
    found -= {_storage(t) for t in _tensors(records)}
    return sum(nbytes for _, nbytes in found - {None})


def at_rest(units, module, records, tries: int = 3) -> int:
    """`held_bytes` once the ranks are done: after a barrier, the least of a few measurements 20 ms apart (a
    collective's worker thread lets go of the tensors of a finished call a moment after it returned)."""
    import time

    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
    held = []
    for k in range(tries):
        held.append(held_bytes(units, module, records))
        if k + 1 < tries:
            time.sleep(0.02)
    return min(held)


def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _copies(value) -> list | None:
    """A list of tensors (the student's `zero.grads` or `zero.shards`) copied out, or None."""
    if type(value) is not list or not all(isinstance(t, torch.Tensor) for t in value):
        return None
    return [t.detach().clone() for t in value]


def _install(units, log) -> None:
    """The grader's hooks, registered after the student's: on each unit's forward (start, end), its output's
    gradient (its backward starts) and each parameter's accumulated gradient."""
    def freed(m):
        return int(all(p.untyped_storage().nbytes() == 0 for p in m.parameters()))

    def after(m, args, out, u):
        log.append((FREED, u, freed(m)))
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda g: log.append((BACKWARD, u, 0)))
    for u, m in enumerate(units):
        m.register_forward_pre_hook(lambda m, args, u=u: log.append((FORWARD, u, 0)))
        m.register_forward_hook(lambda m, args, out, u=u: after(m, args, out, u))
        for i, p in enumerate(m.parameters()):
            REGISTER(p, lambda p, u=u, i=i: log.append((READY, u, i)))


def run_rank(module, inputs: dict, rank: int, device, wire: dict) -> dict:
    gc.freeze()         # what is alive now (torch, par, the student's module, the inputs) is not listed again
    try:
        params = inputs["params"]
        units = [Layer(params[k].clone().to(device), params[k + 1].clone().to(device), k + 2 == len(params))
                 for k in range(0, len(params), 2)]
        log: list = []
        grads, logs = [], []
        with recording(log):
            zero = module.Zero3(units, LR)
            _install(units, log)
            for step in range(STEPS):
                log.clear()
                h = inputs["x"][step].to(device)
                for m in units:
                    h = m(h)
                loss = F.mse_loss(h, inputs["y"][step].to(device))
                loss.backward()
                log.append((END, 0, 0))
                del h, loss
                grads.append(_copies(getattr(zero, "grads", None)))
                zero.step()
                logs.append(torch.tensor(log, dtype=torch.int64).reshape(-1, 3))
            held = at_rest(units, module, [inputs, grads, logs])
    finally:
        gc.unfreeze()
    return {"grads": grads, "shards": _copies(getattr(zero, "shards", None)), "log": logs, "held": held}


# ---------------------------------------------------------------- the grader's judgment
def _list(out, key):
    value = out.get(key) if out is not None else None
    return value if type(value) is list else None


def _shard(shards, u: int, part: int):
    t = rank_io.tensor({"s": shards}, "s", u) if shards is not None else None
    return t if t is not None and tuple(t.shape) == (part,) else None


def schedule_problem(log: torch.Tensor | None, sizes: list[int]) -> str:
    """The first fault of one rank's step, from its log ("" if none): a unit not freed after its forward, an
    all-gather missing, extra or of the wrong size before a unit's forward or backward, a reduce-scatter missing
    or late, an all-reduce."""
    if log is None or log.dtype != torch.int64 or log.dim() != 2 or log.shape[1] != 3:
        return "no schedule was recorded"
    rows = [tuple(int(v) for v in row) for row in log]
    units = len(sizes)
    at = {}
    for pos, (kind, a, _) in enumerate(rows):
        if kind in (FORWARD, FREED, BACKWARD, END):
            at.setdefault((kind, a), pos)
        elif kind == READY:
            at.setdefault((READY, a), pos)
    need = [(k, u) for u in range(units) for k in (FORWARD, FREED, BACKWARD, READY)] + [(END, 0)]
    if any(key not in at for key in need):
        return "forward and backward did not run through every unit once"
    ar = [k for kind, _, k in rows if kind == ALLREDUCE]
    if ar:
        return (f"an all-reduce of {ar[0]} elements: ZeRO-3 reduce-scatters a unit's gradient, so that each rank "
                f"receives only its own partition")

    def between(kind, lo, hi):
        return [k for pos, (c, _, k) in enumerate(rows) if c == kind and lo < pos < hi]
    for u in range(units):
        start = at[(FREED, u - 1)] if u else -1
        found = between(GATHER, start, at[(FORWARD, u)])
        if found != [sizes[u]]:
            return (f"unit {u}'s forward: {len(found)} all-gather(s) of {found} elements right before it, against "
                    f"one of the unit's padded flat size {sizes[u]}")
    for u in reversed(range(units)):
        start = at[(BACKWARD, u + 1)] if u + 1 < units else at[(FREED, units - 1)]
        found = between(GATHER, start, at[(BACKWARD, u)])
        if found != [sizes[u]]:
            return (f"unit {u}'s backward: {len(found)} all-gather(s) of {found} elements right before it, against "
                    f"one of the unit's padded flat size {sizes[u]} (freed after the forward, gathered again)")
        end = at[(READY, u - 1)] if u else at[(END, 0)]
        found = between(SCATTER, at[(BACKWARD, u)], end)
        if found != [sizes[u]]:
            return (f"unit {u}'s backward: {len(found)} reduce-scatter(s) of {found} elements before the previous "
                    f"unit's gradients, against one of the unit's padded flat size {sizes[u]} as soon as its "
                    f"gradients are ready")
    extra = len([r for r in rows if r[0] in (GATHER, SCATTER)]) - 3 * units
    if extra:
        return f"{extra} all-gather(s) or reduce-scatter(s) more than two all-gathers and one reduce-scatter per unit"
    return ""


def verify(args: Args, context: dict, outputs: list) -> dict:
    n, sizes = len(outputs), context["padded"]
    parts = [s // n for s in sizes]
    grad_error, problem, memory_problem, held = 0.0, "", "", []
    formula = 4 * (1 + 1 + 2) * sum(parts)
    for r, out in enumerate(outputs):
        grads, logs = _list(out, "grads"), _list(out, "log")
        for step in range(STEPS):
            mine = grads[step] if grads is not None and step < len(grads) and type(grads[step]) is list else None
            for u, want in enumerate(context["grads"][step]):
                grad_error = max(grad_error, rank_io.error(_shard(mine, u, parts[u]),
                                                           want[r * parts[u]:(r + 1) * parts[u]]))
            log = rank_io.tensor({"l": logs}, "l", step) if logs is not None else None
            found = schedule_problem(log, sizes)
            if found and not problem:
                problem = f"rank {r}, step {step + 1}: {found}"
            if log is not None and not memory_problem and found != "no schedule was recorded":
                kept = [u for kind, u, f in log.tolist() if kind == FREED and f != 1]
                if kept:
                    memory_problem = (f"rank {r}, step {step + 1}: unit {kept[0]}'s parameters still held memory "
                                      f"after its forward (free them after use)")
        value = out.get("held") if out is not None else None
        if type(value) is not int:
            memory_problem = memory_problem or f"rank {r}: no memory was measured"
            continue
        held.append(value)
        if value != formula and not memory_problem:
            memory_problem = (f"rank {r}, after the last step: {value} bytes held at rest, against "
                              f"4·(1 + 1 + 2)·Σ padded/N = {formula} (the parameter shard, its gradient, "
                              f"Adam's m and v: {value / formula:.2f} times that)")
    worst = 0.0
    for u, want in enumerate(context["final"]):
        got = [_shard(_list(out, "shards"), u, parts[u]) for out in outputs]
        whole = torch.cat(got) if all(t is not None for t in got) else None
        worst = max(worst, rank_io.error(whole, want))
    ring = 3 * (n - 1) / n * 4 * sum(sizes)
    return {"world_size": n,
            "params": {"ok": max(worst, grad_error) <= TOLERANCE, "max_error": worst, "grad_error": grad_error},
            "memory": {"ok": not memory_problem, "problem": memory_problem, "held": max(held, default=0),
                       "formula": formula},
            "gathers": {"ok": not problem, "problem": problem, "units": len(sizes), "all_gathers": 2 * len(sizes),
                        "reduce_scatters": len(sizes), "ring_bytes": ring}}


if __name__ == "__main__":
    raise SystemExit(rank_io.main(sys.modules[__name__]))
