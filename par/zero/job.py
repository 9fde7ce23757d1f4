"""Train GPT-lite under ZeRO stages (and offload, and torch FSDP2); report memory, bytes, time, timeline.

    python -m par.zero.job --runs 0,1,2,3,3+offload --preset tiny --steps 20

One launch trains the same model from the same seed once per run in `--runs`
(`S` = stage S, `S+offload` = stage S with the optimizer on the CPU, `3+prefetch` = stage 3
gathering the next unit while this one computes, `fsdp2` = torch's `fully_shard` on the same
units, `par.zero.torch_api.fsdp2`). Each run starts from a clean slate: the previous engine's hooks
are removed and its memory released before the next is built, so a CUDA peak is that run's own.
`--interleave` trains the runs step by step in turn instead (every run's step 1, then every run's step 2, ...):
what else the machine runs then falls on each run alike, which a comparison of their step times needs (every
model is alive at once, so a CUDA peak is the launch's).

Result (the job contract of `par.measure`): {"world_size", "backend", "device", "preset", "precision",
"numel", "runs": [...]}, each run with
    label, stage, offload, prefetch
    losses      the global batch's loss per step (the mean of the ranks' equal shards)
    step_s      per step, the slowest rank's wall-clock seconds; step_steady_s the same on the load-proof clock
                (less each rank's run-queue wait, `par.clock`; on a GPU both are the device's time)
    per_rank    per rank: memory (model-state bytes after backward of step 1, `Zero.memory()`),
                bytes (sent in the last step, by collective), cuda_peak, offload_bytes_per_step
    memory      the rank with the most model-state bytes; formula: `par.memory.accounting.model_state_bytes`
    bytes, bytes_total, bytes_formula   rank 0's last step beside 2(N-1)/N·Ψ·itemsize (3(N-1)/N: stage 3)
    collectives_per_step   how many collectives rank 0 issued in its last step (`collectives_issued`)
    timeline    (`--timeline-runs`) every rank's spans of the last step; such a run records every step, and each
                rank's per_rank entry keeps `parts`: per step its compute, its wait for parameters (the all-gathers
                the computation waited for; `ahead_wait`: those prefetch can start ahead) and the offload copies,
                each {"wall", "steady"} seconds (`step_parts`)
    offload: offload_bytes_per_step, placement, transfer_s_formula (the same bytes over PCIe)
    fsdp2: max_diff_vs_stage3 (max |parameter difference| from the "3" run of the same launch)
`--checkpoint DIR --checkpoint-step K` saves the last run's sharded checkpoint after K steps (and
goes on); `--resume DIR` loads it into every run first and trains the steps after it.
"""
from __future__ import annotations

import gc
from dataclasses import asdict, dataclass

import torch

import par.runtime.dist
from par.comm import commlog
from par.data import CharDataset, global_batches
from par.measure import JobResult, merge_ranks, RankResult, RunResult, timed_step, watch_ranks
from par.memory import accounting as memory
from par.model import build, lm_loss, preset
from par.runtime.job_args import arg, JobArgs
from par.runtime.job_work import Training
from par.timeline import Recorder, seconds
from par.zero import checkpoint, offload, torch_api as torch_zero
from par.zero.engine import Zero, zero_bytes_per_step


@dataclass(frozen=True)
class ZeroRun:
    """One run of the job; its label (`str(run)`, `ZeroRun.parse(label)`) is how a command line names it:
    '2' stage 2; '3+offload', '3+prefetch', '2+bf16' (this run in bf16; or fp16), '3+resume' (load --resume
    first, train the steps after it); 'fsdp2' torch's fully_shard (ZeRO-3)."""
    stage: int
    offload: bool = False
    prefetch: bool = False
    resume: bool = False
    precision: str | None = None     # None: the job's --precision
    fsdp2: bool = False              # torch's ZeRO-3

    @property
    def label(self) -> str:
        """'3+offload', 'fsdp2', ...: what `parse` reads back (the result's "label")."""
        if self.fsdp2:
            return "fsdp2"
        extras = [e for e in ("offload", "prefetch", "resume") if getattr(self, e)]
        return "+".join([str(self.stage), *extras, *([self.precision] if self.precision else [])])

    def __str__(self) -> str:
        return self.label

    @classmethod
    def parse(cls, label: str) -> ZeroRun:
        """The run a label names (ValueError for a label that names none)."""
        if label == "fsdp2":
            return cls(3, fsdp2=True)
        stage, *extras = label.split("+")
        known = {"offload", "prefetch", "resume", "bf16", "fp16"}
        if not stage.isdigit() or int(stage) > 3 or not set(extras) <= known:
            raise ValueError(f"run {label!r}: use a stage 0-3, optionally with +offload, +prefetch, +resume, +bf16 "
                             f"or +fp16 (e.g. 3+offload, 2+bf16), or 'fsdp2'")
        precision = next((e for e in extras if e in ("bf16", "fp16")), None)
        return cls(int(stage), "offload" in extras, "prefetch" in extras, "resume" in extras, precision)


def collectives_issued(events) -> int:
    """Collectives one step issued: a coalesced one (tag "... (every unit)", one message per ring step for all
    units) counts once, every per-unit one once. Each pays the ring's 2(N-1) latency steps α whatever its size;
    the 4-byte overflow flag of mixed precision is left out."""
    coalesced = {e.tag for e in events if "(every unit)" in e.tag}
    return len(coalesced) + sum("(every unit)" not in e.tag and "overflow flag" not in e.tag for e in events)


@dataclass(frozen=True)
class Args(JobArgs):
    runs: tuple[ZeroRun, ...] = arg((ZeroRun(0), ZeroRun(1), ZeroRun(2), ZeroRun(3), ZeroRun(3, offload=True)),
                                "comma-separated: stage, stage+offload, fsdp2 (see `ZeroRun`)")
    preset: str = arg("tiny")
    steps: int = arg(10, minimum=1)
    batch: int = arg(8, "global batch size (a multiple of the world size)")
    optimizer: str = arg("adam")
    lr: float = arg(1e-3)
    impl: str = arg("ring", choices=("ring", "torch"))
    precision: str = arg("fp32", choices=("fp32", "fp16", "bf16"))
    seed: int = arg(0)
    timeline_runs: tuple[ZeroRun, ...] = arg((ZeroRun(3), ZeroRun(3, offload=True)),
                                         "runs whose last step is recorded as a timeline")
    checkpoint: str = arg("", "directory for a sharded checkpoint of the last run")
    checkpoint_step: int = arg(0, "save after this many steps (default: the end)")
    checkpoint_run: ZeroRun | None = arg(None, "the run whose state is saved (default: the last)")
    resume: str = arg("", "the checkpoint the '+resume' runs load (any N_d, any stage)")
    interleave: bool = arg(False, "train the runs step by step in turn, so that the machine's other work falls on "
                                  "each alike (for timing; every run's model is then alive at once)")


@dataclass(frozen=True, kw_only=True)
class RankResult(RankResult):
    """One rank's model-state bytes, bytes sent by collective, CUDA peak and offload traffic."""
    memory: dict
    bytes: dict
    cuda_peak: int | None
    offload_bytes_per_step: dict | None
    parts: list | None = None


@dataclass(frozen=True, kw_only=True)
class RunResult(RunResult):
    """One ZeRO configuration (`ZeroRun`): the quantities of the module's docstring."""
    Rank = RankResult
    label: str
    stage: int
    offload: bool
    prefetch: bool
    precision: str
    start_step: int
    losses: list
    step_s: list
    step_steady_s: list | None = None
    memory: dict
    cuda_peak: int | None
    formula: dict
    bytes: dict
    bytes_total: int
    overflow_flag_bytes: int
    collectives_per_step: object
    bytes_formula: float
    skipped: list | None = None
    offload_bytes_per_step: dict | None = None
    placement: dict | None = None
    timeline: list | None = None
    max_diff_vs_stage3: float | None = None
    transfer_s_formula: float | None = None
    pcie_bytes_per_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class Result(JobResult):
    """The launch: the model and precision, and one run per configuration."""
    Run = RunResult
    device: str
    preset: str
    precision: str
    numel: int
    runs: tuple

def work(args: Args, nproc: int) -> list:
    """What a launch of these arguments computes (the course's dry run costs it): one run per `ZeroRun`, its stage,
    offload and precision."""
    cfg = preset(args.preset)
    return [Training(model=cfg, global_batch=args.batch, dp=nproc, zero_stage=r.stage, offload=r.offload,
                     precision=r.precision or args.precision, optimizer=args.optimizer, steps=args.steps,
                     label=f"ZeRO {r}") for r in args.runs]


class FSDP2Engine:
    """torch FSDP2 behind the same three calls as `Zero` (backward, step, zero_grad)."""

    def __init__(self, model, args):
        self.model = torch_zero.fsdp2(model)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=args.lr)
        self.skipped = 0

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.opt.step()

    def zero_grad(self):
        self.opt.zero_grad(set_to_none=True)

    def memory(self):
        return torch_zero.model_state_bytes(self.model, self.opt)

    def close(self):
        pass


COPIES = ("grads to host", "params to device")     # offload's two copies (`par.zero.updaters.CPUOffload`)


def step_parts(spans: list[dict], rank: int, prefetch: bool) -> dict:
    """One recorded step of `rank`, each part on both clocks ({"wall": s, "steady": s}, `par.timeline.seconds`):
    compute (forward, backward and update spans); the wait for parameters, that is the all-gathers the computation
    waited for (without prefetch the gathers themselves, which it runs; with prefetch its "wait AG ..." spans, what
    was left of each gather when its unit needed it); of those, the ones prefetch can start ahead (`ahead_wait`:
    every gather but the first of the forward and the first of the backward, before which nothing computes); and
    the offload copies."""
    mine = sorted((s for s in spans if s["rank"] == rank), key=lambda s: s["start"])
    gathers = [s for s in mine if s["name"].startswith("wait AG " if prefetch else "AG ")]
    forward_end = max((s["end"] for s in mine if s["name"].startswith("F ")), default=float("inf"))
    forward = [s for s in gathers if s["start"] < forward_end]
    backward = [s for s in gathers if s["start"] >= forward_end]
    picks = {"compute": [s for s in mine if s["lane"] == "compute" and not s["name"].startswith("wait ")],
             "parameter_wait": gathers, "ahead_wait": forward[1:] + backward[1:],
             "copies": [s for s in mine if s["name"] in COPIES]}
    return {part: {clock_: sum(seconds(s, clock_) for s in chosen) for clock_ in ("wall", "steady")}
            for part, chosen in picks.items()}


def release(device) -> None:
    """Free what the previous run left (its engine must be closed and dropped) and restart the CUDA peak."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    memory.reset_cuda_peak(device)


def train_run(run: ZeroRun, args: Args, env, batches, finals: dict):
    """One run on this rank, a step at a time: a generator that yields after each step and returns this rank's
    numbers (rank 0 merges them) when its steps are done (`run_all` drives it)."""
    release(env.device)
    model = build(preset(args.preset), seed=args.seed).to(env.device)
    rec = Recorder() if run in args.timeline_runs else None
    if run.fsdp2:
        engine = FSDP2Engine(model, args)
    else:
        engine = Zero(model, stage=run.stage, optimizer=args.optimizer, lr=args.lr, offload=run.offload,
                      impl=args.impl, recorder=rec, precision=run.precision or args.precision, prefetch=run.prefetch)
    start = checkpoint.load(engine, args.resume)["step"] if run.resume else 0
    n, r = env.world_size, env.rank
    losses, times, steady, parts, mem, step_bytes = [], [], [], [], {}, {}
    for s in range(start, len(batches)):
        x, y = batches[s]
        x, y = x[r::n].to(env.device), y[r::n].to(env.device)
        if rec is not None:
            rec.reset()      # a barrier: the ranks start the step, and the recorder's clock, together
        waited = getattr(engine, "waited", 0.0)
        with timed_step(env.device, barrier=True) as clock, commlog.capture() as log:
            loss = lm_loss(engine.model(x).float(), y)
            engine.backward(loss)
            if s == start + min(1, len(batches) - start - 1):
                mem = engine.memory()    # model states at their peak: grads reduced, optimizer state allocated
            engine.step()
            engine.zero_grad()
        times.append(clock.seconds)
        if env.device.type != "cuda":      # the run-queue wait of what the step waited for (comm thread, ranks)
            clock.waited_s = getattr(engine, "waited", 0.0) - waited
        steady.append(clock.steady_s)
        losses.append(loss.item())
        if rec is not None:
            parts.append(step_parts([asdict(x) for x in rec.spans], r, run.prefetch))
        step_bytes, calls = {}, collectives_issued(log.events)
        for e in log.events:   # the model's traffic; the 4-byte overflow flag of mixed precision is apart
            key = "overflow flag" if "overflow flag" in e.tag else e.kind
            step_bytes[key] = step_bytes.get(key, 0) + e.bytes_sent
        if args.checkpoint and run == (args.checkpoint_run or args.runs[-1]) and \
                s + 1 == (args.checkpoint_step or len(batches)):
            checkpoint.save(engine, args.checkpoint, step=s + 1)
        yield
    out = {"losses": losses, "times": times, "steady": steady, "memory": mem,
           "cuda_peak": memory.cuda_peak_bytes(env.device),
           "bytes": step_bytes, "calls": calls, "start_step": start}
    if rec is not None:     # the last step only: before the full-state gathers below, which are no part of it
        out["timeline"], out["parts"] = rec.gather(), parts
    if run == ZeroRun(3) and any(r.fsdp2 for r in args.runs):
        finals["3"] = engine.full_state_dict()
    if run.fsdp2:
        full = torch_zero.full_parameters(engine.model)
        if "3" in finals:
            out["max_diff_vs_stage3"] = max((full[k] - v).abs().max().item() for k, v in finals["3"].items())
    else:
        out["skipped"] = engine.skipped
        if run.offload:
            steps = len(losses)
            out["offload_bytes_per_step"] = {"to_host": engine.updater.to_host_bytes / steps,
                                             "to_device": engine.updater.to_device_bytes / steps}
            out["placement"] = engine.updater.placement()
    engine.close()          # the hooks point back at the engine: without this the next run's peak includes it
    del engine, model
    return out


def run_all(args: Args, env, batches) -> list[dict]:
    """Every run of `args.runs` on this rank, its numbers in order: one run after the other, or with
    `args.interleave` step by step in turn (each run's step 1, then each run's step 2, ...), so that whatever
    else the machine runs falls on every run alike (a timing comparison's runs)."""
    finals: dict = {}
    if not args.interleave:
        return [_finish(train_run(run, args, env, batches, finals)) for run in args.runs]
    runs = [train_run(run, args, env, batches, finals) for run in args.runs]
    out: list = [None] * len(runs)
    while any(o is None for o in out):
        for i, run in enumerate(runs):
            if out[i] is None:
                try:
                    next(run)
                except StopIteration as done:
                    out[i] = done.value
    return out


def _finish(run) -> dict:
    """Drive a run (`train_run`) through all its steps; its numbers."""
    while True:
        try:
            next(run)
        except StopIteration as done:
            return done.value


def merge(run: ZeroRun, ranks: list[dict], args: Args, n: int, numel: int) -> dict:
    """Rank 0: one run's result from every rank's numbers."""
    mine = ranks[0]
    precision = run.precision or args.precision
    itemsize = 4 if precision == "fp32" else 2
    worst = max(ranks, key=lambda r: r["memory"].get("model_states", 0))
    flag_bytes = mine["bytes"].pop("overflow flag", 0)
    out = {"label": run.label, "stage": run.stage, "offload": run.offload, "prefetch": run.prefetch,
           "precision": precision, "start_step": mine["start_step"],
           **merge_ranks(ranks, step_s="times"), "step_steady_s": merge_ranks(ranks, step_s="steady")["step_s"],
           "per_rank": [{k: r.get(k) for k in ("memory", "bytes", "cuda_peak", "offload_bytes_per_step", "parts")
                         if k != "parts" or "parts" in r} for r in ranks],
           "memory": worst["memory"], "cuda_peak": max((r["cuda_peak"] or 0) for r in ranks) or None,
           "formula": memory.model_state_bytes(numel, n, run.stage, "fp32" if precision == "fp32" else "mixed",
                                               args.optimizer).to_dict(),
           "bytes": mine["bytes"], "bytes_total": sum(mine["bytes"].values()), "overflow_flag_bytes": flag_bytes,
           "collectives_per_step": mine["calls"],
           "bytes_formula": zero_bytes_per_step(numel, n, run.stage, 1, itemsize)}
    for k in ("skipped", "offload_bytes_per_step", "placement", "timeline", "max_diff_vs_stage3"):
        if k in mine:
            out[k] = mine[k]
    if run.offload:
        out["transfer_s_formula"] = offload.transfer_seconds(numel, n, itemsize, itemsize)
        out["pcie_bytes_per_s"] = offload.PCIE_BYTES_PER_S
    return out


def main(argv=None) -> None:
    args = Args.parse(argv)
    if args.checkpoint:
        checkpoint.check_directory(args.checkpoint)   # a read-only folder refused before the training, not after
    env = par.runtime.dist.init()
    watch_ranks()      # a step's steady seconds count the other ranks' run-queue wait while it waited for them
    if args.batch % env.world_size:
        raise SystemExit(f"--batch {args.batch} is not a multiple of the world size {env.world_size}: "
                         f"use e.g. --batch {env.world_size * max(1, args.batch // env.world_size)}")
    for run in args.runs:
        if run.resume and not args.resume:
            raise SystemExit(f"run {run.label!r} resumes: pass --resume DIR (a checkpoint saved with --checkpoint)")
        if run.fsdp2 and args.precision != "fp32":
            raise SystemExit("the fsdp2 run compares fp32 training: use --precision fp32 or drop fsdp2 from --runs")
    cfg = preset(args.preset)
    data = CharDataset(block_size=cfg.block_size)
    batches = list(global_batches(data, args.batch, args.steps, seed=args.seed))
    numel = memory.param_count(cfg)
    runs = []
    for run, mine in zip(args.runs, run_all(args, env, batches)):
        ranks = par.runtime.dist.gather_object(mine)
        if env.is_rank0:
            runs.append(merge(run, ranks, args, env.world_size, numel))
    par.runtime.dist.save_result({"world_size": env.world_size, "backend": env.backend, "device": str(env.device),
                                  "preset": args.preset, "precision": args.precision, "numel": numel, "runs": runs})
    par.runtime.dist.teardown()


if __name__ == "__main__":
    main()
