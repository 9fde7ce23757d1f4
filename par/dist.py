"""Process bootstrap: who am I, how many of us, which backend, which device.

torchrun starts one process per rank and tells each one about the job through
environment variables:

    RANK         global index of this process, 0 .. WORLD_SIZE-1
    LOCAL_RANK   index of this process on its node (picks the GPU)
    WORLD_SIZE   number of processes in the job
    MASTER_ADDR  host of rank 0, where everyone meets
    MASTER_PORT  port of that meeting point

`init()` reads them, picks the backend (NCCL only when every rank can have a
GPU of its own, gloo otherwise), binds one device per rank and joins the
default process group. `teardown()` leaves it cleanly.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

BACKENDS = ("auto", "gloo", "nccl")


class BackendError(RuntimeError):
    """Raised when the requested backend cannot run on this machine."""


@dataclass(frozen=True)
class Env:
    rank: int
    local_rank: int
    world_size: int
    backend: str
    device: torch.device

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


def choose_backend(world_size: int, requested: str = "auto", gpus: int | None = None) -> str:
    """NCCL when `gpus >= world_size` (one GPU per rank), gloo otherwise.

    Asking for NCCL explicitly without enough GPUs is an error that names the fix.
    """
    requested = (requested or "auto").lower()
    if requested not in BACKENDS:
        raise BackendError(f"unknown backend {requested!r}: use one of {', '.join(BACKENDS)}")
    gpus = torch.cuda.device_count() if gpus is None else gpus
    if requested == "auto":
        return "nccl" if gpus >= world_size and gpus > 0 else "gloo"
    if requested == "nccl" and gpus < world_size:
        raise BackendError(
            f"backend 'nccl' needs one GPU per rank: world size {world_size} but {gpus} GPU(s) visible; "
            f"use backend='gloo' (or 'auto'), or run with at most {gpus} ranks")
    return requested


def physical_cores() -> int:
    """CPU cores this process may run on, counting a core once even with hyper-threading.

    Timing experiments never start more ranks than this: an oversubscribed rank waits for a
    core, and its waiting shows up as a bubble or as slow communication.
    """
    try:
        allowed = os.sched_getaffinity(0)
    except AttributeError:  # macOS
        return max(1, (os.cpu_count() or 2) // 2)
    cores = set()
    for cpu in allowed:
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
                cores.add(f.read().strip())
        except OSError:
            cores.add(str(cpu))
    return max(1, len(cores))


def default_world_size() -> int:
    """The course's default number of ranks: min(4, physical cores) (2 on a 2-core CI machine)."""
    return min(4, physical_cores())


def device_for(backend: str, local_rank: int) -> torch.device:
    """One device per rank: cuda:<local_rank> under NCCL, the CPU under gloo."""
    if backend == "nccl":
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


_ENV: Env | None = None


def init(backend: str | None = None, timeout_s: float = 120.0) -> Env:
    """Join the job torchrun started. Also works as a plain single process (world size 1)."""
    global _ENV
    if _ENV is not None:
        return _ENV
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    backend = choose_backend(world_size, backend or os.environ.get("PAR_BACKEND", "auto"))
    device = device_for(backend, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:  # a plain single process: any free port will do
            from par.launch import free_port
            os.environ["MASTER_PORT"] = str(free_port())
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(world_size))
        from datetime import timedelta
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s),
                                **({"device_id": device} if device.type == "cuda" else {}))
    if backend == "gloo":
        from par import nccl_emulation
        if nccl_emulation.enabled():
            nccl_emulation.install()
    _ENV = Env(rank, local_rank, world_size, backend, device)
    return _ENV


def env() -> Env:
    """The Env of this process (call `init()` first)."""
    if _ENV is None:
        raise RuntimeError("par.dist.init() has not been called in this process")
    return _ENV


def teardown() -> None:
    """Leave the process group (waits for everyone first, so no rank exits early). Call it last.

    A rank started by torchrun then ends right here with exit code 0 (`os._exit`, after flushing
    its output): skipping the C++ destructors at interpreter exit avoids a rare abort of a
    leftover gloo thread there ("terminate called without an active exception").
    """
    global _ENV
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
    _ENV = None
    if "TORCHELASTIC_RUN_ID" in os.environ:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def print0(*args, **kwargs) -> None:
    """print() on rank 0 only."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def save_result(obj) -> None:
    """Rank 0 writes the run's results as JSON where the launcher asked (PAR_RESULT)."""
    path = os.environ.get("PAR_RESULT")
    if path and (not dist.is_initialized() or dist.get_rank() == 0):
        with open(path, "w") as f:
            json.dump(obj, f)


def gather_object(obj, dst: int = 0):
    """Collect one picklable object from every rank on `dst` (a list there, None elsewhere)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst)
    return out
