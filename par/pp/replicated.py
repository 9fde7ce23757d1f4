"""Pipelines inside data parallelism: dp replicas of one pipeline of pp stages (DP × PP).

The world is a `par.runtime.grid.Grid(dp, pp, 1)`. Replica d takes rows d, d+dp, ... of the global batch
(`par.dp.naive.replica_rows`) and runs them through its pipeline (`par.pp.pipeline`); then the dp copies of
each stage average their gradients (`par.dp.naive.average_gradients`) and step:

    ∇ = (1/dp) Σ_d ∇ mean loss(x_d) = ∇ mean loss of the whole batch        (equal shares x_d)

so it equals single-process training on the same batches. `par.train.parallel3d.Parallel3D` is this with
tensor-parallel blocks in the stages (and ZeRO-1 over the dp group).
"""
from __future__ import annotations

import torch

from par.comm import commlog
from par.dp.naive import average_gradients, mean_over, replica_rows
from par.memory.accounting import tensor_bytes
from par.model import lm_loss
from par.pp import schedules
from par.pp.pipeline import Pipeline
from par.reference import make_optimizer
from par.runtime.grid import Grid


class ReplicatedPipeline:
    """This rank's stage of replica `grid.dp_rank`, and its optimizer.

        engine = ReplicatedPipeline(model.to_layers(), Grid(dp=2, pp=2), microbatches=4)
        loss = engine.step(x, y)     # x, y: the global batch (the same on every rank)
    """

    def __init__(self, layers, grid: Grid, microbatches: int = 1, optimizer: str = "adam", lr: float = 1e-3,
                 schedule: str = "1f1b", impl: str = "ring", loss_fn=lm_loss, track_memory: bool = False,
                 **opt_kw):
        self.grid, self.impl = grid, impl
        sched = schedules.make(schedule, grid.pp, microbatches)
        self.pipe = Pipeline(layers, sched, loss_fn, ranks=grid.pp_ranks, group=grid.pp_group,
                             track_memory=track_memory)                        # the layers cut into stages
        self.params = list(self.pipe.parameters())
        self.optimizer = make_optimizer(self.params, optimizer, lr, **opt_kw)

    def named_parameters(self):
        """(name, parameter) named '<layer index>.<name in the layer>' of the layer list."""
        return self.pipe.named_parameters()

    def pipeline_step(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        """Forward and backward of this replica's rows through its pipeline (the loss on the last stage)."""
        g = self.grid
        return self.pipe.step(replica_rows(x, g.dp_rank, g.dp), replica_rows(y, g.dp_rank, g.dp))

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        """One optimizer step on the global batch (x, y). Returns the batch's mean loss on the last stage."""
        self.optimizer.zero_grad(set_to_none=True)   # gradients stay alive after the step (as in DDP)
        loss = self.pipeline_step(x, y)
        with commlog.tag("dp gradients"):
            average_gradients(self.params, self.impl, self.grid.dp_group)
            self.optimizer.step()
        return self.mean_loss(loss)

    def mean_loss(self, loss: float | None) -> float | None:
        """The whole batch's loss: the mean of the replicas' losses (None off the last stage)."""
        if loss is None:
            return None
        return mean_over(loss, self.grid.dp_group, self.params[0].device, self.impl)

    def memory(self) -> dict:
        """Live bytes of this rank's parameters, gradients and optimizer state."""
        params = tensor_bytes(self.params)
        grads = tensor_bytes([p.grad for p in self.params if p.grad is not None])
        opt = tensor_bytes([v for s in self.optimizer.state.values() for v in s.values()
                            if isinstance(v, torch.Tensor) and v.dim() > 0])
        return {"params": params, "grads": grads, "optimizer": opt, "model_states": params + grads + opt}

    def activation_peak(self) -> int:
        """The pipeline's measured activation peak over the micro-batches in flight (`track_memory`)."""
        return self.pipe.memory.get("peak_bytes", 0)
