"""3D parallelism: GPT-lite trained with data × pipeline × tensor parallelism at once.

Nothing new is computed here: the lecture's three strategies are stacked through the groups
of a `par.runtime.grid.Grid` (rank = t + tp·(d + dp·s)):

    tensor parallel   every block's matrices split over the tp group        par.tp.layers
    pipeline (1F1B)   the layer list cut into pp stages over the pp group   par.pp.pipeline
    data parallel     the global batch split over the dp group; gradients   par.dp.naive (average)
                      averaged, or reduce-scattered with ZeRO-1             par.zero.engine (stage 1)

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
Mixed precision is not stacked here (fp32); use `par.zero.engine` with pp = tp = 1 for fp16/bf16.

With pp = tp = 1 the grid is plain data parallelism, and `ZeroDataParallel` runs it with every
ZeRO stage, offload and 16-bit precision (`par.zero.engine`). Both engines have the same face, which
is all the training loop (`par.train.loop`) sees:

    engine.step(x, y) -> loss      engine.optimizer (its lr is set per step)
    engine.memory()                engine.activation_peak()        engine.max_diff_from(reference)
    engine.track_memory            the activation meter's saved-tensor hooks on (the loop's untimed warm-up step)
                                   or off (its timed steps); activation_peak() is the peak of the metered steps
"""
from __future__ import annotations

import torch
import torch.nn as nn

from par.comm import commlog
from par.dp.naive import mean_over, replica_rows
from par.memory.accounting import saved_activation_bytes
from par.model import lm_loss
from par.pp.replicated import ReplicatedPipeline
from par.runtime.grid import Grid
from par.tp.layers import TensorParallelGPT
from par.zero.engine import Zero


class Parallel3DError(ValueError):
    """A 3D configuration that cannot run: one line naming the numbers and the fix."""


def tensor_parallel_layers(model, grid: Grid, impl: str = "ring") -> list[nn.Module]:
    """The model's layer list with every block sharded over the tp group (the dense list when tp = 1)."""
    if grid.tp == 1:
        return model.to_layers()
    return TensorParallelGPT.from_dense(model, grid.tp_group, impl).to_layers()


def _max_diff(named, want: dict) -> float:
    """max |p - want[name]| over (name, p); inf when anything is NaN (max() would quietly skip it)."""
    diffs = [(p.detach().float() - want[n].float()).abs().max().item() for n, p in named]
    return max(diffs, default=0.0) if all(d == d and d != float("inf") for d in diffs) else float("inf")


class ZeroDataParallel:
    """pp = tp = 1: the batch split over the dp group, ZeRO stage 0-3 (+ offload, fp16/bf16) from `par.zero.engine`,
    and m micro-batches of gradient accumulation on each replica.

        engine = ZeroDataParallel(build(cfg), Grid(dp=2), microbatches=4, stage=2)
        loss = engine.step(x, y)     # x, y: the global batch (the same on every rank)

    One step on replica d: for each of its m micro-batches, backward of loss_i / m (stages 2-3 reduce-scatter
    the gradients right there, stages 0-1 let them accumulate); then `zero.step()` (stages 0-1 reduce once,
    every stage updates its partition). Stage 0 is plain data parallelism; with one replica, one process.
    The losses add up on the device and are read once a step; with `track_memory` each micro-batch's forward
    runs under the activation meter (`par.memory.accounting.saved_activation_bytes`).
    """

    def __init__(self, model, grid: Grid, microbatches: int = 1, stage: int = 0, optimizer: str = "adam",
                 lr: float = 1e-3, offload: bool = False, precision: str = "fp32", scaler=None,
                 max_grad_norm: float | None = None, prefetch: bool = False, loss_fn=lm_loss, **opt_kw):
        self.model, self.grid, self.m, self.loss_fn = model, grid, microbatches, loss_fn
        self.zero = Zero(model, stage=stage, optimizer=optimizer, lr=lr, offload=offload, group=grid.dp_group,
                         precision=precision, max_grad_norm=max_grad_norm, scaler=scaler, prefetch=prefetch,
                         **opt_kw)
        self.optimizer = self.zero.updater.opt
        self.device = next(model.parameters()).device
        self.track_memory = True
        self._activations = 0

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One optimizer step on the global batch (x, y); returns the batch's mean loss on every rank."""
        g = self.grid
        x, y = replica_rows(x, g.dp_rank, g.dp), replica_rows(y, g.dp_rank, g.dp)
        total = torch.zeros((), device=self.device)
        for xm, ym in zip(x.chunk(self.m), y.chunk(self.m)):
            loss = self._micro_loss(xm, ym)
            self.zero.backward(loss)
            total += loss.detach()
        self.zero.step()
        self.zero.zero_grad()
        return mean_over(total.item(), g.dp_group, self.device)

    def _micro_loss(self, x, y):
        """loss_i / m of one micro-batch (measured by the activation meter when `track_memory`)."""
        if not self.track_memory:
            return self._loss(x, y)
        loss, saved = saved_activation_bytes(self._loss, x, y, exclude=list(self.model.parameters()))
        self._activations = max(self._activations, saved)
        return loss

    def _loss(self, x, y):
        return self.loss_fn(self.model(x).float(), y) / self.m

    def memory(self) -> dict:
        """Model states on this device (under offload the optimizer's host bytes are reported apart)."""
        m = self.zero.memory()
        return {"params": m["params"], "grads": m["grads"], "optimizer": m["optimizer"],
                "model_states": m["params"] + m["grads"] + m["optimizer_device"]}

    def activation_peak(self) -> int:
        """The most bytes autograd kept for one micro-batch's backward (`par.memory.accounting.saved_activation_bytes`)."""
        return self._activations

    def max_diff_from(self, reference: nn.Module) -> float:
        """Largest |parameter - reference| (the full fp32 parameters; one all-gather under ZeRO)."""
        want = dict(reference.named_parameters())
        return _max_diff(self.zero.full_state_dict().items(), want)


class Parallel3D(ReplicatedPipeline):
    """This rank's part of a dp × pp × tp GPT-lite and its optimizer: `par.pp.replicated.ReplicatedPipeline`
    over tensor-parallel blocks, with ZeRO-1 over the dp group when asked.

        engine = Parallel3D(build(cfg), Grid(dp, pp, tp), microbatches=4, zero_stage=1)
        loss = engine.step(x, y)     # x, y: the global batch (the same on every rank)

    `model` must be the same dense model on every rank (`par.model.build(cfg, seed)`).
    """

    def __init__(self, model, grid: Grid, microbatches: int = 1, optimizer: str = "adam", lr: float = 1e-3,
                 zero_stage: int = 0, schedule: str = "1f1b", impl: str = "ring", loss_fn=lm_loss,
                 track_memory: bool = False, **opt_kw):
        if zero_stage not in (0, 1):
            raise Parallel3DError(f"ZeRO stage {zero_stage} is not combined with pipeline/tensor parallelism "
                                  f"here (DeepSpeed neither): use zero_stage 0 or 1, or pp = tp = 1 with par.zero.engine")
        self.zero_stage = zero_stage
        layers = tensor_parallel_layers(model, grid, impl)                      # TP inside every block
        super().__init__(layers, grid, microbatches, optimizer, lr, schedule, impl, loss_fn, track_memory, **opt_kw)
        self.zero = None
        if zero_stage == 1:                                                     # replicas of each shard
            self.zero = Zero(nn.ModuleList(self.pipe.chunks), stage=1, optimizer=optimizer, lr=lr,
                             group=grid.dp_group, impl=impl, **opt_kw)
            self.optimizer = self.zero.updater.opt

    @property
    def track_memory(self) -> bool:
        """The pipeline's activation meter on or off (`par.pp.pipeline.Pipeline.track_memory`)."""
        return self.pipe.track_memory

    @track_memory.setter
    def track_memory(self, on: bool) -> None:
        self.pipe.track_memory = on

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        """One optimizer step on the global batch (x, y). Returns the batch's mean loss on the last stage."""
        if self.zero is None:
            return super().step(x, y)
        loss = self.pipeline_step(x, y)
        with commlog.tag("dp gradients"):      # step() reduces the accumulated gradients once
            self.zero.step()
            self.zero.zero_grad()
        return self.mean_loss(loss)

    def memory(self) -> dict:
        """Live bytes of this rank's parameters, gradients and optimizer state."""
        if self.zero is None:
            return super().memory()
        z = self.zero.memory()
        return {"params": z["params"], "grads": z["grads"], "optimizer": z["optimizer"],
                "model_states": z["model_states"]}

    def max_diff_from(self, reference: nn.Module) -> float:
        """Largest |parameter - reference| over this rank's shards (no communication)."""
        return _max_diff(self.named_parameters(), reference_shards(reference, self.grid, self.impl))


def reference_shards(model, grid: Grid, impl: str = "ring") -> dict:
    """{'<layer>.<name>': tensor} of a dense reference model cut the way this rank holds it
    (TP shards when tp > 1; all layers, of which this rank's stage is a subset). No communication."""
    layers = tensor_parallel_layers(model, grid, impl)
    return {f"{i}.{n}": p.detach() for i, layer in enumerate(layers) for n, p in layer.named_parameters()}
