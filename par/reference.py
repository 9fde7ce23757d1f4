"""The single-process reference every strategy is compared with.

Plain training: one process, the whole global batch, the same model, the same
optimizer. A parallel strategy is correct when its parameters after k steps
equal the ones `train_single` produces (fp32: max abs diff <= 1e-5).
"""
from __future__ import annotations

import torch
import torch.nn as nn


def fused_supported(device) -> bool:
    """Whether torch has a fused Adam/AdamW kernel (the whole update of every tensor in one launch) for
    `device`'s type: CUDA, and the CPU in recent torch."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    return torch.device(device).type in _get_fused_kernels_supported_devices()


def make_optimizer(params, name: str = "adam", lr: float = 1e-2, fused: bool = False, **kw) -> torch.optim.Optimizer:
    """sgd, momentum (SGD with 0.9), adam or adamw, with course defaults. fused=True: Adam and AdamW use torch's
    fused kernel where the parameters' device has one (`fused_supported`), the for-each kernels elsewhere."""
    params = list(params)
    if fused and name in ("adam", "adamw") and params and fused_supported(params[0].device):
        kw = {**kw, "fused": True}
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, **kw)
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, **kw)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, **kw)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, **kw)
    raise ValueError(f"unknown optimizer {name!r}: use sgd, momentum, adam or adamw")


def train_single(model: nn.Module, batches, loss_fn, optimizer: str = "adam", lr: float = 1e-2,
                 lr_at=None, **opt_kw) -> list[float]:
    """Train `model` in place on the (input, target) `batches`; return the loss of each step.
    `lr_at(step)`: a learning-rate schedule (default: `lr` throughout); `opt_kw`: betas, eps, fused, ...
    The losses stay on the device until the end: no step waits for the host to read its loss."""
    opt = make_optimizer(model.parameters(), optimizer, lr, **opt_kw)
    losses = []
    for step, (x, y) in enumerate(batches):
        if lr_at is not None:
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses).tolist() if losses else []


def max_abs_diff(a: nn.Module | dict, b: nn.Module | dict) -> float:
    """Largest |a - b| over all parameters (modules or state dicts with the same keys)."""
    sa = a.state_dict() if isinstance(a, nn.Module) else a
    sb = b.state_dict() if isinstance(b, nn.Module) else b
    if sa.keys() != sb.keys():
        raise ValueError(f"different parameter names: {sorted(set(sa) ^ set(sb))}")
    return max((sa[k].float() - sb[k].float()).abs().max().item() for k in sa)


def param_hash(model: nn.Module) -> str:
    """A short fingerprint of all parameters, to check that replicas are identical."""
    import hashlib
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]
