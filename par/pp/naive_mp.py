"""Naive model parallel: one process, the layers spread over several devices.

The classic form, before pipelines:

    stage 0 on cuda:0 ──activation──▶ stage 1 on cuda:1 ──▶ ... ──▶ loss
           ◀──────────gradient─────────        (autograd follows the tensors back)

`NaiveModelParallel(layers, ["cuda:0", "cuda:1"])` moves stage i to device i and its
forward hands the activation over with `.to(device)`. Only one device works at any
moment: while stage 1 computes, stage 0 waits for the gradient, and every stage
keeps its activations until the backward reaches it. On a machine without GPUs pass
["cpu", "cpu"]: same arithmetic, same idling.

`timed_step` runs the same forward and backward stage by stage and records when each
device is busy, which draws the idling as a timeline.
"""
from __future__ import annotations

import time

import torch
import torch.nn as nn

from par.measure import sync
from par.pp import partition


class NaiveModelParallel(nn.Module):
    """`layers` cut into len(devices) stages (see `par.pp.partition`), stage i living on devices[i]."""

    def __init__(self, layers, devices, method: str = "parameters"):
        super().__init__()
        self.devices = [torch.device(d) for d in devices]
        self.stages = nn.ModuleList(nn.Sequential(*part).to(dev)
                                    for part, dev in zip(partition.split(layers, len(devices), method), self.devices))

    def forward(self, x):
        for stage, dev in zip(self.stages, self.devices):
            x = stage(x.to(dev))
        return x

    def timed_step(self, x, y, loss_fn):
        """Forward then backward of one batch, stage after stage, timing each device's work.

        Returns (loss, spans); spans are dicts like `par.timeline` records, "rank" = stage index.
        Gradients accumulate in .grad exactly as after `loss_fn(self(x), y).backward()`.
        """
        t0, spans = time.perf_counter(), []

        def note(stage, name, start):
            sync(self.devices[stage])       # the span ends when the device's work does
            spans.append({"rank": stage, "name": name, "lane": "compute",
                          "start": start - t0, "end": time.perf_counter() - t0})

        inputs, outputs = [], []
        for i, (stage, dev) in enumerate(zip(self.stages, self.devices)):
            start = time.perf_counter()
            inp = x.to(dev)
            if i > 0:
                inp = inp.detach().requires_grad_(True)  # cut the graph here, so backward runs per stage
            out = stage(inp)
            if i == len(self.stages) - 1:
                out = loss_fn(out, y.to(dev))
            note(i, "F", start)
            inputs.append(inp)
            outputs.append(out)
            x = out
        grad = None
        for i in range(len(self.stages) - 1, -1, -1):
            start = time.perf_counter()
            outputs[i].backward(grad)
            if i > 0:
                grad = inputs[i].grad.to(self.devices[i - 1])
            note(i, "B", start)
        return outputs[-1].item(), spans
