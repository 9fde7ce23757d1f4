"""The same training state through torch's `torch.distributed.checkpoint` (DCP), beside par's format.

DCP saves a nested state dict of tensors, each rank its own pieces, with a `.metadata` file that says where each
piece sits in the whole tensor, and loads *in place* into a state dict of the same structure (resharding where
the tensors are DTensors of another layout). The training state is the same four things as par's
(`par.resilience.resume`):

    {"model": parameters by name, "optim": Adam's state by parameter name (m, v, step) and its param_groups,
     "train": {"step": the data position, "rng": torch's CPU generator state}}

`get_state_dict` / `set_state_dict` (torch.distributed.checkpoint.state_dict) turn a module and its optimizer
into that dict and back; `dcp.save` / `dcp.load` write and read it. Without a process group DCP runs in one
process (no collectives).
"""
from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def training_state(model, opt, step: int) -> dict:
    """The nested dict DCP writes: model, optimizer (keyed by parameter name), data position, random state."""
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "train": {"step": torch.tensor(step), "rng": torch.get_rng_state()}}


def save(model, opt, directory: str, step: int) -> None:
    """`dcp.save` of `training_state` into `directory` (one .distcp file per rank, and .metadata)."""
    dcp.save(training_state(model, opt, step), checkpoint_id=directory)


def load(model, opt, directory: str) -> int:
    """`dcp.load` in place into this model's and optimizer's state dict, then set them, restore torch's CPU
    generator; return the data position."""
    state = training_state(model, opt, 0)
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    torch.set_rng_state(state["train"]["rng"])
    return int(state["train"]["step"])
