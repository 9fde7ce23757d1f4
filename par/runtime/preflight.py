"""Before any rank starts: can this machine run what was asked?

Every entry that starts ranks (`par.runtime.launch.run`, and through `python -m par` the commands
`batch`, `train` and `bench`) asks here first, so a request that cannot run stops at once with
one line naming the fix (`BackendError`), instead of failing inside every rank minutes later.

The rule (`choose_backend`): NCCL needs one GPU per rank *on each node*; gloo runs anywhere.

    ranks per node = LOCAL_WORLD_SIZE (torchrun's --nproc-per-node); on one node, the world size
    "auto"  -> nccl when GPUs visible >= ranks per node > 0, else gloo
    "nccl"  -> an error when torch has no CUDA, or GPUs visible < ranks per node

A gloo job on more than RANKS_PER_CORE ranks per physical core is refused too (`check_fits`): its ranks
would wait for a core, for minutes, and time the waiting; `python -m par ... --oversubscribe` starts them anyway.

This module does not import torch (which takes seconds, more on a busy machine): it reads
whether the installed torch was built with CUDA from torch/version.py, and only a CUDA build
is asked how many GPUs it sees.
"""
from __future__ import annotations

import importlib.util
import os
import re
import sys

BACKENDS = ("auto", "gloo", "nccl")
RANKS_PER_CORE = 4   # gloo ranks per physical core a command starts without --oversubscribe (8 on 2 cores)


class BackendError(RuntimeError):
    """Raised when the requested backend cannot run on this machine."""


def cuda_build() -> str | None:
    """`torch.version.cuda` (None for a CPU-only build), read without importing torch."""
    if "torch" in sys.modules:
        return sys.modules["torch"].version.cuda
    spec = importlib.util.find_spec("torch")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        try:
            with open(os.path.join(folder, "version.py")) as f:
                m = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", f.read(), re.M)
            return m.group(1) if m else None
        except OSError:
            continue
    import torch   # an unusual installation: ask torch itself
    return torch.version.cuda


def torch_version() -> str:
    if "torch" in sys.modules:
        return sys.modules["torch"].__version__
    from importlib.metadata import version
    return version("torch")


def visible_gpus() -> int:
    """GPUs this process can use (0 without a CUDA build of torch; CUDA_VISIBLE_DEVICES applies)."""
    if cuda_build() is None:
        return 0
    import torch
    return torch.cuda.device_count()


def choose_backend(world_size: int, requested: str = "auto", gpus: int | None = None,
                   local_world_size: int | None = None) -> str:
    """NCCL when every rank of a node has a GPU of its own, gloo otherwise (see the module docstring).

    `local_world_size`: ranks on this node (default: all of `world_size`). `gpus=None` looks at
    this machine; a number asks about an imagined one. Asking for NCCL where it cannot run is a
    one-line `BackendError` naming the fix.
    """
    requested = (requested or "auto").lower()
    if requested not in BACKENDS:
        raise BackendError(f"unknown backend {requested!r}: use one of {', '.join(BACKENDS)}")
    per_node = local_world_size or world_size
    here = gpus is None
    gpus = visible_gpus() if here else gpus
    if requested == "auto":
        return "nccl" if gpus >= per_node and gpus > 0 else "gloo"
    if requested == "nccl" and here and cuda_build() is None:
        raise BackendError(f"backend 'nccl' needs CUDA, but this torch ({torch_version()}) is a CPU-only build: "
                           f"use backend='gloo' (or 'auto'), or install torch's CUDA build on the GPU server")
    if requested == "nccl" and gpus < per_node:
        ranks = (f"world size {world_size}" if per_node == world_size else
                 f"{per_node} ranks per node (world size {world_size})")
        hint = f" (CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r})" \
            if here and "CUDA_VISIBLE_DEVICES" in os.environ else ""
        raise BackendError(
            f"backend 'nccl' needs one GPU per rank: {ranks} but {gpus} GPU(s) visible{hint}; "
            f"use backend='gloo' (or 'auto'), or run with at most {gpus} ranks per node")
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


def ranks_requested(argv: list[str], flags=("--nproc", "--world-size", "--world-sizes", "--worlds")) -> int | None:
    """The largest number of ranks a command line asks for through `flags` (None when it names none).

    `--nproc 8`, `--world-size=8`, `--world-sizes 2,4` all count; values that are not numbers are
    left to the command's own parser."""
    found = []
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name in flags:
            value = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            found += [int(v) for v in value.split(",") if v.strip().isdigit()]
    return max(found) if found else None


def option(argv: list[str], flag: str, default: str | None = None) -> str | None:
    """The value of `flag` on a command line (`--flag v` or `--flag=v`), else `default`."""
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name == flag:
            return value if eq else (argv[i + 1] if i + 1 < len(argv) else default)
    return default


def check_fits(ranks: int, backend: str, oversubscribe: bool = False) -> None:
    """Raise `BackendError` when `ranks` gloo ranks would crowd this machine: more than RANKS_PER_CORE per
    physical core (`oversubscribe`: start them anyway). NCCL ranks each have a GPU of their own."""
    limit = RANKS_PER_CORE * physical_cores()
    if backend == "nccl" or oversubscribe or ranks <= limit:
        return
    raise BackendError(f"{ranks} ranks on {physical_cores()} physical CPU cores: at most {limit} "
                       f"({RANKS_PER_CORE} per core) start here; ask for fewer ranks, or add --oversubscribe "
                       f"to start {ranks} anyway")


def check_command_line(argv: list[str], default_ranks: int = 1, oversubscribe: bool = False) -> None:
    """Preflight of a command that starts ranks: its `--backend` against the ranks it asks for, and
    whether this machine holds them (`check_fits`)."""
    ranks = ranks_requested(argv) or default_ranks
    check_fits(ranks, choose_backend(ranks, option(argv, "--backend", "auto")), oversubscribe)
