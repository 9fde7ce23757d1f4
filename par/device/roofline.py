"""The roofline of one device, measured: the matmul rate it reaches and the bytes per second it copies.

    time(op) ≥ max(FLOPs / P, bytes / B)         P: matmul FLOP/s, B: memory bandwidth (bytes/s)
    intensity I = FLOPs / bytes;   ridge point I* = P / B;   I < I*: memory-bound,  I > I*: compute-bound

An n×n by n×n matmul does 2n³ FLOPs on 3n² numbers (I = 2n/3 per element size: compute-bound for large n);
a copy moves 2·bytes (read and write) and computes nothing (I = 0: memory-bound). The peaks here are what
this machine reaches with torch's own kernels, the "achievable" peaks, below the datasheet's.
"""
from __future__ import annotations

import statistics
import time

import torch

from par.measure import sync

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _median_seconds(fn, device, repeats: int, warmup: int = 2) -> float:
    """Median wall seconds of `fn()` over `repeats` calls, the device synchronised around each."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_flops_per_s(device, dtype: str = "fp32", n: int | None = None, repeats: int = 5) -> float:
    """P = 2n³ / t: the FLOP/s of one n×n matmul in `dtype` (n: 8192 on a GPU, 1024 on a CPU)."""
    device = torch.device(device)
    n = n or (8192 if device.type == "cuda" else 1024)
    a, b = (torch.randn(n, n, device=device, dtype=DTYPES[dtype]) for _ in range(2))
    return 2 * n ** 3 / _median_seconds(lambda: a @ b, device, repeats)


def copy_bytes_per_s(device, mib: int | None = None, repeats: int = 5) -> float:
    """B = 2·bytes / t: a copy of `mib` MiB reads and writes each byte once (1 GiB on a GPU, 64 MiB on a CPU)."""
    device = torch.device(device)
    mib = mib or (1024 if device.type == "cuda" else 64)
    src = torch.empty(mib * 2 ** 20 // 4, device=device, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _median_seconds(lambda: dst.copy_(src), device, repeats)


def ridge_point(flops_per_s: float, bytes_per_s: float) -> float:
    """I* = P / B: the FLOPs per byte above which an operation is compute-bound."""
    return flops_per_s / bytes_per_s


def attainable(intensity: float, flops_per_s: float, bytes_per_s: float) -> float:
    """The roofline: min(P, I·B), the FLOP/s an operation of intensity I can reach."""
    return min(flops_per_s, intensity * bytes_per_s)


def op_intensities(fn, *args) -> list[dict]:
    """Run `fn(*args)` and list every aten operation it dispatches: {op, flops, bytes, intensity}. FLOPs by the
    formulas `torch.utils.flop_counter.FlopCounterMode` uses (its registry: matmuls and attention, 0 for the
    rest); intensity = FLOPs / bytes, where an operation FlopCounterMode does not count (elementwise, softmax,
    LayerNorm) is taken as one FLOP per output element; bytes = what the operation reads and writes, its tensor inputs and outputs once each (no cache).
    Views (an output that aliases an input: view, transpose, expand, ...) move nothing and are left out."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from torch.utils.flop_counter import flop_registry

    def nbytes(tree):
        return sum(t.numel() * t.element_size() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor))

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            name = func._overloadpacket.__name__
            if any(r.alias_info is not None for r in func._schema.returns) or name == "_unsafe_view":
                return out                                   # a view (view, transpose, expand...): moves nothing
            count = flop_registry.get(func._overloadpacket)
            f = count(*args, **kwargs, out_val=out) if count else 0
            b = nbytes(args) + nbytes(kwargs) + nbytes(out)
            work = f or sum(t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
            self.ops.append({"op": name, "flops": f, "bytes": b, "intensity": work / b if b else 0.0})
            return out

    with Recorder() as rec:
        fn(*args)
    return rec.ops
