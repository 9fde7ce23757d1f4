"""Exercise 06's check on real ranks: the student's ZeRO-3 (each unit gathered before its use and freed after
it, its gradients reduce-scattered into the local shard, Adam on the shard), judged by the grader.

    par.runtime.launch.run("par.course.grading.exercise_zero3", nproc=2, args=["--answer", "my_zero3.py"])

A small MLP is given to every rank as a list of units (`par.course.grading.units`: one Linear layer each, tanh
after all but the last; widths drawn at random, so that some units' flat size divides N and some do not), each
rank its own batches.
On every rank the student's `Zero3(units, lr)` shards the units and registers its hooks; then, for each of
STEPS steps, the rank runs forward and backward of the MSE loss through the units, reads the student's
gradient shards (`zero.grads`), calls `zero.step()`, and measures what it holds. After the last step it reads
the student's parameter shards (`zero.shards`). The expected values are computed by the grader before the job
starts: each step's gradient averaged over the ranks (flat, padded, per unit) and the parameters after STEPS
steps of Adam (`adam`: torch.optim.Adam's step) on that average, in one process.

What happened is recorded outside the student's process: each record goes to the grader the moment it is made
(`par.course.grading.ledger`), so nothing the student's code does afterwards changes it. The grader's hooks are
registered after the student's, so on each module, output and parameter they run right after the student's:

    STEP s              step s starts (the records until the next STEP are that step's)
    FORWARD u, 0        unit u's forward starts (after the student's gather)
    FREED u, f          unit u's forward returned; f = 1 when every storage its parameters pointed to as its
                        forward started (the gathered parameters) then held no bytes or was gone: resized to 0, as
                        FSDP frees, so that autograd's saved views of it hold nothing either (a parameter pointed at
                        an empty tensor while autograd keeps the gathered one alive is not freed)
    BACKWARD u, 0       the gradient of unit u's output is ready: unit u's backward starts (after a re-gather)
    READY u, i          parameter i of unit u has its gradient
    GATHER c, k         an all-gather whose output holds k elements (every ProcessGroup all-gather, wrapped)
    SCATTER c, k        a reduce-scatter whose input holds k elements
    ALLREDUCE c, k      an all-reduce of k elements
    END 0, 0            loss.backward() returned
    HELD b, 0           after the last step: the bytes held at rest (`held_bytes`, `at_rest`)

The bytes held at rest are the storages, each once, of every tensor and storage object the garbage collector can
reach (any `gc.freeze()` undone first; the gc functions are bound before the student's module is imported) that
did not exist before the units were built, plus the growth of those that did (`snapshot`, weak references taken
before), the units' parameters and their .grad, and the tensors at the top level of the student's module, less
the grader's own copies; tensors of no dimension are not counted. (A tensor the student's module allocated when
it was imported and keeps out of sight, or one only C++ holds, such as a Work's, is not counted: the guarantee is
for what it builds and keeps in Python.)

`verify` judges, in the grader's process from the raw outputs and the records: the gradient shards and the
parameters (max |yours − expected| over ranks, steps and units); the memory (every unit freed after its forward;
the bytes at rest equal to 4·(1 + 1 + 2)·Σ padded/N: the parameter shard, its gradient and Adam's m and v, fp32);
the communication (per unit and step one all-gather of its padded flat size before its forward and one before
its backward, each issued in the order the pass reaches the units and at most one unit ahead, as DeepSpeed's and
FSDP's prefetch does: unit u + 1's as unit u's forward starts or runs, unit u − 1's as unit u's backward starts
or runs; one reduce-scatter of it during its backward, before the previous unit's gradients; no all-reduce).

par's `Zero` is refused on the ranks (`EXERCISE.forbidden`) and stubbed in the sandbox's par (`EXERCISE.stubs`); torch's
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
import torch.nn.functional as F

from par.course.grading import ledger, rank_io
from par.course.grading.exercise import Exercise
from par.course.grading.units import units as make_units
from par.runtime.job_args import JobArgs, arg

PRELOAD = ("torch",)    # what par.runtime.agent imports before it forks the ranks: no optimizer step, no dispatch
#                         mode here, so the ranks never import torch._dynamo

EXERCISE = Exercise(
    "06_zero", runner=__name__,
    why="write the gather, the free and the reduce-scatter yourself with torch.distributed's collectives",
    forbidden=[("par.zero.engine", "Zero")],
    p2p_only=False,
    stubs=[("par.zero.engine", n) for n in ("Zero", "Unit", "_free", "_alloc")] +
           [("par.zero.flat", "FlatParams")])
STEPS, LR, TOLERANCE = 2, 1e-2, 1e-5
FORWARD, FREED, BACKWARD, READY, GATHER, SCATTER, ALLREDUCE, END, STEP, HELD = range(10)
# bound before any student module is imported (rank_io.main imports this module first): what the student's module
# replaces later (torch's methods, gc's functions) is not what the grader calls
REGISTER = torch.Tensor.register_post_accumulate_grad_hook
COLLECT, OBJECTS, FREEZE, UNFREEZE = gc.collect, gc.get_objects, gc.freeze, gc.unfreeze
STORAGE_OF, DIM, IS_META = (torch._C.TensorBase.untyped_storage, torch._C.TensorBase.dim,
                            torch._C.TensorBase.__dict__["is_meta"].__get__)
NBYTES, ADDRESS = torch._C.StorageBase.nbytes, torch._C.StorageBase.__dict__["_cdata"].__get__
WEAK_REF, FROM_WEAK, FREE_WEAK = (torch._C.StorageBase._weak_ref, torch._C.StorageBase._new_with_weak_ptr,
                                  torch._C.StorageBase._free_weak_ref)
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
def recording():
    """Within the block, every all-gather, reduce-scatter and all-reduce of a ProcessGroup is recorded: its kind,
    its call number and the elements of its full side (an all-gather's output, a reduce-scatter's input)."""
    from torch._C import _distributed_c10d as c10d
    calls, saved = [0], []

    def make(name, original):
        kind = KIND[name]

        def collective(self, *args, **kwargs):
            full = args[0] if kind != SCATTER else args[1] if len(args) > 1 else None
            ledger.record(kind, calls[0], _numel(full))
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


# ---------------------------------------------------------------- the storages a rank holds
def _storage(o) -> torch.UntypedStorage | None:
    """The storage of a tensor of at least one dimension, or of a storage object; None for anything else."""
    try:
        if isinstance(o, torch.Tensor):
            return None if DIM(o) == 0 or IS_META(o) else STORAGE_OF(o)
        if isinstance(o, torch.UntypedStorage):
            return o
        if isinstance(o, torch.TypedStorage):
            return o._untyped_storage
    except Exception:       # a sparse or wrapper tensor: no storage of its own
        return None
    return None


class StorageRef:
    """A weak reference to a storage (torch's C API, which torch.multiprocessing's StorageWeakRef wraps): while it
    lives, the storage's address is not reused by another."""
    __slots__ = ("cdata",)

    def __init__(self, storage: torch.UntypedStorage):
        self.cdata = WEAK_REF(storage)

    def get(self) -> torch.UntypedStorage | None:
        """The storage, or None once no reference to it is left."""
        return FROM_WEAK(self.cdata)

    def __del__(self):
        FREE_WEAK(self.cdata)


STORING = (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)


def alive() -> dict[int, torch.UntypedStorage]:
    """Every storage reachable from an object the garbage collector tracks (tensors and storage objects), by
    its address; any `gc.freeze()` undone first, so that nothing is hidden in the frozen generation."""
    UNFREEZE()
    found, storing = {}, {}
    for o in OBJECTS():
        kind = type(o)
        hit = storing.get(kind)
        if hit is None:
            hit = storing[kind] = issubclass(kind, STORING)
        if hit and (s := _storage(o)) is not None:
            found[ADDRESS(s)] = s
    return found


def snapshot() -> dict:
    """{address: (weak reference, bytes)} of every storage alive now (`alive`). Then every object alive leaves the
    collector again (frozen, as the agent freezes its imports before it forks the ranks), so that the run's
    collections, and the one `at_rest` makes, look only at what was made since."""
    before = {address: (StorageRef(s), NBYTES(s)) for address, s in alive().items()}
    FREEZE()
    return before


def held_bytes(units, module, records, before: dict) -> int:
    """Bytes of every storage alive (`alive`) that is not in `before`, the growth of those that are, and all of the
    units' parameters and their .grad and of the tensors at the top level of the student's module, each storage
    once, less the storages of the grader's `records`."""
    shown = {}
    for t in [x for m in units for p in m.parameters() for x in (p, p.grad)] + _tensors(list(vars(module).values())):
        if (s := _storage(t)) is not None:
            shown[ADDRESS(s)] = s
    grader = {ADDRESS(s) for t in _tensors(records) if (s := _storage(t)) is not None}
    total = 0
    for address, s in {**alive(), **shown}.items():
        if address in grader:
            continue
        was = before.get(address) if address not in shown else None
        total += max(0, NBYTES(s) - was[1]) if was is not None else NBYTES(s)
    return total


def at_rest(units, module, records, before: dict, tries: int = 3) -> int:
    """`held_bytes` once the ranks are done: after a barrier and a collection (of the cycles the run left), the
    least of up to `tries` measurements 20 ms apart, until two in a row agree (a collective's worker thread lets go
    of the tensors of a finished call a moment after it returned)."""
    import time

    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
    COLLECT()
    held = [held_bytes(units, module, records, before)]
    while len(held) < tries and (len(held) < 2 or held[-1] != held[-2]):
        time.sleep(0.02)
        held.append(held_bytes(units, module, records, before))
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


# ---------------------------------------------------------------- the grader's hooks
def released(refs) -> bool:
    """Every storage of `refs` (weak references) holds no bytes or is gone; a storage still held is looked at again
    after a collection (a reference cycle the collector has not broken yet)."""
    def empty():
        return all((s := ref.get()) is None or NBYTES(s) == 0 for ref in refs)
    if empty():
        return True
    COLLECT()
    return empty()


def _install(units) -> None:
    """The grader's hooks, registered after the student's: on each unit's forward (start: the storages its
    parameters point to; end: whether they were released), its output's gradient (its backward starts) and each
    parameter's accumulated gradient."""
    used: dict[int, list] = {}

    def before(m, u):
        ledger.record(FORWARD, u)
        storages = {ADDRESS(s): s for p in m.parameters() if (s := _storage(p)) is not None}
        used[u] = [StorageRef(s) for s in storages.values()]

    def after(m, out, u):
        ledger.record(FREED, u, int(released(used.pop(u, []))))
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda g: ledger.record(BACKWARD, u))
    for u, m in enumerate(units):
        m.register_forward_pre_hook(lambda m, args, u=u: before(m, u))
        m.register_forward_hook(lambda m, args, out, u=u: after(m, out, u))
        for i, p in enumerate(m.parameters()):
            REGISTER(p, lambda p, u=u, i=i: ledger.record(READY, u, i))


def run_rank(module, inputs: dict, rank: int, device, wire: dict) -> dict:
    before = snapshot()         # what is alive now (torch, par, the student's module, the inputs) is not counted
    params = inputs["params"]
    units = make_units(params, device)
    grads = []
    with recording():
        zero = module.Zero3(units, LR)
        _install(units)
        for step in range(STEPS):
            ledger.record(STEP, step)
            h = inputs["x"][step].to(device)
            for m in units:
                h = m(h)
            loss = F.mse_loss(h, inputs["y"][step].to(device))
            loss.backward()
            ledger.record(END)
            del h, loss
            grads.append(_copies(getattr(zero, "grads", None)))
            zero.step()
        ledger.record(HELD, at_rest(units, module, grads, before))
    return {"grads": grads, "shards": _copies(getattr(zero, "shards", None))}


# ---------------------------------------------------------------- the grader's judgment
def _list(out, key):
    value = out.get(key) if out is not None else None
    return value if type(value) is list else None


def _shard(shards, u: int, part: int):
    t = rank_io.tensor({"s": shards}, "s", u) if shards is not None else None
    return t if t is not None and tuple(t.shape) == (part,) else None


def schedule_problem(rows: list | None, sizes: list[int]) -> str:
    """The first fault of one rank's step, from its records ((kind, a, b) rows; "" if none): a pass that did not
    run through every unit, an all-reduce, an all-gather missing, extra, of the wrong size or more than one unit
    ahead in the forward or the backward (`gathers_problem`), a reduce-scatter missing or late."""
    if rows is None:
        return "no schedule was recorded"
    units = len(sizes)
    at = {}
    for pos, (kind, a, _) in enumerate(rows):
        if kind in (FORWARD, FREED, BACKWARD, READY, END):
            at.setdefault((kind, a), pos)
    need = [(k, u) for u in range(units) for k in (FORWARD, FREED, BACKWARD, READY)] + [(END, 0)]
    if any(key not in at for key in need):
        return "forward and backward did not run through every unit once"
    ar = [k for kind, _, k in rows if kind == ALLREDUCE]
    if ar:
        return (f"an all-reduce of {ar[0]} elements: ZeRO-3 reduce-scatters a unit's gradient, so that each rank "
                f"receives only its own partition")
    turn = at[(FREED, units - 1)]            # the forward's end
    gathers = [(pos, k) for pos, (kind, _, k) in enumerate(rows) if kind == GATHER]
    found = gathers_problem([g for g in gathers if g[0] < turn], list(range(units)), sizes, "forward",
                            lambda u: at[(FREED, u - 2)] if u >= 2 else -1, lambda u: at[(FORWARD, u)])
    found = found or gathers_problem([g for g in gathers if g[0] > turn], list(reversed(range(units))), sizes,
                                     "backward", lambda u: at[(BACKWARD, u + 2)] if u + 2 < units else turn,
                                     lambda u: at[(BACKWARD, u)])
    if found:
        return found
    for u in reversed(range(units)):
        end = at[(READY, u - 1)] if u else at[(END, 0)]
        found = [k for pos, (kind, _, k) in enumerate(rows) if kind == SCATTER and at[(BACKWARD, u)] < pos < end]
        if found != [sizes[u]]:
            return (f"unit {u}'s backward: {len(found)} reduce-scatter(s) of {found} elements before the previous "
                    f"unit's gradients, against one of the unit's padded flat size {sizes[u]} as soon as its "
                    f"gradients are ready")
    extra = len([r for r in rows if r[0] in (GATHER, SCATTER)]) - 3 * units
    if extra:
        return f"{extra} all-gather(s) or reduce-scatter(s) more than two all-gathers and one reduce-scatter per unit"
    return ""


def gathers_problem(gathers: list, order: list[int], sizes: list[int], phase: str, lo, hi) -> str:
    """The first fault of one pass's all-gathers ((position, elements), in the order issued), "" if none: the k-th
    is unit order[k]'s, of its padded flat size, issued after position lo(u) (the pass has finished with the unit
    two before it: at most one unit ahead, a prefetch) and before hi(u) (the unit computes); one per unit."""
    again = " (freed after the forward, gathered again)" if phase == "backward" else ""
    for k, u in enumerate(order):
        if k >= len(gathers) or gathers[k][0] > hi(u):
            return (f"unit {u}'s {phase}: no all-gather of it before it, against one of the unit's padded flat size "
                    f"{sizes[u]}{again}")
        pos, got = gathers[k]
        if got != sizes[u]:
            return (f"unit {u}'s {phase}: its all-gather holds {got} elements, against the unit's padded flat size "
                    f"{sizes[u]} (one all-gather per unit, in the order the {phase} reaches them)")
        if pos < lo(u):
            return (f"unit {u}'s {phase}: all-gathered more than one unit ahead (prefetch the next unit only, while "
                    f"the unit before it computes)")
    if len(gathers) > len(order):
        return f"the {phase}: {len(gathers) - len(order)} all-gather(s) more than one per unit"
    return ""


def verify(args: Args, context: dict, outputs: list) -> dict:
    n, sizes = len(outputs), context["padded"]
    parts = [s // n for s in sizes]
    grad_error, problem, memory_problem, held = 0.0, "", "", []
    formula = 4 * (1 + 1 + 2) * sum(parts)
    for r, out in enumerate(outputs):
        grads = _list(out, "grads")
        steps = ledger.segments(out.get("ledger") if out is not None else None, STEP, STEPS)
        for step in range(STEPS):
            mine = grads[step] if grads is not None and step < len(grads) and type(grads[step]) is list else None
            for u, want in enumerate(context["grads"][step]):
                grad_error = max(grad_error, rank_io.error(_shard(mine, u, parts[u]),
                                                           want[r * parts[u]:(r + 1) * parts[u]]))
            rows = steps[step] if steps is not None else None
            found = schedule_problem(rows, sizes)
            if found and not problem:
                problem = f"rank {r}, step {step + 1}: {found}"
            kept = [u for kind, u, f in rows or [] if kind == FREED and f != 1]
            if kept and not memory_problem:
                memory_problem = (f"rank {r}, step {step + 1}: unit {kept[0]}'s gathered parameters still held "
                                  f"memory after its forward (free their storage after use, as FSDP does with "
                                  f"resize_(0): parameters pointed at another tensor leave the gathered one to "
                                  f"autograd, which keeps it for backward)")
        value = max((b for kind, b, _ in steps[-1] if kind == HELD), default=None) if steps is not None else None
        if value is None:
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
