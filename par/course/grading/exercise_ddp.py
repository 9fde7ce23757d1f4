"""Exercise 02's check on real ranks: the student's DDP (gradient hooks, bucketed asynchronous all-reduces),
judged by the grader on its gradients, on when each bucket went out, and on its bytes.

    par.runtime.launch.run("par.course.grading.exercise_ddp", nproc=2, args=["--answer", "my_ddp.py"])

A small MLP (Linear layers, tanh between them; widths drawn at random) is given to every rank as a list of
parameters, with the buckets `par.dp.bucketed.assign_buckets` makes of them for a drawn cap, and each rank
gets its own batches. On every rank the student's `BucketedAllReduce(params, buckets)` registers its hooks;
then, for each of STEPS steps, the rank runs forward and backward of the MSE loss, calls the student's
`finish()`, and reads every `.grad` (then takes an SGD step itself). The expected gradients, the mean over
the ranks of each rank's gradient, as `DistributedDataParallel` averages them, are computed by the grader
before the job starts.

What the schedule was is recorded outside the student's process: each record goes to the grader the moment it
is made (`par.course.grading.ledger`), so nothing the student's code does afterwards changes it:

    STEP s         step s starts (the records until the next STEP are that step's)
    READY i        the grader's post-accumulate hook of parameter i, registered after the student's hooks
                   (so it runs after them: the student's hook that fills a bucket runs before this record)
    LAUNCH c, k    an all-reduce of k elements (ProcessGroup.allreduce, wrapped for the run: every
                   `dist.all_reduce` goes through it), call c
    WAIT c         the first wait of call c: its handle's wait(), or the wait() of its future
                   (`handle.get_future()`) or of a future chained to it with then()
    BACKWARD       loss.backward() returned
    FINISH         finish() returned; the grader's optimizer step comes next

As under NCCL, an all-reduced buffer holds NaN until its all-reduce is waited (the wrapper reduces a private
copy and writes it into the student's tensor at the first wait), so a bucket read before its wait is wrong.
The handle's future (`handle.get_future()`, DDP's comm-hook style) behaves as ProcessGroupNCCL's (`Future`): done
at once, its value the student's tensors, valid after a wait() and inside a then() callback, which therefore
runs at that first wait.

`verify` judges, in the grader's process from the raw outputs and the records: the gradients (max |yours - mean| over the
ranks, steps and parameters); the overlap (every bucket launched by the hook that filled it, i.e. before the
grader's record of the gradient that completed it; no all-reduce waited before the last gradient was ready;
every one waited before the step); the bytes (one all-reduce per bucket, of the bucket's size: Ψ elements
all-reduced, so a ring sends 2(N−1)/N·Ψ·4 bytes per rank).

Result: world_size, backend, and
    grads     {max_error, ok}
    overlap   {ok, problem}           problem: the first schedule fault found (rank, step, bucket), "" if none
    bytes     {ok, all_reduced, psi, calls, buckets, ring_bytes, formula_bytes, problem}
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from par.course.grading import ledger, rank_io
from par.course.grading.exercise import Exercise
from par.dp.bucketed import assign_buckets
from par.runtime.job_args import JobArgs, arg

PRELOAD = ("torch",)    # what par.runtime.agent imports before it forks the ranks: no optimizer step, no dispatch
#                         mode here, so the ranks never import torch._dynamo

EXERCISE = Exercise(
    "02_gradient_buckets", runner=__name__,
    why="write the hooks and the bucketed all-reduce yourself with torch.distributed.all_reduce(async_op=True)",
    forbidden=[("torch.nn.parallel", "DistributedDataParallel"), ("par.dp.bucketed", "BucketedDP")],
    p2p_only=False,
    stubs=[("par.dp.bucketed", n) for n in ("BucketedDP", "Bucket")])
STEPS, LR, TOLERANCE = 2, 0.1, 1e-5
READY, LAUNCH, WAIT, BACKWARD, FINISH, STEP = range(6)
REGISTER = torch.Tensor.register_post_accumulate_grad_hook    # bound before any student module is imported


@dataclass(frozen=True)
class Args(JobArgs):
    answer: str = arg("my_ddp.py", "the student's module file")
    io: str = arg("", "the grader's folder of inputs and outputs (par.course.grading.rank_io); none: rank 0 verifies")


# ---------------------------------------------------------------- the model and its expected gradients
def mlp_loss(params, x, y):
    """MSE of the MLP whose Linear layers are (params[0], params[1]), (params[2], params[3]), ... (tanh between)."""
    h = x
    for layer in range(0, len(params), 2):
        h = F.linear(h, params[layer], params[layer + 1])
        if layer + 2 < len(params):
            h = torch.tanh(h)
    return F.mse_loss(h, y)


def mean_gradients(params, batches):
    """The gradient DistributedDataParallel leaves on every rank: (1/N) Σ_r ∇ loss(params; rank r's batch)."""
    total = [torch.zeros_like(p) for p in params]
    for x, y in batches:
        leaves = [p.clone().requires_grad_() for p in params]
        mlp_loss(leaves, x, y).backward()
        total = [t + leaf.grad for t, leaf in zip(total, leaves)]
    return [t / len(batches) for t in total]


def make_inputs(args: Args, n: int, seed: int):
    """(each rank's parameters, buckets and batches; the expected gradients per step and the buckets)."""
    g = torch.Generator().manual_seed(seed)
    draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))      # noqa: E731
    widths = [draw(3, 9) for _ in range(draw(3, 4) + 1)]
    params = []
    for fan_in, fan_out in zip(widths, widths[1:]):
        params += [torch.randn(fan_out, fan_in, generator=g) / fan_in ** 0.5, torch.randn(fan_out, generator=g)]
    nbytes = [4 * p.numel() for p in params]
    cap = sum(nbytes) // draw(3, 5)                                     # three to five buckets, about
    buckets = assign_buckets(nbytes, cap)
    batch = draw(3, 6)
    data = [[(torch.randn(batch, widths[0], generator=g), torch.randn(batch, widths[-1], generator=g))
             for _ in range(STEPS)] for _ in range(n)]
    expected, now = [], [p.clone() for p in params]
    for step in range(STEPS):
        mean = mean_gradients(now, [data[r][step] for r in range(n)])
        expected.append(mean)
        now = [p - LR * m for p, m in zip(now, mean)]
    inputs = [{"params": params, "buckets": buckets, "x": [x for x, _ in data[r]], "y": [y for _, y in data[r]]}
              for r in range(n)]
    return inputs, {"expected": expected, "buckets": buckets, "numels": [p.numel() for p in params]}


# ---------------------------------------------------------------- what the rank records
class Handle:
    """What `dist.all_reduce(..., async_op=True)` returns during the run: the real Work, and the student's
    tensors, which get the reduced values (NaN until then, as under NCCL) at the first wait (`settle`)."""

    def __init__(self, work, mine, private, call):
        self._work, self._mine, self._private, self._call = work, mine, private, call
        self._waited, self._future = False, None

    def settle(self) -> None:
        """The first wait of this all-reduce, by whichever object: record WAIT, write the reduced values into the
        student's tensors, run the then() callbacks of its future."""
        if self._waited:
            return
        self._waited = True
        ledger.record(WAIT, self._call)
        self._work.wait()
        with torch.no_grad():
            for t, reduced in zip(self._mine, self._private):
                t.copy_(reduced)
        if self._future is not None:
            self._future._settled()

    def wait(self, timeout=None) -> bool:
        self.settle()
        return True

    def is_completed(self) -> bool:
        return self._waited

    def get_future(self) -> "Future":
        if self._future is None:
            self._future = Future(self, value=list(self._mine))
        return self._future

    def __getattr__(self, name):
        raise AttributeError(f"the all-reduce's handle offers wait(), is_completed() and get_future(), not {name}")


class Future:
    """`Handle.get_future()` and what its then() returns, as ProcessGroupNCCL's future behaves: done() at once (it
    is marked completed when the collective is enqueued, with its output tensors); value() without a wait is not
    synchronized (here: the NaN the tensors hold until the all-reduce is waited); wait() returns the value, valid;
    a then() callback sees valid values, so it runs at the first wait of the chain (`Handle.settle`), and its
    result is the value of the future then() returned (valid after that future's wait())."""

    def __init__(self, handle: Handle, value=None):
        self._handle, self._value, self._error, self._ready = handle, value, None, value is not None
        self._callbacks: list = []          # (callback, the future it fills, or None for add_done_callback)

    def wait(self):
        self._handle.settle()
        return self.value()

    def value(self):
        if self._error is not None:
            raise self._error
        if not self._ready:
            raise RuntimeError("value() of a then() future before its wait(): under NCCL its tensors are not "
                               "valid yet (call wait() first)")
        return self._value

    def done(self) -> bool:
        return True

    def then(self, callback) -> "Future":
        child = Future(self._handle)
        self._callbacks.append((callback, child))
        if self._handle.is_completed() and self._ready:
            self._settled()
        return child

    def add_done_callback(self, callback) -> None:
        self._callbacks.append((callback, None))
        if self._handle.is_completed() and self._ready:
            self._settled()

    def _settled(self) -> None:
        """Run the callbacks waiting on this future, in order; each fills its own future and runs that one's."""
        callbacks, self._callbacks = self._callbacks, []
        for callback, child in callbacks:
            try:
                result, error = callback(self), None
            except Exception as e:      # noqa: BLE001  (the student's callback: its error is its future's)
                result, error = None, e
            if child is not None:
                child._value, child._error, child._ready = result, error, True
                child._settled()

    def __getattr__(self, name):
        raise AttributeError(f"the all-reduce's future offers wait(), value(), then(), add_done_callback() and "
                             f"done(), not {name}")


@contextmanager
def recording():
    """Within the block, every ProcessGroup.allreduce is recorded (LAUNCH) and returns a Handle (WAIT on wait)."""
    from torch._C import _distributed_c10d as c10d
    original = c10d.ProcessGroup.allreduce
    calls = [0]

    def allreduce(self, tensors, *args, **kwargs):
        mine = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        call, calls[0] = calls[0], calls[0] + 1
        ledger.record(LAUNCH, call, sum(t.numel() for t in mine))
        private = [t.detach().clone() for t in mine]
        work = original(self, private, *args, **kwargs)
        with torch.no_grad():
            for t in mine:
                t.fill_(float("nan"))
        return Handle(work, mine, private, call)
    c10d.ProcessGroup.allreduce = allreduce
    try:
        yield
    finally:
        c10d.ProcessGroup.allreduce = original


def run_rank(module, inputs: dict, rank: int, device, wire: dict) -> dict:
    params = [p.clone().to(device).requires_grad_() for p in inputs["params"]]
    grads = []
    with recording():
        ddp = module.BucketedAllReduce(params, [list(b) for b in inputs["buckets"]])
        for i, p in enumerate(params):          # after the student's hooks: they run first
            REGISTER(p, lambda _, i=i: ledger.record(READY, i))
        for step in range(STEPS):
            ledger.record(STEP, step)
            x, y = inputs["x"][step].to(device), inputs["y"][step].to(device)
            mlp_loss(params, x, y).backward()
            ledger.record(BACKWARD)
            ddp.finish()
            ledger.record(FINISH)
            grads.append([p.grad.detach().clone() if p.grad is not None else None for p in params])
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p -= LR * p.grad
                    p.grad = None
    return {"grads": grads}


# ---------------------------------------------------------------- the grader's judgment
def _grad(out, step: int, i: int):
    value = out.get("grads") if out is not None else None
    value = value[step] if type(value) is list and step < len(value) else None
    return rank_io.tensor({"g": value}, "g", i) if type(value) is list else None


def schedule_problem(rows: list | None, buckets: list[list[int]], numels: list[int]) -> str:
    """The first fault of one rank's step, from its records ((kind, a, b) rows; "" if none): a bucket not launched
    by the hook that filled it, an all-reduce waited before the last gradient was ready, or not waited before the
    step."""
    if rows is None:
        return "no schedule was recorded"
    ready, launches, waits, end, finish = [], {}, {}, None, None
    for pos, (kind, a, b) in enumerate(rows):
        if kind == READY:
            ready.append(a)
        elif kind == LAUNCH:
            launches[a] = (len(ready), b)
        elif kind == WAIT:
            waits.setdefault(a, (len(ready), pos))
        elif kind == BACKWARD:
            end = len(ready)
        elif kind == FINISH:
            finish = pos
    if sorted(ready) != list(range(len(numels))) or end is None or finish is None:
        return "backward did not produce every gradient once"
    order = {i: k for k, i in enumerate(ready)}
    for b, bucket in enumerate(buckets):
        filled = max(order[i] for i in bucket)      # the student's hook for this gradient fills the bucket
        size = sum(numels[i] for i in bucket)
        if not any(at == filled and k == size for at, k in launches.values()):
            if any(at == len(ready) and k == size for at, k in launches.values()):
                return f"bucket {b} was launched only after backward ended: its all-reduce overlapped nothing"
            return (f"bucket {b} was not launched by the hook that filled it (one all-reduce of the whole "
                    f"bucket, as soon as its last gradient is ready)")
    for k, call in enumerate(sorted(launches), 1):
        if call not in waits or waits[call][1] > finish:
            return f"all-reduce {k} of the step was never waited before the optimizer step"
        if waits[call][0] < len(ready):
            return (f"all-reduce {k} of the step was waited during backward: backward stopped until it "
                    f"finished (wait every handle only after the last gradient is ready)")
    return ""


def verify(args: Args, context: dict, outputs: list) -> dict:
    expected, buckets, numels = context["expected"], context["buckets"], context["numels"]
    n, worst, problem = len(outputs), 0.0, ""
    all_reduced, calls, bytes_problem = [], [], ""
    for r, out in enumerate(outputs):
        steps = ledger.segments(out.get("ledger") if out is not None else None, STEP, STEPS)
        for step in range(STEPS):
            for i, want in enumerate(expected[step]):
                worst = max(worst, rank_io.error(_grad(out, step, i), want))
            rows = steps[step] if steps is not None else None
            found = schedule_problem(rows, buckets, numels)
            if found and not problem:
                problem = f"rank {r}, step {step + 1}: {found}"
            if rows is None:
                bytes_problem = bytes_problem or f"rank {r}, step {step + 1}: no all-reduce was recorded"
                continue
            sizes = sorted(k for kind, _, k in rows if kind == LAUNCH)
            calls.append(len(sizes))
            all_reduced.append(sum(sizes))
            want = sorted(sum(numels[i] for i in b) for b in buckets)
            if sizes != want and not bytes_problem:
                bytes_problem = (f"rank {r}, step {step + 1}: {len(sizes) - len(buckets):+d} all-reduce(s) against "
                                 f"one per bucket, {sum(sizes) / sum(numels):.2f} times the gradient's elements "
                                 f"all-reduced (each bucket once, of its own size: 1.00)")
    psi = sum(numels)
    most = max(all_reduced, default=0)
    ring = 2 * (n - 1) / n * 4 * most if n > 1 else 0.0
    return {"world_size": n, "grads": {"max_error": worst, "ok": worst <= TOLERANCE},
            "overlap": {"ok": not problem, "problem": problem},
            "bytes": {"ok": not bytes_problem, "problem": bytes_problem, "all_reduced": most, "psi": psi,
                      "calls": max(calls, default=0), "buckets": len(buckets), "ring_bytes": ring,
                      "formula_bytes": 2 * (n - 1) / n * 4 * psi if n > 1 else 0.0}}


if __name__ == "__main__":
    raise SystemExit(rank_io.main(sys.modules[__name__]))
