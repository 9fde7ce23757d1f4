"""Elastic restart: a rank killed mid-run, torchrun's restart, the run resumed from its last checkpoint.

    torchrun --nproc-per-node=2 --max-restarts=1 -m par.resilience.elastic_job --dir /tmp/run --steps 16 --every 5 \
        --kill-step 12

torchrun (`--max-restarts=K`) starts the ranks again, all of them, when one dies: each start is an *attempt*, its
number in TORCHELASTIC_RESTART_COUNT (0 first). Every attempt of this job builds a ZeRO engine, loads the newest
complete checkpoint in DIR if there is one (DIR/step_S, par's sharded format: `par.resilience.resume`), and trains
to `--steps`, saving after every `--every` steps. In attempt 0 only, rank `--kill-rank` sends itself SIGKILL
before step `--kill-step` (after that many steps): no exception, no goodbye; the other ranks wait in their next
collective until torchrun's agent sees the dead worker, stops them and starts every rank again. `--kill-step 0`:
nothing is killed (the uninterrupted run).

The time lost to the kill at step k, the last checkpoint at step c ≤ k, each step taking t:

    lost = R + (k − c) · t          R: restart (kill → the first step of the next attempt)

Each step's loss (averaged over the ranks) and its start and end time, each attempt's process start, each
checkpoint's start and end, and the kill's time go to DIR/log.jsonl (appended line by line, flushed: what an
attempt wrote before it died stays). `--step-ms` pads every step to at least that long (a larger model's step on
this machine: the rework k − c steps then shows beside the restart).

Result (saved by rank 0 of the attempt that finishes): {"world_size", "backend", "attempts", "kill": {"step",
"rank", "time"} or null, "starts": [{"attempt", "time"}], "steps": [{"attempt", "step", "loss", "start", "end"}],
"loads": [{"attempt", "step", "start", "end"}], "saves": [{"attempt", "step", "start", "end"}]}, times in seconds
since the epoch (`time.time()`: one clock for every process of the machine).
"""
from __future__ import annotations

import time

STARTED = time.time()          # before torch is imported: the import is part of a restart's cost

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402

import par.runtime.dist   # noqa: E402
from par.data import CharDataset   # noqa: E402
from par.measure import JobResult   # noqa: E402
from par.model import build, lm_loss, preset   # noqa: E402
from par.resilience import resume   # noqa: E402
from par.runtime.job_args import arg, JobArgs   # noqa: E402
from par.runtime.job_work import Training
from par.zero import checkpoint   # noqa: E402
from par.zero.engine import Zero   # noqa: E402

ATTEMPT_ENV = "TORCHELASTIC_RESTART_COUNT"


@dataclass(frozen=True)
class Args(JobArgs):
    dir: str = arg(help="folder for the checkpoints (step_S) and the log (log.jsonl); empty at the first attempt")
    preset: str = arg("tiny")
    steps: int = arg(16, minimum=1)
    every: int = arg(5, "checkpoint after every EVERY steps", minimum=1)
    kill_step: int = arg(0, "attempt 0's rank KILL_RANK sends itself SIGKILL before this step (0: no kill)", minimum=0)
    kill_rank: int = arg(1, "the rank that dies (taken modulo the world size)", minimum=0)
    step_ms: float = arg(0.0, "pad every step to at least this long (ms)", minimum=0)
    stage: int = arg(3, choices=(0, 1, 2, 3))
    batch: int = arg(8, "global batch size (a multiple of the world size)")
    lr: float = arg(1e-3)
    seed: int = arg(0)
    noise: float = arg(0.25, "probability that an input token is replaced by a random one")


@dataclass(frozen=True, kw_only=True)
class Result(JobResult):
    """The log of every attempt (see the module's docstring), as rank 0 of the last attempt read it."""
    attempts: int
    kill: dict | None = None
    starts: list
    steps: list
    loads: list
    saves: list


def work(args: Args, nproc: int) -> list:
    """What a launch computes (the course's dry run costs it): the steps, and those redone after the kill."""
    redo = args.kill_step - latest_before(args.kill_step, args.every) if args.kill_step else 0
    return [Training(model=preset(args.preset), global_batch=args.batch, dp=nproc, zero_stage=args.stage,
                     steps=args.steps + redo, label="killed and restarted" if args.kill_step else "uninterrupted")]


def latest_before(step: int, every: int) -> int:
    """The last checkpoint at or before `step` when one is saved after every `every` steps: every·⌊step/every⌋."""
    return every * (step // every)


# ---------------------------------------------------------------- the log every attempt appends to
def log(directory: str, kind: str, **fields) -> None:
    """One JSON line in DIR/log.jsonl, flushed and fsynced (a SIGKILL right after loses nothing)."""
    with open(os.path.join(directory, "log.jsonl"), "a") as f:
        f.write(json.dumps({"kind": kind, **fields}) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_log(directory: str) -> dict:
    """The log's lines by kind: {"start": [...], "step": [...], "load": [...], "save": [...], "kill": [...]}."""
    out = {k: [] for k in ("start", "step", "load", "save", "kill")}
    with open(os.path.join(directory, "log.jsonl")) as f:
        for line in f:
            entry = json.loads(line)
            out[entry.pop("kind")].append(entry)
    return out


def newest_checkpoint(directory: str) -> tuple[int, str] | None:
    """(step, folder) of the newest checkpoint DIR/step_S that is complete and intact (`checkpoint.verify`: its
    meta.pt, written last, and every shard checked), None without one. A newer one that is not is passed over,
    and the line printed says which and why."""
    found = sorted(((int(name[5:]), os.path.join(directory, name)) for name in os.listdir(directory)
                    if name.startswith("step_") and name[5:].isdigit() and resume.exists(os.path.join(directory, name))),
                   reverse=True)
    for k, (step, folder) in enumerate(found):
        try:
            checkpoint.verify(folder)
        except checkpoint.CheckpointError as e:
            after = f"falls back to {found[k + 1][1]}" if k + 1 < len(found) else "starts from step 0"
            print(f"note: {folder} cannot be resumed ({e}); the restart {after}", flush=True)
            continue
        return step, folder
    return None


# ---------------------------------------------------------------- one attempt
def attempt(args: Args, env, data, number: int) -> None:
    """Load the newest checkpoint (if any), train to `--steps`, save after every `--every` steps; in attempt 0,
    rank `kill_rank` dies by SIGKILL before step `kill_step`. Rank 0 logs each step."""
    torch.manual_seed(args.seed)
    engine = Zero(build(preset(args.preset), seed=args.seed).to(env.device), stage=args.stage, optimizer="adam",
                  lr=args.lr)
    start = 0
    newest = newest_checkpoint(args.dir)
    if newest is not None:
        t0 = time.time()
        start = resume.load(engine, newest[1])
        if env.is_rank0:
            log(args.dir, "load", attempt=number, step=start, start=t0, end=time.time())
    killer = args.kill_rank % env.world_size
    for s, (x, y) in enumerate(resume.batches_from(data, args.batch, args.steps, args.seed, start), start):
        if number == 0 and args.kill_step and s == args.kill_step and env.rank == killer:
            log(args.dir, "kill", attempt=number, step=s, rank=env.rank, time=time.time())
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.time()
        x, y = resume.global_step_input(x, y, args.noise, data.vocab_size, env.rank, env.world_size)
        loss = lm_loss(engine.model(x.to(env.device)), y.to(env.device))
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        mean = loss.detach().clone()
        if env.world_size > 1:
            torch.distributed.all_reduce(mean)          # the ranks' shards' losses, averaged below
        time.sleep(max(0.0, t0 + args.step_ms / 1e3 - time.time()))
        if env.is_rank0:
            log(args.dir, "step", attempt=number, step=s, loss=mean.item() / env.world_size, start=t0, end=time.time())
        if (s + 1) % args.every == 0 and s + 1 < args.steps:
            t1 = time.time()
            resume.save(engine, os.path.join(args.dir, f"step_{s + 1}"), step=s + 1)
            if env.is_rank0:
                log(args.dir, "save", attempt=number, step=s + 1, start=t1, end=time.time())
    engine.close()


def main(argv=None) -> None:
    args = Args.parse(argv)
    if args.kill_step >= args.steps:
        raise SystemExit(f"error: --kill-step {args.kill_step} is not before the last step: use a step below "
                         f"--steps {args.steps} (or 0: no kill)")
    number = int(os.environ.get(ATTEMPT_ENV, 0))
    checkpoint.check_directory(args.dir)
    os.makedirs(args.dir, exist_ok=True)
    if number == 0 and (newest_checkpoint(args.dir) or os.path.exists(os.path.join(args.dir, "log.jsonl"))):
        raise SystemExit(f"error: --dir {args.dir} holds a checkpoint or a log: the first attempt starts from a "
                         f"folder without them (a checkpoint there would be resumed); give a new folder")
    env = par.runtime.dist.init()      # under torchrun, through this attempt's own keys (dist.attempt_store)
    if args.batch % env.world_size:
        raise SystemExit(f"error: --batch {args.batch} is not a multiple of the world size {env.world_size}: "
                         f"use e.g. --batch {env.world_size * max(1, args.batch // env.world_size)}")
    if env.is_rank0:
        log(args.dir, "start", attempt=number, time=STARTED)
    attempt(args, env, CharDataset(block_size=preset(args.preset).block_size), number)
    if env.world_size > 1:
        torch.distributed.barrier()
    if env.is_rank0:
        got = read_log(args.dir)
        par.runtime.dist.save_result({"world_size": env.world_size, "backend": env.backend, "attempts": number + 1,
                                      "kill": got["kill"][0] if got["kill"] else None, "starts": got["start"],
                                      "steps": got["step"], "loads": got["load"], "saves": got["save"]})
    par.runtime.dist.teardown()


if __name__ == "__main__":
    main()
