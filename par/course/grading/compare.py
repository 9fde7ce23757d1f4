"""What a check compares: the student's value judged by type, shape and dtype before its numbers.

    close(got, want, atol=1e-8, rtol=1e-5)     tensors: same type, shape, dtype; |got - want| <= atol + rtol|want|
    equal(got, want)                           tensors: same type, shape, dtype and values
    arguments_after(f, *args, **kwargs)        (result, args, kwargs) as `f` left them: copies, never `args`

`torch.allclose` broadcasts, so an empty tensor is "close" to anything; these do not. `arguments_after` is how
a check sees what a function does to its arguments (a step that updates in place, a rule that must not modify
its input): in the student's own notebook it calls `f` on deep copies; in the grader, `f` stands for the
student's function (`par.course.grading.proxies.Proxy`) and the copies are the ones the kernel sends back, so
whatever the function did to them never reaches an object the grader computed its expected values from.
"""
from __future__ import annotations

import copy


def _same_kind(got, want) -> bool:
    import torch
    return (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor) and got.shape == want.shape
            and got.dtype == want.dtype)


def close(got, want, atol: float = 1e-8, rtol: float = 1e-5) -> bool:
    """True when `got` is a tensor of `want`'s shape and dtype with |got - want| <= atol + rtol·|want| everywhere
    (a nan is never close)."""
    import torch
    return _same_kind(got, want) and torch.allclose(got.detach(), want.detach(), atol=atol, rtol=rtol)


def equal(got, want) -> bool:
    """True when `got` is a tensor of `want`'s shape and dtype holding the same values."""
    import torch
    return _same_kind(got, want) and torch.equal(got.detach(), want.detach())


def arguments_after(f, *args, **kwargs):
    """(f's result, its positional arguments, its keyword arguments) as `f` left them, on copies of `args`."""
    remote = getattr(f, "arguments_after", None)
    if remote is not None:          # the student's function, called from the grader: the kernel's copies
        return remote(*args, **kwargs)
    args, kwargs = copy.deepcopy(list(args)), copy.deepcopy(dict(kwargs))
    return f(*args, **kwargs), args, kwargs
