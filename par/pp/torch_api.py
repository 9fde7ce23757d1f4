"""The same pipeline with torch's own runtime: `torch.distributed.pipelining` on par's stages.

torch ships a pipeline runtime: a `PipelineStage` wraps the part of the model a rank holds,
and a schedule object (`Schedule1F1B`, `ScheduleGPipe`) runs the micro-batches through it.
Give it the layer list par cuts (`model.to_layers()`), the same boundaries (`Pipeline.bounds`),
the same micro-batches and the same loss, and it must compute the same gradients as
`par.pp.pipeline.Pipeline`:

    stage = PipelineStage(nn.Sequential(*layers[a:b]), rank, p, device)
    schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=loss_fn)
    schedule.step(x)                      on the first stage (it cuts x into m micro-batches)
    schedule.step(target=y, losses=ls)    on the last stage (ls: the m micro-batch losses)
    schedule.step()                       on the stages between

torch divides every micro-batch's gradient by m (`scale_grads=True`); par divides every
micro-batch's loss by m: the same arithmetic. One stage per rank (no interleaving here).
"""
from __future__ import annotations

import torch
import torch.nn as nn

SCHEDULES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe"}


class TorchPipeline:
    """This rank's stage `layers[bounds[rank][0]:bounds[rank][1]]` under a torch.distributed.pipelining schedule."""

    def __init__(self, layers, bounds, loss_fn, microbatches: int, schedule: str = "1f1b",
                 rank: int = 0, world_size: int = 1, device=None, group=None):
        from torch.distributed import pipelining
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r} for torch.distributed.pipelining: "
                             f"use one of {', '.join(SCHEDULES)}")
        if len(bounds) != world_size:
            raise ValueError(f"torch's {SCHEDULES[schedule]} runs one stage per rank: got {len(bounds)} stages "
                             f"for {world_size} ranks")
        a, b = bounds[rank]
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.module = nn.Sequential(*list(layers)[a:b]).to(self.device)
        self.stage = pipelining.PipelineStage(self.module, rank, world_size, self.device, group=group)
        self.schedule = getattr(pipelining, SCHEDULES[schedule])(self.stage, n_microbatches=microbatches,
                                                                 loss_fn=loss_fn)

    def parameters(self):
        return self.module.parameters()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        """Forward and backward of the batch (x, y); .grad accumulates. The mean loss on the last stage."""
        if self.world_size == 1:
            losses = []
            self.schedule.step(x, target=y, losses=losses)
        elif self.rank == 0:
            self.schedule.step(x)
            return None
        elif self.rank == self.world_size - 1:
            losses = []
            self.schedule.step(target=y, losses=losses)
        else:
            self.schedule.step()
            return None
        return float(torch.stack([l.detach() for l in losses]).mean())


V_SCHEDULES = {"zb_v": "ScheduleZBVZeroBubble", "dualpipe_v": "ScheduleDualPipeV"}


class TorchVPipeline:
    """This rank's two stages r and 2p-1-r (a V: `par.pp.schedules` placement "v") under torch's
    `ScheduleZBVZeroBubble` or `ScheduleDualPipeV`, cut at par's boundaries `bounds` (2p stages).

    Rank 0 holds both the first stage (it cuts x into m micro-batches) and the last (it computes the
    losses): it calls `schedule.step(x, target=y, losses=ls)`, every other rank `schedule.step()`.
    """

    def __init__(self, layers, bounds, loss_fn, microbatches: int, schedule: str = "zb_v",
                 rank: int = 0, world_size: int = 1, device=None, group=None):
        from torch.distributed import pipelining
        if schedule not in V_SCHEDULES:
            raise ValueError(f"unknown V schedule {schedule!r} for torch.distributed.pipelining: "
                             f"use one of {', '.join(V_SCHEDULES)}")
        if len(bounds) != 2 * world_size:
            raise ValueError(f"torch's {V_SCHEDULES[schedule]} runs two stages per rank: got {len(bounds)} stages "
                             f"for {world_size} ranks (use {2 * world_size})")
        layers = list(layers)
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        mine = (rank, 2 * world_size - 1 - rank)
        self.modules = [nn.Sequential(*layers[slice(*bounds[s])]).to(self.device) for s in mine]
        stages = [pipelining.PipelineStage(mod, s, 2 * world_size, self.device, group=group)
                  for mod, s in zip(self.modules, mine)]
        self.schedule = getattr(pipelining, V_SCHEDULES[schedule])(stages, n_microbatches=microbatches,
                                                                   loss_fn=loss_fn)

    def named_parameters(self):
        """(name, parameter) of both chunks, chunk 0 first ('<chunk>.<name in the chunk>')."""
        for c, mod in enumerate(self.modules):
            for name, param in mod.named_parameters():
                yield f"{c}.{name}", param

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        """Forward and backward of the batch (x, y); .grad accumulates. The mean loss on rank 0."""
        if self.rank != 0:
            self.schedule.step()
            return None
        losses = []
        self.schedule.step(x, target=y, losses=losses)
        return float(torch.stack([l.detach() for l in losses]).mean())
