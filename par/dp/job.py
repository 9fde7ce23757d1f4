"""Train GPT-lite with data parallelism and report what happened.

    torchrun --nproc-per-node=2 -m par.dp.job --dp naive,bucketed --impl ring --bucket-kb 64 \\
        --batch 16 --accum 1 --steps 20 --compression none

`--dp` and `--compression` take comma-separated lists; every combination trains from the same
initial weights on the same data, one after the other (`--dp ddp` is torch's DistributedDataParallel,
for comparison). Rank 0 saves {"world_size", "backend", "runs": [...]} (the job contract of
`par.measure`), one entry per run with:

    losses                  loss of the global batch per step (the mean over ranks)
    step_s, step_steady_s   seconds per step, the slowest rank's, on the wall clock and the load-proof one
                            (less the run-queue wait, `par.clock`; on a GPU both the device's time)
    per_rank                each rank's losses, step times, bytes sent per step, parameter fingerprint, and
                            `parts`: per step its forward, backward, optimizer and wait after backward, each
                            {"wall", "steady"} seconds from its recorded spans (`par.dp.wrap.step_parts`)
    bytes_sent_per_step     rank 0's, counted by par.comm.commlog (0 for ddp: torch's own traffic is not logged)
    bytes_expected          the exact ring count and the formula 2(N-1)/N · gradient bytes
    memory                  model states measured and predicted, plus the wrapper's own buffers
    timeline, overlap       one step's recorded spans (every step is recorded, each started together after a
                            barrier), and each rank's share of communication hidden behind backward
    launched_in_backward    buckets the last step sent from a gradient hook, before backward ended (bucketed)
    max_param_diff_vs_first with --compare: max |parameters - the first run's parameters| over every rank
    profile_traces          with --profile-dir: the torch.profiler traces of step --profile-step, one per rank
"""
from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

import torch

import par.runtime.dist
from par.runtime import profile
from par.runtime.job_args import JobArgs, arg
from par.comm import collectives, commlog
from par.dp import compression
from par.memory import accounting as memory
from par.dp.batch_size import resolve_batch
from par.comm.collectives import all_reduce_formula_bytes, ring_all_reduce_bytes
from par.data import CharDataset
from par.dp.wrap import (VARIANTS, overlap_fraction, shard_loader, split_micro, step_parts, train_step, wrap,
                         wrapper_buffer_bytes)
from par.dp.bucketed import bucket_all_reduce_bytes
from par.measure import JobResult, RankResult, RunResult, merge_ranks, timed_step, watch_ranks
from par.model import build, lm_loss, preset
from par.reference import make_optimizer, param_hash
from par.timeline import Recorder
from par.runtime.job_work import Training


@dataclass(frozen=True)
class Args(JobArgs):
    dp: tuple[str, ...] = arg(("bucketed",), f"comma-separated, of: {', '.join(VARIANTS)}")
    impl: str = arg("ring", "all-reduce: par's ring or torch's", choices=("ring", "torch"))
    bucket_kb: float = arg(25 * 1024.0, "bucket size cap in KiB (DDP: 25 MiB)")
    preset: str = arg("tiny")
    tie_embeddings: bool = arg(False)
    batch: int = arg(16, "train_batch_size: the global batch per step", minimum=1)
    micro_batch: int | None = arg(None, "default: batch / (accum × world size)")
    accum: int | None = arg(None, "gradient accumulation steps (default: batch / (micro-batch × world size), else 1)")
    steps: int = arg(20, minimum=1)
    optimizer: str = arg("adam")
    lr: float = arg(3e-3)
    compression: tuple[str, ...] = arg(("none",), f"comma-separated, of: {', '.join(compression.NAMES)}")
    ratio: float = arg(0.01, "fraction kept by topk / randomk")
    timeline_step: int | None = arg(None, "step whose timeline is kept (default: 3rd)")
    seed: int = arg(0)
    compare: bool = arg(False, "report each run's largest parameter difference from the first run "
                               "(e.g. --dp bucketed,ddp)")
    profile_dir: str = arg("", "profile step --profile-step of every run with torch.profiler: a Chrome/Perfetto "
                               "trace per run and rank in this folder (par.runtime.profile)")
    profile_step: int = arg(1, minimum=0)


@dataclass(frozen=True, kw_only=True)
class RankResult(RankResult):
    """One rank's own losses, step times, bytes sent per step, parameter fingerprint, profiler traces and the parts
    of each step."""
    losses: list
    step_s: list
    step_steady_s: list | None = None
    bytes_sent_per_step: list
    param_hash: str
    traces: list
    parts: list | None = None


@dataclass(frozen=True, kw_only=True)
class RunResult(RunResult):
    """One (variant, compression) run: the quantities of the module's docstring."""
    Rank = RankResult
    dp: str
    compression: str
    impl: str
    world_size: int
    backend: str
    batch: dict
    preset: str
    numel: int
    losses: list
    step_s: list
    step_steady_s: list | None = None
    bytes_sent_per_step: list
    bytes_expected: dict | None = None
    n_buckets: int | None = None
    launched_in_backward: int | None = None
    memory: dict
    timeline: list | None = None
    timeline_step: int | None = None
    replicas_identical: bool
    profile_traces: list
    overlap: list
    max_param_diff_vs_first: float | None = None


@dataclass(frozen=True, kw_only=True)
class Result(JobResult):
    """The launch: one run per (variant, compression)."""
    Run = RunResult
    runs: tuple

def work(args: Args, nproc: int) -> list:
    """What a launch of these arguments computes (the course's dry run costs it): one run per --dp ×
    --compression, the global batch in micro-batches of --micro-batch where given."""
    cfg = preset(args.preset, tie_embeddings=args.tie_embeddings)
    accum = args.accum or (args.batch // (args.micro_batch * nproc) if args.micro_batch else 1)
    return [Training(model=cfg, global_batch=args.batch, dp=nproc, microbatches=accum, optimizer=args.optimizer,
                     steps=args.steps, label=f"{v}, {c}") for v in args.dp for c in args.compression]


def expected_bytes(dp, comp, n: int, rank: int) -> dict:
    """What one step should send: exact for this rank (ring, uneven chunks) and the lecture's formula."""
    params = [p for p in dp.module.parameters() if p.requires_grad] if hasattr(dp, "module") else []
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    if hasattr(dp, "buckets"):
        buffers = dp.bucket_numels
    else:
        buffers = [sum(p.numel() for p in params)] if comp is not None else [p.numel() for p in params]
    if comp is not None:
        exact = sum(comp.bytes_formula(k, n, rank) for k in buffers)
    elif hasattr(dp, "buckets"):
        exact = bucket_all_reduce_bytes(buffers, n, rank)
    else:
        exact = sum(ring_all_reduce_bytes(k, n, rank) for k in buffers)
    return {"exact": exact, "formula": all_reduce_formula_bytes(grad_bytes, n), "grad_bytes": grad_bytes,
            "buffers": len(buffers)}


def train_one(args, variant: str, comp_name: str, env) -> dict:
    n = env.world_size
    if variant == "none" and n > 1:
        raise ValueError(f"--dp none trains one process on the whole batch: launch it with 1 rank, not {n}")
    sizes = resolve_batch(n, args.batch, args.micro_batch, args.accum)
    cfg = preset(args.preset, tie_embeddings=args.tie_embeddings)
    model = build(cfg, seed=args.seed).to(env.device)
    comp = compression.make(comp_name, args.ratio, args.seed)
    rec = Recorder()
    dp = wrap(model, variant, args.impl, int(args.bucket_kb * 1024), comp)
    opt = make_optimizer(model.parameters(), args.optimizer, args.lr)
    data = CharDataset(block_size=cfg.block_size)
    loader = shard_loader(data, sizes.per_rank, args.seed)
    if len(loader) < args.steps:
        raise ValueError(f"{args.steps} steps of {sizes.train_batch_size} sequences need more data than the "
                         f"{len(data)} windows of the corpus: lower --steps or --batch")
    tl_step = min(args.timeline_step if args.timeline_step is not None else 2, args.steps - 1)
    losses, times, steady, sent, parts, timeline, traces = [], [], [], [], [], None, []
    if hasattr(dp, "recorder"):
        dp.recorder = rec
    for step, (x, y) in zip(range(args.steps), loader):
        rec.reset()  # a barrier: every rank starts the step, and its recorded clock, together
        micro = split_micro(x.to(env.device), y.to(env.device), sizes.grad_accum)
        waited = getattr(dp, "waited", 0.0)
        with profile.step(args.profile_dir, f"dp_{variant}_rank{env.rank}", on=step == args.profile_step) as trace, \
                timed_step(env.device) as clock, commlog.capture() as log:
            losses.append(train_step(dp, opt, micro, lm_loss, rec))
        traces += [str(trace.path)] if trace.path else []
        times.append(clock.seconds)
        if env.device.type != "cuda":      # the run-queue wait of what the step waited for (comm thread, ranks)
            clock.waited_s = getattr(dp, "waited", 0.0) - waited
        steady.append(clock.steady_s)
        sent.append(log.total_bytes())
        spans = [asdict(s) for s in rec.spans]
        parts.append(step_parts(spans, env.rank, variant))
        if step == tl_step:
            timeline = rec.gather()
    numel = sum(p.numel() for p in model.parameters())
    per_rank = par.runtime.dist.gather_object({"losses": losses, "step_s": times, "step_steady_s": steady,
                                               "bytes_sent_per_step": sent, "param_hash": param_hash(model),
                                               "traces": traces, "parts": parts})
    result = {
        "dp": variant, "compression": comp_name, "impl": args.impl, "world_size": n, "backend": env.backend,
        "batch": asdict(sizes) | {"per_rank": sizes.per_rank}, "preset": args.preset, "numel": numel,
        "bytes_sent_per_step": sent,   # rank 0's, counted by par.comm.commlog (0 for ddp: torch's own traffic)
        "bytes_expected": expected_bytes(dp, comp, n, env.rank) if variant in ("naive", "bucketed") else None,
        "n_buckets": len(getattr(dp, "buckets", [])) or None,
        "launched_in_backward": getattr(dp, "launched_in_backward", None),   # last step, rank 0: the overlap's cause
        "memory": {"measured": memory.live_model_state_bytes(model, opt).to_dict(),
                   "predicted": memory.model_state_bytes(numel, 1, 0, "fp32", args.optimizer).to_dict(),
                   "wrapper_buffers": wrapper_buffer_bytes(dp)},
        "timeline": timeline, "timeline_step": tl_step,
    }
    if per_rank is not None:
        result.update(merge_ranks(per_rank))
        result["step_steady_s"] = merge_ranks(per_rank, step_s="step_steady_s")["step_s"]
        result["per_rank"] = per_rank
        result["replicas_identical"] = len({r["param_hash"] for r in per_rank}) == 1
        result["profile_traces"] = [t for r in per_rank for t in r["traces"]]
        result["overlap"] = [overlap_fraction(timeline, r) for r in range(n)]
    final = torch.cat([p.detach().reshape(-1) for p in model.parameters()]) if args.compare else None
    return result, final


def largest_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over every element and every rank (the same on every rank)."""
    worst = (a - b).abs().max().reshape(1).double()
    collectives.all_reduce(worst, "max", impl="torch")
    return worst.item()


def main(argv=None):
    args = Args.parse(argv)
    env = par.runtime.dist.init()
    watch_ranks()      # a step's steady seconds count the other ranks' run-queue wait while it waited for them
    runs, first = [], None
    for v, c in itertools.product(args.dp, args.compression):
        result, final = train_one(args, v, c, env)
        if args.compare:
            first = final if first is None else first
            result["max_param_diff_vs_first"] = largest_difference(final, first)
        runs.append(result)
    par.runtime.dist.save_result({"world_size": env.world_size, "backend": env.backend, "runs": runs})
    par.runtime.dist.teardown()


if __name__ == "__main__":
    main()
