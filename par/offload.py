"""ZeRO-Offload: the optimizer lives on the CPU, forward and backward stay on the device.

Ren et al. (2021) split training into a cheap part and an expensive part.
Forward and backward cost O(Ψ·B) (B the batch size) and stay on the GPU; the
parameter update costs O(Ψ) but needs the K bytes per parameter of optimizer
state, so it moves, with that state, to the CPU and its much larger memory:

    device:  params (wΨ) + gradients            host:  fp32 master partition + Adam m, v  (4+8 per element)

    each step:  gradient partition  ── device → host (g bytes/element) ──▶  Adam on the CPU
                updated partition   ◀── host → device (w bytes/element) ──  (the new parameters)

Per rank that is g·Ψ/N_d bytes down and w·Ψ/N_d up per step, over PCIe.
`CPUOffload` is the updater `par.zero.Zero(offload=True)` uses (`load_grads`,
then `apply`): it keeps the master copy and the optimizer state on the host, counts the bytes it moves
each way, and times the three phases when given a `par.timeline.Recorder`.
On a CPU-only run "host" and "device" are the same memory, but the copies,
the placement and the accounting are exactly those of a GPU run.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn as nn

from par.memory import tensor_bytes
from par.reference import make_optimizer
from par.zero import DeviceUpdate

HOST = torch.device("cpu")


def transfer_bytes_per_step(numel: int, world: int, grad_bytes: int = 4, param_bytes: int = 4) -> dict:
    """Bytes one rank moves per step: its gradient partition down, its updated parameters up (Ψ/N_d each)."""
    part = -(-numel // world)
    return {"to_host": part * grad_bytes, "to_device": part * param_bytes}


class CPUOffload(DeviceUpdate):
    """fp32 master partitions and their optimizer on the host; `step` moves grads down and params up.

    The same updater as `par.zero.DeviceUpdate` (clear_grads, masters, state_tensors), placed on the host."""

    def __init__(self, masters: list[torch.Tensor], optimizer: str, lr: float, recorder=None, **kw):
        """`masters`: this rank's partitions (their fp32 values are copied to the host)."""
        pin = any(p.device.type == "cuda" for p in masters) and torch.cuda.is_available()
        self.params = []
        for p in masters:
            host = torch.empty(p.shape, dtype=torch.float32, device=HOST, pin_memory=pin)
            host.copy_(p.detach())
            self.params.append(nn.Parameter(host))
        self.opt = make_optimizer(self.params, optimizer, lr, **kw)
        self.rec = recorder
        self.to_host_bytes = 0
        self.to_device_bytes = 0

    def _span(self, name: str, lane: str):
        return self.rec.span(name, lane=lane) if self.rec is not None else nullcontext()

    def load_grads(self, grads) -> None:
        """Device -> host: the reduced gradient partitions become the fp32 masters' .grad."""
        with self._span("grads to host", "copy"):
            for m, g in zip(self.params, grads):
                m.grad = g.detach().to(HOST, torch.float32, copy=True)   # a real copy, even on a CPU-only run
                self.to_host_bytes += g.numel() * g.element_size()

    def apply(self, partitions) -> None:
        """The update on the host, then host -> device: the new values into the device partitions."""
        with self._span("update on host", "host"):
            self.opt.step()
        with self._span("params to device", "copy"):
            for m, p in zip(self.params, partitions):
                p.copy_(m.detach(), non_blocking=True)
                self.to_device_bytes += p.numel() * p.element_size()
            if any(p.device.type == "cuda" for p in partitions):
                torch.cuda.current_stream().synchronize()
        self.clear_grads()

    def state_bytes(self) -> dict:
        """Everything here is on the host: the fp32 masters and the per-element optimizer state."""
        b = tensor_bytes(self.state_tensors() + self.params)
        return {"total": b, "device": 0, "host": b}

    def placement(self) -> dict:
        return {"master": str(self.params[0].device),
                "optimizer_state": str(self.state_tensors()[0].device) if self.state_tensors() else "none yet"}
