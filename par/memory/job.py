"""Predicted vs measured model-state memory of GPT-lite, on every rank.

    torchrun --nproc-per-node=2 -m par.memory.job --preset tiny --optimizers adam,momentum,sgd --precisions fp32,bf16

Each rank builds the same GPT-lite on its device and, for each precision and
optimizer, trains it for `--steps` real steps on batches of its own:

* fp32: weights, grads and optimizer state in fp32: 4 + 4 + K bytes per parameter
  (K: Adam 8, momentum 4, SGD 0);
* bf16: a bf16 model (weights and grads 2 + 2) and an optimizer over fp32 master
  copies (K: 4 + Adam 8, momentum 4, SGD 0), the bare bones of mixed precision
  (no loss scaling is needed for bf16; lecture 05 builds the full recipe).

It measures the live bytes of parameters, gradients and optimizer state after
building, after the first backward and after every step
(`par.memory.accounting.live_model_state_bytes`), beside the formula `model_state_bytes`; the
bytes autograd saves for one forward (activations); and the CUDA peak on a GPU, each
configuration's own (the previous one is released first). Rank 0 saves {"world_size",
"backend", ..., "runs": {"<precision> <optimizer>": ...}}, each run with every rank's numbers
and the job contract's `losses` (mean over the ranks' own batches), `step_s` (slowest rank) and
`per_rank`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import par.runtime.dist
from par.data import CharDataset
from par.measure import JobResult, merge_ranks, RankResult, RunResult, timed_step
from par.memory import accounting as memory
from par.model import build, lm_loss, preset
from par.reference import make_optimizer
from par.runtime.job_args import arg, JobArgs
from par.runtime.job_work import Training

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Args(JobArgs):
    preset: str = arg("tiny")
    optimizers: tuple[str, ...] = arg(("adam", "momentum", "sgd"), "comma-separated: sgd, momentum, adam")
    precisions: tuple[str, ...] = arg(("fp32",), "comma-separated: fp32, bf16", choices=tuple(DTYPES))
    batch: int = arg(8, "sequences per rank", minimum=1)
    steps: int = arg(1, "optimizer steps (model states stay constant)", minimum=1)
    seed: int = arg(0)


@dataclass(frozen=True, kw_only=True)
class RankResult(RankResult):
    """One rank's numbers of one configuration."""
    losses: list
    times: list
    cuda_peak: int | None


@dataclass(frozen=True, kw_only=True)
class RunResult(RunResult):
    """One configuration ("<precision> <optimizer>"): the formula, every rank's measurements (one entry per rank),
    the contract's losses and step_s."""
    Rank = RankResult
    predicted: dict                  # model_state_bytes: params, grads, optimizer, total
    measured: list                   # per rank: live model-state bytes after the last step
    phases: list                     # per rank: live bytes after building, the first backward, the last step
    totals_per_step: list
    activation_bytes: list
    scalar_bytes: list
    cuda_peak: list
    losses: list
    step_s: list


@dataclass(frozen=True, kw_only=True)
class Result(JobResult):
    """The launch: the model and its size, and one run per configuration, named ("fp32 adam": `named()`)."""
    Run = RunResult
    preset: str
    steps: int
    batch: int
    device: str
    numel: int
    runs: dict

def work(args: Args, nproc: int) -> list:
    """What a launch of these arguments computes (the course's dry run costs it): one data-parallel run per
    precision × optimizer, `batch` sequences per rank."""
    cfg = preset(args.preset)
    return [Training(model=cfg, global_batch=args.batch * nproc, dp=nproc, precision=p, optimizer=o, steps=args.steps,
                     label=f"{p} {o}") for p in args.precisions for o in args.optimizers]


def measure_one(cfg, precision: str, optimizer: str, batch: int, steps: int, seed: int, env) -> dict:
    """`steps` steps; live model-state bytes after build, the first backward and each step."""
    memory.free_device_memory()       # the previous configuration's tensors must not count in this peak
    memory.reset_cuda_peak(env.device)
    model = build(cfg, seed=seed).to(env.device, DTYPES[precision])
    params = list(model.parameters())
    masters = params if precision == "fp32" else [p.detach().float().requires_grad_() for p in params]
    opt = make_optimizer(masters, optimizer, lr=1e-3)
    data = CharDataset(block_size=cfg.block_size)
    g = torch.Generator().manual_seed(seed * 1000 + env.rank)
    phases = {"built": memory.live_model_state_bytes(model, opt).to_dict()}
    totals, losses, times = [], [], []
    for step in range(max(1, steps)):
        with timed_step(env.device) as clock:
            rows = torch.randint(len(data), (batch,), generator=g).tolist()
            x, y = (torch.stack(t).to(env.device) for t in zip(*(data[i] for i in rows)))
            opt.zero_grad(set_to_none=True)
            loss = lm_loss(model(x).float(), y)
            loss.backward()
            if step == 0:
                phases["backward"] = memory.live_model_state_bytes(model, opt).to_dict()
            if masters is not params:                     # mixed precision: update the fp32 masters
                for m, p in zip(masters, params):
                    m.grad = p.grad.float()
            opt.step()
            if masters is not params:                     # copy back; the fp32 grads were transient
                with torch.no_grad():
                    for m, p in zip(masters, params):
                        p.copy_(m)
                        m.grad = None
        times.append(clock.seconds)
        losses.append(loss.item())
        totals.append(memory.live_model_state_bytes(model, opt).total)
    measured = memory.live_model_state_bytes(model, opt)
    phases["step"] = measured.to_dict()
    _, activations = memory.saved_activation_bytes(lambda: lm_loss(model(x).float(), y), exclude=params)
    numel = sum(p.numel() for p in params)
    return {
        "numel": numel,
        "predicted": memory.model_state_bytes(numel, precision=precision, optimizer=optimizer).to_dict(),
        "measured": measured.to_dict(),
        "phases": phases,
        "totals_per_step": totals,
        "activation_bytes": activations,
        "scalar_bytes": memory.live_model_state_bytes(model, opt, include_scalars=True).optimizer - measured.optimizer,
        "cuda_peak": memory.cuda_peak_bytes(env.device),
        "losses": losses, "times": times,
    }


def main(argv=None):
    args = Args.parse(argv)
    env = par.runtime.dist.init()
    cfg = preset(args.preset)
    keys = [(p, o) for p in args.precisions for o in args.optimizers]
    mine = {f"{p} {o}": measure_one(cfg, p, o, args.batch, args.steps, args.seed, env) for p, o in keys}
    for k, r in mine.items():
        ok = "equal" if r["predicted"] == r["measured"] else "DIFFERENT"
        print(f"rank {env.rank} {k:>14}: predicted {r['predicted']['total']:,.0f} B, "
              f"measured {r['measured']['total']:,.0f} B ({ok}), cuda peak {memory.format_bytes(r['cuda_peak'])}",
              flush=True)
    ranks = par.runtime.dist.gather_object(mine)
    if env.is_rank0:
        per_rank = ("measured", "phases", "totals_per_step", "activation_bytes", "scalar_bytes", "cuda_peak")
        par.runtime.dist.save_result({
            "preset": args.preset, "steps": args.steps, "batch": args.batch, "world_size": env.world_size,
            "backend": env.backend, "device": str(env.device), "numel": memory.param_count(cfg),
            "runs": {k: {"predicted": mine[k]["predicted"], **{f: [r[k][f] for r in ranks] for f in per_rank},
                         **merge_ranks([r[k] for r in ranks], step_s="times"),
                         "per_rank": [{f: r[k][f] for f in ("losses", "times", "cuda_peak")} for r in ranks]}
                     for k in mine},
        })
    par.runtime.dist.teardown()


if __name__ == "__main__":
    main()
