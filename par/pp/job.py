"""Train GPT-lite pipeline-parallel and record what every rank did.

    torchrun --nproc-per-node=4 -m par.pp.job --schedules gpipe,1f1b --microbatches 1,4,8

One launch runs every (schedule, m) combination in turn, each on a fresh copy of the model:
`--warmup` untimed steps (only before the first with `--warmup-once`), then `--steps` timed ones. With a fixed `--micro-batch-size` the batch
grows with m (the GPipe view); with `--batch` the batch is fixed and the micro-batches shrink as m
grows (the micro-batch size trade-off). `--d-model`, `--n-head`, `--n-layer`, `--block-size` and
`--vocab-size` change the preset (the lecture's timing experiments use wide blocks and a small
vocabulary, so the stages are equal and an action is tens of ms of compute).

`--model square` trains `par.model.SquareStack` instead (square Linear+ReLU layers of width --d-model on random
rows, the mean-squared error): its forward, input gradient and weight gradient are one matmul each, the
equal F = I = W the zero-bubble formulas assume, so lecture 03 times the schedules on it.

With `--dp D` the world is D replicas of a pipeline of world/D stages (`par.pp.replicated`): every replica runs its rows of the batch through its pipeline, then the D copies of each
stage average their gradients. Only 1F1B there.

With `--check` every rank also trains the single-process model on the same batches and compares
its stage: the first step's gradients (max_grad_diff), every step's loss (max_loss_diff) and the
parameters at the end (max_diff). The reference runs the batch in the pipeline's micro-batches and
accumulates their gradients (loss_i / m), so it never holds more than one micro-batch's activations.

Rank 0 saves {"world_size", "backend", "config", "runs": [...]}; each run follows the job result
contract (losses, step_s, per_rank) and adds: schedule, m, v, dp, batch, micro_batch_size, text, bounds,
step_steady_s (the slowest rank's steady seconds per step, `par.measure.timed_step`), spans (every action of the
last timed step, wall clock, with its cost `cpu_s`: CPU time, on a GPU CUDA-event time,
`par.pp.pipeline.ActionCosts`, and `after_s`, what its rank spent before its next action without waiting,
`Pipeline.after_s`), and three bubbles, each the median over the timed steps of idle / step time:

    bubble              the executed timeline on the wall clock (bubble_steps: every step's)
    bubble_load_proof   the step rebuilt from each rank's own CPU time, the waits for the other ranks replayed from
                        the plan (`par.pp.sim.as_executed(..., clock="cpu")`; on a GPU the CUDA-event timeline
                        itself); bubble_load_proof_steps: every step's
    bubble_simulated    `par.pp.sim.simulate` with this run's median `cpu_s` of F, B, I, W on every stage

beside bubble_formula (ZB-H1's with this run's median F, I, W) and bubble_replayed_wall (the last step rebuilt from
its wall-clock durations, on the CPU: the executed bubble again when the run's waits were the plan's). costs and
action_costs hold those medians over every timed step's actions (F and B; F, B, I, W), memory (per rank: activation peak,
micro-batches in flight), bytes (per rank and step, by kind: pipeline sends, data-parallel gradients) and the
max_*diff of --check; with --profile-dir, profile_traces: the torch.profiler traces of the first timed step, one
per rank.
"""
from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

import par.runtime.dist
from par.comm import commlog
from par.data import CharDataset, global_batches
from par.measure import JobResult, RankResult, RunResult, slowest, timed_step
from par.model import build, GPTConfig, lm_loss, preset, square_batches, SquareStack
from par.pp import schedules, sim as pipeline_sim
from par.pp.pipeline import Pipeline, split_microbatches
from par.pp.replicated import ReplicatedPipeline
from par.reference import make_optimizer
from par.runtime import profile
from par.runtime.grid import Grid
from par.runtime.job_args import arg, JobArgs
from par.runtime.job_work import Training
from par.timeline import Recorder


@dataclass(frozen=True)
class Args(JobArgs):
    schedules: tuple[str, ...] = arg(("1f1b",), "comma-separated: naive, gpipe, 1f1b, interleaved, zb_h1, zb_v, "
                                                "dualpipe_v; 'given' runs --schedule-text")
    schedule_text: str = arg("", "the 'given' schedule: every rank's actions, ranks separated by '|' "
                                 "(e.g. 'F0 I0 W0 | F0 I0 W0'), checked before it runs")
    microbatches: tuple[int, ...] = arg((4,), "comma-separated numbers of micro-batches m", minimum=1)
    virtual: int = arg(2, "chunks per rank for 'interleaved'")
    micro_batch_size: int = arg(4, "sequences per micro-batch", minimum=1)
    batch: int | None = arg(None, "fixed batch (overrides --micro-batch-size)")
    dp: int = arg(1, "data-parallel replicas of the pipeline (1F1B only)")
    model: str = arg("gpt", "gpt: GPT-lite (--preset and the overrides below); square: --n-layer square Linear+ReLU "
                            "layers of width --d-model on random rows, mean-squared error (F = I = W: the "
                            "zero-bubble formulas' equal costs; --micro-batch-size counts rows)", choices=("gpt", "square"))
    preset: str = arg("tiny")
    n_layer: int | None = arg(None, "override the preset's number of blocks")
    d_model: int | None = arg(None, "override the preset's width")
    n_head: int | None = arg(None, "override the preset's number of heads")
    block_size: int | None = arg(None, "override the preset's context length")
    vocab_size: int | None = arg(None, "override the preset's vocabulary")
    partition: str = arg("parameters", choices=("parameters", "uniform"))
    steps: int = arg(2, "timed steps per combination", minimum=1)
    profile_dir: str = arg("", "profile the first timed step of every run with torch.profiler: a Chrome/Perfetto "
                               "trace per run and rank in this folder (par.runtime.profile)")
    warmup: int = arg(1, "untimed steps before each combination's timed ones")
    warmup_once: bool = arg(False, "warm up before the first combination only (when all have the same "
                                   "micro-batch shapes)")
    lr: float = arg(1e-3)
    seed: int = arg(0)
    check: bool = arg(False, "compare with single-process training")
    record_comm: bool = arg(False, "also record blocking waits (lane 'comm')")


@dataclass(frozen=True, kw_only=True)
class RankResult(RankResult):
    """One stage's memory, bytes sent by label, and CPU seconds per action."""
    memory: dict
    bytes: dict
    cpu_s: object


@dataclass(frozen=True, kw_only=True)
class RunResult(RunResult):
    """One (schedule, m) run: the schedule, the step, the measured bubble beside its formula (see the module's
    docstring); spans, bubble and costs where the run recorded a timeline; max_*_diff with --check."""
    Rank = RankResult
    schedule: str
    m: int
    v: int
    dp: int
    pp: int
    batch: int
    micro_batch_size: int
    text: str
    bounds: list
    losses: list
    step_s: list
    median_step_s: float | None
    memory: list
    bubble_formula: float
    step_steady_s: list | None = None
    median_step_steady_s: float | None = None
    profile_traces: list | None = None
    spans: list | None = None
    bubble_steps: list | None = None
    bubble: float | None = None
    bubble_load_proof_steps: list | None = None
    bubble_load_proof: float | None = None
    bubble_replayed_wall: float | None = None
    bubble_simulated: float | None = None
    costs: dict | None = None
    action_costs: dict | None = None
    max_diff: float | None = None
    max_grad_diff: float | None = None
    max_loss_diff: float | None = None


@dataclass(frozen=True, kw_only=True)
class Result(JobResult):
    """The launch: the model, and one run per (schedule, m)."""
    Run = RunResult
    preset: str
    model: str
    config: dict
    runs: tuple

def work(args: Args, nproc: int) -> list:
    """What a launch of these arguments computes (the course's dry run costs it): one run per schedule × m on dp
    replicas of a pipeline of nproc / dp stages, after `warmup` steps; the single-process reference of the same
    batch beside (--check)."""
    cfg = config(args) if args.model == "gpt" else square_in_gpt_terms(args, nproc)
    rows_per_sequence = 1 if args.model == "gpt" else cfg.block_size
    out = []
    for schedule in args.schedules:
        for m in args.microbatches:
            batch = -(-(args.batch or args.dp * m * args.micro_batch_size) // rows_per_sequence)
            out.append(Training(model=cfg, global_batch=batch, dp=args.dp, pp=nproc // args.dp, microbatches=m,
                                steps=args.steps + args.warmup, reference_batch=batch if args.check else 0,
                                label=f"{schedule} m={m}"))
    return out


def square_in_gpt_terms(args: Args, nproc: int):
    """`--model square` for the planner: L square layers of width d hold L·d² weights and cost 6·L·d² FLOPs per
    row, those of L/12 GPT blocks of width d (12·d² weights each), a row a token (the planner's shortest sequence:
    2 tokens, so 2 rows); the planner's activations per block bound a square layer's from above. At least a
    block per stage."""
    import math
    width, layers = square_width(args), square_layers(args)
    return GPTConfig(vocab_size=2, block_size=2, n_layer=max(nproc, math.ceil(layers / 12)), n_head=1, d_model=width)


def config(args):
    """The GPT-lite configuration of --preset and its overrides (--model gpt)."""
    overrides = {"n_layer": args.n_layer, "d_model": args.d_model, "n_head": args.n_head,
                 "block_size": args.block_size, "vocab_size": args.vocab_size}
    return preset(args.preset, **{k: v for k, v in overrides.items() if v is not None})


def square_width(args) -> int:
    """--model square: the layers' width (--d-model, else 1024: a matmul of tens of ms on one CPU core)."""
    return args.d_model or 1024


def square_layers(args) -> int:
    """--model square: the number of layers (--n-layer, else 8)."""
    return args.n_layer or 8


def model_and_loss(args, cfg):
    """(the model, its loss function) of --model: GPT-lite with the LM loss, or the square stack with the MSE."""
    if args.model == "square":
        return SquareStack(square_width(args), square_layers(args), seed=args.seed), F.mse_loss
    return build(cfg, seed=args.seed), lm_loss


def batches(args, cfg, rows: int, steps: int):
    """The global batches of every step: token sequences of the corpus, or random rows (--model square)."""
    if args.model == "square":     # x requires grad: stage 0 also computes dL/dx, so every stage's I costs the same
        return ((x.requires_grad_(True), y) for x, y in square_batches(square_width(args), rows, steps, seed=args.seed))
    return global_batches(corpus(cfg.block_size), rows, steps, seed=args.seed)


@functools.lru_cache(maxsize=None)
def corpus(block_size: int) -> CharDataset:
    """The character dataset, built once per job."""
    return CharDataset(block_size=block_size)


class Reference:
    """Single-process training of the whole model on every rank, one micro-batch at a time."""

    def __init__(self, args, cfg, device, m):
        self.model, self.loss_fn = model_and_loss(args, cfg)
        self.model.to(device)
        self.opt = make_optimizer(self.model.parameters(), "adam", args.lr)
        self.m = m
        self.params = {f"{i}.{n}": p for i, layer in enumerate(self.model.to_layers())
                       for n, p in layer.named_parameters()}

    def step(self, x, y) -> float:
        """∇ (1/m) Σ_i loss(x_i): the whole batch's gradient, accumulated micro-batch by micro-batch."""
        self.opt.zero_grad(set_to_none=True)
        total = 0.0
        for xi, yi in zip(split_microbatches(x, self.m), split_microbatches(y, self.m)):
            loss = self.loss_fn(self.model(xi), yi) / self.m
            loss.backward()
            total += loss.item()
        return total

    def max_diff(self, named, grads: bool) -> float:
        return max(((p.grad if grads else p) - (self.params[n].grad if grads else self.params[n])).abs().max().item()
                   for n, p in named)


def given_schedule(text: str, pp: int, m: int):
    """The schedule of --schedule-text (one rank's actions per '|'), checked by `par.pp.sim.check`."""
    lists = [part.strip() for part in text.split("|")]
    if len(lists) != pp:
        raise schedules.ScheduleError(f"--schedule-text has {len(lists)} ranks' actions for {pp} pipeline ranks: "
                                      f"separate one list per rank with '|'")
    return pipeline_sim.check(schedules.from_lists(lists, microbatches=m, name="given"))


def run_one(args, cfg, kind, m, env, warmup):
    """Train one (schedule, m) for warmup + steps steps; rank 0 returns the run's record, the others None."""
    v = args.virtual if kind == "interleaved" else 1
    pp = env.world_size // args.dp
    batch = args.batch if args.batch is not None else args.dp * m * args.micro_batch_size
    sched = given_schedule(args.schedule_text, pp, m) if kind == "given" else schedules.make(kind, pp, m, v)
    model, loss_fn = model_and_loss(args, cfg)
    if args.dp > 1:
        engine = ReplicatedPipeline(model.to_layers(), Grid(args.dp, pp, 1), microbatches=m, lr=args.lr,
                                    schedule=kind, track_memory=True)
        pipe, opt = engine.pipe, None
    else:
        pipe = Pipeline(model.to_layers(), sched, loss_fn, method=args.partition, track_memory=True)
        engine, opt = None, make_optimizer(pipe.parameters(), "adam", args.lr)
    ref = Reference(args, cfg, env.device, args.dp * m) if args.check else None
    rec = Recorder()
    losses, times, steadies, bubbles, proof_bubbles, steps_bytes, traces = [], [], [], [], [], [], []
    timed_spans = []                                  # every timed step's compute spans (the costs' medians)
    loss_diff = grad_diff = 0.0
    for step, (x, y) in enumerate(batches(args, cfg, batch, warmup + args.steps)):
        x, y = x.to(env.device), y.to(env.device)
        timed = step >= warmup
        rec.reset()                                   # a barrier: every rank starts the step together
        with profile.step(args.profile_dir, f"pp_{kind}_m{m}_rank{env.rank}", on=step == warmup) as trace, \
                commlog.capture() as log, timed_step(env.device) as clock:
            if engine is not None:
                loss = engine.step(x, y)
            else:
                opt.zero_grad(set_to_none=True)
                loss = pipe.step(x, y, recorder=rec, record_comm=args.record_comm)
                opt.step()
        if loss is not None:
            losses.append(loss)
        if ref is not None:
            ref_loss = ref.step(x, y)
            loss_diff = max(loss_diff, abs(loss - ref_loss) if loss is not None else 0.0)
            if step == 0:
                grad_diff = ref.max_diff(pipe.named_parameters(), grads=True)
            ref.opt.step()
        if trace.path is not None:
            traces.append(str(trace.path))
        if timed:
            times.append(clock.seconds)
            steadies.append(clock.steady_s)
            steps_bytes.append({k: e["bytes_sent"] for k, e in _bytes_by_tag(log).items()})
            if engine is None:
                spans = _with_cpu(rec, pipe)
                if spans is not None:
                    bubbles.append(pipeline_sim.bubble_fraction(spans))
                    proof_bubbles.append(bubbles[-1] if env.device.type == "cuda" else     # the GPU's own time
                                         pipeline_sim.as_executed(spans, sched, clock="cpu").bubble_fraction)
                    timed_spans += [s for s in spans if s["lane"] == "compute"]
    diff = ref.max_diff(pipe.named_parameters(), grads=False) if ref is not None else None
    mine = {"losses": losses, "times": times, "steady": steadies, "memory": pipe.memory, "diff": diff,
            "grad_diff": grad_diff, "loss_diff": loss_diff, "bounds": pipe.bounds, "cpu_s": pipe.cpu_s,
            "bytes": steps_bytes[-1] if steps_bytes else {}, "traces": traces}
    parts = par.runtime.dist.gather_object(mine)
    if parts is None:
        return None
    step_s = slowest(p["times"] for p in parts)
    step_steady_s = slowest(p["steady"] for p in parts)
    record = {"schedule": kind, "m": m, "v": sched.virtual, "dp": args.dp, "pp": pp, "batch": batch,
              "micro_batch_size": batch // (args.dp * m), "text": sched.text(), "bounds": parts[0]["bounds"],
              "losses": next((p["losses"] for p in parts if p["losses"]), []),   # from a last stage
              "step_s": step_s, "median_step_s": statistics.median(step_s) if step_s else None,
              "step_steady_s": step_steady_s,
              "median_step_steady_s": statistics.median(step_steady_s) if step_steady_s else None,
              "per_rank": [{k: p[k] for k in ("memory", "bytes", "cpu_s")} for p in parts],
              "memory": [p["memory"] for p in parts],
              "bubble_formula": pipeline_sim.bubble_formula(pp, m)}     # ZB-H1/ZB-V: theirs, below
    if args.profile_dir:
        record["profile_traces"] = [t for p in parts for t in p["traces"]]
    if engine is None:
        record["spans"] = spans
        record["bubble_steps"] = bubbles
        record["bubble"] = statistics.median(bubbles) if bubbles else None
        record["bubble_load_proof_steps"] = proof_bubbles
        record["bubble_load_proof"] = statistics.median(proof_bubbles) if proof_bubbles else None
        if env.device.type != "cuda":      # the time between actions is the CPU's (a GPU's actions are its events)
            record["bubble_replayed_wall"] = pipeline_sim.as_executed(spans, sched, clock="wall").bubble_fraction
        costs = pipeline_sim.action_costs(timed_spans, sched, clock="cpu")     # F, B, I, W per stage
        record["costs"] = {"forward": costs["F"], "backward": costs["B"]}
        record["action_costs"] = costs
        record["bubble_simulated"] = pipeline_sim.simulate(sched, forward=costs["F"], backward=costs["B"],
                                                           backward_input=costs["I"],
                                                           backward_weight=costs["W"]).bubble_fraction
        if kind in ("zb_h1", "zb_v", "dualpipe_v"):    # the schedule's own formula, with this run's F, I, W
            f, i, w = (statistics.median(costs[k]) for k in "FIW")
            record["bubble_formula"] = pipeline_sim.bubble_formula_of(kind, pp, m, f, i, w)
    if args.check:
        record.update({"max_diff": max(p["diff"] for p in parts), "max_grad_diff": max(p["grad_diff"] for p in parts),
                       "max_loss_diff": max(p["loss_diff"] for p in parts)})
    return record


def _bytes_by_tag(log) -> dict:
    """{"pipeline": {...}, "dp gradients": {...}}: this rank's bytes sent in the step, by the label par gave them."""
    out = {}
    for e in log.events:
        part = out.setdefault(e.tag.split("/")[0] or "other", {"bytes_sent": 0, "count": 0})
        part["bytes_sent"] += e.bytes_sent
        part["count"] += 1
    return out


def _with_cpu(rec: Recorder, pipe: Pipeline):
    """The step's spans on rank 0 (None elsewhere), each compute span with its CPU seconds `cpu_s` and the steady
    seconds its rank spent after it before its next action, not waiting, by clock (`after_s`, `Pipeline.after_s`)."""
    spans = rec.gather()
    own = par.runtime.dist.gather_object({"cpu_s": pipe.cpu_s, "after_s": pipe.after_s})
    if spans is None:
        return None
    for s in spans:
        if s["lane"] == "compute":
            for key in ("cpu_s", "after_s"):
                s[key] = own[s["rank"]][key][s["name"]]
    return spans


def main(argv=None):
    args = Args.parse(argv)
    env = par.runtime.dist.init()
    torch.manual_seed(args.seed)
    if env.world_size % args.dp:
        raise SystemExit(f"error: --dp {args.dp} does not divide the {env.world_size} ranks: "
                         f"launch a multiple of {args.dp} ranks")
    if args.dp > 1 and args.schedules != ("1f1b",):
        raise SystemExit("error: --dp > 1 runs 1F1B only: pass --schedules 1f1b")
    if args.model == "square" and args.dp > 1:
        raise SystemExit("error: --model square runs one pipeline: drop --dp")
    cfg = config(args)
    runs = []
    for kind in args.schedules:
        for m in args.microbatches:
            r = run_one(args, cfg, kind, m, env, 0 if args.warmup_once and runs else args.warmup)
            runs.append(r)
            if r is not None:
                bubble = f"bubble measured {r['bubble']:.3f}, " if r.get("bubble") is not None else ""
                formula = f"formula {r['bubble_formula']:.3f}" if r["bubble_formula"] is not None else "no formula"
                print(f"{kind:>11} m={m:<3} step {r['median_step_s'] * 1e3:8.1f} ms   {bubble}{formula}", flush=True)
    par.runtime.dist.save_result({"world_size": env.world_size, "backend": env.backend, "preset": args.preset,
                                  "model": args.model, "config": cfg.to_dict() if args.model == "gpt" else
                                  {"d_model": square_width(args), "n_layer": square_layers(args)}, "runs": runs})
    if dist.is_initialized():
        par.runtime.dist.teardown()


if __name__ == "__main__":
    main()
