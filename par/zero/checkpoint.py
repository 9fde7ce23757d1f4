"""Sharded checkpoints of ZeRO training: every rank writes only what it owns.

Under ZeRO no rank holds the whole model state, so no rank can write it alone.
Each rank saves its own partition of every unit, the fp32 master values and
the optimizer state of that partition, with the metadata that says where the
partition sits (unit, parameter names and shapes, Ψ of the unit, padding, N_d):

    directory/meta.pt                 world size, stage, step, units (names, shapes, numel), loss scaler, extra
    directory/shard_00000_of_00004.pt rank 0's partitions: master values + optimizer state, per unit
    ...

Loading with the same N_d reads one file per rank and gives training that is
bit-for-bit the run that never stopped. Loading with a different N_d
*re-shards*: the saved partitions of a unit are concatenated back into the
unit's flat vector (padding dropped), padded again for the new N_d, and cut
into the new partitions. Element-wise optimizer state (Adam's m and v) is
re-sharded the same way; scalars (Adam's step) are copied. Files hold only
tensors, numbers, strings and lists, so they load with `torch.load(...,
weights_only=True)` and never run pickled code.

A checkpoint is never left half-written: `check_directory` refuses a folder that cannot be written before
training starts; every file is written to a temporary name, flushed to disk (fsync) and renamed; a write that
fails (a full disk) removes its temporary file and raises `CheckError` naming the file and the cause; and
`meta.pt` is written last, after every shard exists, so a folder without it is no checkpoint (`load` says so).

A checkpoint knows itself. Each save draws an id; every shard records it with its rank, the world and stage it
was cut for, the layout's fingerprint (the units' parameter names, shapes and sizes) and the SHA-256 of its
tensors, and meta.pt records the id and every shard's checksum. Reading a shard (`read_shard`) checks all of
them: a file that does not load (empty, truncated, not a checkpoint), a shard of another save, of another rank
(two files swapped), of another layout, or whose bytes changed raises `CheckpointError` in one line naming the
file and what differs. meta.pt of a pipeline's state (`par.resilience.resume.save_pp`) is refused by `load`
with the loader to use.
"""
from __future__ import annotations

import hashlib
import os
import secrets

import torch
import torch.distributed as dist

from par.runtime.checks import CheckError, check_writable
from par.zero.flat import padded_numel

FORMAT = 2


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used: its message names the file and what is wrong with it."""


def shard_path(directory: str, rank: int, world: int) -> str:
    return os.path.join(directory, f"shard_{rank:05d}_of_{world:05d}.pt")


def meta_path(directory: str) -> str:
    return os.path.join(directory, "meta.pt")


def _barrier(group=None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def read_file(path: str) -> dict:
    """A checkpoint file's dict, or CheckpointError naming the file: missing, or not loadable (empty, truncated,
    not a torch.save file, not plain data)."""
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint file {path} is missing: was the checkpoint saved completely?")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises RuntimeError, EOFError, UnpicklingError, OSError for a damaged file
        cause = " ".join(str(e).split())[:160] or type(e).__name__
        raise CheckpointError(f"checkpoint file {path} is damaged and cannot be read ({type(e).__name__}: "
                              f"{cause}): save the checkpoint again, or resume from an earlier one") from None
    if type(data) is not dict:
        raise CheckpointError(f"checkpoint file {path} holds a {type(data).__name__}, not a checkpoint's record")
    return data


def checksum(value) -> str:
    """SHA-256 of the tensors in `value` (dicts by sorted key, lists in order; their dtype, shape and bytes) and of
    its other plain values: what a shard's bytes were when it was written."""
    h = hashlib.sha256()

    def feed(v):
        if isinstance(v, torch.Tensor):
            t = v.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(v, dict):
            for k in sorted(v, key=str):
                h.update(f"K{k}".encode())
                feed(v[k])
        elif isinstance(v, (list, tuple)):
            h.update(f"L{len(v)}".encode())
            for x in v:
                feed(x)
        else:
            h.update(f"V{v!r}".encode())
    feed(value)
    return h.hexdigest()


def fingerprint(units: list[dict]) -> str:
    """The layout's fingerprint: SHA-256 of every unit's parameter names, shapes and size (meta.pt's "units")."""
    return hashlib.sha256(repr([(u["params"], [list(s) for s in u["shapes"]], u["numel"])
                                for u in units]).encode()).hexdigest()


def read_shard(directory: str, meta: dict, rank: int) -> list[dict]:
    """Rank `rank`'s saved partitions (per unit {"master", "state"}), after checking the shard is this
    checkpoint's (its id), rank `rank`'s of meta's world and stage, of meta's layout, and unchanged (its checksum,
    also kept in meta.pt): CheckpointError naming the file and the mismatch."""
    path = shard_path(directory, rank, meta["world"])
    shard = read_file(path)
    where = f"checkpoint file {path}"
    if shard.get("format") != FORMAT:
        raise CheckpointError(f"{where} is of format {shard.get('format')}, this code reads {FORMAT}")
    if shard.get("id") != meta.get("id"):
        raise CheckpointError(f"{where} belongs to another save than its meta.pt (copied from another checkpoint?)")
    for key, want in (("rank", rank), ("world", meta["world"]), ("stage", meta["stage"])):
        if shard.get(key) != want:
            raise CheckpointError(f"{where} holds the partitions of {key} {shard.get(key)}, where {key} {want}'s "
                                  f"belong (were shard files swapped or renamed?)")
    if shard.get("layout") != fingerprint(meta["units"]):
        raise CheckpointError(f"{where} was cut for another model's layout than its meta.pt describes")
    got = checksum(shard.get("units"))
    if got != shard.get("checksum") or got != meta.get("checksums", {}).get(str(rank)):
        raise CheckpointError(f"{where} has changed since it was written (its SHA-256 differs from the one saved "
                              f"with it): save the checkpoint again, or resume from an earlier one")
    return shard["units"]


def read_meta(directory: str) -> dict:
    """meta.pt of a complete ZeRO checkpoint in `directory`, checked: CheckpointError when there is none (meta.pt
    is written last), when it is damaged, of another format, or a pipeline's (`save_pp`: load it with
    `par.resilience.resume.load_pp`)."""
    if not os.path.exists(meta_path(directory)):
        raise CheckpointError(f"{directory} holds no complete checkpoint (no meta.pt, written last): save it "
                              f"again (--checkpoint DIR)")
    meta = read_file(meta_path(directory))
    if meta.get("layout") == "pp":
        raise CheckpointError(f"{directory} holds a pipeline's state (par.resilience.resume.save_pp): load it with "
                              f"par.resilience.resume.load_pp")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_path(directory)} is of checkpoint format {meta.get('format')}, this code "
                              f"reads {FORMAT}")
    for key in ("world", "stage", "units", "id", "checksums"):
        if key not in meta:
            raise CheckpointError(f"{meta_path(directory)} has no {key!r}: it is not a ZeRO checkpoint's meta.pt")
    return meta


def verify(directory: str) -> dict:
    """The metadata of the complete, intact ZeRO checkpoint in `directory`, after reading and checking every shard
    (`read_meta`, `read_shard`): CheckpointError naming the first file that is not."""
    meta = read_meta(directory)
    for rank in range(meta["world"]):
        read_shard(directory, meta, rank)
    return meta


def check_directory(directory: str) -> None:
    """Refuse (`CheckError`) a checkpoint folder that cannot be written (read-only, a file in the way), before the
    training whose state would go there: tried by writing, as `par.runtime.checks.check_writable` does."""
    check_writable(directory, directory=True, parents=True)


def write_file(obj, path: str) -> None:
    """`torch.save(obj)` to `path` atomically: a temporary file beside it, fsync, rename. On failure (ENOSPC: torch
    reports it as "unexpected pos ..."), the temporary file is removed and `CheckError` names `path`."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        cause = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
        raise CheckError(f"cannot write checkpoint file {path}: {cause}; free some space there or choose another "
                         f"checkpoint folder") from e


def metadata(zero, step: int = 0, extra: dict | None = None) -> dict:
    """What every loader needs to know: how the flat units are laid out, and the world they were cut for."""
    names = zero._names
    return {"format": FORMAT, "world": zero.n, "stage": zero.stage, "step": int(step), "extra": extra or {},
            "precision": zero.precision, "skipped": zero.skipped,
            "scaler": zero.scaler.state_dict() if zero.scaler is not None else None,
            "units": [{"name": u.name, "params": [names[id(p)] for p in u.params],
                       "shapes": [list(s) for s in u.flat.shapes], "numel": u.flat.numel}
                      for u in zero.units]}


def save(zero, directory: str, step: int = 0, extra: dict | None = None) -> None:
    """Every rank writes its shard (`write_file`); once all exist, rank 0 writes the metadata. Returns after all
    files exist."""
    os.makedirs(directory, exist_ok=True)
    if zero.rank == 0 and os.path.exists(meta_path(directory)):   # an older checkpoint there: no longer complete
        os.unlink(meta_path(directory))
    _barrier(zero.group)
    ident = _shared_id(zero.group)
    masters, states = zero.updater.masters(), zero.updater.opt.state
    units = []
    for m in masters:
        st = {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in states.get(m, {}).items()}
        units.append({"master": m.detach().to("cpu", torch.float32).clone(), "state": st})
    meta = metadata(zero, step, extra)
    mine = checksum(units)
    write_file({"format": FORMAT, "id": ident, "rank": zero.rank, "world": zero.n, "stage": zero.stage,
                "layout": fingerprint(meta["units"]), "checksum": mine, "units": units},
               shard_path(directory, zero.rank, zero.n))
    sums = _gathered(mine, zero.group)
    _barrier(zero.group)
    if zero.rank == 0:
        write_file({**meta, "id": ident, "checksums": {str(r): c for r, c in enumerate(sums)}}, meta_path(directory))
    _barrier(zero.group)


def _shared_id(group) -> str:
    """A fresh id for this save, the same on every rank (rank 0's, broadcast)."""
    ident = [secrets.token_hex(8)]
    if dist.is_initialized():
        dist.broadcast_object_list(ident, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return ident[0]


def _gathered(value: str, group) -> list[str]:
    """Every rank's `value`, in rank order."""
    if not dist.is_initialized():
        return [value]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def _check_layout(meta: dict, zero) -> None:
    mine = metadata(zero)["units"]
    if [u["params"] for u in meta["units"]] != [u["params"] for u in mine] or \
            [u["shapes"] for u in meta["units"]] != [u["shapes"] for u in mine]:
        raise ValueError("the checkpoint's units (parameter names and shapes) differ from this model's: "
                         "build the same model (same config) before loading")


def reshard(parts: list[torch.Tensor], numel: int, world: int, rank: int) -> torch.Tensor:
    """Concatenate a unit's saved partitions, drop the old padding, pad for `world` ranks, cut `rank`'s part."""
    flat = torch.cat([p.reshape(-1) for p in parts])[:numel]
    padded = torch.zeros(padded_numel(numel, world), dtype=flat.dtype)
    padded[:numel] = flat
    size = padded.numel() // world
    return padded[rank * size:(rank + 1) * size].clone()


def _partitions_for(meta: dict, directory: str, world: int, rank: int, stage: int) -> list[dict]:
    """Per unit: {"master": my partition, "state": {...}} for a (world, rank, stage) layout."""
    old = meta["world"]
    if old == world and (stage == 0) == (meta["stage"] == 0):
        return read_shard(directory, meta, rank)
    shards = [read_shard(directory, meta, r) for r in range(1 if meta["stage"] == 0 else old)]   # stage 0 saved
    #                                   the whole (padded) unit on every rank: rank 0's copy is it
    out = []
    for i, u in enumerate(meta["units"]):
        pieces = [s[i] for s in shards]

        def cut(parts, numel=u["numel"]):
            if stage != 0:
                return reshard(parts, numel, world, rank)
            full = torch.zeros(padded_numel(numel, world), dtype=parts[0].dtype)   # stage 0 keeps it all
            full[:numel] = reshard(parts, numel, 1, 0)
            return full
        state = {}
        for k, v in pieces[0]["state"].items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                state[k] = cut([p["state"][k] for p in pieces])
            else:
                state[k] = v
        out.append({"master": cut([p["master"] for p in pieces]), "state": state})
    return out


def load(zero, directory: str) -> dict:
    """Fill a freshly built `Zero` engine from a checkpoint (any N_d, any stage); returns the metadata
    (with "step" and "extra")."""
    meta = read_meta(directory)
    _check_layout(meta, zero)
    parts = _partitions_for(meta, directory, zero.n, zero.rank, zero.stage)
    zero.load_partitions([p["master"] for p in parts], [p["state"] for p in parts])
    if zero.scaler is not None and meta.get("scaler"):
        zero.scaler.load_state_dict(meta["scaler"])
    zero.skipped = meta.get("skipped", 0)
    return meta


def load_full(directory: str) -> dict[str, torch.Tensor]:
    """The whole model (fp32, by parameter name) from a sharded checkpoint, in one process."""
    meta = read_meta(directory)
    parts = _partitions_for(meta, directory, 1, 0, stage=1)
    out = {}
    for u, p in zip(meta["units"], parts):
        flat, start = p["master"], 0
        for name, shape in zip(u["params"], u["shapes"]):
            k = 1
            for s in shape:
                k *= s
            out[name] = flat[start:start + k].view(shape).clone()
            start += k
    return out
