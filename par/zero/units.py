"""Units: the groups of parameters ZeRO lays out, reduces, gathers and frees together (FSDP's "units").

Every trainable parameter belongs to exactly one unit, and a unit is a module whose forward runs:

    candidates   the entries of `model.to_layers()` (if the model has it), else every module that
                 defines its own forward, and always the model itself (the root);
    owner        a parameter belongs to the nearest candidate at or above the module that holds it.

So a parameter held by a module *without* a forward of its own (`nn.ParameterList`,
`nn.ParameterDict`, a bare container) goes to the parent whose forward uses it, and parameters
outside every `to_layers()` entry go to the root: exactly where torch FSDP2 puts them when
`fully_shard` wraps the layers and the root. Stage 3 gathers a unit just before its forward and
frees it just after (and again around its backward); stages 0-2 use units only as gradient buckets.

What cannot work is refused in one line, naming the parameter and the reason:
* a parameter reached from two different units (tied weights across layers) under stage 3: no
  single forward encloses both uses (stages 0-2 train it: it is laid out once, in the first unit);
* parameters of one unit with different dtypes or devices (one flat buffer holds a unit);
* sparse parameters.
Frozen parameters (`requires_grad=False`) and buffers are not model states ZeRO partitions: they
stay in the module, replicated, as plain data parallelism keeps them.

A parameter read outside its unit's forward (say `F.linear(x, self.layer.weight)` in the parent,
after `self.layer` already ran) is only visible at run time: `FreedParameterGuard` watches the first
stage-3 step and turns what would be a crash ("data is not allocated yet", or worse) into the same
kind of one-line refusal.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def defines_forward(m: nn.Module) -> bool:
    """True for modules with a forward of their own (Linear, a Block, Sequential); False for
    containers that are never called (ModuleList, ModuleDict, ParameterList, ParameterDict)."""
    return type(m).forward is not nn.Module.forward


def candidates(model: nn.Module) -> list[nn.Module]:
    """The modules a unit may be, in forward order as far as it is known: the root first, then the
    `to_layers()` entries (or every module with a forward, in `model.modules()` order)."""
    if hasattr(model, "to_layers"):
        inner = [m for m in model.to_layers() if isinstance(m, nn.Module) and defines_forward(m)]
    else:
        inner = [m for m in model.modules() if defines_forward(m)]
    out, seen = [], set()
    for m in [model, *inner]:
        if id(m) not in seen:
            seen.add(id(m))
            out.append(m)
    return out


def plan(model: nn.Module, stage: int) -> list[tuple[nn.Module, str, list[nn.Parameter]]]:
    """The units of `model` as (module, name, trainable parameters it owns), in unit order.

    Raises ValueError naming the parameter when a parameter cannot be placed (see the module docstring)."""
    cands = candidates(model)
    is_cand = {id(m): i for i, m in enumerate(cands)}
    modules = dict(model.named_modules(remove_duplicate=False))
    unit_of: dict[int, list[int]] = {}
    first_name: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if not p.requires_grad:
            continue
        first_name.setdefault(id(p), name)
        path = name.split(".")[:-1]
        owner = None
        for k in range(len(path), -1, -1):   # the holder, then its parent, ... up to the root
            m = modules[".".join(path[:k])]
            if id(m) in is_cand:
                owner = is_cand[id(m)]
                break
        found = unit_of.setdefault(id(p), [])
        if owner not in found:
            found.append(owner)
    names = {id(m): n for n, m in model.named_modules()}
    params_by_unit: dict[int, list[nn.Parameter]] = {}
    for p in model.parameters():
        if not p.requires_grad:
            continue
        owners = unit_of[id(p)]
        if len(owners) > 1 and stage == 3:
            users = " and ".join(repr(unit_name(names.get(id(cands[i]), ""), i)) for i in owners)
            raise ValueError(f"parameter {first_name[id(p)]!r} is shared by units {users} (tied weights): ZeRO-3 "
                             f"gathers a unit only around its own forward, so no unit can hold it; use stage 0, 1 "
                             f"or 2 (they train tied weights), or untie it")
        if p.is_sparse:
            raise ValueError(f"parameter {first_name[id(p)]!r} is sparse: ZeRO lays parameters out in dense flat "
                             f"buffers; make it dense")
        params_by_unit.setdefault(min(owners), []).append(p)
    out = []
    for i, m in enumerate(cands):
        ps = params_by_unit.get(i)
        if not ps:
            continue
        name = unit_name(names.get(id(m), ""), i)
        kinds = {(p.dtype, p.device) for p in ps}
        if len(kinds) > 1:
            detail = ", ".join(f"{first_name[id(p)]}: {p.dtype} on {p.device}" for p in ps[:6])
            raise ValueError(f"unit {name!r} mixes dtypes or devices ({detail}): ZeRO keeps one flat buffer per unit; "
                             f"move and cast the whole model first (model.to(device, dtype))")
        out.append((m, name, ps))
    if not out:
        raise ValueError("the model has no trainable parameters (requires_grad=True): nothing for ZeRO to partition")
    return out


def unit_name(module_name: str, index: int) -> str:
    return module_name or ("(root)" if index == 0 else f"unit{index}")


def output_tensors(out) -> list[torch.Tensor]:
    """Every tensor in a module's output (a tensor, tuple, list, dict, or nested)."""
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]


# ---------------------------------------------------------------- the first stage-3 step, watched
def is_freed(t: torch.Tensor) -> bool:
    """A tensor whose storage stage 3 released (shape kept, zero bytes behind it)."""
    return t.numel() > 0 and t.device.type != "meta" and t.untyped_storage().nbytes() == 0


class FreedParameterGuard(TorchDispatchMode):
    """While active, every operation is checked for a stage-3 parameter whose memory is freed; the
    first one raises a ValueError naming the parameter, its unit, and where it was read.

    `engine` gives `owner_of(tensor) -> (parameter name, unit name) | None` and `active_units()`."""

    def __init__(self, engine):
        super().__init__()
        self.engine = engine

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and is_freed(t):
                owner = self.engine.owner_of(t)
                if owner is not None:
                    raise ValueError(freed_message(*owner, func, self.engine.active_units()))
        return func(*args, **(kwargs or {}))


def freed_message(param: str, unit: str, func, active: list[str]) -> str:
    if torch._C._current_graph_task_id() != -1:
        where = "in backward, outside the backward of its unit"
    elif active:
        where = f"in the forward of {active[-1]!r}"
    else:
        where = "outside every unit's forward (in the loss?)"
    return (f"ZeRO-3 cannot train this model: parameter {param!r} of unit {unit!r} is read by {func} {where}, "
            f"but stage 3 gathers a unit's parameters only while its own forward (or backward) runs. Call the "
            f"module that holds it instead of reading its parameters, give the model a to_layers() that puts the "
            f"reader and the parameter in one unit, or use stage 0, 1 or 2")
