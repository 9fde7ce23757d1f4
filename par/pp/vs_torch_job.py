"""par's pipeline next to torch.distributed.pipelining: same stages, same data, same Adam steps.

    torchrun --nproc-per-node=2 -m par.pp.vs_torch_job --schedule 1f1b --microbatches 4 --steps 3

Every rank builds par's `Pipeline` and torch's `PipelineStage` + `Schedule1F1B` (or
`ScheduleGPipe`) on the same stage of the same GPT-lite (the same layer boundaries, the same
initial weights, `par.pp.torch_api`), feeds both the same batches cut into the same
micro-batches, and takes `--steps` Adam steps with each. It compares the first step's gradients,
every step's loss and the parameters at the end. Rank 0 saves the job result contract (losses,
step_s and per_rank are par's) plus losses_torch, step_s_torch, max_grad_diff, max_loss_diff and
max_param_diff (the largest absolute difference on any rank).
"""
from __future__ import annotations

from dataclasses import dataclass

import par.runtime.dist
from par.data import CharDataset, global_batches
from par.measure import JobResult, RankResult, RunResult, slowest, timed_step
from par.model import build, lm_loss, preset
from par.pp import schedules
from par.pp.pipeline import Pipeline
from par.pp.torch_api import SCHEDULES, TorchPipeline
from par.reference import make_optimizer
from par.runtime.job_args import arg, JobArgs
from par.runtime.job_work import Training


@dataclass(frozen=True)
class Args(JobArgs):
    schedule: str = arg("1f1b", choices=tuple(sorted(SCHEDULES)))
    microbatches: int = arg(4)
    micro_batch_size: int = arg(2, "sequences per micro-batch")
    preset: str = arg("tiny")
    n_layer: int | None = arg(None, "override the preset's number of blocks")
    steps: int = arg(3, "Adam steps with each runtime")
    lr: float = arg(1e-3)
    seed: int = arg(0)


@dataclass(frozen=True, kw_only=True)
class RankResult(RankResult):
    """One stage's largest gaps to torch.distributed.pipelining and its layers."""
    grad_diff: float
    param_diff: float
    bounds: list


@dataclass(frozen=True, kw_only=True)
class Result(JobResult, RunResult):
    """The launch (one run): par's and torch's losses and step times, and the largest gaps between them."""
    Rank = RankResult
    schedule: str
    m: int
    config: dict
    losses: list
    losses_torch: list
    step_s: list
    step_s_torch: list
    max_grad_diff: float
    max_loss_diff: float
    max_param_diff: float

def work(args: Args, nproc: int) -> list:
    """What a launch of these arguments computes (the course's dry run costs it): the same pipeline under par's
    runtime and torch's."""
    from dataclasses import replace
    cfg = preset(args.preset, **({"n_layer": args.n_layer} if args.n_layer else {}))
    one = Training(model=cfg, global_batch=args.microbatches * args.micro_batch_size, pp=nproc,
                   microbatches=args.microbatches, steps=args.steps, label=f"{args.schedule} m={args.microbatches}")
    return [one, replace(one, label=f"torch {one.label}")]


def run_step(runtime, opt, x, y, device):
    """(loss, seconds) of one forward and backward of `runtime` (the optimizer steps later)."""
    opt.zero_grad(set_to_none=True)
    with timed_step(device) as clock:
        loss = runtime.step(x, y)
    return loss, clock.seconds


def main(argv=None):
    args = Args.parse(argv)
    env = par.runtime.dist.init()
    p, m = env.world_size, args.microbatches
    cfg = preset(args.preset, **({"n_layer": args.n_layer} if args.n_layer else {}))
    ours = Pipeline(build(cfg, seed=args.seed).to_layers(), schedules.make(args.schedule, p, m), lm_loss)
    theirs = TorchPipeline(build(cfg, seed=args.seed).to_layers(), ours.bounds, lm_loss, m, args.schedule,
                           env.rank, p, env.device)
    opt = {"par": make_optimizer(ours.parameters(), "adam", args.lr),
           "torch": make_optimizer(theirs.parameters(), "adam", args.lr)}
    out = {"losses": [], "losses_torch": [], "step_s": [], "step_s_torch": []}
    grad_diff = loss_diff = 0.0
    ds = CharDataset(block_size=cfg.block_size)
    for step, (x, y) in enumerate(global_batches(ds, m * args.micro_batch_size, args.steps, seed=args.seed)):
        x, y = x.to(env.device), y.to(env.device)
        loss, t = run_step(ours, opt["par"], x, y, env.device)
        loss_t, t_t = run_step(theirs, opt["torch"], x, y, env.device)
        if step == 0:
            grad_diff = max((a.grad - b.grad).abs().max().item()
                            for a, b in zip(ours.parameters(), theirs.parameters()))
        if loss is not None:
            out["losses"].append(loss)
            out["losses_torch"].append(loss_t)
            loss_diff = max(loss_diff, abs(loss - loss_t))
        out["step_s"].append(t)
        out["step_s_torch"].append(t_t)
        opt["par"].step()
        opt["torch"].step()
    param_diff = max((a - b).abs().max().item() for a, b in zip(ours.parameters(), theirs.parameters()))
    mine = {"grad_diff": grad_diff, "param_diff": param_diff, "loss_diff": loss_diff, "bounds": ours.bounds[env.rank],
            **out}
    parts = par.runtime.dist.gather_object(mine)
    if parts is not None:
        last = parts[ours.last_rank]
        par.runtime.dist.save_result({
            "world_size": p, "backend": env.backend, "schedule": args.schedule, "m": m, "config": cfg.to_dict(),
            "losses": last["losses"], "losses_torch": last["losses_torch"],
            "step_s": slowest(q["step_s"] for q in parts),
            "step_s_torch": slowest(q["step_s_torch"] for q in parts),
            "per_rank": [{k: q[k] for k in ("grad_diff", "param_diff", "bounds")} for q in parts],
            "max_grad_diff": max(q["grad_diff"] for q in parts),
            "max_loss_diff": max(q["loss_diff"] for q in parts),
            "max_param_diff": max(q["param_diff"] for q in parts)})
    par.runtime.dist.teardown()


if __name__ == "__main__":
    main()
