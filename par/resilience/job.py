"""Save on one ZeRO layout, resume on another: the resumed losses and parameters equal the run that never stopped.

    python -m par.resilience.job --dir /tmp/ckpt --save-stage 3 --save-step 3 --resume-stages 1,3 --steps 6

One launch, every run from the same seed on the same ranks:
    "3"      the uninterrupted run (stage `--save-stage`), all `--steps` steps; after `--save-step` steps it saves
             the training state (`par.resilience.resume.save`: model, Adam, data position, random state) to
             DIR/state and goes on
    "3>S"    for each S in `--resume-stages`: a fresh engine of stage S (fresh torch seed, as a new process has)
             loads DIR/state (re-sharded where the stage differs) and trains the steps after it
`--dcp`: the uninterrupted run also saves that state with `torch.distributed.checkpoint` to DIR/dcp
(`par.resilience.torch_api.save_zero`). Each run saves its final state to DIR/final_<label>, where a test reads
its parameters (`load_full`).
`--resume-tp`: one more resumed run, "3>tp", on tensor parallelism over all the ranks (`resume.load_tp`: the state
loaded whole, the weights and Adam's m and v cut into TP shards; every rank trains on the whole global batch).
`--pp P`: two more runs on a dp × pp grid (P pipeline stages, `--microbatches` m, 1F1B, dp = world / P): "pp",
uninterrupted, saving its state after `--save-step` steps to DIR/state_pp (`resume.save_pp`: each stage's parameters
and Adam state by the dense model's names), and "pp>pp", resumed from it on the same grid (`resume.load_pp`); their
final states go to DIR/final_pp and DIR/final_pp_to_pp (`resume.pp_units` reads them; one process resumes with
`resume.load_pp`).
`--forget data|rng|optimizer` makes the resumed runs restart the data order, keep the fresh random state, or lose
rank 0's shard of Adam's state. `--mistakes data,rng,optimizer` adds, after the resumed runs, one more resumed
run per mistake (on the first of `--resume-stages`, labelled "3>1 forget data"), each forgetting that one thing:
the three mistakes beside the right resume, in one launch.

Result: {"world_size", "backend", "runs": [{"label", "stage", "start_step", "losses", "final"}]}.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

import par.runtime.dist
from par.data import CharDataset
from par.measure import JobResult, RunResult
from par.model import build, lm_loss, preset
from par.pp.replicated import ReplicatedPipeline
from par.resilience import resume, torch_api
from par.runtime.grid import Grid
from par.runtime.job_args import arg, JobArgs
from par.runtime.job_work import Training
from par.tp.layers import check_tp_degree, TensorParallelGPT
from par.zero import checkpoint
from par.zero.engine import Zero


@dataclass(frozen=True)
class Args(JobArgs):
    dir: str = arg(help="folder for the saved state and each run's final state")
    preset: str = arg("tiny")
    steps: int = arg(6, minimum=1)
    batch: int = arg(8, "global batch size (a multiple of the world size)")
    lr: float = arg(1e-3)
    seed: int = arg(0)
    noise: float = arg(0.25, "probability that an input token is replaced by a random one (torch's CPU generator)")
    save_stage: int = arg(3, choices=(0, 1, 2, 3))
    save_step: int = arg(3, minimum=1)
    resume_stages: tuple[int, ...] = arg((1, 3), "comma-separated ZeRO stages that resume from the saved state")
    dcp: bool = arg(False, "the uninterrupted run also saves its state with torch.distributed.checkpoint (DIR/dcp)")
    forget: str = arg("", "what the resumed runs do not restore (optimizer: rank 0's shard of Adam's state)",
                      choices=("", "data", "rng", "optimizer"))
    mistakes: tuple[str, ...] = arg((), "comma-separated, of data, rng, optimizer: one more resumed run each, "
                                        "forgetting that one thing", choices=("data", "rng", "optimizer"))
    resume_tp: bool = arg(False, "one more resumed run (labelled \"3>tp\"): tensor parallelism over every rank")
    pp: int = arg(0, "pipeline stages of two more runs, uninterrupted (\"pp\") and resumed (\"pp>pp\"); 0: none",
                  minimum=0)
    microbatches: int = arg(2, "micro-batches per step of the --pp runs", minimum=1)


@dataclass(frozen=True, kw_only=True)
class RunResult(RunResult):
    """One run: uninterrupted ("3") or resumed ("3>1"); its losses from `start_step` on; its final state's folder."""
    label: str
    stage: int
    start_step: int
    losses: list
    final: str
    final_shard_diff: float | None = None     # the TP run: max |Δ| of its weight shards against the uninterrupted run


@dataclass(frozen=True, kw_only=True)
class Result(JobResult):
    """The uninterrupted run first, then one run per resumed stage."""
    Run = RunResult
    runs: tuple


def work(args: Args, nproc: int) -> list:
    """What a launch computes (the course's dry run costs it): the uninterrupted run and each resumed one."""
    cfg = preset(args.preset)
    resumed = [(s, args.steps - args.save_step, f"resumed on ZeRO-{s}") for s in args.resume_stages]
    resumed += [(args.resume_stages[0], args.steps - args.save_step, f"resumed forgetting {m}")
                for m in args.mistakes if args.resume_stages]
    tp = [Training(model=cfg, global_batch=args.batch, tp=nproc, steps=args.steps - args.save_step,
                   label="resumed on TP")] if args.resume_tp else []
    pp = [Training(model=cfg, global_batch=args.batch, dp=nproc // args.pp, pp=args.pp,
                   microbatches=args.microbatches, steps=n, label=label)
          for n, label in [(args.steps, "uninterrupted on PP"), (args.steps - args.save_step, "resumed on PP")]
          ] if args.pp else []
    return [Training(model=cfg, global_batch=args.batch, dp=nproc, zero_stage=s, steps=n, label=label)
            for s, n, label in [(args.save_stage, args.steps, "uninterrupted"), *resumed]] + tp + pp


def train_run(stage: int, args: Args, env, data, resume_from: str = "", mistake: str = "") -> dict:
    """One run on this rank: a fresh model and engine, the torch seed a new process starts from; resumed from
    `resume_from` when given, without restoring `mistake` (one of `--mistakes`, named in the label) or else
    `--forget`. Saves the state after `save_step` (the uninterrupted run) and at the end."""
    forget = mistake or args.forget
    torch.manual_seed(args.seed)
    engine = Zero(build(preset(args.preset), seed=args.seed).to(env.device), stage=stage, optimizer="adam", lr=args.lr)
    start = 0
    if resume_from:
        start = resume.load(engine, resume_from, data=forget != "data", rng=forget != "rng",
                            optimizer=forget != "optimizer")
    label = f"{args.save_stage}>{stage}" if resume_from else str(stage)
    label += f" forget {mistake}" if resume_from and mistake else ""
    losses = []
    for s, (x, y) in enumerate(resume.batches_from(data, args.batch, args.steps, args.seed, start), start):
        x, y = resume.global_step_input(x, y, args.noise, data.vocab_size, env.rank, env.world_size)
        loss = lm_loss(engine.model(x.to(env.device)), y.to(env.device))
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
        if not resume_from and s + 1 == args.save_step:
            resume.save(engine, os.path.join(args.dir, "state"), step=s + 1)
            if args.dcp:
                torch_api.save_zero(engine, os.path.join(args.dir, "dcp"), step=s + 1)
    final = os.path.join(args.dir, f"final_{label.replace('>', '_to_').replace(' ', '_')}")
    resume.save(engine, final, step=args.steps)
    engine.close()
    return {"label": label, "stage": stage, "start_step": start,
            "losses": losses, "final": final}


def train_tp(args: Args, env, data, resume_from: str) -> dict:
    """The resumed run on TP ranks (every rank: the whole batch, its shards); saves no final state (its
    parameters are compared shard by shard in `final_shard_diff`)."""
    torch.manual_seed(args.seed)
    model, opt, start = resume.load_tp(build(preset(args.preset), seed=args.seed), resume_from, lr=args.lr)
    model = model.to(env.device)
    losses = []
    for x, y in resume.batches_from(data, args.batch, args.steps, args.seed, start):
        x, y = resume.global_step_input(x, y, args.noise, data.vocab_size)
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model(x.to(env.device)), y.to(env.device))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    whole = build(preset(args.preset), seed=args.seed)
    final = os.path.join(args.dir, f"final_{args.save_stage}")
    with torch.no_grad():
        for name, value in checkpoint.load_full(final).items():
            dict(whole.named_parameters())[name].copy_(value)
    expected = dict(TensorParallelGPT.from_dense(whole, impl="torch").named_parameters())
    diff = max((p.detach().cpu() - expected[n]).abs().max().item() for n, p in model.named_parameters())
    return {"label": f"{args.save_stage}>tp", "stage": -1, "start_step": start, "losses": losses, "final": "",
            "final_shard_diff": diff}


def train_pp(args: Args, env, data, resume_from: str = "") -> dict:
    """One run on a dp × pp grid (`par.pp.replicated.ReplicatedPipeline` over the dense model's layers), from the
    seed or resumed from `resume_from` (`resume.load_pp`: the whole state into the model, each stage's parameters
    given their Adam state). Saves the state after `save_step` (the uninterrupted run) and at the end. Losses
    on the last stage only (elsewhere [])."""
    torch.manual_seed(args.seed)
    model = build(preset(args.preset), seed=args.seed)
    start, loaded = 0, None
    if resume_from:
        loaded, start = resume.load_pp(model, resume_from, lr=args.lr)
    engine = ReplicatedPipeline(model.to(env.device).to_layers(), Grid(dp=env.world_size // args.pp, pp=args.pp),
                                args.microbatches, "adam", args.lr)
    if loaded is not None:                      # the stage's modules are the model's: the same parameter objects
        for p in engine.params:
            engine.optimizer.state[p] = {k: v.to(p.device) for k, v in loaded.state[p].items()}
    label = "pp>pp" if resume_from else "pp"
    losses = []
    for s, (x, y) in enumerate(resume.batches_from(data, args.batch, args.steps, args.seed, start), start):
        x, y = resume.global_step_input(x, y, args.noise, data.vocab_size)
        loss = engine.step(x.to(env.device), y.to(env.device))
        if loss is not None:
            losses.append(loss)
        if not resume_from and s + 1 == args.save_step:
            resume.save_pp(engine, model, os.path.join(args.dir, "state_pp"), step=s + 1)
    final = os.path.join(args.dir, f"final_{label.replace('>', '_to_')}")
    resume.save_pp(engine, model, final, step=args.steps)
    return {"label": label, "stage": -1, "start_step": start, "losses": losses, "final": final}


def main(argv=None) -> None:
    args = Args.parse(argv)
    if args.save_step >= args.steps:
        raise SystemExit(f"error: --save-step {args.save_step} leaves nothing to resume: use --steps "
                         f"{args.save_step + 1} or more")
    if args.mistakes and not args.resume_stages:
        raise SystemExit("error: --mistakes resume on the first of --resume-stages: give --resume-stages too")
    checkpoint.check_directory(args.dir)
    env = par.runtime.dist.init()
    if args.pp and (env.world_size % args.pp or args.batch % (env.world_size // args.pp * args.microbatches)):
        raise SystemExit(f"error: --pp {args.pp} needs a world size ({env.world_size}) it divides and a --batch "
                         f"({args.batch}) divisible by dp × --microbatches: use --pp 2 on 2 or 4 ranks, --batch 8")
    if args.batch % env.world_size:
        raise SystemExit(f"error: --batch {args.batch} is not a multiple of the world size {env.world_size}: "
                         f"use e.g. --batch {env.world_size * max(1, args.batch // env.world_size)}")
    if args.resume_tp:        # before any training: TP over every rank must split the model's heads and widths
        try:
            check_tp_degree(preset(args.preset), env.world_size)
        except ValueError as e:
            raise SystemExit(f"error: --resume-tp on {env.world_size} ranks: {e}") from None
    data = CharDataset(block_size=preset(args.preset).block_size)
    state = os.path.join(args.dir, "state")
    todo = [(args.save_stage, "", ""), *[(s, state, "") for s in args.resume_stages],
            *[(args.resume_stages[0], state, m) for m in args.mistakes]]
    runs = []
    for stage, source, mistake in todo:
        ranks = par.runtime.dist.gather_object(train_run(stage, args, env, data, source, mistake))
        if env.is_rank0:
            mine = ranks[0]
            losses = [sum(r["losses"][i] for r in ranks) / len(ranks) for i in range(len(mine["losses"]))]
            runs.append({**mine, "losses": losses})
    if args.resume_tp:
        ranks = par.runtime.dist.gather_object(train_tp(args, env, data, state))
        if env.is_rank0:
            runs.append({**ranks[0], "final_shard_diff": max(r["final_shard_diff"] for r in ranks)})
    for source in ("", state + "_pp") if args.pp else ():
        ranks = par.runtime.dist.gather_object(train_pp(args, env, data, source))
        if env.is_rank0:
            runs.append(next(r for r in ranks if r["losses"]))
    par.runtime.dist.save_result({"world_size": env.world_size, "backend": env.backend, "runs": runs})
    par.runtime.dist.teardown()


if __name__ == "__main__":
    main()
