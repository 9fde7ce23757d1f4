"""Resume on another layout: the training state that makes a resumed run equal the one that never stopped.

A run at step s is a function of four things, and a checkpoint must hold all four:

    model          the fp32 parameters                       par's sharded checkpoint (`par.zero.checkpoint`)
    optimizer      Adam's m, v and its step t (bias          the same files: each rank's partitions of m and v,
                   correction 1 - β^t)                       t copied
    data position  which batch comes next: s                 meta.pt's "step"
    random state   torch's CPU generator (here it draws      meta.pt's "extra": torch.get_rng_state()
                   the token noise of every batch)           (and every CUDA generator's, on a GPU)

The batches are par's single-process order (`par.data.global_batches`, a permutation fixed by the seed), so
the data position is the index of the next batch in it. Every rank draws the same noise for the *global*
batch from the same generator and keeps its rows r, r+N, ... , so the draws do not depend on the layout
(dropout inside the model would: N ranks draw N masks for N shards, one process one mask for the batch).

Saved on one layout (ZeRO-3 on N ranks), the model and optimizer state re-shard to another (ZeRO-1 on M ranks,
`par.zero.checkpoint.load`), or gather whole into a single process with a plain `torch.optim.Adam`
(`load_single`): flat partitions concatenated, padding dropped, cut back into parameters.
A dp × pp run saves each stage's parameters and Adam state by the dense model's names (`save_pp`); one process
(`load_pp`) or a pipeline again reads every stage's file into the whole model.
"""
from __future__ import annotations

import itertools
import os

import torch
import torch.distributed as dist

from par.data import global_batches
from par.model import lm_loss
from par.reference import make_optimizer
from par.tp.layers import TensorParallelGPT
from par.zero import checkpoint


# ------------------------------------------------------------------ the data position and the random state
def batches_from(dataset, batch: int, steps: int, seed: int, position: int = 0):
    """The global batches position, position + 1, ..., steps - 1 of par's single-process order."""
    return itertools.islice(global_batches(dataset, batch, steps, seed=seed), position, steps)


def token_noise(x: torch.Tensor, p: float, vocab: int) -> torch.Tensor:
    """Replace each input token by a uniformly random one with probability p (a data augmentation), drawn from
    torch's default CPU generator: mask = rand < p, x' = where(mask, randint(vocab), x). Two draws per batch."""
    mask = torch.rand(x.shape) < p
    return torch.where(mask, torch.randint(vocab, x.shape), x)


def rng_state() -> dict:
    """Torch's CPU generator, and every CUDA generator where there are GPUs (ByteTensors: weights_only loads)."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Put back what `rng_state` took."""
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ------------------------------------------------------------------ one step, the same on every layout
def global_step_input(x: torch.Tensor, y: torch.Tensor, noise: float, vocab: int, rank: int = 0, world: int = 1):
    """This rank's rows r, r+N, ... of the global batch after the token noise (drawn for the whole batch)."""
    x = token_noise(x, noise, vocab) if noise > 0 else x
    return x[rank::world], y[rank::world]


# ------------------------------------------------------------------ save and load on a ZeRO layout
def save(engine, directory: str, step: int) -> None:
    """Model and optimizer (every rank its shard), the data position `step` and the random state (meta.pt)."""
    checkpoint.save(engine, directory, step=step, extra={"rng": rng_state()})


def load(engine, directory: str, data: bool = True, rng: bool = True, optimizer: bool = True) -> int:
    """Fill a fresh `Zero` engine (any N_d, any stage) from `save`'s folder; restore the random state; return the
    data position (the next batch). The mistakes a test shows: data=False restarts the data order, rng=False keeps
    the fresh random state, optimizer=False loses rank 0's shard of Adam's state (its m, v and t start again)."""
    meta = checkpoint.load(engine, directory)
    if not optimizer and engine.rank == 0:
        engine.updater.opt.state.clear()
    if rng:
        set_rng_state(meta["extra"]["rng"])
    return meta["step"] if data else 0


# ------------------------------------------------------------------ load into a single process
def full_units(directory: str) -> tuple[dict, list[dict]]:
    """(meta, per unit {"master": flat fp32 of Ψ_unit, "state": {m, v: flat; step: as saved}}): every rank's
    partitions concatenated (`checkpoint.reshard` to one rank), padding dropped."""
    meta = checkpoint.read_meta(directory)
    shards = [checkpoint.read_shard(directory, meta, r)     # each checked: its save, rank, layout and bytes
              for r in range(1 if meta["stage"] == 0 else meta["world"])]   # stage 0: every rank saved it whole
    units = []
    for i, u in enumerate(meta["units"]):
        pieces = [s[i] for s in shards]

        def whole(parts, numel=u["numel"]):
            return checkpoint.reshard(parts, numel, 1, 0)[:numel]
        state = {k: whole([p["state"][k] for p in pieces]) if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                 for k, v in pieces[0]["state"].items()}
        units.append({"master": whole([p["master"] for p in pieces]), "state": state})
    return meta, units


def by_parameter(meta: dict, units: list[dict]) -> tuple[dict, dict]:
    """(parameters, optimizer state) by parameter name: each unit's flat vectors cut by its parameters' shapes."""
    params, states = {}, {}
    for u, full in zip(meta["units"], units):
        start = 0
        for name, shape in zip(u["params"], u["shapes"]):
            k = 1
            for s in shape:
                k *= s
            params[name] = full["master"][start:start + k].view(shape).clone()
            states[name] = {key: (v[start:start + k].view(shape).clone() if isinstance(v, torch.Tensor) and v.dim() > 0
                                  else v.clone() if isinstance(v, torch.Tensor) else v)
                            for key, v in full["state"].items()}
            start += k
    return params, states


def load_single(model, directory: str, optimizer: str = "adam", lr: float = 1e-3, data: bool = True,
                rng: bool = True, moments: bool = True) -> tuple[torch.optim.Optimizer, int]:
    """A single process resumes a ZeRO run: parameters and Adam's state into `model` and a fresh optimizer
    (`par.reference.make_optimizer`), the random state restored; returns (optimizer, data position).
    data=False, rng=False, moments=False (Adam's m, v and t not restored): the mistakes a test shows."""
    return install(model, *full_units(directory), optimizer, lr, data, rng, moments)


def install(model, meta: dict, units: list[dict], optimizer: str = "adam", lr: float = 1e-3, data: bool = True,
            rng: bool = True, moments: bool = True) -> tuple[torch.optim.Optimizer, int]:
    """`load_single` from whole units (`full_units`' pair, or DCP's: `par.resilience.torch_api`)."""
    params, states = by_parameter(meta, units)
    named = dict(model.named_parameters())
    if set(named) != set(params):
        raise ValueError(f"the checkpoint's parameters differ from this model's: {sorted(set(named) ^ set(params))}")
    with torch.no_grad():
        for name, p in named.items():
            p.copy_(params[name])
    opt = make_optimizer(model.parameters(), optimizer, lr)
    for name, p in named.items():
        if states[name] and moments:
            opt.state[p] = {k: v.to(p.device) if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                            for k, v in states[name].items()}
    if rng:
        set_rng_state(meta["extra"]["rng"])
    return opt, (meta["step"] if data else 0)


def load_tp(model, directory: str, lr: float = 1e-3, group=None) -> tuple:
    """Resume a ZeRO run on tensor-parallel ranks: every rank loads the whole state into the dense `model`
    (`load_single`: the random state and data position too), then keeps its TP shards of the weights and of Adam's
    m and v (`TensorParallelGPT.from_dense` cuts a dense model holding m, or v, the same way; t is copied).
    Returns (TP model, its Adam, data position)."""
    import copy

    dense_opt, position = load_single(model, directory, lr=lr)
    restored = rng_state()              # building the TP modules draws from the generator: put it back after
    tp = TensorParallelGPT.from_dense(model, group, impl="torch")
    opt = make_optimizer(tp.parameters(), "adam", lr)
    dense = dict(model.named_parameters())
    shards = {}
    for key in ("exp_avg", "exp_avg_sq"):
        holder = copy.deepcopy(model)
        with torch.no_grad():
            for name, p in holder.named_parameters():
                p.copy_(dense_opt.state[dense[name]][key])
        shards[key] = dict(TensorParallelGPT.from_dense(holder, group, impl="torch").named_parameters())
    step = next(iter(dense_opt.state.values()))["step"]
    for name, p in tp.named_parameters():
        opt.state[p] = {"step": step.clone(), **{k: shards[k][name].detach().clone() for k in shards}}
    set_rng_state(restored)
    return tp, opt, position


# ------------------------------------------------------------------ save and load on a pipeline layout
def stage_path(directory: str, stage: int, stages: int) -> str:
    return os.path.join(directory, f"stage_{stage:05d}_of_{stages:05d}.pt")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_pp(engine, model, directory: str, step: int) -> None:
    """A dp × pp run's state (`par.pp.replicated.ReplicatedPipeline` over `model.to_layers()`): replica 0 of each
    stage writes its parameters and their Adam state by the dense model's names (the stage's modules are the
    model's own, so a parameter is found by identity); rank 0 writes meta.pt last (data position, random state)."""
    grid = engine.grid
    names = {id(p): n for n, p in model.named_parameters()}
    os.makedirs(directory, exist_ok=True)
    if grid.dp_rank == 0:
        own = [(names[id(p)], p) for p in engine.params]
        checkpoint.write_file({"params": {n: p.detach().cpu() for n, p in own},
                               "state": {n: {k: v.cpu() for k, v in engine.optimizer.state[p].items()}
                                         for n, p in own}}, stage_path(directory, grid.stage, grid.pp))
    _barrier()
    if grid.rank == 0:
        checkpoint.write_file({"layout": "pp", "stages": grid.pp, "dp": grid.dp, "step": step,
                               "extra": {"rng": rng_state()}}, checkpoint.meta_path(directory))
    _barrier()


def pp_units(directory: str) -> tuple[dict, list[dict]]:
    """`save_pp`'s folder as `install` reads it: one unit per parameter, {"master": flat, "state": {m, v: flat;
    step}}, every stage's file read."""
    meta = checkpoint.read_file(checkpoint.meta_path(directory)) if exists(directory) else None
    if meta is None or meta.get("layout") != "pp":
        raise checkpoint.CheckpointError(f"{directory} holds no pipeline state (save_pp's): load it with "
                                         f"load_single or load")
    meta, units = {**meta, "units": []}, []
    for s in range(meta["stages"]):
        saved = checkpoint.read_file(stage_path(directory, s, meta["stages"]))
        for name, value in saved["params"].items():
            meta["units"].append({"params": [name], "shapes": [tuple(value.shape)]})
            units.append({"master": value.flatten(),
                          "state": {k: v.flatten() if v.dim() > 0 else v for k, v in saved["state"][name].items()}})
    return meta, units


def load_pp(model, directory: str, lr: float = 1e-3) -> tuple[torch.optim.Optimizer, int]:
    """A single process resumes a dp × pp run (`save_pp`'s folder): every stage's parameters and Adam state into
    `model` and a fresh Adam, the random state restored; returns (optimizer, data position). A pipeline resumes
    from it too: build it over this `model`'s layers and hand each of its parameters this optimizer's state."""
    return install(model, *pp_units(directory), "adam", lr)


def train_single(model, opt, dataset, batch: int, steps: int, seed: int, position: int, noise: float) -> list[float]:
    """One process trains from the data position to `steps` with the same batches and noise as every layout;
    returns the losses."""
    losses = []
    for x, y in batches_from(dataset, batch, steps, seed, position):
        x, y = global_step_input(x, y, noise, dataset.vocab_size)
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def exists(directory: str) -> bool:
    """Whether `directory` holds a complete checkpoint (its meta.pt, written last)."""
    return os.path.exists(checkpoint.meta_path(directory))
