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

On ZeRO's ranks (`save_zero`) each unit's flat partition is a DTensor sharded along its one dimension, so DCP
writes each rank's piece with its offset, and a single process (`load_zero_single`) reads the whole unit back.
"""
from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from par.resilience import resume
from par.zero import units


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


# ------------------------------------------------------------------ ZeRO's flat partitions as DTensors
def sharded(local: torch.Tensor, numel: int, mesh) -> DTensor:
    """A rank's partition of a flat unit as a DTensor of the whole unit (numel elements, Shard(0)): par's padded
    partitions of ⌈Ψ/N⌉ are torch.chunk's, so the local piece is the partition with the padding cut off."""
    rank, part = mesh.get_local_rank(), local.numel()
    valid = max(0, min(part, numel - rank * part))
    return DTensor.from_local(local[:valid].contiguous(), mesh, [Shard(0)], run_check=False,
                              shape=torch.Size([numel]), stride=(1,))


def save_zero(engine, directory: str, step: int) -> None:
    """`dcp.save` of a ZeRO engine's training state, every rank writing its partitions: per unit the master
    values and Adam's m and v as DTensors, t as a tensor; the data position and torch's CPU generator."""
    mesh = init_device_mesh(engine.device.type, (engine.n,))
    units = {}
    for u, m in zip(engine.units, engine.updater.masters()):
        st = engine.updater.opt.state.get(m, {})
        units[u.name] = {"master": sharded(m.detach().float(), u.flat.numel, mesh),
                         **{k: sharded(st[k], u.flat.numel, mesh) for k in ("exp_avg", "exp_avg_sq") if k in st},
                         **({"step": st["step"].detach().clone()} if "step" in st else {})}
    dcp.save({"units": units, "train": {"step": torch.tensor(step), "rng": torch.get_rng_state()}},
             checkpoint_id=directory)


def layout(model, stage: int) -> list[dict]:
    """The units ZeRO cuts `model` into (`par.zero.units.plan`): name, parameter names, shapes, Ψ of each."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [{"name": name, "params": [names[id(p)] for p in ps], "shapes": [list(p.shape) for p in ps],
             "numel": sum(p.numel() for p in ps)} for _, name, ps in units.plan(model, stage)]


def load_zero_single(model, directory: str, stage: int, lr: float = 1e-3) -> tuple[torch.optim.Optimizer, int]:
    """One process reads `save_zero`'s checkpoint: `dcp.load` into whole unit tensors (DCP re-shards the ranks'
    pieces by their offsets), then `par.resilience.resume.install` as par's format does."""
    units_ = layout(model, stage)
    state = {"units": {u["name"]: {"master": torch.zeros(u["numel"]), "exp_avg": torch.zeros(u["numel"]),
                                   "exp_avg_sq": torch.zeros(u["numel"]), "step": torch.tensor(0.0)}
                       for u in units_},
             "train": {"step": torch.tensor(0), "rng": torch.get_rng_state()}}
    dcp.load(state, checkpoint_id=directory)
    whole = [{"master": s["master"], "state": {k: s[k] for k in ("step", "exp_avg", "exp_avg_sq")}}
             for s in (state["units"][u["name"]] for u in units_)]
    meta = {"units": units_, "step": int(state["train"]["step"]), "extra": {"rng": {"cpu": state["train"]["rng"]}}}
    return resume.install(model, meta, whole, "adam", lr)
