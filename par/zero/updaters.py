"""Where a rank's partition is updated: on the training device, or on the host (ZeRO-Offload).

ZeRO (`par.zero.engine`) reduces the gradients so that each rank holds the averaged gradient of its
own partition, then hands them to an *updater*, which runs the optimizer over this rank's
partitions only and writes the new values back into the parameter buffers:

    updater.load_grads(grad_partitions)     the reduced gradients become the masters' .grad (fp32)
    updater.apply(param_partitions)         optimizer step on the masters, then masters -> partitions
    updater.clear_grads()                   a skipped step (fp16 overflow) drops the gradients

Two placements, one interface:

    DeviceUpdate   the optimizer on the training device. fp32: the masters *are* the partitions
                   (views, no copy). Mixed precision: fp32 copies of the 16-bit partitions.
    CPUOffload     the fp32 masters and the optimizer state on the host (Ren et al. 2021):
                   each step the gradient partition goes down (g·Ψ/N_d bytes) and the updated
                   partition comes back up (w·Ψ/N_d bytes). `par.zero.offload` has the formulas.

On a CPU-only run host and device are the same memory: `CPUOffload` still makes both copies and
counts them, so its placement and accounting are those of a GPU run, but nothing crosses a bus.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn as nn

from par.memory.accounting import tensor_bytes
from par.reference import make_optimizer

HOST = torch.device("cpu")


class DeviceUpdate:
    """The optimizer over this rank's partitions, on the training device.

    fp32: the optimizer's parameters *are* the partitions (views, no copy), so its update writes
    straight into the flat buffers. Mixed precision: they are fp32 master copies of the partitions,
    and `apply` rounds them back into the 16-bit partitions after the step.
    """

    def __init__(self, masters: list[torch.Tensor], optimizer: str, lr: float, copies: bool = False, **kw):
        self.params = [nn.Parameter(p, requires_grad=True) for p in masters]   # shares storage with `masters`
        self.copies = copies   # the masters are fp32 copies (mixed precision), not the partitions themselves
        self.opt = make_optimizer(self.params, optimizer, lr, **kw)

    def load_grads(self, grads) -> None:
        """The reduced gradient partitions become the masters' .grad (fp32; no copy when already fp32)."""
        for m, g in zip(self.params, grads):
            m.grad = g if g.dtype == torch.float32 else g.float()

    def apply(self, partitions) -> None:
        """The optimizer step on the masters, then the new values into the partitions (a no-op in fp32)."""
        self.opt.step()
        with torch.no_grad():
            for m, p in zip(self.params, partitions):
                if p.data_ptr() != m.data_ptr():
                    p.copy_(m)
        self.clear_grads()

    def clear_grads(self) -> None:
        for m in self.params:
            m.grad = None

    def masters(self) -> list[torch.Tensor]:
        return self.params

    def state_tensors(self) -> list[torch.Tensor]:
        """The optimizer's per-element state (Adam's m and v; not its 0-dim step counters)."""
        return [v for st in self.opt.state.values() for v in st.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0]

    def state_bytes(self) -> dict:
        """Per-element optimizer state, plus the fp32 masters when they are copies (mixed precision)."""
        b = tensor_bytes(self.state_tensors() + (self.params if self.copies else []))
        return {"total": b, "device": b, "host": 0}


class CPUOffload(DeviceUpdate):
    """fp32 master partitions and their optimizer on the host; `load_grads` moves the gradients down,
    `apply` steps on the host and moves the new values up. Counts the bytes it moves each way and,
    given a `par.timeline.Recorder`, records the three phases as spans (the copies on the "comm" lane,
    the update on the "compute" lane)."""

    def __init__(self, masters: list[torch.Tensor], optimizer: str, lr: float, recorder=None, **kw):
        """`masters`: this rank's partitions (their fp32 values are copied to the host)."""
        pin = any(p.device.type == "cuda" for p in masters) and torch.cuda.is_available()
        self.params = []
        for p in masters:
            host = torch.empty(p.shape, dtype=torch.float32, device=HOST, pin_memory=pin)
            host.copy_(p.detach())
            self.params.append(nn.Parameter(host))
        self.copies = True
        self.opt = make_optimizer(self.params, optimizer, lr, **kw)
        self.rec = recorder
        self.to_host_bytes = 0
        self.to_device_bytes = 0

    def _span(self, name: str, lane: str):
        return self.rec.span(name, lane=lane) if self.rec is not None else nullcontext()

    def load_grads(self, grads) -> None:
        """Device -> host: the reduced gradient partitions become the fp32 masters' .grad."""
        with self._span("grads to host", "comm"):
            for m, g in zip(self.params, grads):
                m.grad = g.detach().to(HOST, torch.float32, copy=True)   # a real copy, even on a CPU-only run
                self.to_host_bytes += g.numel() * g.element_size()

    def apply(self, partitions) -> None:
        """The update on the host, then host -> device: the new values into the device partitions."""
        with self._span("update on host", "compute"):
            self.opt.step()
        with self._span("params to device", "comm"):
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
