"""Mixed-precision training: compute in 16 bits, keep the truth in 32 bits.

The eight steps of one iteration (Micikevicius et al. 2018; DeepSpeed's `fp16` mode):

    1. copy the fp32 master weights into the 16-bit model          master_to_model()
    2. forward in 16 bits (the loss itself is computed in fp32)    model(x); loss_fn(logits.float(), y)
    3. scale the loss by S                                         scaled_loss(loss)
    4. backward: 16-bit gradients, S times too large               backward(loss)
       (data parallel / ZeRO reduce the gradients here)            reduce_grads()
    5. copy the 16-bit gradients into fp32                         grads_to_master()
    6. unscale (÷ S); inf/nan on any rank -> skip the step;       unscale_(), found_overflow(),
       optionally clip the gradient norm                           clip_(max_norm)
    7. optimizer step on the fp32 master weights                   optimizer.step()
    8. copy the updated masters back into the model (= step 1)     master_to_model()

`step()` runs 4½ to 8 in that order and returns whether the optimizer stepped.
The masters stay fp32 because an update lr·g is often smaller than the gap between
neighbouring 16-bit numbers (2^-10 relative for fp16, 2^-7 for bf16): added to a 16-bit
weight it would round away, added to an fp32 master it accumulates.

API (`mp = MixedPrecision(model, optimizer_factory, dtype="fp16", scaler=None, reduce_grads=None, group=None, max_grad_norm=None)`):

    model              an nn.Module in fp32; converted IN PLACE to 16 bits. Its fp32 values
                       become the masters first, so no precision is lost at the start.
    optimizer_factory  called once with the list of fp32 master tensors, e.g.
                       `lambda ps: torch.optim.Adam(ps, lr=1e-3)`; the result is `mp.optimizer`.
    dtype              "fp16" (default scaler: DynamicLossScaler()) or "bf16" (default
                       StaticLossScaler(1.0): bf16 has fp32's range, nothing to scale).
    scaler             anything with `.scale` and `.update(overflow)` (see par.precision.loss_scaler).
    reduce_grads       a callable `reduce_grads(params: list[Parameter]) -> None` that reduces the
                       16-bit `.grad` of the model's parameters IN PLACE, called after backward and
                       before step 5. Data parallel passes its average here, e.g.
                       `lambda ps: par.dp.naive.average_gradients(ps)` (16-bit all-reduce: half
                       the bytes of fp32), or `lambda ps: dp.sync_gradients()` for a `NaiveDP`
                       wrapper built BEFORE MixedPrecision (it broadcasts rank 0's fp32 weights,
                       which then become every rank's masters). None: no communication.
    group              the process group whose ranks must agree on skipping (default: all).
    max_grad_norm      clip the global gradient norm to this in step 6 (None: no clipping).

    mp.params / mp.masters   the 16-bit model parameters and their fp32 masters (same order)
    mp.last                  StepInfo(scale, overflow, grad_norm) of the last `step()`
    mp.skipped               how many steps were skipped so far

Step 6 is made of plain functions over a list of fp32 gradients, so that every trainer runs the
same code: `unscale_(grads, S)`, `found_overflow(grads, group)` (a MAX all-reduce of a 0/1 flag:
a rank that sees inf only in its own gradients makes every rank skip), `grad_norm(grads, group,
sharded)` (with `sharded=True` the squared norms of the ranks' shards are summed first) and
`clip_(grads, max_norm, norm)`. `MixedPrecision` calls them on its masters; ZeRO (`par.zero.engine`)
calls them on its partitions, whose fp32 masters exist only for this rank's share.

Typical loop (what par/precision/job.py runs):

    mp = MixedPrecision(model, lambda ps: torch.optim.Adam(ps, lr), dtype="fp16")
    for x, y in batches:
        loss = lm_loss(model(x).float(), y)      # steps 1-2 (the weights were copied already)
        mp.backward(loss)                        # steps 3-4
        mp.step()                                # steps 5-8

Gradient accumulation: call `mp.backward(loss / k)` for each of k micro-batches (the 16-bit
gradients add up in .grad), then `mp.step()` once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from par.comm import collectives, commlog
from par.precision.loss_scaler import default_scaler

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class UnsupportedPrecision(RuntimeError):
    """The device cannot compute in the requested 16-bit format."""


def check_supported(dtype: str, device) -> None:
    """Raise `UnsupportedPrecision` naming the fix when `device` cannot run a 16-bit matmul and its backward."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown precision {dtype!r}: use 'fp16' or 'bf16'")
    device = torch.device(device)
    if device.type == "cuda" and dtype == "bf16" and not bf16_supported(device):
        major, minor = torch.cuda.get_device_capability(device)
        raise UnsupportedPrecision(
            f"bf16 needs an NVIDIA Ampere GPU or newer (compute capability >= 8.0); {device} is "
            f"sm_{major}{minor}. Use dtype='fp16' (with loss scaling) on this GPU")
    try:
        a = torch.ones(4, 4, dtype=DTYPES[dtype], device=device, requires_grad=True)
        (a @ a).sum().backward()
    except RuntimeError as e:
        raise UnsupportedPrecision(
            f"{dtype} matmul is not supported on {device} by torch {torch.__version__} ({e}). "
            f"Use dtype='fp16' or a device that supports {dtype}") from e


def bf16_supported(device=None) -> bool:
    """True when `device` computes in bf16 natively: the CPU, or a CUDA GPU of compute capability >= 8.0
    (Ampere or newer). `torch.cuda.is_bf16_supported()` alone also says True on older GPUs that only
    emulate bf16 (slowly, without bf16 tensor cores), hence `including_emulation=False`."""
    device = torch.device(device) if device is not None else \
        torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda":
        return True
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)


# ---------------------------------------------------------------- step 6, as functions of the fp32 gradients
@torch.no_grad()
def unscale_(grads, scale: float) -> None:
    """Divide every gradient by the loss scale S in place (inf and nan stay inf and nan)."""
    inv = 1.0 / scale
    if inv == 1.0:
        return
    for g in grads:
        if g is not None:
            g.mul_(inv)


def _device(grads, device):
    return device if device is not None else (grads[0].device if grads else torch.device("cpu"))


@torch.no_grad()
def found_overflow(grads, group=None, impl: str = "ring", device=None) -> bool:
    """True when any gradient on ANY rank of `group` holds inf or nan.

    Each rank checks its own gradients, then a MAX all-reduce of that 0/1 flag makes every rank
    take the same decision; otherwise one rank would skip a step the others take, and the replicas
    (or, under ZeRO, the partitions) would drift apart.
    """
    grads = [g for g in grads if g is not None]
    local = torch.stack([~torch.isfinite(g).all() for g in grads]).any() if grads else torch.tensor(False)
    flag = local.float().reshape(1).to(_device(grads, device))
    with commlog.tag("overflow flag"):
        collectives.all_reduce(flag, op="max", group=group, impl=impl)
    return bool(flag.item() > 0)


@torch.no_grad()
def grad_norm(grads, group=None, impl: str = "ring", sharded: bool = False, device=None) -> float:
    """‖g‖₂ = sqrt(Σ g²) over every gradient, summed in float64. `sharded`: each rank holds only its
    shard of the gradient (ZeRO), so the ranks' Σ g² are added up over `group` first (one all-reduce)."""
    grads = [g for g in grads if g is not None]
    sq = torch.stack([g.double().pow(2).sum() for g in grads]).sum() if grads else torch.zeros((), dtype=torch.float64)
    if sharded:
        sq = sq.reshape(1).to(_device(grads, device))
        with commlog.tag("grad norm"):
            collectives.all_reduce(sq, op="sum", group=group, impl=impl)
    return math.sqrt(sq.item())


@torch.no_grad()
def clip_(grads, max_norm: float, norm: float) -> float:
    """If ‖g‖ = `norm` exceeds `max_norm`, multiply every gradient by max_norm / ‖g‖. Returns ‖g‖."""
    if norm > max_norm:
        for g in grads:
            if g is not None:
                g.mul_(max_norm / (norm + 1e-6))
    return norm


@dataclass(frozen=True)
class StepInfo:
    scale: float        # the loss scale this step's backward used
    overflow: bool      # some gradient on some rank was inf/nan: the step was skipped
    grad_norm: float    # global L2 norm of the unscaled gradient (nan when skipped)


class MixedPrecision:
    """A 16-bit model trained through fp32 master weights, with loss scaling (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, optimizer_factory: Callable, dtype: str = "fp16",
                 scaler=None, reduce_grads: Callable | None = None, group=None,
                 max_grad_norm: float | None = None):
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable parameters")
        check_supported(dtype, params[0].device)
        if any(p.dtype != torch.float32 for p in params):
            raise ValueError("MixedPrecision wants the model in fp32: its values become the fp32 masters")
        self.model, self.dtype_name, self.dtype = model, dtype, DTYPES[dtype]
        self.masters = self.make_masters(params)
        model.to(self.dtype)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = optimizer_factory(self.masters)
        self.scaler = scaler if scaler is not None else default_scaler(dtype)
        self.reduce_hook, self.group, self.max_grad_norm = reduce_grads, group, max_grad_norm
        self.last: StepInfo | None = None
        self.skipped = 0
        self.master_to_model()

    # ------------------------------------------------------------ the eight steps
    def make_masters(self, params) -> list[torch.Tensor]:
        """fp32 copies of the parameters, taken before the model is cast to 16 bits."""
        return [p.detach().clone().float() for p in params]

    @torch.no_grad()
    def master_to_model(self) -> None:
        """Steps 1 and 8: round the fp32 masters into the 16-bit model parameters."""
        for p, m in zip(self.params, self.masters):
            p.copy_(m)

    def cast_inputs(self, *xs):
        """Floating-point inputs in the model's 16-bit dtype (token ids pass through)."""
        out = tuple(x.to(self.dtype) if torch.is_tensor(x) and x.is_floating_point() else x for x in xs)
        return out[0] if len(out) == 1 else out

    def scaled_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Step 3: S · loss, in fp32 (backward then carries S · gradient everywhere)."""
        return loss.float() * self.scaler.scale

    def backward(self, loss: torch.Tensor) -> None:
        """Steps 3-4: back-propagate the scaled loss; the model's .grad are 16-bit and S times too large."""
        self.scaled_loss(loss).backward()

    def reduce_grads(self) -> None:
        """Between 4 and 5: hand the 16-bit gradients to the communication hook (data parallel, ZeRO)."""
        if self.reduce_hook is not None:
            self.reduce_hook(self.params)

    def grads_to_master(self) -> None:
        """Step 5: the 16-bit gradients become the fp32 masters' .grad; the 16-bit ones are freed."""
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None

    def _grads(self) -> list:
        return [m.grad for m in self.masters]

    def unscale_(self) -> None:
        """Step 6: divide the fp32 gradients by S (inf and nan stay inf and nan)."""
        unscale_(self._grads(), self.scaler.scale)

    def found_overflow(self, group=None) -> bool:
        """Step 6: True when any gradient on ANY rank of `group` (default: this trainer's) is inf or nan."""
        return found_overflow(self._grads(), group if group is not None else self.group,
                              device=self.masters[0].device)

    def grad_norm(self) -> float:
        """‖g‖₂ over all fp32 gradients, sqrt(Σ g²): every rank holds all of them."""
        return grad_norm(self._grads())

    def clip_(self, max_norm: float) -> float:
        """Step 6: if ‖g‖ > max_norm, multiply every gradient by max_norm / ‖g‖. Returns ‖g‖ before clipping."""
        return clip_(self._grads(), max_norm, self.grad_norm())

    def step(self) -> bool:
        """Steps 5-8 after `backward`; returns True if the optimizer stepped, False if the step was skipped."""
        scale = self.scaler.scale
        self.reduce_grads()                       # data parallel: all-reduce the 16-bit gradients
        self.grads_to_master()                    # 5
        self.unscale_()                           # 6
        overflow = self.found_overflow()          # 6, agreed by every rank
        self.scaler.update(overflow)
        if overflow:
            self.zero_grad()
            self.skipped += 1
            self.last = StepInfo(scale, True, math.nan)
            return False
        norm = self.clip_(self.max_grad_norm) if self.max_grad_norm else self.grad_norm()   # 6
        self.optimizer.step()                     # 7
        self.master_to_model()                    # 8
        self.zero_grad()
        self.last = StepInfo(scale, False, norm)
        return True

    def zero_grad(self) -> None:
        """Free both the 16-bit and the fp32 gradients."""
        for p, m in zip(self.params, self.masters):
            p.grad = None
            m.grad = None

    # ------------------------------------------------------------ accounting
    def model_state_bytes(self) -> dict:
        """Bytes of the model states alive now, by kind: 16-bit weights and gradients, fp32 masters,
        and each optimizer state (Adam: exp_avg = momentum, exp_avg_sq = variance)."""
        out = {f"{self.dtype_name} weights": sum(p.numel() * p.element_size() for p in self.params),
               f"{self.dtype_name} grads": sum(p.grad.numel() * p.grad.element_size()
                                               for p in self.params if p.grad is not None),
               "fp32 master weights": sum(m.numel() * m.element_size() for m in self.masters),
               "fp32 master grads": sum(m.grad.numel() * m.grad.element_size()
                                        for m in self.masters if m.grad is not None)}
        for state in self.optimizer.state.values():
            for key, t in state.items():
                if torch.is_tensor(t) and t.dim() > 0:
                    name = f"fp32 {OPTIMIZER_STATE_NAMES.get(key, key)}"
                    out[name] = out.get(name, 0) + t.numel() * t.element_size()
        return out


OPTIMIZER_STATE_NAMES = {"exp_avg": "momentum", "exp_avg_sq": "variance", "momentum_buffer": "momentum"}


# ---------------------------------------------------------------- measurements for the lecture
def warmup_cosine_lr(step: int, base_lr: float, warmup: int, total: int, min_lr: float = 0.0) -> float:
    """Learning rate at `step`: linear warm-up from 0 over `warmup` steps, then cosine decay to `min_lr`.

        step < warmup:  base_lr · (step + 1) / warmup
        otherwise:      min_lr + (base_lr - min_lr) · ½ (1 + cos(π · p)),  p = (step - warmup) / (total - warmup)

    Early steps of a fresh model have large, noisy gradients; a small learning rate (and
    clipping) keeps them from throwing the weights, and the loss scale, off a cliff.
    """
    if step < warmup:
        return base_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + (base_lr - min_lr) * 0.5 * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Use learning rate `lr` in every parameter group."""
    for group in optimizer.param_groups:
        group["lr"] = lr
