"""Train GPT-lite in fp32, fp16 (fp32 masters + loss scaling) or bf16, data parallel over the ranks.

    torchrun --nproc-per-node=2 -m par.precision.job --dtype fp32,fp16,bf16 --steps 20 --batch 16
    torchrun --nproc-per-node=2 -m par.precision.job --dtype fp16 --window 8 --inject 3,4,9,15

Every run starts from the same fp32 weights and sees the same global batches (rank r takes
rows r, r+N, ... as DistributedSampler would); the 16-bit gradients are averaged across
ranks (par.dp.naive.average_gradients) between backward and unscale. `--inject` puts an inf
into one gradient on `--inject-rank` at the listed steps of the fp16/bf16 runs: every rank must
skip them (fp32 training has no overflow check, so an inf there would end the run in nan).
Rank 0 saves {"world_size", "backend", "runs": [...]} (the job contract of `par.measure`), per run:
`losses` (per step, the mean over ranks), `step_s` (per step, the slowest rank), `per_rank`
(each rank's losses, times, parameter hash and skips), and per step the loss scale used, skipped
or not, gradient norm and learning rate; the model-state bytes measured after a backward beside
the formula; the bytes autograd saved for backward (activations); the bytes the gradient
all-reduce sent; whether the replicas ended identical.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import par.runtime.dist
from par.comm import commlog
from par.data import CharDataset, global_batches
from par.dp.naive import average_gradients
from par.measure import JobResult, merge_ranks, RankResult, RunResult, timed_step
from par.memory import accounting as memory
from par.memory.accounting import saved_activation_bytes
from par.model import build, lm_loss, preset
from par.precision.loss_scaler import DynamicLossScaler, StaticLossScaler
from par.precision.mixed_precision import MixedPrecision, set_lr, warmup_cosine_lr
from par.reference import make_optimizer, param_hash
from par.runtime.job_args import arg, JobArgs
from par.runtime.job_work import Training

DTYPES = ("fp32", "fp16", "bf16")


@dataclass(frozen=True)
class Args(JobArgs):
    dtype: tuple[str, ...] = arg(("fp16",), f"comma-separated, of: {', '.join(DTYPES)}", choices=DTYPES)
    preset: str = arg("tiny")
    batch: int = arg(16, "global batch (sequences per step, all ranks)", minimum=1)
    steps: int = arg(20, minimum=1)
    optimizer: str = arg("adam")
    lr: float = arg(3e-3)
    warmup: int = arg(0, "linear warm-up steps, then cosine decay (0: constant lr); counted in steps the optimizer "
                         "took: a skipped (overflow) step does not advance the schedule")
    max_grad_norm: float = arg(0.0, "clip the gradient norm (0: off)")
    loss_scale: str = arg("dynamic", "'dynamic', or a number for a static scale (1: none)")
    init_scale: float = arg(2.0 ** 16)
    window: int = arg(1000)
    hysteresis: int = arg(2)
    min_scale: float = arg(1.0)
    inject: tuple[int, ...] = arg((), "comma-separated steps whose gradient gets an inf (16-bit runs only)")
    inject_rank: int = arg(0, "the rank that injects (-1: every rank)")
    seed: int = arg(0)


@dataclass(frozen=True, kw_only=True)
class RankResult(RankResult):
    """One rank's losses, step times, parameter fingerprint and skipped steps."""
    loss: list
    time: list
    hash: str
    skipped: list


@dataclass(frozen=True, kw_only=True)
class RunResult(RunResult):
    """One dtype's run: the quantities of the module's docstring."""
    Rank = RankResult
    dtype: str
    world_size: int
    backend: str
    preset: str
    numel: int
    batch: int
    scale: list
    skipped: list
    grad_norm: list
    lr: list
    grad_bytes: object
    memory: dict | None
    activation_bytes: int
    scaler: str | None
    losses: list
    step_s: list
    replicas_identical: bool
    same_skips_on_all_ranks: bool


@dataclass(frozen=True, kw_only=True)
class Result(JobResult):
    """The launch: one run per dtype."""
    Run = RunResult
    runs: tuple

def work(args: Args, nproc: int) -> list:
    """What a launch of these arguments computes (the course's dry run costs it): one data-parallel run per dtype."""
    cfg = preset(args.preset)
    return [Training(model=cfg, global_batch=args.batch, dp=nproc, precision=d, optimizer=args.optimizer,
                     steps=args.steps, label=d) for d in args.dtype]


def make_scaler(args, dtype: str):
    if dtype == "bf16":
        return StaticLossScaler(1.0)
    if args.loss_scale == "dynamic":
        return DynamicLossScaler(args.init_scale, args.window, args.hysteresis, min_scale=args.min_scale)
    return StaticLossScaler(float(args.loss_scale))


def poison(params, kind: str = "inf") -> None:
    """Put an inf (or nan) into the first gradient element: a stand-in for a real overflow."""
    for p in params:
        if p.grad is not None:
            p.grad.view(-1)[0] = float(kind)
            return


def train_one(args, dtype: str, env) -> dict:
    n, rank = env.world_size, env.rank
    memory.free_device_memory()       # the previous dtype's run is gone: its peak must not count here
    memory.reset_cuda_peak(env.device)
    if args.batch % n:
        raise ValueError(f"--batch {args.batch} must be divisible by the world size {n}")
    cfg = preset(args.preset)
    model = build(cfg, seed=args.seed).to(env.device)
    numel = sum(p.numel() for p in model.parameters())
    reduce = (lambda ps: average_gradients(ps)) if n > 1 else None
    if dtype == "fp32":
        mp, opt, params = None, make_optimizer(model.parameters(), args.optimizer, args.lr), list(model.parameters())
    else:
        mp = MixedPrecision(model, lambda ps: make_optimizer(ps, args.optimizer, args.lr), dtype,
                            make_scaler(args, dtype), reduce_grads=reduce, max_grad_norm=args.max_grad_norm or None)
        opt, params = mp.optimizer, mp.params
    inject = set(args.inject)
    data = CharDataset(block_size=cfg.block_size)
    log = {k: [] for k in ("loss", "scale", "skipped", "grad_norm", "lr", "time", "grad_bytes")}
    mem = None
    for step, (x, y) in enumerate(global_batches(data, args.batch, args.steps, args.seed)):
        x, y = x[rank::n].to(env.device), y[rank::n].to(env.device)
        taken = step - sum(log["skipped"])        # the schedule counts the steps the optimizer took (as DeepSpeed's):
        lr = warmup_cosine_lr(taken, args.lr, args.warmup, args.steps) if args.warmup else args.lr   # a skip waits
        set_lr(opt, lr)
        with timed_step(env.device) as clock:
            loss = lm_loss(model(x).float(), y)                      # steps 1-2: 16-bit forward, fp32 loss
            if mp is None:
                loss.backward()
            else:
                mp.backward(loss)                                    # steps 3-4
            if mp is not None and step in inject and args.inject_rank in (-1, rank):
                poison(params)
            if mem is None and opt.state:                            # after a backward, once the optimizer has state
                mem = {"measured": memory.live_model_state_bytes(model, opt).to_dict(),
                       "by_kind": mp.model_state_bytes() if mp else None}
            with commlog.capture() as comm:
                if mp is None:
                    if reduce:
                        reduce(params)
                    norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm or float("inf")).item()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    scale, skipped = 1.0, False
                else:
                    mp.step()                                        # steps 5-8
                    scale, skipped = mp.last.scale, mp.last.overflow
                    norm = None if skipped else mp.last.grad_norm
        log["time"].append(clock.seconds)
        log["grad_bytes"].append(sum(e.bytes_sent for e in comm.events if "overflow flag" not in e.tag))
        for k, v in (("loss", loss.item()), ("scale", scale), ("skipped", skipped), ("grad_norm", norm), ("lr", lr)):
            log[k].append(v)
    x, y = next(global_batches(data, args.batch, 1, args.seed))
    x, y = x[rank::n].to(env.device), y[rank::n].to(env.device)
    _, activations = saved_activation_bytes(lambda: lm_loss(model(x).float(), y), exclude=params)
    precision = "fp32" if dtype == "fp32" else "mixed"
    per_rank = par.runtime.dist.gather_object({"loss": log["loss"], "time": log["time"], "hash": param_hash(model),
                                               "skipped": log["skipped"]})
    result = {"dtype": dtype, "world_size": n, "backend": env.backend, "preset": args.preset, "numel": numel,
              "batch": args.batch, **{k: log[k] for k in ("scale", "skipped", "grad_norm", "lr", "grad_bytes")},
              "memory": mem and {**mem, "predicted": memory.model_state_bytes(numel, 1, 0, precision,
                                                                              args.optimizer).to_dict()},
              "activation_bytes": activations,
              "scaler": repr(mp.scaler) if mp else None}
    if per_rank is not None:
        result.update(merge_ranks(per_rank, losses="loss", step_s="time"))
        result["per_rank"] = per_rank
        result["replicas_identical"] = len({r["hash"] for r in per_rank}) == 1
        result["same_skips_on_all_ranks"] = len({tuple(r["skipped"]) for r in per_rank}) == 1
    return result


def main(argv=None):
    args = Args.parse(argv)
    env = par.runtime.dist.init()
    runs = [train_one(args, d, env) for d in args.dtype]
    par.runtime.dist.save_result({"runs": runs, "world_size": env.world_size, "backend": env.backend})
    par.runtime.dist.teardown()


if __name__ == "__main__":
    main()
