"""ZeRO: data parallelism without the redundant copies (Rajbhandari et al., 2020).

Plain data parallelism keeps on every one of the N_d ranks the parameters (wΨ
bytes), the gradients (gΨ) and the optimizer state (KΨ). ZeRO partitions them
instead, with the flat layout of `par.zero.flat` (one padded flat buffer per unit,
rank i owning the i-th equal partition):

    stage 0  plain DP   all-reduce gradients; every rank updates everything      wΨ + gΨ + KΨ
    stage 1  P_os       optimizer state only for my partition                    wΨ + gΨ + KΨ/N_d
    stage 2  P_os+g     + reduce-scatter gradients during backward, keep mine    wΨ + (g+K)Ψ/N_d
    stage 3  P_os+g+p   + parameters sharded; gathered per unit just in time     (w+g+K)Ψ/N_d

The step of stages 1 and 2 is reduce-scatter(grads) -> update my partition ->
all-gather(params): as many bytes as one all-reduce. Stage 3 gathers the
parameters twice (before forward and again before backward, because they were
freed in between) and reduce-scatters the gradients once: 1.5x. The bytes per
step, with micro-batches: `zero_bytes_per_step` (the formula's one home).

A *unit* is the granularity of all of this (`par.zero.units`): one module of `model.to_layers()`
(or each module with a forward of its own), plus the root for parameters no such module
holds. In stage 2 a unit is a gradient bucket: it is reduce-scattered as soon as backward has
produced all its gradients. In stage 3 it is what is gathered and freed (FSDP's "unit").

    zero = Zero(model, stage=2, optimizer="adam", lr=1e-3)
    for x, y in batches:
        zero.backward(loss_fn(model(x), y))
        zero.step()
        zero.zero_grad()
    zero.close()            # remove the hooks: the model no longer points back at the engine

The update of this rank's partitions is done by an updater (`par.zero.updaters`): on the device, or
with `offload=True` on the CPU, with the fp32 master partition and the optimizer state there.
All communication goes through the `par.comm.collectives` front doors, so `par.comm.commlog` counts every byte.

Mixed precision (`precision="fp16"` or `"bf16"`) composes the steps of `par.precision.mixed_precision`:
the flat buffers, the forward, the backward and the gradient reduce-scatter are 16-bit; the
fp32 master weights exist only for this rank's partition, next to the optimizer state
(K = 4 + 4 + 4 = 12 bytes per element). `backward` scales the loss by S (`par.precision.loss_scaler`);
`step` hands the 16-bit gradient partition to the updater as fp32 and runs step 6 on it with
`mixed_precision.unscale_`, `found_overflow` (every rank skips if any partition saw inf/nan),
`grad_norm(sharded=True)` and `clip_`; the updater then steps and rounds the masters back into
the 16-bit partition that the all-gather spreads.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn

from par import clock
from par.comm import coalesced, collectives, thread as comm_thread, commlog
from par.precision import mixed_precision
from par.zero import units
from par.zero.flat import FlatParams
from par.precision.loss_scaler import default_scaler
from par.memory.accounting import cuda_peak_bytes, tensor_bytes
from par.zero.updaters import CPUOffload, DeviceUpdate

STAGES = (0, 1, 2, 3)


def unit_modules(model: nn.Module, stage: int = 0) -> list[nn.Module]:
    """The modules ZeRO works unit by unit (see `par.zero.units.plan`)."""
    return [m for m, _, _ in units.plan(model, stage)]



def zero_bytes_per_step(numel: float, dp: int, stage: int, microbatches: int = 1, bytes_per_value: int = 2) -> float:
    """Bytes one data-parallel rank sends per step for Ψ = `numel` gradient values under ZeRO `stage`:
    c · (N_d - 1)/N_d · e·Ψ, with c the number of full-size ring passes per step over m micro-batches:

        stage 0, 1   c = 2       all-reduce (or reduce-scatter + all-gather) once per step
        stage 2      c = m + 1   a reduce-scatter per micro-batch, one all-gather of the parameters
        stage 3      c = 3m      per micro-batch: gather before forward, again before backward, reduce-scatter

    With m = 1: 2, 2, 2, 3, the ZeRO paper's Ψ, Ψ, Ψ, 1.5Ψ per all-reduce's worth."""
    m = microbatches
    passes = {0: 2, 1: 2, 2: m + 1, 3: 3 * m}[stage]
    return passes * (dp - 1) / dp * bytes_per_value * numel


class Unit:
    """One flat-partitioned group of parameters and everything ZeRO keeps for it on this rank."""

    def __init__(self, index: int, name: str, module: nn.Module, params: list, n: int, rank: int):
        self.index, self.name, self.module = index, name, module
        self.flat = FlatParams(params, n, rank)
        self.params = self.flat.params
        self.full = self.flat.flat          # the padded parameter buffer (stage 3: storage freed between uses)
        self.shard: torch.Tensor | None = None       # stage 3: this rank's partition, kept for good
        self.grad_full: torch.Tensor | None = None   # the unit's full gradient (stages 0-1: kept; 2-3: transient)
        self.grad_shard: torch.Tensor | None = None  # this rank's reduced gradient partition (stages 2-3)
        self.pending = None                 # stage 3 with prefetch: the all-gather in flight
        self.arrived = 0                    # how many of the unit's parameters have their gradient this backward
        self.gathered = True
        self.span = None                    # the open forward/backward span of a recorded step

    def is_full(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0


def _free(t: torch.Tensor) -> None:
    """Release a tensor's memory but keep the tensor (and the views of it) around."""
    t.untyped_storage().resize_(0)


def _alloc(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(t.numel() * t.element_size())


def _in_backward() -> bool:
    """True while autograd runs a backward pass (a forward now is a recomputation, e.g. checkpointing)."""
    return torch._C._current_graph_task_id() != -1


# ---------------------------------------------------------------- the engine
class Zero:
    """ZeRO stages 0-3 (and offload) around a plain `nn.Module`; the module itself keeps its forward.

    optimizer: "adam", "adamw", "sgd", "momentum" (par.reference.make_optimizer), built over this
    rank's partitions only. group: the data-parallel process group (default: everyone).
    impl: "ring" (par's hand-written ring) or "torch" for the collectives. recorder: a
    par.timeline.Recorder to note gathers, reduce-scatters, forward and backward per unit (with prefetch also
    "wait <collective>": how long the computation waited for one on the communication thread).
    precision: "fp32", "fp16" or "bf16"; scaler: a par.precision.loss_scaler scaler (default:
    `loss_scaler.default_scaler(precision)`); max_grad_norm: clip the global gradient norm.
    prefetch (stage 3): start gathering the next unit (in the order the last forward ran them;
    backward: the previous one) while this one computes; every collective then runs on par's
    communication thread, in issue order, and at most two units are gathered at a time.
    Frozen parameters (requires_grad=False) and buffers stay as they are, replicated.
    """

    def __init__(self, model: nn.Module, stage: int = 1, optimizer: str = "adam", lr: float = 1e-3,
                 offload: bool = False, group=None, impl: str = "ring", recorder=None,
                 precision: str = "fp32", scaler=None, max_grad_norm: float | None = None,
                 prefetch: bool = False, **opt_kw):
        if stage not in STAGES:
            raise ValueError(f"ZeRO stage must be one of {STAGES}, got {stage}")
        self.model, self.stage, self.group, self.impl, self.rec = model, stage, group, impl, recorder
        self.offload = offload
        if prefetch and stage != 3:
            raise ValueError(f"prefetch gathers parameters ahead of use, which only stage 3 does (stage {stage})")
        self.prefetch = prefetch
        self.waited = 0.0   # run-queue seconds of what the computation waited for (`_blocked`), so far
        self.n = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        if self.rank < 0:
            raise ValueError("this process is not a member of the data-parallel group it was given")
        self._names = {id(p): name for name, p in model.named_parameters()}
        self._aliases: dict[int, list[str]] = {}        # every name of a parameter (tied weights have several)
        for name, p in model.named_parameters(remove_duplicate=False):
            self._aliases.setdefault(id(p), []).append(name)
        planned = units.plan(model, stage)
        self.device = planned[0][2][0].device
        self.units = [Unit(i, name, m, ps, self.n, self.rank) for i, (m, name, ps) in enumerate(planned)]
        self.precision, self.max_grad_norm, self.skipped = precision, max_grad_norm, 0
        self.scaler, masters = self._mixed_precision(precision, scaler)
        self.numel = sum(u.flat.numel for u in self.units)          # Ψ (trainable)
        self.padded = sum(u.flat.padded for u in self.units)        # Ψ rounded up per unit
        self._next = len(self.units) - 1   # next unit to reduce in backward (backward runs units in reverse)
        self._hooks = []
        self._reduced = False  # stages 0-1: gradients of this step already reduced?
        self._order = [u.index for u in self.units] if hasattr(model, "to_layers") else []   # forward order
        self._seen: list[int] = []         # units whose forward ran in the current forward
        self._active: list[Unit] = []      # units whose forward is running now (nested units stack)
        self._guard = None                 # stage 3: the first step runs under FreedParameterGuard
        self._in_forward = False
        self._checked = stage != 3
        if stage == 3:
            for u in self.units:
                u.shard = u.flat.partition(u.full).clone()
                self._free_params(u)
            self._install_param_hooks()
        if stage >= 2:
            for u in self.units:
                u.grad_shard = torch.zeros(u.flat.part, dtype=u.flat.dtype, device=self.device)
            self._install_grad_hooks()
        self.updater = self._make_updater(optimizer, lr, masters, **opt_kw)

    def _mixed_precision(self, precision: str, scaler):
        """fp32: no scaler, the partitions are the masters. fp16/bf16: keep fp32 copies of my partitions
        (taken before the cast, so nothing is lost), then re-lay every buffer in 16 bits."""
        if precision == "fp32":
            if scaler is not None:
                raise ValueError("a loss scaler only makes sense with precision='fp16' (or 'bf16')")
            return None, None
        mixed_precision.check_supported(precision, self.device)
        masters = [p.detach().float().clone() for p in self.param_partitions(full_only=True)]
        for u in self.units:
            u.flat.cast_(mixed_precision.DTYPES[precision])
            u.full = u.flat.flat
        return (scaler if scaler is not None else default_scaler(precision)), masters

    # ------------------------------------------------------------ which partition do I update?
    def param_partitions(self, full_only: bool = False) -> list[torch.Tensor]:
        """The parameter elements this rank updates, per unit: everything (stage 0), my partition of
        the full buffer (stages 1-2), or the shard that is all this rank keeps (stage 3)."""
        if self.stage == 0:
            return [u.full for u in self.units]
        if self.stage == 3 and not full_only:
            return [u.shard for u in self.units]
        return [u.flat.partition(u.full) for u in self.units]

    def grad_partitions(self) -> list[torch.Tensor]:
        """The reduced gradient matching `param_partitions` (valid after `backward`)."""
        if self.stage == 0:
            return [u.grad_full for u in self.units]
        if self.stage == 1:
            return [u.flat.partition(u.grad_full) for u in self.units]
        return [u.grad_shard for u in self.units]

    def _make_updater(self, optimizer, lr, masters, **kw):
        if self.offload:
            return CPUOffload(masters or self.param_partitions(), optimizer, lr, recorder=self.rec, **kw)
        return DeviceUpdate(masters or self.param_partitions(), optimizer, lr, copies=masters is not None, **kw)

    # ------------------------------------------------------------ collectives, logged and timed
    @contextmanager
    def _blocked(self, name: str, lane: str, thread: str | None = None):
        """A block in which the computation waits for the other ranks (and for `thread`, the communication
        thread): the run-queue seconds of what it waited for (`par.clock.Waiting`) add up in `waited`, and a
        recorded step keeps the block as a span with them in its `ready` (on a GPU: between events on the
        current stream)."""
        waiting = clock.Waiting(thread)        # read outside the span: the reads are no part of the wait
        start = self.rec.mark() if self.rec is not None else None
        yield
        end = self.rec.mark() if self.rec is not None else None
        self.waited += waiting.done()
        if self.rec is not None:
            self.rec.add(name, start, end, lane=lane, waited=waiting.ready)

    def _comm(self, name: str, fn, *args, **kw):
        if self.prefetch:   # one talker per process: everything goes through the communication thread
            return self._wait(self._comm_async(name, fn, *args, **kw))
        with commlog.tag(name), self._blocked(name, "comm"):
            return fn(*args, group=self.group, impl=self.impl, **kw)

    def _comm_async(self, name: str, fn, *args, **kw):
        """Run a collective on the communication thread (recorded there, on the comm lane, as it runs; on a GPU
        on the comm stream, `par.comm.thread`)."""
        out = []

        def job():
            with commlog.tag(name):
                if self.rec is None:
                    out.append(fn(*args, group=self.group, impl=self.impl, **kw))
                else:
                    with self.rec.span(name, lane="comm"):
                        out.append(fn(*args, group=self.group, impl=self.impl, **kw))
        pending = comm_thread.run_async(job, tensors=[a for a in args if isinstance(a, torch.Tensor)])
        pending.result, pending.name = out, name
        return pending

    def _wait(self, pending):
        """Wait for a collective on the communication thread, as the span "wait <collective>" of the compute lane
        (what the computation waited for; on a GPU the stall of the compute stream)."""
        with self._blocked(f"wait {pending.name}", "compute", comm_thread.NAME):
            pending.wait()
        return pending.result[0]

    def _reduce(self, u: Unit) -> None:
        """Stages 2-3, during backward: reduce-scatter the unit's gradient (averaged over the group), keep
        only my partition; the full gradient goes away (stage 3: the parameters too)."""
        mine = self._comm(f"RS {u.name}", collectives.reduce_scatter, u.grad_full, op="avg")
        u.grad_shard.add_(mine)
        u.grad_full = None
        if self.stage == 3:
            self._free_params(u)

    def _all_gather_params(self, u: Unit) -> None:
        """Stage 3: materialise the unit's full parameters from everyone's shard (or finish the prefetch)."""
        if u.pending is not None:
            self._wait(u.pending)
            u.pending, u.gathered = None, True
        if u.gathered:
            return
        _alloc(u.full)
        u.flat.partition(u.full).copy_(u.shard)
        self._comm(f"AG {u.name}", collectives.all_gather, u.full)
        u.gathered = True

    def _prefetch(self, u: Unit, step: int) -> None:
        """Start gathering the unit after `u` in forward order (step=+1) or before it (backward, step=-1)."""
        if not self.prefetch or u.index not in self._order:
            return
        k = self._order.index(u.index) + step
        if not 0 <= k < len(self._order):
            return
        nxt = self.units[self._order[k]]
        if nxt.gathered or nxt.pending is not None:
            return
        _alloc(nxt.full)
        nxt.flat.partition(nxt.full).copy_(nxt.shard)
        nxt.pending = self._comm_async(f"AG {nxt.name} (prefetched)", collectives.all_gather, nxt.full)

    def _free_params(self, u: Unit) -> None:
        if u.pending is not None:       # a prefetch still writing into the buffer: let it land first
            self._wait(u.pending)
            u.pending = None
        _free(u.full)
        u.gathered = False

    # ------------------------------------------------------------ spans of a recorded step
    def _open(self, u: Unit, name: str) -> None:
        if self.rec is not None and u.span is None:
            u.span = self.rec.span(name, lane="compute")
            u.span.__enter__()

    def _close(self, u: Unit) -> None:
        if u.span is not None:
            span, u.span = u.span, None
            span.__exit__(None, None, None)

    # ------------------------------------------------------------ hooks
    def _install_param_hooks(self) -> None:
        """Stage 3: gather before forward, free after it; gather again when backward reaches the unit.
        The first forward and backward run under `units.FreedParameterGuard`."""
        root = self.model
        self._hooks.append(root.register_forward_pre_hook(lambda m, a: self._guard_on()))
        for u in self.units:
            self._hooks.append(u.module.register_forward_pre_hook(lambda m, a, u=u: self._before_forward(u)))
            self._hooks.append(u.module.register_forward_hook(lambda m, a, out, u=u: self._after_forward(u, out),
                                                              always_call=True))
        self._hooks.append(root.register_forward_hook(lambda m, a, out: self._guard_off(), always_call=True))

    def _guard_on(self) -> None:
        """Root forward starts. On the first step, watch every operation until that step's backward ends."""
        self._seen, self._in_forward = [], True
        if not self._checked and self._guard is None:
            self._guard = units.FreedParameterGuard(self)
            self._guard.__enter__()

    def _guard_off(self) -> None:
        """Root forward ends: remember the order the units ran in (for prefetch). The guard stays on
        through the loss and the backward when a backward can follow (`backward` turns it off)."""
        self._in_forward = False
        if self._seen and not _in_backward():
            self._order = list(self._seen)
        if self._guard is not None and (not torch.is_grad_enabled() or sys.exc_info()[0] is not None):
            self._guard_stop()          # no backward will follow (no grad), or the forward failed

    def _guard_stop(self) -> None:
        if self._guard is not None:
            guard, self._guard = self._guard, None
            guard.__exit__(None, None, None)

    def _before_forward(self, u: Unit) -> None:
        self._all_gather_params(u)
        if u.index not in self._seen:
            self._seen.append(u.index)
        self._active.append(u)
        self._prefetch(u, +1)
        self._open(u, f"F {u.name}")

    def _after_forward(self, u: Unit, out) -> None:
        self._close(u)
        if self._active and self._active[-1] is u:
            self._active.pop()
        if _in_backward():       # a recomputation (activation checkpointing): keep it for the backward
            return
        self._free_params(u)
        if torch.is_grad_enabled():
            for t in units.output_tensors(out):
                if t.requires_grad:
                    t.register_hook(lambda g, u=u: self._before_backward(u))

    def _before_backward(self, u: Unit) -> None:
        self._all_gather_params(u)
        self._prefetch(u, -1)
        self._open(u, f"B {u.name}")

    def _install_grad_hooks(self) -> None:
        """Stages 2-3: each parameter hands its gradient to its unit's bucket as soon as it is accumulated."""
        for u in self.units:
            for i, p in enumerate(u.params):
                self._hooks.append(p.register_post_accumulate_grad_hook(
                    lambda p, u=u, i=i: self._grad_ready(u, i, p)))

    def _grad_ready(self, u: Unit, i: int, p: nn.Parameter) -> None:
        if u.grad_full is None:
            u.grad_full = torch.zeros(u.flat.padded, dtype=u.flat.dtype, device=self.device)
        u.flat.views(u.grad_full)[i].copy_(p.grad)
        p.grad = None
        u.arrived += 1
        if u.arrived == len(u.params):
            self._close(u)
            self._reduce_in_order()

    def _reduce_in_order(self, flush: bool = False) -> None:
        """Reduce complete units in backward order (last unit first), so every rank issues the same
        collectives in the same order; `flush` also reduces units some of whose params got no gradient."""
        while self._next >= 0:
            u = self.units[self._next]
            if u.arrived < len(u.params) and not flush:
                return
            self._close(u)
            if u.grad_full is None:
                u.grad_full = torch.zeros(u.flat.padded, dtype=u.flat.dtype, device=self.device)
            self._reduce(u)
            self._next -= 1

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def close(self) -> None:
        """Remove every hook: the model stops pointing back at this engine (through its hooks), so
        dropping both frees them at once, without waiting for the cycle collector. Call it before
        building the next engine when you measure peak memory per configuration."""
        self.remove_hooks()
        self._guard_stop()

    # ------------------------------------------------------------ who holds a freed tensor (for the guard)
    def owner_of(self, t: torch.Tensor):
        """(parameter name, unit name) of a tensor that is a view of a stage-3 unit's buffer, else None."""
        key = t.untyped_storage()._cdata
        for u in self.units:
            if u.full.untyped_storage()._cdata == key:
                at = t.storage_offset() - u.full.storage_offset()
                for p, (a, b) in zip(u.params, u.flat.offsets):
                    if a <= at < b:
                        return self._names.get(id(p), "?"), u.name
                return "?", u.name
        return None

    def active_units(self) -> list[str]:
        """Names of the units whose forward is running now, innermost last (the model itself when none)."""
        return [u.name for u in self._active] or (["the model (outside every unit)"] if self._in_forward else [])

    # ------------------------------------------------------------ the training step
    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward() (times the loss scale S in fp16). Stages 2-3 reduce each unit's gradient
        while backward runs; stages 0-1 let gradients accumulate locally and reduce them once per
        step (`reduce_gradients`), so accumulating micro-batches averages every partition once."""
        scaled = loss.float() * self.scaler.scale if self.scaler is not None else loss
        try:
            scaled.backward()
        finally:
            if self._guard is not None:      # the first stage-3 step was watched to its end
                self._guard_stop()
                self._checked = True
        if self.stage >= 2:
            self._reduce_in_order(flush=True)
            for u in self.units:
                u.arrived = 0
            self._next = len(self.units) - 1
        if self.stage == 3:      # a prefetched unit whose forward did not run this step
            for u in self.units:
                if u.gathered or u.pending is not None:
                    self._free_params(u)

    def reduce_gradients(self) -> None:
        """Stages 0-1, once per step (`step` calls it): put each unit's accumulated gradients in its flat
        buffer and all-reduce (stage 0) or reduce-scatter (stage 1) all of them, in one coalesced ring
        (`par.comm.coalesced`: each unit's chunks, one message per ring step). Stage 1 must not reduce after
        every micro-batch: only my partition is averaged, the rest keeps local sums."""
        if self.stage <= 1 and not self._reduced:
            for u in self.units:
                self._collect_grads(u)
            grads = [u.grad_full for u in reversed(self.units)]
            if self.stage == 0:
                self._comm("AR (every unit)", coalesced.all_reduce, grads, op="avg")
            else:
                self._comm("RS (every unit)", coalesced.reduce_scatter, grads, op="avg")
            self._reduced = True

    def _collect_grads(self, u: Unit) -> None:
        """Stages 0-1: the unit's gradients live in one flat buffer; .grad of each param is a view of it
        (from the second step on autograd accumulates straight into the buffer: nothing to copy)."""
        if u.grad_full is None:
            u.grad_full = torch.zeros(u.flat.padded, dtype=u.flat.dtype, device=self.device)
        for p, view in zip(u.params, u.flat.views(u.grad_full)):
            if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            p.grad = view

    def step(self) -> bool:
        """Update this rank's partition (stages 1-2 then all-gather the parameters). Returns False when
        mixed precision skipped the step because some rank's gradients overflowed."""
        self.reduce_gradients()
        self.updater.load_grads(self.grad_partitions())
        grads = [m.grad for m in self.updater.masters()]
        if self.scaler is not None:
            mixed_precision.unscale_(grads, self.scaler.scale)
            overflow = mixed_precision.found_overflow(grads, self.group, self.impl, self.device)
            self.scaler.update(overflow)
            if overflow:
                self.updater.clear_grads()
                self.skipped += 1
                return False
        if self.max_grad_norm is not None:
            self.clip_grad_norm_(self.max_grad_norm)
        if self.rec and not self.offload:       # CPUOffload records its own phases
            with self.rec.span("update", lane="compute"):
                self.updater.apply(self.param_partitions())
        else:
            self.updater.apply(self.param_partitions())
        if self.stage in (1, 2):
            self._comm("AG (every unit)", coalesced.all_gather, [u.full for u in self.units])
        return True

    def clip_grad_norm_(self, max_norm: float) -> float:
        """‖g‖ = sqrt(Σ over ranks of Σ over my partition g²) (stage 0 holds all of it); scale g if ‖g‖ > max_norm."""
        grads = [m.grad for m in self.updater.masters()]
        norm = mixed_precision.grad_norm(grads, self.group, self.impl, sharded=self.stage > 0, device=self.device)
        return mixed_precision.clip_(grads, max_norm, norm)

    def zero_grad(self) -> None:
        self._reduced = False
        for u in self.units:
            if u.grad_full is not None and self.stage <= 1:
                u.grad_full.zero_()
            if u.grad_shard is not None:
                u.grad_shard.zero_()

    # ------------------------------------------------------------ what is alive, in bytes
    def memory(self) -> dict:
        """Live bytes of model states on this rank, by kind, counted from the tensors themselves.

        params: the parameter buffers (stage 3: shards, plus any unit gathered right now);
        grads: full gradient buffers and reduced gradient partitions; optimizer: the updater's
        per-element state and any master copy (on the host under offload). Also the CUDA peak.
        """
        params = tensor_bytes([u.full for u in self.units if u.is_full()] + [u.shard for u in self.units])
        grads = tensor_bytes([u.grad_full for u in self.units] + [u.grad_shard for u in self.units])
        opt = self.updater.state_bytes()
        out = {"params": params, "grads": grads, "optimizer": opt["total"],
               "model_states": params + grads + opt["total"],
               "optimizer_device": opt["device"], "optimizer_host": opt["host"],
               "numel": self.numel, "padded": self.padded, "world": self.n, "stage": self.stage,
               "cuda_peak": cuda_peak_bytes(self.device)}
        return out

    def gathered_units(self) -> list[int]:
        """Indices of units whose full parameters are materialised right now (stage 3: at most the current
        one, plus the next one with prefetch)."""
        return [u.index for u in self.units if u.is_full()]

    # ------------------------------------------------------------ the whole model, for checks and checkpoints
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter at full size and in fp32 (the updater's master values), on every rank,
        under each of its names (a tied weight appears under both). Costs one all-gather of Ψ (logged)."""
        out = {}
        masters = self.updater.masters()
        for u, m in zip(self.units, masters):
            if self.stage == 0:
                full = m.detach().to(self.device, torch.float32).clone()
            else:
                full = torch.zeros(u.flat.padded, dtype=torch.float32, device=self.device)
                u.flat.partition(full).copy_(m.detach())
                self._comm(f"AG {u.name} state", collectives.all_gather, full)
            for p, view in zip(u.params, u.flat.views(full)):
                for name in self._aliases[id(p)]:
                    out[name] = view.clone()
        return out

    def load_partitions(self, masters: list[torch.Tensor], states: list[dict]) -> None:
        """Set this rank's master partitions and their optimizer state (from `par.zero.checkpoint`), then
        rebuild the parameters from them (stages 1-2 all-gather; stage 3 keeps the shard)."""
        own = self.updater.masters()
        if len(masters) != len(own) or any(a.numel() != b.numel() for a, b in zip(masters, own)):
            raise ValueError("checkpoint partitions do not match this engine's layout: "
                             f"{[m.numel() for m in masters]} vs {[m.numel() for m in own]}")
        with torch.no_grad():
            for m, new, st in zip(own, masters, states):
                m.copy_(new)
                self.updater.opt.state[m] = {k: (v.to(m.device) if isinstance(v, torch.Tensor) and v.dim() > 0
                                                 else v.clone() if isinstance(v, torch.Tensor) else v)
                                             for k, v in st.items()}
                if not st:
                    self.updater.opt.state.pop(m)
            for part, m in zip(self.param_partitions(), own):
                if part.data_ptr() != m.data_ptr():
                    part.copy_(m)
        if self.stage in (1, 2):
            for u in self.units:
                self._comm(f"AG {u.name} load", collectives.all_gather, u.full)
