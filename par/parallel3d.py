"""3D parallelism: GPT-lite trained with data × pipeline × tensor parallelism at once.

Nothing new is computed here: the lecture's three strategies are stacked through the groups
of a `par.grid.Grid` (rank = t + tp·(d + dp·s)):

    tensor parallel   every block's matrices split over the tp group        par.tensor_parallel
    pipeline (1F1B)   the layer list cut into pp stages over the pp group   par.pipeline
    data parallel     the global batch split over the dp group; gradients   par.dp_naive (average)
                      averaged, or reduce-scattered with ZeRO-1             par.zero (stage 1)

One step on rank (d, s, t) with global batch B and m micro-batches:

    x_d = rows d, d+dp, d+2dp, ... of the batch                 (what DistributedSampler gives replica d)
    pipeline.step(x_d): m micro-batches of B/(dp·m) rows, 1F1B; each stage's matmuls run tensor parallel,
                        the loss of micro-batch i is divided by m, so .grad = ∇ mean loss of x_d
    average .grad over the dp group: ∇ = (1/dp) Σ_d ∇_d = ∇ mean loss of the whole batch
    optimizer step (ZeRO-1: each dp rank updates its partition, then all-gathers the parameters)

The replicated pieces of TP (embedding, layer norms, LM head, row biases) get the same
gradient on every tp rank without communication, so they stay identical. Which is why this
equals single-process training on the same batches, up to the rounding of a different
summation order.

ZeRO-2/3 with a pipeline is refused (as in DeepSpeed): a pipeline accumulates gradients
over m micro-batches, and sharding them would reduce-scatter once per micro-batch.
Mixed precision is not stacked here (fp32); use `par.zero` with pp = tp = 1 for fp16/bf16.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from par import collectives, commlog, schedules
from par.dp_naive import average_gradients
from par.grid import Grid
from par.model import lm_loss
from par.pipeline import Pipeline
from par.reference import make_optimizer
from par.tensor_parallel import TensorParallelGPT


class Parallel3DError(ValueError):
    """A 3D configuration that cannot run: one line naming the numbers and the fix."""


def replica_rows(x: torch.Tensor, d: int, dp: int) -> torch.Tensor:
    """Replica d's share of a global batch: rows d, d+dp, ... (the DistributedSampler order)."""
    if x.size(0) % dp:
        raise Parallel3DError(f"a global batch of {x.size(0)} rows does not split over dp={dp} replicas: "
                              f"use a multiple of {dp}")
    return x[d::dp]


def tensor_parallel_layers(model, grid: Grid, impl: str = "ring") -> list[nn.Module]:
    """The model's layer list with every block sharded over the tp group (the dense list when tp = 1)."""
    if grid.tp == 1:
        return model.to_layers()
    return TensorParallelGPT.from_dense(model, grid.tp_group, impl).to_layers()


class Parallel3D:
    """This rank's part of a dp × pp × tp GPT-lite and its optimizer.

        engine = Parallel3D(build(cfg), Grid(dp, pp, tp), microbatches=4, zero_stage=1)
        loss = engine.step(x, y)     # x, y: the global batch (the same on every rank)

    `model` must be the same dense model on every rank (`par.model.build(cfg, seed)`).
    """

    def __init__(self, model, grid: Grid, microbatches: int = 1, optimizer: str = "adam", lr: float = 1e-3,
                 zero_stage: int = 0, schedule: str = "1f1b", impl: str = "ring", loss_fn=lm_loss,
                 track_memory: bool = False, **opt_kw):
        if zero_stage not in (0, 1):
            raise Parallel3DError(f"ZeRO stage {zero_stage} is not combined with pipeline/tensor parallelism "
                                  f"here (DeepSpeed neither): use zero_stage 0 or 1, or pp = tp = 1 with par.zero")
        self.grid, self.impl, self.zero_stage = grid, impl, zero_stage
        layers = tensor_parallel_layers(model, grid, impl)
        sched = schedules.make(schedule, grid.pp, microbatches)
        self.pipe = Pipeline(layers, sched, loss_fn, ranks=grid.pp_ranks, group=grid.pp_group,
                             track_memory=track_memory)
        self.params = list(self.pipe.parameters())
        if zero_stage == 1:
            from par.zero import Zero
            self.zero = Zero(nn.ModuleList(self.pipe.chunks), stage=1, optimizer=optimizer, lr=lr,
                             group=grid.dp_group, impl=impl, **opt_kw)
            self.optimizer = self.zero.updater.opt
        else:
            self.zero = None
            self.optimizer = make_optimizer(self.params, optimizer, lr, **opt_kw)

    def named_parameters(self):
        """(name, parameter) named '<layer index>.<name in the layer>' of the (TP) layer list."""
        return self.pipe.named_parameters()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        """One optimizer step on the global batch (x, y). Returns the batch's mean loss on the last stage."""
        g = self.grid
        if self.zero is None:     # gradients stay alive after the step (as in DDP), so memory() sees them
            self.optimizer.zero_grad(set_to_none=True)
        loss = self.pipe.step(replica_rows(x, g.dp_rank, g.dp), replica_rows(y, g.dp_rank, g.dp))
        with commlog.tag("dp gradients"):
            if self.zero is not None:   # step() reduces the accumulated gradients once
                self.zero.step()
                self.zero.zero_grad()
            else:
                average_gradients(self.params, self.impl, g.dp_group)
                self.optimizer.step()
        if loss is None:
            return None
        if g.dp > 1:  # each replica knows the loss of its rows: their mean is the batch's
            t = torch.tensor([loss], device=self.params[0].device)
            with commlog.tag("loss"):
                collectives.all_reduce(t, op="avg", group=g.dp_group, impl=self.impl)
            loss = t.item()
        return loss

    def memory(self) -> dict:
        """Live bytes of this rank's parameters, gradients and optimizer state, and the pipeline's
        measured activation peak (`track_memory`)."""
        from par.memory import tensor_bytes
        params = tensor_bytes(self.params)
        if self.zero is not None:
            z = self.zero.memory()
            return {"params": z["params"], "grads": z["grads"], "optimizer": z["optimizer"],
                    "model_states": z["model_states"]}
        grads = tensor_bytes([p.grad for p in self.params if p.grad is not None])
        opt = tensor_bytes([v for s in self.optimizer.state.values() for v in s.values()
                            if isinstance(v, torch.Tensor) and v.dim() > 0])
        return {"params": params, "grads": grads, "optimizer": opt, "model_states": params + grads + opt}


def reference_shards(model, grid: Grid, impl: str = "ring") -> dict:
    """{'<layer>.<name>': tensor} of a dense reference model cut the way this rank holds it
    (TP shards when tp > 1; all layers, of which this rank's stage is a subset). No communication."""
    layers = tensor_parallel_layers(model, grid, impl)
    return {f"{i}.{n}": p.detach() for i, layer in enumerate(layers) for n, p in layer.named_parameters()}
