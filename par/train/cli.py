"""`python -m par train --config configs/zero1.json --nproc 4`: check a DeepSpeed-style config, then train it.

Everything that can be checked before any rank starts is checked here: a bad config, a world size the
degrees do not divide, a missing file or a backend this machine lacks raises its error, which
`python -m par` (par/__main__.py) turns into one line `error: ...` naming the fix and exit code 2
(`--debug` or `PAR_DEBUG=1`: the traceback instead). Then the job
`par.train.job` runs on `--nproc` ranks through `par.runtime.launch.run`, and its result is printed as one row.

On several machines (`--nnodes M --rdzv-endpoint HOST:PORT`): check the config for the whole world of
`--nproc` ranks, then print the torchrun command each node runs (`par.runtime.multinode.MultiNode`); nothing starts
here (`configs/slurm/train.sbatch` runs them under Slurm).
"""
from __future__ import annotations

import argparse

import par.runtime.dist
from par.memory.accounting import format_bytes
from par.runtime import launch, preflight
from par.runtime.checks import positive_float, positive_int
from par.runtime.multinode import MultiNode, MultiNodeError
from par.train import planner
from par.train.config import ConfigError, ignored_keys, load, read   # light: a bad config fails before torch loads


def format_row(row: dict) -> str:
    lo, hi = row["samples_per_s_range"]
    check = f"  max |param - single process| {row['max_param_diff']:.1e}" if "max_param_diff" in row else ""
    return (f"{row['strategy']:<28} {row['samples_per_s']:>9.1f} ({lo:.1f}-{hi:.1f}) {format_bytes(row['mem_avg']):>11} "
            f"{format_bytes(row['mem_peak']):>11} {format_bytes(row['bytes_per_step']):>11}  "
            f"loss {row['losses'][0]:.3f} -> {row['losses'][-1]:.3f}{check}")


def main(argv=None) -> int:
    """`python -m par train --config FILE --nproc N [--backend auto] [--steps S] [--check]`: check everything
    that can be checked here, then start the ranks."""
    ap = argparse.ArgumentParser(prog="python -m par train", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="a JSON file (see configs/) or a JSON object as text")
    ap.add_argument("--nproc", type=positive_int, default=1, help="ranks to start (dp = nproc / (pp · tp))")
    ap.add_argument("--backend", default="auto", help="auto, gloo or nccl")
    ap.add_argument("--steps", type=positive_int, default=None, help="override the config's steps")
    ap.add_argument("--timeout", type=positive_float, default=600, help="seconds before the job is killed")
    ap.add_argument("--check", action="store_true", help="compare with one process trained on the same batches")
    ap.add_argument("--nnodes", type=positive_int, default=None,
                    help="several machines: print the torchrun command for each node (--nproc ranks in all)")
    ap.add_argument("--rdzv-endpoint", default="node0:29500", help="with --nnodes: HOST:PORT of node 0")
    ap.add_argument("--rdzv-backend", default="c10d", help="with --nnodes: c10d (same command everywhere) or static")
    ap.add_argument("--ignore-memory", action="store_true",
                    help="start even when the planner predicts more memory than this machine has")
    args = ap.parse_args(argv)
    if args.nnodes is not None:
        return print_nodes(args)
    tc = load(args.config, args.nproc)     # the config's own error, before starting ranks
    chosen = par.runtime.dist.choose_backend(args.nproc, args.backend)
    if not args.ignore_memory:
        fits_here(tc, args.nproc, chosen)
    skipped = ignored_keys(read(args.config))
    if skipped:
        print(f"note: accepted for DeepSpeed compatibility, no effect in par: {', '.join(skipped)}")
    print(f"{tc.strategy} ({tc.layout}) on {args.nproc} rank(s): batch {tc.train_batch_size} = micro "
          f"{tc.micro_batch} × accum {tc.grad_accum} × dp {tc.dp}")
    extra = (["--steps", str(args.steps)] if args.steps is not None else []) + (["--check"] if args.check else [])
    row = launch.run("par.train.job", nproc=args.nproc, args=["--config", args.config, *extra], backend=args.backend,
                     timeout=args.timeout)
    print(f"{'strategy':<28} {'samples/s (range)':>21} {'mem avg':>11} {'mem peak':>11} {'bytes/step':>11}")
    print(format_row(row))
    return 0


def fits_here(tc, nproc: int, backend: str) -> None:
    """ConfigError when the planner (`par.train.planner.from_config`) predicts more memory than this machine has:
    per rank against a GPU's memory (nccl), or all the ranks together against the host's available memory (gloo).
    `--ignore-memory` skips it."""
    need = planner.from_config(tc).memory["total"]
    if backend == "nccl":
        import torch
        have, what, total = torch.cuda.get_device_properties(0).total_memory, "a GPU's memory", need
    else:
        have, what, total = available_host_memory(), "this machine's available memory", need * nproc
    if have and total > have:
        raise ConfigError(f"the planner predicts {format_bytes(need)} per rank ({format_bytes(total)} in all) for "
                          f"{tc.strategy} on {nproc} rank(s), more than {what} ({format_bytes(have)}): use a smaller "
                          f"model, more ranks or a higher ZeRO stage, or --ignore-memory to start anyway")


def available_host_memory() -> int:
    """MemAvailable of /proc/meminfo in bytes (0 where it is not known)."""
    try:
        with open("/proc/meminfo") as f:
            line = next(l for l in f if l.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration, ValueError, IndexError):
        return 0


def print_nodes(args) -> int:
    """`--nnodes N`: check the config for the whole world, then print the command each node runs."""
    if args.nproc % args.nnodes:
        raise ConfigError(f"--nproc {args.nproc} ranks do not split over --nnodes {args.nnodes}: "
                          f"give --nproc a multiple of --nnodes (ranks in all, e.g. --nproc {2 * args.nnodes})")
    tc = load(args.config, args.nproc)
    per_node = args.nproc // args.nnodes     # the nodes' GPUs, not this machine's: only the backend's name is checked
    preflight.choose_backend(args.nproc, args.backend, gpus=per_node, local_world_size=per_node)
    try:
        nodes = MultiNode(args.nnodes, args.nproc // args.nnodes, args.rdzv_endpoint, rdzv_id="par-train",
                          rdzv_backend=args.rdzv_backend)
    except MultiNodeError as e:
        raise ConfigError(str(e)) from None
    extra = (["--steps", str(args.steps)] if args.steps is not None else []) + (["--check"] if args.check else [])
    print(f"{tc.strategy} ({tc.layout}) on {args.nproc} ranks over {args.nnodes} nodes: batch {tc.train_batch_size}")
    print(nodes.describe("par.train.job", ["--config", args.config, *extra]))
    return 0

