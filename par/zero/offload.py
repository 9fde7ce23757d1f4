"""ZeRO-Offload: the optimizer lives on the CPU, forward and backward stay on the device.

Ren et al. (2021) split training into a cheap part and an expensive part.
Forward and backward cost O(Ψ·B) (B the batch size) and stay on the GPU; the
parameter update costs O(Ψ) but needs the K bytes per parameter of optimizer
state, so it moves, with that state, to the CPU and its much larger memory:

    device:  params (wΨ) + gradients            host:  fp32 master partition + Adam m, v  (4+8 per element)

    each step:  gradient partition  ── device → host (g bytes/element) ──▶  Adam on the CPU
                updated partition   ◀── host → device (w bytes/element) ──  (the new parameters)

Per rank that is g·Ψ/N_d bytes down and w·Ψ/N_d up per step, over PCIe
(`transfer_bytes_per_step`); at a bandwidth of B bytes/s they take
(g + w)·Ψ/N_d / B seconds (`transfer_seconds`) unless overlapped with backward.

The updater that does it is `par.zero.updaters.CPUOffload` (`Zero(offload=True)` builds it): it keeps
the master copy and the optimizer state on the host and counts the bytes it moves each way.
On a CPU-only run "host" and "device" are the same memory: the copies are made and counted,
but nothing crosses a bus, so their time is not what a GPU would pay; `transfer_seconds` is.
"""
from __future__ import annotations

from par.zero.updaters import CPUOffload  # noqa: F401  (the updater, for `from par.offload import CPUOffload`)

# PCIe 4.0 x16 moves 32 GB/s per direction in theory and about 20-25 GB/s in practice; the planner's
# host link (`par.train.planner.Hardware.bw_host`) uses the same 20 GB/s.
PCIE_BYTES_PER_S = 20e9


def transfer_bytes_per_step(numel: int, world: int, grad_bytes: int = 4, param_bytes: int = 4) -> dict:
    """Bytes one rank moves per step: its gradient partition down, its updated parameters up (⌈Ψ/N_d⌉ each)."""
    part = -(-numel // world)
    return {"to_host": part * grad_bytes, "to_device": part * param_bytes}


def transfer_seconds(numel: int, world: int, grad_bytes: int = 4, param_bytes: int = 4,
                     bandwidth: float = PCIE_BYTES_PER_S) -> dict:
    """Seconds the two copies of one step take at `bandwidth` bytes/s, one direction at a time:
    (g + w)·⌈Ψ/N_d⌉ / bandwidth."""
    moved = transfer_bytes_per_step(numel, world, grad_bytes, param_bytes)
    out = {k: v / bandwidth for k, v in moved.items()}
    out["total"] = out["to_host"] + out["to_device"]
    return out
