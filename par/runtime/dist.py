"""Process bootstrap: who am I, how many of us, which backend, which device.

torchrun (or `par.runtime.agent`, which does the same on one machine) starts one process per rank and tells each
one about the job through environment variables:

    RANK         global index of this process, 0 .. WORLD_SIZE-1
    LOCAL_RANK   index of this process on its node (picks the GPU)
    WORLD_SIZE   number of processes in the job
    LOCAL_WORLD_SIZE  number of processes on this node (each needs a GPU of its own under NCCL)
    MASTER_ADDR  host of rank 0, where everyone meets
    MASTER_PORT  port of that meeting point

`init()` reads them, picks the backend (`par.runtime.preflight.choose_backend`: NCCL only
when every rank of a node can have a GPU of its own, gloo otherwise), binds one
device per rank and joins the default process group. `teardown()` leaves it cleanly.
"""
from __future__ import annotations

import faulthandler
import json
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from par.runtime import failure, heap
# the backend rule and the core count live in par.runtime.preflight (no torch import there: it runs before any rank)
from par.runtime.preflight import BACKENDS, BackendError, choose_backend, default_world_size, physical_cores  # noqa: F401
from par.runtime import nccl_emulation
from par.runtime.hang import collective_timeout
from par.runtime.launch import STACK_SIGNAL, free_port
from par.runtime.lifeline import watch_parent


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
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if "TORCHELASTIC_RUN_ID" in os.environ:   # par.runtime.launch asks a rank that did not finish where it is
        faulthandler.register(STACK_SIGNAL, all_threads=True)
        watch_launcher()
    heap.keep_freed_memory()          # a timed step reuses its pages, never faults new ones in (par.runtime.heap)
    backend = choose_backend(world_size, backend or os.environ.get("PAR_BACKEND", "auto"),
                             local_world_size=local_world_size)
    device = device_for(backend, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:  # a plain single process: any free port will do
            os.environ["MASTER_PORT"] = str(free_port())
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(world_size))
        from datetime import timedelta
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")   # a timed-out NCCL op ends the rank
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s), store=attempt_store(world_size, timeout_s),
                                **({"device_id": device} if device.type == "cuda" else {}))
        set_collective_timeout()
        if "TORCHELASTIC_RUN_ID" in os.environ:
            sys.excepthook = exit_after_traceback(sys.excepthook)
    if backend == "gloo":
        if nccl_emulation.enabled():
            nccl_emulation.install()
    _ENV = Env(rank, local_rank, world_size, backend, device)
    return _ENV


def attempt_store(world_size: int, timeout_s: float):
    """Under torchrun's own agent (TORCHELASTIC_USE_AGENT_STORE=True): the agent's store seen through this attempt's
    own prefix, `attempt_<TORCHELASTIC_RESTART_COUNT>/`; else None (the env:// rendezvous, rank 0 serving the store).

    torchrun's static rendezvous keeps one TCPStore for every attempt of a job, and the process group's keys are the
    same in each: the ranks of a restarted attempt would read the dead attempt's gloo addresses and dial closed ports
    ("connectFullMesh failed ... Connection refused", about one restart in three here)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    from datetime import timedelta
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                          timeout=timedelta(seconds=timeout_s))
    return dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)


def watch_launcher() -> None:
    """A rank started by torchrun or the agent ends within a second of its starter's death (`par.runtime.lifeline.watch_parent`):
    an orphaned rank would otherwise hold its cores, its GPU and the master port for ever."""
    watch_parent(what=f"rank {os.environ.get('RANK', '?')}")


def set_collective_timeout() -> None:
    """Let a gloo or NCCL collective of the world group wait `par.runtime.hang.collective_timeout()` seconds
    (60 by default): a hang fails within a minute even when no launcher watches. Joining
    (`init_process_group`) keeps its own, longer `timeout_s`: ranks start at different times on a busy
    machine. Groups made later with `dist.new_group` keep torch's default; the launcher's watch covers them."""
    from datetime import timedelta

    seconds = collective_timeout()
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)     # torch >= 2.3
    if seconds and setter is not None:
        setter(timedelta(seconds=seconds))


def current() -> Env | None:
    """The Env of this process, None before `init()`."""
    return _ENV


def env() -> Env:
    """The Env of this process (call `init()` first)."""
    if _ENV is None:
        raise RuntimeError("par.runtime.dist.init() has not been called in this process")
    return _ENV


def teardown() -> None:
    """Leave the process group (waits for everyone first, so no rank exits early). Call it last.

    A rank started by torchrun or the agent then ends right here with exit code 0 (`os._exit`, after flushing
    its output), skipping the interpreter's finalization. Why: a thread that is inside a torch C++
    call with the GIL released (par's communication thread in a gloo wait, or gloo's own thread
    about to run a Python callback) and comes back while Python finalizes is ended by CPython
    with pthread_exit; the unwinding crosses a C++ `noexcept` frame (pybind11 re-taking the GIL)
    and the C++ runtime aborts: "terminate called without an active exception", SIGABRT, a rank
    that did all its work reported as crashed. Rare (the call must return inside the short
    window of finalization, more likely on a busy machine), and reproduced on purpose by
    tests/workers/exit_race.py. After `destroy_process_group` nothing is left that finalization
    would need to clean up, so the rank skips it. A rank that fails with an exception skips it
    too (`init` installs `exit_after_traceback`).
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


def exit_after_traceback(previous):
    """A sys.excepthook for launched ranks: print the traceback as before, write it to the rank's error file
    (`par.runtime.failure.record_exception`), then leave with exit code 1 at once (`os._exit`), skipping the
    finalization in which a C++ thread can abort the process and turn a Python error into a SIGABRT (see
    `teardown`)."""
    def hook(kind, value, tb):
        try:
            previous(kind, value, tb)
            failure.record_exception(kind, value, tb)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
    return hook


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
