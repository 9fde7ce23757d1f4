"""The conjugate operators of tensor parallelism (Megatron-LM) and of sequence parallelism, as autograd functions.

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

Sequence parallelism (`par.tp.sequence`) splits the tokens (dim 1) between the regions instead, and
replaces f and g by their sequence-wise conjugate pair (a ring all-reduce is a reduce-scatter then
an all-gather), with the same two edges:

    operator                              forward                           backward
    gather_from_sequence_region       (g)  all-gather the T/N-token slices   reduce-scatter the gradient
    reduce_scatter_to_sequence_region (ḡ)  reduce-scatter the partials       all-gather the gradient
    scatter_to_sequence                    keep my T/N tokens                all-gather the gradient's slices
    gather_to_full                         all-gather the slices             keep my slice of the gradient

On a group of size 1 every operator returns its input unchanged (no-op). All
communication goes through `par.comm.collectives` (so `par.comm.commlog` counts it), tagged
"<label>/fwd" or "<label>/bwd". Buffers are allocated on the input's device.
"""
from __future__ import annotations

import torch

from par.comm import collectives, commlog
from par.comm.collectives import group_rank, group_size


SEQ = 1   # the sequence dimension of a (B, T, h) activation


def direction_tag(label: str, direction: str) -> str:
    """The commlog tag "<label>/<direction>" ("fwd", "bwd", ...) of one operator's collective."""
    return f"{label}/{direction}" if label else direction


def check_sequence(seq: int, n: int) -> None:
    """One clear error when the sequence cannot be cut into n equal slices."""
    if seq % n:
        raise ValueError(f"sequence length {seq} is not divisible by the sequence-parallel degree {n}: "
                         f"make it a multiple of {n} (or use context parallelism, which takes any length)")


def _all_reduce(t: torch.Tensor, group, impl: str, tag: str) -> torch.Tensor:
    """A summed copy of `t` (the collectives work in place, so never on the caller's tensor)."""
    out = t.contiguous().clone()
    with commlog.tag(tag):
        return collectives.all_reduce(out, "sum", group=group, impl=impl)


def _part(t: torch.Tensor, dim: int, n: int) -> int:
    """k = t.size(dim) / N, the length of one rank's equal slice of dimension `dim`."""
    if t.size(dim) % n:
        raise ValueError(f"dimension {dim} of size {t.size(dim)} cannot be split evenly over {n} "
                         f"tensor-parallel ranks; make it a multiple of {n}")
    return t.size(dim) // n


def my_slice(t: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Rank r's equal slice of dimension `dim`: t[r·k : (r+1)·k] along it, k = size / N."""
    k = _part(t, dim, group_size(group))
    return t.narrow(dim, group_rank(group) * k, k).contiguous()


def my_sequence_slice(x: torch.Tensor, group=None) -> torch.Tensor:
    """Rank r's T/N tokens of a (B, T, h) activation: x[:, r·T/N : (r+1)·T/N]."""
    check_sequence(x.size(SEQ), group_size(group))
    return my_slice(x, SEQ, group)


def all_gather_along(t: torch.Tensor, dim: int, group, impl: str, tag: str) -> torch.Tensor:
    """[t_0 | t_1 | ... | t_N-1] along `dim`, in rank order (one all-gather of N·|t| elements)."""
    n, r = group_size(group), group_rank(group)
    buf = torch.empty((n, *t.shape), dtype=t.dtype, device=t.device)
    buf[r].copy_(t)
    with commlog.tag(tag):
        collectives.all_gather(buf, group=group, impl=impl)
    return torch.cat(buf.unbind(0), dim=dim)


def reduce_scatter_along(t: torch.Tensor, dim: int, group, impl: str, tag: str) -> torch.Tensor:
    """Rank r's equal slice along `dim` of sum over ranks of t (one reduce-scatter)."""
    n = group_size(group)
    k = _part(t, dim, n)
    buf = torch.stack(t.chunk(n, dim=dim)).contiguous()
    with commlog.tag(tag):
        mine = collectives.reduce_scatter(buf, "sum", group=group, impl=impl)
    shape = list(t.shape)
    shape[dim] = k
    return mine.view(shape).clone()


class _CopyToRegion(torch.autograd.Function):           # f
    @staticmethod
    def forward(ctx, x, group, impl, label):
        ctx.group, ctx.impl, ctx.label = group, impl, label
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group, ctx.impl, direction_tag(ctx.label, "bwd")), None, None, None


class _ReduceFromRegion(torch.autograd.Function):       # g
    @staticmethod
    def forward(ctx, x, group, impl, label):
        return _all_reduce(x, group, impl, direction_tag(label, "fwd"))

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


class _Scatter(torch.autograd.Function):
    """y = my slice of x along `dim`; dL/dx = all-gather of the slices' gradients."""

    @staticmethod
    def forward(ctx, x, group, impl, label, dim):
        ctx.group, ctx.impl, ctx.label, ctx.dim = group, impl, label, dim
        return my_slice(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        d_x = all_gather_along(grad.contiguous(), ctx.dim, ctx.group, ctx.impl, direction_tag(ctx.label, "bwd"))
        return d_x, None, None, None, None


class _Gather(torch.autograd.Function):
    """y = [x_0 | ... | x_N-1] along `dim`; dL/dx = my slice of dL/dy."""

    @staticmethod
    def forward(ctx, x, group, impl, label, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather_along(x.contiguous(), dim, group, impl, direction_tag(label, "fwd"))

    @staticmethod
    def backward(ctx, grad):
        return my_slice(grad, ctx.dim, ctx.group), None, None, None, None


class _GatherFromSequence(torch.autograd.Function):       # g of sequence parallelism
    @staticmethod
    def forward(ctx, x, group, impl, label):
        ctx.group, ctx.impl, ctx.label = group, impl, label
        return all_gather_along(x.contiguous(), SEQ, group, impl, direction_tag(label, "fwd"))

    @staticmethod
    def backward(ctx, grad):
        d_x = reduce_scatter_along(grad, SEQ, ctx.group, ctx.impl, direction_tag(ctx.label, "bwd"))
        return d_x, None, None, None


class _ReduceScatterToSequence(torch.autograd.Function):  # ḡ
    @staticmethod
    def forward(ctx, x, group, impl, label):
        ctx.group, ctx.impl, ctx.label = group, impl, label
        return reduce_scatter_along(x, SEQ, group, impl, direction_tag(label, "fwd"))

    @staticmethod
    def backward(ctx, grad):
        d_x = all_gather_along(grad.contiguous(), SEQ, ctx.group, ctx.impl, direction_tag(ctx.label, "bwd"))
        return d_x, None, None, None


def copy_to_region(x: torch.Tensor, group=None, impl: str = "ring", label: str = "") -> torch.Tensor:
    """f: y = x forward; dL/dx = sum over ranks of dL/dy backward (one all-reduce)."""
    return x if group_size(group) == 1 else _CopyToRegion.apply(x, group, impl, label)


def reduce_from_region(x: torch.Tensor, group=None, impl: str = "ring", label: str = "") -> torch.Tensor:
    """g: y = sum over ranks of x forward (one all-reduce); dL/dx = dL/dy backward."""
    return x if group_size(group) == 1 else _ReduceFromRegion.apply(x, group, impl, label)


def scatter_to_region(x: torch.Tensor, group=None, impl: str = "ring", label: str = "") -> torch.Tensor:
    """y = my slice of x's last dim forward; dL/dx = all-gather of the slices' gradients backward."""
    return x if group_size(group) == 1 else _Scatter.apply(x, group, impl, label, -1)


def gather_from_region(x: torch.Tensor, group=None, impl: str = "ring", label: str = "") -> torch.Tensor:
    """y = [x_0 | x_1 | ... ] along the last dim forward; dL/dx = my slice of dL/dy backward."""
    return x if group_size(group) == 1 else _Gather.apply(x, group, impl, label, -1)


def gather_from_sequence_region(x, group=None, impl: str = "ring", label: str = "") -> torch.Tensor:
    """g: y = [x_0 | ... | x_N-1] along the sequence forward (all-gather); dL/dx = reduce-scatter of dL/dy."""
    return x if group_size(group) == 1 else _GatherFromSequence.apply(x, group, impl, label)


def reduce_scatter_to_sequence_region(x, group=None, impl: str = "ring", label: str = "") -> torch.Tensor:
    """ḡ: y = my T/N tokens of the sum over ranks of x forward (reduce-scatter); dL/dx = all-gather of dL/dy."""
    return x if group_size(group) == 1 else _ReduceScatterToSequence.apply(x, group, impl, label)


def scatter_to_sequence(x, group=None, impl: str = "ring", label: str = "") -> torch.Tensor:
    """Enter the sequence-parallel region from a replicated tensor: keep my T/N tokens; all-gather backward."""
    if group_size(group) == 1:
        return x
    check_sequence(x.size(SEQ), group_size(group))
    return _Scatter.apply(x, group, impl, label, SEQ)


def gather_to_full(x, group=None, impl: str = "ring", label: str = "") -> torch.Tensor:
    """Leave the region to a replicated tensor: all-gather forward; keep my slice of the gradient backward."""
    return x if group_size(group) == 1 else _Gather.apply(x, group, impl, label, SEQ)
