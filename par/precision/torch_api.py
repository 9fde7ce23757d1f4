"""Mixed precision through torch's own API, beside par's loss scaler: `torch.autocast` + `torch.amp.GradScaler`.

    scaler = torch.amp.GradScaler(device_type, init_scale=2.0 ** 16, growth_interval=1000)
    with torch.autocast(device_type, dtype=torch.float16):     # matmuls in fp16, softmax/norms in fp32
        loss = lm_loss(model(x).float(), y)                    # the weights stay fp32: no master copy
    scaler.scale(loss).backward()                              # S · loss
    scaler.step(optimizer)                                     # unscale (÷ S), skip the step on inf/nan
    scaler.update()                                            # halve S on overflow, double after a clean window

autocast casts per operation (a fp16 copy of each weight for each matmul) where par's `MixedPrecision` casts
the model once and keeps fp32 masters; the loss scaling is the same rule. `train` runs the autocast forward
with either scaler: torch's GradScaler, or par's `DynamicLossScaler` with hysteresis 1 and par's own step-6
functions (`unscale_`, `found_overflow`). `compare` runs both on the same data and returns the scale of
every step, the skipped steps and the largest parameter difference after the last step.
"""
from __future__ import annotations

import copy

import torch

from par.measure import typed
from par.model import lm_loss
from par.precision.loss_scaler import DynamicLossScaler
from par.precision.mixed_precision import found_overflow, unscale_


def train(model, batches, scaler: str = "par", dtype=torch.float16, init_scale: float = 2.0 ** 16, window: int = 1000,
          blow_up: tuple = (), lr: float = 3e-3) -> dict:
    """Adam under `torch.autocast(dtype)` with torch's GradScaler (`scaler="torch"`) or par's scaler ("par").
    At the steps in `blow_up` the loss is multiplied by 2^20 first: a real fp16 overflow in backward."""
    device = next(model.parameters()).device.type
    opt = torch.optim.Adam(model.parameters(), lr=lr, foreach=False)
    ours = DynamicLossScaler(init_scale, window=window, hysteresis=1)   # hysteresis 1: GradScaler's rule
    theirs = torch.amp.GradScaler(device, init_scale=init_scale, growth_interval=window)
    log = {"scale": [], "skipped": [], "loss": []}
    for step, (x, y) in enumerate(batches):
        with torch.autocast(device, dtype=dtype):
            logits = model(x)
        loss = lm_loss(logits.float(), y) * (2.0 ** 20 if step in blow_up else 1.0)
        if scaler == "torch":
            scale = theirs.get_scale()
            theirs.scale(loss).backward()
            theirs.step(opt)
            theirs.update()
            skipped = theirs.get_scale() < scale           # with GradScaler, an overflow always backs off
        else:
            scale = ours.scale
            (loss * scale).backward()                      # step 3-4
            grads = [p.grad for p in model.parameters()]
            unscale_(grads, scale)                         # 6: ÷ S
            skipped = found_overflow(grads)                # 6: inf/nan anywhere?
            ours.update(skipped)
            if not skipped:
                opt.step()                                 # 7
        opt.zero_grad(set_to_none=True)
        log["scale"].append(scale)
        log["skipped"].append(bool(skipped))
        log["loss"].append(loss.item())
    return log


def compare(model, batches, **kwargs) -> dict:
    """par's scaler and torch's GradScaler, each training a copy of `model` on `batches` under autocast: their
    scales and skips per step, and the largest |difference| of the parameters after the last step; typed
    (`par.measure.typed`: `out.par.scale`, `out.max_param_diff`)."""
    runs = {}
    models = {}
    for name in ("par", "torch"):
        models[name] = copy.deepcopy(model)
        runs[name] = train(models[name], batches, scaler=name, **kwargs)
    diff = max((a - b).abs().max().item() for a, b in zip(models["par"].parameters(), models["torch"].parameters()))
    return typed({"par": runs["par"], "torch": runs["torch"], "max_param_diff": diff,
                  "same_scales": runs["par"]["scale"] == runs["torch"]["scale"],
                  "same_skips": runs["par"]["skipped"] == runs["torch"]["skipped"]})
