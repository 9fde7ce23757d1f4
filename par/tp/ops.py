"""The four conjugate operators of tensor parallelism (Megatron-LM), as autograd functions.

A tensor-parallel region is the stretch of a layer where every rank of the group
holds a different slice of the activations. Entering and leaving it costs
communication, and each operator's backward is the conjugate of its forward:

    operator               forward                          backward
    copy_to_region    (f)  identity                         all-reduce (sum) the gradient
    reduce_from_region (g) all-reduce (sum) the partials    identity
    scatter_to_region      keep my slice of the last dim    all-gather the gradient's slices
    gather_from_region     all-gather the slices            keep my slice of the gradient

Why conjugate: if y = x is used by N ranks (f), dL/dx is the sum of the N ranks'
contributions; if y = sum of N partials (g), each partial's gradient is dL/dy.

On a group of size 1 every operator returns its input unchanged (no-op). All
communication goes through `par.comm.collectives` (so `par.comm.commlog` counts it), tagged
"<label>/fwd" or "<label>/bwd". Buffers are allocated on the input's device.
"""
from __future__ import annotations

import torch

from par.comm import collectives, commlog
from par.comm.collectives import group_rank, group_size


def _tag(label: str, direction: str) -> str:
    return f"{label}/{direction}" if label else direction


def _all_reduce(t: torch.Tensor, group, impl: str, tag: str) -> torch.Tensor:
    """A summed copy of `t` (the collectives work in place, so never on the caller's tensor)."""
    out = t.contiguous().clone()
    with commlog.tag(tag):
        return collectives.all_reduce(out, "sum", group=group, impl=impl)


def _my_slice(t: torch.Tensor, group) -> torch.Tensor:
    """This rank's equal slice of the last dimension."""
    n, r = group_size(group), group_rank(group)
    width = t.size(-1)
    if width % n:
        raise ValueError(f"last dimension {width} cannot be split evenly over {n} tensor-parallel ranks; "
                         f"make it a multiple of {n}")
    k = width // n
    return t.narrow(-1, r * k, k).contiguous()


def _all_gather_last_dim(t: torch.Tensor, group, impl: str, tag: str) -> torch.Tensor:
    """Concatenate every rank's `t` along the last dimension, in rank order."""
    n, r = group_size(group), group_rank(group)
    buf = torch.empty((n, *t.shape), dtype=t.dtype, device=t.device)
    buf[r].copy_(t)
    with commlog.tag(tag):
        collectives.all_gather(buf, group=group, impl=impl)
    return torch.cat(buf.unbind(0), dim=-1)


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, impl, label):
        ctx.group, ctx.impl, ctx.label = group, impl, label
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group, ctx.impl, _tag(ctx.label, "bwd")), None, None, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, impl, label):
        return _all_reduce(x, group, impl, _tag(label, "fwd"))

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, impl, label):
        ctx.group, ctx.impl, ctx.label = group, impl, label
        return _my_slice(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_last_dim(grad.contiguous(), ctx.group, ctx.impl, _tag(ctx.label, "bwd")), None, None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, impl, label):
        ctx.group = group
        return _all_gather_last_dim(x.contiguous(), group, impl, _tag(label, "fwd"))

    @staticmethod
    def backward(ctx, grad):
        return _my_slice(grad, ctx.group), None, None, None


def copy_to_region(x: torch.Tensor, group=None, impl: str = "ring", label: str = "") -> torch.Tensor:
    """f: y = x forward; dL/dx = sum over ranks of dL/dy backward (one all-reduce)."""
    return x if group_size(group) == 1 else _CopyToRegion.apply(x, group, impl, label)


def reduce_from_region(x: torch.Tensor, group=None, impl: str = "ring", label: str = "") -> torch.Tensor:
    """g: y = sum over ranks of x forward (one all-reduce); dL/dx = dL/dy backward."""
    return x if group_size(group) == 1 else _ReduceFromRegion.apply(x, group, impl, label)


def scatter_to_region(x: torch.Tensor, group=None, impl: str = "ring", label: str = "") -> torch.Tensor:
    """y = my slice of x's last dim forward; dL/dx = all-gather of the slices' gradients backward."""
    return x if group_size(group) == 1 else _ScatterToRegion.apply(x, group, impl, label)


def gather_from_region(x: torch.Tensor, group=None, impl: str = "ring", label: str = "") -> torch.Tensor:
    """y = [x_0 | x_1 | ... ] along the last dim forward; dL/dx = my slice of dL/dy backward."""
    return x if group_size(group) == 1 else _GatherFromRegion.apply(x, group, impl, label)
