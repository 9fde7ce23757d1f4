"""The same ideas through torch's own APIs, beside par's: ZeRO-1 and ZeRO-3 as a PyTorch user calls them.

    ZeRO-1   DDP(model, gradient_as_bucket_view=True)  +  ZeroRedundancyOptimizer(params, Adam)
             every rank keeps the optimizer state of its share of the parameters (whole tensors,
             greedily balanced); gradients are all-reduced, updated shares broadcast.
    ZeRO-3   fully_shard(unit) for every unit, then fully_shard(model)          (FSDP2, torch >= 2.4)
             parameters become DTensors sharded on dim 0; each unit is all-gathered before its
             forward and backward and its gradient reduce-scattered, as `par.zero.engine.Zero(stage=3)`
             does with flat partitions; the root takes the parameters no unit holds.

    model = fsdp2(build("tiny"))                       # the same GPT-lite par trains
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss = lm_loss(model(x), y); loss.backward(); opt.step(); opt.zero_grad()
    full = full_parameters(model)                      # {name: full tensor}, gathered from the shards

Both run on gloo (CPU) and NCCL (GPU) unchanged.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from par.memory.accounting import tensor_bytes


def fsdp2(model: nn.Module, mesh=None) -> nn.Module:
    """FSDP2: `fully_shard` each `to_layers()` entry that holds parameters, then the root (in place)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    if mesh is None:
        device = next(model.parameters()).device
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for unit in (model.to_layers() if hasattr(model, "to_layers") else []):
        if isinstance(unit, nn.Module) and any(True for _ in unit.parameters()):
            fully_shard(unit, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def zero1(model: nn.Module, lr: float = 1e-3) -> tuple[nn.Module, torch.optim.Optimizer]:
    """ZeRO-1 the torch way: (DDP-wrapped model, ZeroRedundancyOptimizer over Adam)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    device = next(model.parameters()).device
    ddp = DDP(model, device_ids=[device] if device.type == "cuda" else None, gradient_as_bucket_view=True)
    return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=lr)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a plain tensor is its own)."""
    return t.to_local() if hasattr(t, "to_local") else t


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter at full size on every rank (a DTensor's shards all-gathered), fp32, by name."""
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
            for name, p in model.named_parameters()}


def model_state_bytes(model: nn.Module, optimizer) -> dict:
    """Bytes of this rank's parameters, gradients and optimizer state (a DTensor counted by its local shard)."""
    opt = getattr(optimizer, "optim", optimizer)          # ZeroRedundancyOptimizer wraps the local one
    params = list(model.parameters())
    states = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    out = {"params": tensor_bytes([local(p) for p in params]),
           "grads": tensor_bytes([local(p.grad) for p in params if p.grad is not None]),
           "optimizer": tensor_bytes([local(s) for s in states])}
    out["model_states"] = out["params"] + out["grads"] + out["optimizer"]
    return out
