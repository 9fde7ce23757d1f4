"""The roofline of one device, measured: the matmul rate it reaches and the bytes per second it copies.

    time(op) ≥ max(FLOPs / P, bytes / B)         P: matmul FLOP/s, B: memory bandwidth (bytes/s)
    intensity I = FLOPs / bytes;   ridge point I* = P / B;   I < I*: memory-bound,  I > I*: compute-bound

An n×n by n×n matmul does 2n³ FLOPs on 3n² numbers (I = 2n/3 per element size: compute-bound for large n);
a copy moves 2·bytes (read and write) and computes nothing (I = 0: memory-bound). The peaks here are what
this machine reaches with torch's own kernels, the "achievable" peaks, below the datasheet's.

Every time here is read on the load-proof clock (`par.clock`: wall seconds less the calling thread's run-queue
wait, so other work on a shared CPU does not slow the roof; on a GPU the wall clock with the device synchronised):
the roof from the fastest of its runs (the best the device does), an operation's time as the median of its runs.
On a CPU the rates are those of the threads torch runs with (`torch.get_num_threads()`): the lectures measure on
one.

`op_rates` times every operation of a function the same way and gives each its measured rate beside its
intensity: where it sits under the roof.
"""
from __future__ import annotations

import statistics

import torch

from par import clock
from par.measure import sync

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SIZES = {"cpu": (256, 384, 512, 768, 1024), "cuda": (4096, 8192)}      # the matmuls the roof P is the fastest of


def _fastest_seconds(fn, device, repeats: int, warmup: int = 2) -> float:
    """The fastest of `repeats` calls of `fn()`, the device synchronised around each: on a CPU in steady seconds
    (wall less the thread's run-queue wait, `par.clock`), on a GPU on the wall clock. A roof is the best the device
    does, so the fastest run measures it."""
    for _ in range(warmup):
        fn()
    cuda = torch.device(device).type == "cuda"
    times = []
    for _ in range(repeats):
        sync(device)
        start = clock.read()
        fn()
        sync(device)
        took = clock.since(start)
        times.append(took.wall if cuda else took.steady)
    return min(times)


def matmul_flops_per_s(device, dtype: str = "fp32", n: int | None = None, repeats: int = 9) -> float:
    """P = max over n of 2n³ / t: the FLOP/s of an n×n matmul in `dtype`, the fastest of `repeats`, at the size
    that runs fastest (n given: that size alone; else 4096 and 8192 on a GPU, 256 to 1024 on a CPU, where a
    matmul whose three matrices fit the cache runs faster than a 1024² one). A roof is the best the device does:
    at one size alone an operation of another shape can run above it."""
    device = torch.device(device)
    sizes = (n,) if n else SIZES["cuda" if device.type == "cuda" else "cpu"]
    best = 0.0
    for k in sizes:
        a, b = (torch.randn(k, k, device=device, dtype=DTYPES[dtype]) for _ in range(2))
        best = max(best, 2 * k ** 3 / _fastest_seconds(lambda: a @ b, device, repeats))
    return best


def copy_bytes_per_s(device, mib: int | None = None, repeats: int = 9) -> float:
    """B = 2·bytes / t: a copy of `mib` MiB reads and writes each byte once, the fastest of `repeats` (1 GiB on a
    GPU, 64 MiB on a CPU). The size decides which memory it measures: a copy that fits a cache measures the
    cache."""
    device = torch.device(device)
    mib = mib or (1024 if device.type == "cuda" else 64)
    src = torch.empty(mib * 2 ** 20 // 4, device=device, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _fastest_seconds(lambda: dst.copy_(src), device, repeats)


def ridge_point(flops_per_s: float, bytes_per_s: float) -> float:
    """I* = P / B: the FLOPs per byte above which an operation is compute-bound."""
    return flops_per_s / bytes_per_s


def attainable(intensity: float, flops_per_s: float, bytes_per_s: float) -> float:
    """The roofline: min(P, I·B), the FLOP/s an operation of intensity I can reach."""
    return min(flops_per_s, intensity * bytes_per_s)


def _nbytes(tree) -> int:
    from torch.utils._pytree import tree_flatten
    return sum(t.numel() * t.element_size() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor))


def _op_recorder(timed: bool):
    """A dispatch mode that lists every aten operation run under it (`op_intensities`), with its steady seconds
    when `timed` (`op_rates`)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from torch.utils.flop_counter import flop_registry

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            start = clock.read() if timed else None
            out = func(*args, **kwargs)
            took = clock.since(start).steady if timed else None
            name = func._overloadpacket.__name__
            if any(r.alias_info is not None for r in func._schema.returns) or name == "_unsafe_view":
                return out                                   # a view (view, transpose, expand...): moves nothing
            count = flop_registry.get(func._overloadpacket)
            f = count(*args, **kwargs, out_val=out) if count else 0
            b = _nbytes(args) + _nbytes(kwargs) + _nbytes(out)
            work = f or sum(t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
            op = {"op": name, "flops": f, "bytes": b, "intensity": work / b if b else 0.0}
            if timed:
                op["work"], op["seconds"] = work, took
            self.ops.append(op)
            return out

    return Recorder()


def op_intensities(fn, *args) -> list[dict]:
    """Run `fn(*args)` and list every aten operation it dispatches: {op, flops, bytes, intensity}. FLOPs by the
    formulas `torch.utils.flop_counter.FlopCounterMode` uses (its registry: matmuls and attention, 0 for the
    rest); intensity = FLOPs / bytes, where an operation FlopCounterMode does not count (elementwise, softmax,
    LayerNorm) is taken as one FLOP per output element; bytes = what the operation reads and writes, its tensor inputs and outputs once each (no cache).
    Views (an output that aliases an input: view, transpose, expand, ...) move nothing and are left out."""
    with _op_recorder(timed=False) as rec:
        fn(*args)
    return rec.ops


def op_rates(fn, *args, repeats: int = 5, warmup: int = 1) -> list[dict]:
    """`op_intensities`' list for `fn(*args)` run `warmup + repeats` times on the CPU, each operation also with its
    measured time and rate: `work` (its FLOPs, or one per output element where FlopCounterMode counts none, as in
    its intensity), `seconds` (the median over the repeats of the steady seconds, `par.clock`, around the
    operation's own kernel: dispatch to it and back included, Python between operations not) and
    `rate` = work / seconds, the point the operation reaches under the roof. Every run must dispatch the same
    operations in the same order (a forward and backward does)."""
    runs = []
    for _ in range(warmup + repeats):
        with _op_recorder(timed=True) as rec:
            fn(*args)
        runs.append(rec.ops)
    runs = runs[warmup:]
    names = [o["op"] for o in runs[0]]
    if any([o["op"] for o in r] != names for r in runs):
        raise ValueError("op_rates: the runs dispatched different operations; time a function that runs the same "
                         "operations every time")
    out = []
    for i, op in enumerate(runs[0]):
        seconds = statistics.median(r[i]["seconds"] for r in runs)
        out.append({**op, "seconds": seconds, "rate": op["work"] / seconds if seconds > 0 else float("inf")})
    return out
