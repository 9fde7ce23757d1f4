"""Local SGD / DiLoCo: H inner steps per rank, then one all-reduce of the parameters' change: H times fewer bytes.

Data parallelism all-reduces every gradient at every step: 2(N−1)/N · 4Ψ bytes per rank per step. Over a slow link
(between data centres, over the internet) that is the step time. DiLoCo (Douillard et al. 2023) lets each rank
train alone for H steps with its own AdamW (the inner optimizer, its state never sent), then averages the change:

    θ_r ← H inner AdamW steps from θ on rank r's data              (no communication)
    Δ   = (1/N) Σ_r (θ − θ_r)                                       (one all-reduce of Ψ floats: the "outer gradient")
    θ   ← Nesterov SGD step on θ with gradient Δ (outer lr, momentum)   θ_r ← θ on every rank

so the bytes per step fall by H: 2(N−1)/N · 4Ψ / H. H = 1 with outer lr 1 and no momentum averages the parameters
after every local step (not DP: Adam's update is not linear in the gradient).

Both run on the same global batches (par's single-process order; rank r takes rows r, r+N, ...), from the same
seed: the same tokens. DP's model every `--eval-every` steps and DiLoCo's outer θ after every outer step are
evaluated on a fixed held-out batch; every collective is counted by `par.comm.commlog`.

    torchrun --nproc-per-node=2 -m par.resilience.diloco_job --h 4,16 --steps 48

Result: {"world_size", "backend", "psi", "runs": [{"label", "h", "losses", "eval_steps", "eval_losses",
"bytes_sent", "all_reduces", "step_s"}]}: "dp" first, then "diloco H=h" per h; `losses` the mean over the ranks of
each step's training loss (DiLoCo: on the ranks' own θ_r), `bytes_sent` rank 0's total.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

import par.runtime.dist
from par.comm import collectives, commlog
from par.data import CharDataset, global_batches
from par.dp.naive import broadcast_parameters, flatten_grads, trainable_parameters, unflatten_into_grads
from par.measure import JobResult, RunResult
from par.model import build, lm_loss, preset
from par.reference import make_optimizer
from par.runtime.job_args import arg, JobArgs
from par.runtime.job_work import Training

EVAL_SEED = 10_000          # the held-out batch: another permutation of the data


@dataclass(frozen=True)
class Args(JobArgs):
    h: tuple[int, ...] = arg((4, 16), "comma-separated numbers of inner steps between two outer steps", minimum=1)
    steps: int = arg(48, "steps per run (a multiple of every H)", minimum=1)
    preset: str = arg("tiny")
    batch: int = arg(8, "global batch size (a multiple of the world size)", minimum=1)
    lr: float = arg(1e-3, "AdamW's learning rate (DP's, and DiLoCo's inner one)")
    outer_lr: float = arg(0.7, "DiLoCo's outer learning rate (Nesterov SGD)")
    momentum: float = arg(0.9, "the outer optimizer's Nesterov momentum")
    eval_every: int = arg(4, "DP: evaluate every EVAL_EVERY steps (DiLoCo: after every outer step)", minimum=1)
    seed: int = arg(0)


@dataclass(frozen=True, kw_only=True)
class RunResult(RunResult):
    """One run: DP ("dp", h 0) or DiLoCo ("diloco H=4"); its losses, held-out losses, bytes and all-reduces."""
    label: str
    h: int
    losses: list
    eval_steps: list
    eval_losses: list
    bytes_sent: int
    all_reduces: int
    step_s: float


@dataclass(frozen=True, kw_only=True)
class Result(JobResult):
    """DP first, then one DiLoCo run per H; Ψ the parameters all-reduced."""
    Run = RunResult
    psi: int
    runs: tuple


def work(args: Args, nproc: int) -> list:
    """What a launch computes (the course's dry run costs it): DP, and DiLoCo per H, on the same steps."""
    return [Training(model=preset(args.preset), global_batch=args.batch, dp=nproc, steps=args.steps, label=label)
            for label in ["dp", *[f"diloco H={h}" for h in args.h]]]


# ---------------------------------------------------------------- the outer step
def outer_gradient(global_flat: torch.Tensor, local_flat: torch.Tensor) -> torch.Tensor:
    """Δ = (1/N) Σ_r (θ − θ_r): this rank's θ − θ_r, averaged over the ranks by one all-reduce."""
    delta = global_flat - local_flat
    collectives.all_reduce(delta, "avg", impl="torch")
    return delta


def nesterov_step(theta: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, lr: float, momentum: float) -> None:
    """Nesterov SGD in place, torch.optim.SGD(nesterov=True)'s rule: b ← μb + g; θ ← θ − lr·(g + μb)."""
    buf.mul_(momentum).add_(grad)
    theta.sub_(lr * (grad + momentum * buf))


def evaluate(model, x: torch.Tensor, y: torch.Tensor) -> float:
    """The model's loss on the held-out batch (every rank the whole batch: the same number everywhere)."""
    with torch.no_grad():
        return lm_loss(model(x), y).item()


# ---------------------------------------------------------------- the two runs
def train(h: int, args: Args, env, batches, held_out) -> dict:
    """One run on this rank: DP (h = 0: gradients all-reduced every step) or DiLoCo with h inner steps."""
    model = build(preset(args.preset), seed=args.seed).to(env.device)
    broadcast_parameters(model)
    params = trainable_parameters(model)
    opt = make_optimizer(params, "adamw", args.lr)
    theta = torch.nn.utils.parameters_to_vector(params).detach().clone()     # DiLoCo's outer θ
    buf = torch.zeros_like(theta)
    losses, eval_steps, eval_losses = [], [], []
    t0 = time.perf_counter()
    with commlog.capture() as log:
        for s, (x, y) in enumerate(batches):
            x, y = x[env.rank::env.world_size].to(env.device), y[env.rank::env.world_size].to(env.device)
            loss = lm_loss(model(x), y)
            loss.backward()
            if h == 0:
                flat = flatten_grads(params)
                collectives.all_reduce(flat, "avg", impl="torch")
                unflatten_into_grads(flat, params)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if h and (s + 1) % h == 0:
                with torch.no_grad():
                    delta = outer_gradient(theta, torch.nn.utils.parameters_to_vector(params))
                    nesterov_step(theta, delta, buf, args.outer_lr, args.momentum)
                    torch.nn.utils.vector_to_parameters(theta, params)
            if (s + 1) % (h or args.eval_every) == 0:
                eval_steps.append(s + 1)
                eval_losses.append(evaluate(model, *held_out))
    step_s = (time.perf_counter() - t0) / max(1, len(losses))
    return {"label": f"diloco H={h}" if h else "dp", "h": h, "losses": losses, "eval_steps": eval_steps,
            "eval_losses": eval_losses, "bytes_sent": log.total_bytes(), "all_reduces": log.count("all_reduce"),
            "step_s": step_s}


def main(argv=None) -> None:
    args = Args.parse(argv)
    for h in args.h:
        if args.steps % h:
            raise SystemExit(f"error: --h {h} does not divide --steps {args.steps}: the last outer step would be "
                             f"missing; use e.g. --steps {h * max(1, args.steps // h)}")
    env = par.runtime.dist.init()
    if args.batch % env.world_size:
        raise SystemExit(f"error: --batch {args.batch} is not a multiple of the world size {env.world_size}: "
                         f"use e.g. --batch {env.world_size * max(1, args.batch // env.world_size)}")
    data = CharDataset(block_size=preset(args.preset).block_size)
    batches = list(global_batches(data, args.batch, args.steps, seed=args.seed))
    x, y = next(iter(global_batches(data, args.batch, 1, seed=EVAL_SEED)))
    psi = sum(p.numel() for p in trainable_parameters(build(preset(args.preset), seed=args.seed)))
    runs = []
    for h in (0, *args.h):
        torch.manual_seed(args.seed)
        mine = train(h, args, env, batches, (x.to(env.device), y.to(env.device)))
        ranks = par.runtime.dist.gather_object(mine)
        if env.is_rank0:
            n = len(ranks)
            runs.append({**mine, "losses": [sum(r["losses"][i] for r in ranks) / n for i in range(len(mine["losses"]))],
                         "step_s": max(r["step_s"] for r in ranks)})
    par.runtime.dist.save_result({"world_size": env.world_size, "backend": env.backend, "psi": psi, "runs": runs})
    par.runtime.dist.teardown()


if __name__ == "__main__":
    main()
