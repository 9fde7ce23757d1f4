"""The course's launches as data, and the dry run that checks a GPU batch before any GPU is rented.

Every job a lecture notebook starts is one `Launch`: the module, the number of ranks, the job's
typed arguments (its `Args`, e.g. `par.dp.job.Args`: a notebook reads `job.args.batch`), the
backend, the timeout, and what it computes (`Training` runs in the planner's terms, or `Collectives`),
derived from those arguments (`work`). `launches(notebook, world_size, backend, preset, steps)` gives a
notebook's launches as a pure function of the batch's four parameters, so the notebook can run
exactly those (`launch.run()`), and the dry run checks exactly what will run.

`dry_run(world_size, backend, preset, steps, gpu_memory)` checks every launch of every notebook
for a server of `world_size` GPUs with `gpu_memory` bytes each, without touching a GPU:

    layout   the degrees divide what they split (heads and width for tp, the layer list for pp,
             the batch for dp × micro-batches: `par.train.planner.predict`), and a launch under NCCL
             asks for at most `world_size` ranks (one GPU each)
    memory   predicted bytes per GPU at the peak (`par.train.planner`: model states by ZeRO stage +
             activations, plus a single-process reference kept beside) <= gpu_memory
    time     predicted seconds = STARTUP_S + Σ steps × (planner step time + per-layer overhead)
             <= the launch's timeout <= the batch's cell timeout; the launches of one cell
             together <= the cell timeout
    kernel   what a notebook computes in its own process (`KernelWork`: demos, one-process
             references; `kernel_work(notebook, ...)`, `in_kernel(notebook, cell, ...)`), sized by the
             same four parameters to at most KERNEL_MEMORY or skipped with the reason: its predicted
             bytes <= gpu_memory (on GPU 0) or <= host_memory (on the host)

Timeouts scale with the work: `scaled_timeout(work, backend)` is SAFETY × the time predicted on
a deliberately slow reference device (fp32 without TF32 on a GPU, a few GFLOP/s on a CPU) plus
the start-up, never below MIN_TIMEOUT_S. The batch's cell timeout for a notebook
(`notebook_timeout`) is then the largest cell's launch timeouts added up, plus NOTEBOOK_S, at
least CELL_TIMEOUT_S: a launch's own timeout (which names the ranks that hang) always fires first.

The predictions are the planner's formulas; they are upper-bound estimates for a go/no-go
check, not a benchmark (the planner ignores latency and overlaps nothing).
"""
from __future__ import annotations

import functools
import math
import shlex
from dataclasses import dataclass, field, fields, replace

from par.comm import job as comm_job
from par.cp import job as cp_job
from par.dp import job as dp_job
from par.memory import job as memory_job
from par.moe import job as moe_job
from par.pp import job as pp_job, vs_torch_job
from par.precision import job as precision_job
from par.runtime.job_args import JobArgs
from par.tp import job as tp_job
from par.train import planner, job as train_job
from par.zero import job as zero_job, activations_job
from par.memory.accounting import format_bytes
from par.model import GPTConfig, preset as model_preset
from par.tp.layers import tp_degree   # noqa: F401  (the one home of the rule; re-exported)

CELL_TIMEOUT_S = 600.0      # the batch's cell timeout for a notebook that launches little
NOTEBOOK_S = 60.0           # what a cell does besides its launches (plots, small computations)
STARTUP_S = 30.0            # torchrun, imports, process group (NCCL communicators), CUDA context
SAFETY = 3.0                # a timeout is this many times the predicted time (plus the start-up)
MIN_TIMEOUT_S = 300.0
FP32_FLOPS = 15e12          # achieved fp32 matmul FLOP/s of an A100 without TF32 (19.5 peak): the slow case
OVERHEAD_S = {"gpu": 1e-3, "cpu": 2e-3}   # seconds per layer and micro-batch the FLOP count misses (launches)
CPU = planner.HARDWARE["cpu"]


class CourseError(ValueError):
    """A notebook or launch the registry does not know."""


def gpu(memory: float = math.inf, gpus_per_node: int = 8) -> planner.Hardware:
    """The GPU the dry run imagines: the planner's A100 links and bf16 FLOP/s, `memory` bytes."""
    return replace(planner.Hardware(), name="GPU", memory=memory, gpus_per_node=gpus_per_node)


# ---------------------------------------------------------------- what a launch computes
@dataclass(frozen=True)
class Training:
    """A training run in the planner's terms: model, global batch, layout, precision, steps.

    `reference_batch` > 0: every rank also trains the single-process model on that many sequences
    at once (a correctness check), kept in memory beside the parallel model."""
    model: object                    # par.model.GPTConfig
    global_batch: int
    dp: int = 1
    pp: int = 1
    tp: int = 1
    zero_stage: int = 0
    offload: bool = False
    microbatches: int = 1
    precision: str = "fp32"          # fp32 | fp16 | bf16
    optimizer: str = "adam"
    steps: int = 1
    reference_batch: int = 0
    label: str = ""

    def workload(self, batch: int | None = None, precision: str | None = None) -> planner.Workload:
        p = precision or self.precision
        return planner.Workload(self.model, batch or self.global_batch, "fp32" if p == "fp32" else "mixed",
                                self.optimizer)

    def hardware(self, hw: planner.Hardware, precision: str | None = None) -> planner.Hardware:
        fp32 = (precision or self.precision) == "fp32" and hw.name != CPU.name
        return replace(hw, flops=min(hw.flops, FP32_FLOPS)) if fp32 else hw

    def plan(self, hw: planner.Hardware) -> planner.Plan:
        return planner.predict(self.workload(), self.dp, self.pp, self.tp, self.zero_stage, self.microbatches,
                               self.hardware(hw), self.offload)

    def reference_plan(self, hw: planner.Hardware) -> planner.Plan | None:
        if not self.reference_batch:
            return None
        return planner.predict(self.workload(self.reference_batch, "fp32"), 1, 1, 1, 0, 1,
                               self.hardware(hw, "fp32"))

    def problems(self, hw: planner.Hardware) -> list[str]:
        plan = self.plan(hw)
        return [] if plan.valid else [plan.reason]

    def memory(self, hw: planner.Hardware) -> float:
        """Bytes per device at the peak: the parallel run's, plus the reference's kept beside it
        (NaN for a layout that cannot run: see `problems`)."""
        plan, ref = self.plan(hw), self.reference_plan(hw)
        if not plan.valid:
            return math.nan
        return plan.memory["total"] + (ref.memory["total"] if ref else 0.0)

    def seconds(self, hw: planner.Hardware) -> float:
        """steps × (planner step time + OVERHEAD per layer and micro-batch), the reference's steps too."""
        kind = "cpu" if hw.name == CPU.name else "gpu"
        layers = self.model.n_layer + 2
        if not self.plan(hw).valid:
            return math.nan
        per_step = self.plan(hw).time["total"] + OVERHEAD_S[kind] * layers * self.microbatches / self.pp
        ref = self.reference_plan(hw)
        if ref:
            per_step += ref.time["total"] + OVERHEAD_S[kind] * layers
        return self.steps * per_step

    def describe(self) -> str:
        from par.runtime.grid import layout_label
        layout = layout_label(self.dp, self.pp, self.tp) + (f" ZeRO-{self.zero_stage}" if self.zero_stage else "")
        return f"{self.label or 'training'} ({layout}, {self.precision}, batch {self.global_batch})"


@dataclass(frozen=True)
class Collectives:
    """Collectives timed on tensors of `numels` float32 elements, `rounds` times each (ring and torch)."""
    numels: tuple
    rounds: int
    label: str = "collectives"

    def problems(self, hw) -> list[str]:
        return []

    def memory(self, hw) -> float:
        return 4 * 4 * max(self.numels)        # the tensor, a copy, the ring's receive buffer, torch's

    def seconds(self, hw) -> float:
        bw = hw.bw_node if hw.name != CPU.name else CPU.bw_node
        return sum(2 * self.rounds * (2 * 4 * n / bw + 1e-3) for n in self.numels)

    def describe(self) -> str:
        return self.label


@dataclass(frozen=True)
class Launch:
    """One `par.runtime.launch.run` a notebook makes: the job's module and its typed arguments (`args`, the
    job's `Args`: `job.args.batch`), the ranks, backend and timeout, and what it computes (`work`, in order)."""
    notebook: str
    cell: str                        # which part of the notebook (the launches of one cell share it)
    module: str
    nproc: int
    args: JobArgs
    backend: str
    timeout: float
    work: tuple = field(default_factory=tuple)

    def run(self, show: bool = True, **kwargs):
        """Run it: `par.runtime.launch.run` with exactly these parameters (quiet=..., env=... pass through).
        `show`: first print the one-line command (what a student would type), so the notebook says what runs.
        Returns rank 0's result parsed once into the typed `par.measure.JobResult` (`result.runs[0].losses`)."""
        from par.measure import parse
        from par.runtime.launch import run
        if show:
            print(f"$ {self.command()}")
        return parse(run(self.module, nproc=self.nproc, args=self.args.to_argv(), backend=self.backend,
                         timeout=self.timeout, **kwargs))

    def command(self) -> str:
        """The launch as a shell command: `torchrun --nproc-per-node=N -m module args...`."""
        return shlex.join(["torchrun", f"--nproc-per-node={self.nproc}", "-m", self.module, *self.args.to_argv()])

    def with_args(self, **changes) -> Launch:
        """The launch with some arguments changed (e.g. `with_args(dtype=("fp32", "fp16"))` on a GPU without bf16)."""
        return replace(self, args=replace(self.args, **changes))

    def fill(self, **values) -> Launch:
        """The launch with `{name}` placeholders in its text arguments filled in (e.g. a temporary directory)."""
        text = {f.name: getattr(self.args, f.name) for f in fields(self.args)}
        return self.with_args(**{k: v.format(**values) for k, v in text.items() if isinstance(v, str) and "{" in v})

    def name(self) -> str:
        return f"{self.notebook} [{self.cell}] {self.module} on {self.nproc} rank{'s' if self.nproc > 1 else ''}"


def on_gpus(backend: str, world_size: int) -> bool:
    """Whether the launches run on GPUs: "nccl", or "auto" where this machine has a GPU per rank."""
    if backend != "auto":
        return backend == "nccl"
    from par.runtime.preflight import choose_backend
    return choose_backend(world_size, "auto") == "nccl"


def scaled_timeout(work, backend: str, nproc: int = 1) -> float:
    """SAFETY × (time on the slow reference device) + STARTUP_S, at least MIN_TIMEOUT_S, in whole minutes."""
    hw = gpu() if on_gpus(backend, nproc) else CPU
    predicted = sum(0.0 if math.isnan(s) else s for s in (w.seconds(hw) for w in work))
    return float(max(MIN_TIMEOUT_S, 60 * math.ceil((SAFETY * predicted + STARTUP_S) / 60)))


def launch(notebook, cell, nproc, args: JobArgs, backend, timeout=None) -> Launch:
    """A Launch of the job whose `Args` `args` are: its work derived from them (`work`), its timeout scaled
    with that work (unless given)."""
    done = tuple(work(args, nproc))
    return Launch(notebook, cell, type(args).__module__, nproc, args, backend,
                  timeout if timeout is not None else scaled_timeout(done, backend, nproc), done)


# ---------------------------------------------------------------- what a job's arguments compute
@functools.singledispatch
def work(args: JobArgs, nproc: int) -> list:
    """What a launch of `args` on `nproc` ranks computes, in the planner's terms: one entry per run of the job."""
    raise CourseError(f"no work known for the arguments of {type(args).__module__}")


@work.register
def collectives_work(args: comm_job.Args, nproc: int) -> list:
    """The counted sizes and the timed ones, `warmup + reps` times each (ring and torch)."""
    counted = args.bytes_sizes if "bytes" in args.parts else ()
    return [Collectives((*counted, *(args.sizes if "timing" in args.parts else ())), args.reps + args.warmup)]


@work.register
def memory_work(args: memory_job.Args, nproc: int) -> list:
    """One data-parallel run per precision × optimizer, `batch` sequences per rank."""
    cfg = model_preset(args.preset)
    return [Training(cfg, args.batch * nproc, dp=nproc, precision=p, optimizer=o, steps=args.steps, label=f"{p} {o}")
            for p in args.precisions for o in args.optimizers]


@work.register
def dp_work(args: dp_job.Args, nproc: int) -> list:
    """One run per --dp × --compression: the global batch, in micro-batches of --micro-batch where given."""
    cfg = model_preset(args.preset, tie_embeddings=args.tie_embeddings)
    accum = args.accum or (args.batch // (args.micro_batch * nproc) if args.micro_batch else 1)
    return [Training(cfg, args.batch, dp=nproc, microbatches=accum, optimizer=args.optimizer, steps=args.steps,
                     label=f"{v}, {c}") for v in args.dp for c in args.compression]


@work.register
def pipeline_work(args: pp_job.Args, nproc: int) -> list:
    """One run per schedule × m on dp replicas of a pipeline of nproc / dp stages, after `warmup` steps; the
    single-process reference of the same batch beside (--check)."""
    cfg = pp_job.config(args) if args.model == "gpt" else square_in_gpt_terms(args, nproc)
    rows_per_sequence = 1 if args.model == "gpt" else cfg.block_size
    out = []
    for schedule in args.schedules:
        for m in args.microbatches:
            batch = -(-(args.batch or args.dp * m * args.micro_batch_size) // rows_per_sequence)
            out.append(Training(cfg, batch, dp=args.dp, pp=nproc // args.dp, microbatches=m,
                                steps=args.steps + args.warmup, reference_batch=batch if args.check else 0,
                                label=f"{schedule} m={m}"))
    return out


def square_in_gpt_terms(args: pp_job.Args, nproc: int) -> GPTConfig:
    """`par.pp.job --model square` for the planner: L square layers of width d hold L·d² weights and cost
    6·L·d² FLOPs per row, those of L/12 GPT blocks of width d (12·d² weights each), a row a token (the planner's
    shortest sequence: 2 tokens, so 2 rows); the planner's activations per block bound a square layer's from
    above. At least a block per stage."""
    width, layers = pp_job.square_width(args), pp_job.square_layers(args)
    return GPTConfig(vocab_size=2, block_size=2, n_layer=max(nproc, math.ceil(layers / 12)), n_head=1, d_model=width)


@work.register
def torch_pipeline_work(args: vs_torch_job.Args, nproc: int) -> list:
    """The same pipeline under par's runtime and torch's."""
    cfg = model_preset(args.preset, **({"n_layer": args.n_layer} if args.n_layer else {}))
    one = Training(cfg, args.microbatches * args.micro_batch_size, pp=nproc, microbatches=args.microbatches,
                   steps=args.steps, label=f"{args.schedule} m={args.microbatches}")
    return [one, replace(one, label=f"torch {one.label}")]


@work.register
def tp_work(args: tp_job.Args, nproc: int) -> list:
    """TP training on nproc ranks, the dense model trained beside (unless --no-reference)."""
    sizes = {k: v for k, v in (("n_head", args.n_head), ("d_model", args.d_model)) if v is not None}
    one = Training(model_preset(args.preset, **sizes), args.batch_size, tp=nproc, optimizer=args.optimizer,
                   steps=args.steps, reference_batch=0 if args.no_reference else args.batch_size, label=f"TP {nproc}")
    # --torch-api: par's TP and torch's DTensor TP trained side by side for a few steps
    return [one] + ([replace(one, steps=2 * args.torch_api, reference_batch=0, label=f"TP {nproc}: par and DTensor")]
                    if args.torch_api else [])


@work.register
def precision_work(args: precision_job.Args, nproc: int) -> list:
    """One data-parallel run per dtype."""
    cfg = model_preset(args.preset)
    return [Training(cfg, args.batch, dp=nproc, precision=d, optimizer=args.optimizer, steps=args.steps, label=d)
            for d in args.dtype]


@work.register
def zero_work(args: zero_job.Args, nproc: int) -> list:
    """One run per `ZeroRun`: its stage, offload and precision."""
    cfg = model_preset(args.preset)
    return [Training(cfg, args.batch, dp=nproc, zero_stage=r.stage, offload=r.offload,
                     precision=r.precision or args.precision, optimizer=args.optimizer, steps=args.steps,
                     label=f"ZeRO {r}") for r in args.runs]


@work.register
def zero_r_work(args: activations_job.Args, nproc: int) -> list:
    """One TP step whose activations are measured."""
    return [Training(model_preset(args.preset), args.batch, tp=nproc, steps=1, label="ZeRO-R activations")]


@work.register
def config_work(args: train_job.Args, nproc: int) -> list:
    """One run per config, as `par.train.config` parses it for nproc ranks."""
    from par.train.config import model_config, parse, read
    out = []
    for source in args.config:
        tc = parse(read(source), nproc)
        out.append(Training(model_config(tc), tc.train_batch_size, dp=tc.dp, pp=tc.pp, tp=tc.tp,
                            zero_stage=tc.zero_stage, offload=tc.offload, microbatches=tc.grad_accum,
                            precision=tc.precision, optimizer=tc.optimizer,
                            steps=tc.steps if args.steps is None else args.steps, label=tc.strategy))
    return out


@work.register
def context_parallel_work(args: cp_job.Args, nproc: int) -> list:
    """TP+SP and CP training (and a timeline) beside the dense model: costed as three TP trainings with the dense
    reference (the planner's TP activations bound TP+SP's and CP's)."""
    return [Training(model_preset(args.preset), args.batch_size, tp=nproc, steps=3 * args.steps,
                     reference_batch=args.batch_size, label=f"TP+SP and CP on {nproc}")]


@work.register
def moe_work(args: moe_job.Args, nproc: int) -> list:
    """One run per alpha. The planner has no MoE: a dense model whose FFN holds the experts a rank keeps (a
    go/no-go estimate), the single-process reference beside (--check)."""
    cfg = model_preset(args.preset)
    held = replace(cfg, d_ff=cfg.ffn * max(args.k, math.ceil(args.experts / (args.ep or nproc))))
    batch = args.batch * nproc
    return [Training(held, batch, dp=nproc, steps=args.steps, reference_batch=batch if args.check else 0,
                     label=f"alpha {a}") for a in args.alphas]


# ---------------------------------------------------------------- the registry: one function per notebook
def per_rank_batch(cfg, small: int) -> int:
    """Sequences per rank: `small` for a short context (tiny, small); 1 for a long one (gpt3-small's 2048)."""
    return small if cfg.block_size <= 256 else 1


def world_sizes(candidates, world_size: int, backend: str) -> list[int]:
    """Extra world sizes a notebook sweeps: any on CPU ranks; on GPUs only those the server has."""
    return sorted(n for n in set(candidates) if not on_gpus(backend, world_size) or n <= world_size)


def cores() -> int:
    from par.runtime.preflight import physical_cores
    return physical_cores()


# Lecture 00: the ring all-reduce on `world_size` ranks, then the same job on 2, 3 and 4 ranks.
COLLECTIVE_SIZES = (64, 1024, 16384, 1 << 18, 1 << 20, 1 << 22)   # float32 elements timed: 256 B to 16 MB
COUNTED_SIZES = (1, 5, 7, 1001, 4096, 65536)                      # bytes counted, uneven chunks included
SWEEP_NUMEL = 4096                                                # bytes counted on every world size


def ring_step_sizes(sizes=COLLECTIVE_SIZES, ranks=(2, 3, 4)) -> tuple[int, ...]:
    """The chunks (elements) a ring of N ranks sends per step for every timed size S: ceil(S/N), so that
    `ring_time_from_steps` can simulate N = 3 and 4 from steps measured on the ranks there are cores for."""
    return tuple(sorted({-(-s // n) for s in sizes for n in ranks}))


def launches_00(W, backend, preset, steps):
    """Lecture 00. On one rank (a one-GPU server) no "show": every collective of one rank is the identity, and
    its send/recv around the ring would have no neighbour but the rank itself (the notebook says so)."""
    nb = "00_distributed_basics"
    out = [launch(nb, "collectives", W, comm_job.Args(
        parts=("env", "show", "trace", "bytes", "timing", "steps") if W > 1 else ("env", "trace", "bytes", "timing"),
        sizes=COLLECTIVE_SIZES, bytes_sizes=COUNTED_SIZES, reps=9, warmup=2, step_sizes=ring_step_sizes()),
        backend)]
    gpus = on_gpus(backend, W)
    for n in world_sizes({2, 3, 4}, W, backend):
        if n != W:          # timings only where each rank has a core (or GPU) of its own, else the latency point
            timed = COLLECTIVE_SIZES if gpus or n <= cores() else (64,)
            out.append(launch(nb, "world-size sweep", n, comm_job.Args(
                parts=("trace", "bytes", "timing") if n == 4 else ("bytes", "timing"), bytes_sizes=(SWEEP_NUMEL,),
                reps=9, warmup=2, sizes=timed), backend))
    return out


def launches_01(W, backend, preset, steps):
    b = per_rank_batch(model_preset(preset), 8)
    return [launch("01_memory", "measured model states", W, memory_job.Args(
        preset=preset, steps=steps, optimizers=("adam", "momentum", "sgd"), precisions=("fp32", "bf16"), batch=b),
                   backend)]


def bucket_kb(cfg) -> float:
    """A bucket cap of a quarter of the fp32 gradients (about 4 buckets, whatever the model), in KiB."""
    from par.memory.accounting import param_count
    return round(max(1.0, 4 * param_count(cfg) / 4 / 1024), 1)


def launches_02(W, backend, preset, steps):
    nb, cfg = "02_data_parallel", model_preset(preset)
    from par.memory.accounting import param_count
    gpus = on_gpus(backend, W)
    long = cfg.block_size > 256
    batch = 2 * W if long else 32                    # the global batch of every run
    micro = 1 if long else None                      # a long context trains micro-batches of one sequence
    # the timeline: a model large enough that backward outlasts the all-reduces, one core (or GPU) per rank
    timed_preset = preset if param_count(cfg) >= param_count(model_preset("small")) else "small"
    timed_ranks = W if gpus else min(W, cores())
    timeline_steps = max(4, steps // 5)              # the third step is drawn; the median of all is printed
    out = [launch(nb, "bucketed timeline", timed_ranks, dp_job.Args(
        dp=("naive", "bucketed"), impl="ring", bucket_kb=bucket_kb(model_preset(timed_preset)), preset=timed_preset,
        steps=timeline_steps, batch=batch, micro_batch=micro), backend)]
    out.append(launch(nb, "torch DDP", W, dp_job.Args(
        dp=("bucketed", "ddp"), impl="ring", bucket_kb=bucket_kb(cfg), preset=preset, steps=steps, batch=batch,
        micro_batch=micro, compare=True, profile_dir="{trace_dir}"), backend))   # the notebook fills in a folder
    for n in world_sizes({1, 2, 4}, W, backend):
        if n != W and batch % n == 0:    # the same micro-batches on every world size: the same losses
            out.append(launch(nb, "loss curves", n, dp_job.Args(
                dp=("none",) if n == 1 else ("bucketed",), impl="torch", preset=preset, steps=steps, batch=batch,
                micro_batch=micro or batch // max(n, W)), backend))
    out.append(launch(nb, "compression", W, dp_job.Args(
        dp=("bucketed",), impl="torch", bucket_kb=bucket_kb(cfg), preset=preset, steps=steps, batch=batch,
        micro_batch=micro, compression=("none", "topk", "randomk", "int8"), ratio=0.05), backend))
    return out


@dataclass(frozen=True)
class PipelineSetup:
    """Lecture 03's experiments, chosen from the batch's parameters (`pipeline_setup`)."""
    on_gpu: bool           # one GPU per rank; else CPU ranks on gloo
    backend: str           # what the timed launches use
    processors: int        # GPUs, or physical CPU cores: timing needs one per rank
    p_time: int            # ranks of the timed experiments (bubble vs m, fixed batch, torch)
    p_chart: int           # ranks of the Gantt charts
    timed_steps: int       # timed steps per launched run (the median is reported)
    time_cfg: object       # identical blocks: the bubble formula's equal stages
    chart_cfg: object
    trade_cfg: object
    time_mbs: int          # sequences per micro-batch
    chart_mbs: int
    trade_batch: int       # the fixed batch of the step-time trade-off
    square: tuple          # zero-bubble timing (`par.pp.job --model square`): width, rows per micro-batch, layers per stage

    @property
    def chart_timed(self) -> bool:
        """Whether the chart's ranks each have a processor (else their wall clock times the waiting for one)."""
        return self.p_chart <= self.processors


def pipeline_setup(W, backend, preset, steps) -> PipelineSetup:
    """Stages whose actions last far longer than the overhead around them (Python between actions, a
    message each way): identical blocks, a 65-symbol vocabulary (embedding and head cost next to nothing),
    2 or 4 blocks per stage. GPUs: GPT-3 Small's width, one stage per GPU. CPU: one thread per rank,
    width 256 on 12 sequences of 64 tokens (tens of ms per action), the chart on 4 cheap ranks.
    The zero-bubble schedules are timed on the square stack (F = I = W, their formulas' assumption): 12 layers
    of width 1024 per stage on 256 rows on a CPU (about 70 ms per action on a core; F, I and W measured equal).
    The waits of a blocking send put the measurement above the formula: the largest gap over 1F1B, ZB-H1 and ZB-V
    was 0.037, 0.027 and 0.035 in three runs (the median of 5 steps); 8 layers gave up to 0.06, 16 no better for
    40 s more. On a GPU, 8 layers of 4096 on 2048 rows."""
    gpus = on_gpus(backend, W)
    processors = W if gpus else cores()
    p_time = W if gpus else max(2, min(W, processors))
    p_chart = p_time if gpus else 4
    if gpus:
        time_cfg = model_preset("gpt3-small", vocab_size=65, block_size=1024, n_layer=4 * p_time)
        chart_cfg = model_preset("gpt3-small", vocab_size=65, block_size=1024, n_layer=4 * p_chart)
        trade_cfg, sizes = time_cfg, (8, 2, 32)
    else:
        time_cfg = model_preset("small", d_model=256, n_head=8, n_layer=2 * p_time)
        chart_cfg = model_preset("small", n_layer=p_chart)
        trade_cfg, sizes = model_preset("small", block_size=32, n_layer=2 * p_time), (12, 2, 32)
    return PipelineSetup(gpus, backend if gpus else "gloo", processors, p_time, p_chart,
                         max(2, min(3, steps // 6)), time_cfg, chart_cfg, trade_cfg, *sizes,
                         (4096, 2048, 8) if gpus else (1024, 256, 12))


def model_args(c) -> dict:
    """The arguments that give `par.pp.job` the GPT-lite configuration `c` (every size of 'tiny' overridden)."""
    return dict(preset="tiny", vocab_size=c.vocab_size, d_model=c.d_model, n_head=c.n_head, block_size=c.block_size,
                n_layer=c.n_layer)


def launches_03(W, backend, preset, steps):
    nb, cfg, s = "03_pipelines", model_preset(preset), pipeline_setup(W, backend, preset, steps)
    m_chart, ms = 2 * s.p_chart, (1, 2, 4, 8, 16)
    check = s.chart_cfg.block_size <= 256     # a single-process reference of a long-context model would not fit
    out = [launch(nb, "gantt", s.p_chart, pp_job.Args(
        schedules=("gpipe", "1f1b"), microbatches=(m_chart,), **model_args(s.chart_cfg),
        micro_batch_size=s.chart_mbs, check=check, steps=1, profile_dir="{trace_dir}"), s.backend)]  # filled by 03
    out.append(launch(nb, "bubble vs m", s.p_time, pp_job.Args(
        schedules=("1f1b",), microbatches=ms, **model_args(s.time_cfg), micro_batch_size=s.time_mbs,
        warmup_once=True, record_comm=True, steps=s.timed_steps), s.backend))
    width, rows, per_stage = s.square
    out.append(launch(nb, "zero bubble measured", s.p_time, pp_job.Args(     # section 11: F = I = W, executed
        model="square", schedules=("1f1b", "zb_h1", "zb_v"), microbatches=tuple(m for m in ms if m >= max(4, s.p_time)),
        d_model=width, n_layer=per_stage * s.p_time, micro_batch_size=rows, partition="uniform", warmup_once=True,
        steps=s.timed_steps + 2), s.backend))     # two more steps for the median: bubbles of a few hundredths
    out.append(launch(nb, "fixed batch", s.p_time, pp_job.Args(
        schedules=("1f1b",), microbatches=tuple(m for m in ms if s.trade_batch % m == 0), **model_args(s.trade_cfg),
        batch=s.trade_batch, steps=max(3, s.timed_steps)), s.backend))
    out.append(launch(nb, "torch pipelining", s.p_time, vs_torch_job.Args(
        schedule="1f1b", microbatches=2 * s.p_time, preset=preset, n_layer=max(cfg.n_layer, s.p_time - 2),
        micro_batch_size=2, steps=3), s.backend))
    if not s.on_gpu or W >= 4:      # dp 2 × pp 2: four ranks (on a smaller GPU server: skipped)
        out.append(launch(nb, "dp x pp", 4, pp_job.Args(
            dp=2, schedules=("1f1b",), microbatches=(3,), preset=preset, micro_batch_size=2,
            check=cfg.block_size <= 256, steps=2), s.backend))
    return out


def launches_04(W, backend, preset, steps):
    cfg = model_preset(preset)
    dense = cfg.block_size <= 256        # the dense model beside the TP one: only where it is small
    return [launch("04_tensor_parallel", "TP training", tp_degree(cfg, W), tp_job.Args(
        preset=preset, steps=steps, batch_size=per_rank_batch(cfg, 8), eps=1e-6, no_reference=not dense,
        torch_api=3), backend)]


def launches_05(W, backend, preset, steps):
    nb = "05_mixed_precision"
    batch = per_rank_batch(model_preset(preset), 8) * W
    inject = sorted({s for s in (2, 3, steps // 2, steps // 2 + 1) if s < steps})
    dtypes = ("fp32", "fp16", "bf16")       # bf16 is dropped by the notebook on a GPU without it
    return [
        launch(nb, "loss scaling", W, precision_job.Args(
            dtype=("fp16",), preset=preset, steps=steps, batch=batch, window=5, inject=tuple(inject), inject_rank=0,
            warmup=4, max_grad_norm=2.0), backend),   # above the norms of a trained step: clips the first ones only
        launch(nb, "fp32 / fp16 / bf16", W, precision_job.Args(
            dtype=dtypes, preset=preset, steps=steps, batch=batch, init_scale=2.0 ** 13), backend),
    ]


ZERO_STAGES = (0, 1, 2, 3)


def launches_06(W, backend, preset, steps):
    """ZeRO on `W` ranks (every stage in fp32 and 16 bits, prefetch, offload, FSDP2), then on the other
    data-parallel degrees 2-4: one global batch they all divide, so every degree trains the same thing.
    The 4-rank job saves a sharded checkpoint (`{checkpoint}`: the notebook fills in a directory) that
    the 2-rank job resumes."""
    nb, cfg = "06_zero", model_preset(preset)
    long = cfg.block_size > 256
    half = "bf16"        # the CPU, and the GPUs of a course server (Ampere or newer), compute in bf16
    degrees = [n for n in world_sizes({2, 3, 4, W}, W, backend) if n == W or not long or W % n == 0]
    batch = W if long else math.lcm(2, 3, 4, W)          # gpt3-small's 2048 tokens: one sequence per rank
    Run, out = zero_job.ZeroRun, []
    for n in sorted(degrees, reverse=True):              # 4 first: it saves the checkpoint 2 loads
        main = n == W
        runs = (*(Run(st) for st in ZERO_STAGES), *(Run(st, precision=half) for st in ZERO_STAGES),
                *((Run(3, prefetch=True), Run(3, offload=True), Run(3, fsdp2=True)) if main else ()))
        n_steps = steps if main else 3
        args = zero_job.Args(runs=runs, preset=preset, steps=n_steps, batch=batch,
                             timeline_runs=(Run(3), Run(3, prefetch=True), Run(3, offload=True)) if main else ())
        if n == 4:
            args = replace(args, checkpoint="{checkpoint}", checkpoint_run=Run(3), checkpoint_step=2)
        if n == 2 and 4 in degrees:
            args = replace(args, runs=(*runs, Run(3, resume=True)), resume="{checkpoint}")
        out.append(launch(nb, "stages", n, args, backend))
    out.append(launch(nb, "ZeRO-R", tp_degree(cfg, W), activations_job.Args(preset=preset, batch=4), backend))
    return out


def bench_steps(steps: int) -> int:
    """Steps of each benchmark row: the first is a warm-up, the others are timed (4 or 5)."""
    return max(4, min(steps, 5))


def launches_07(W, backend, preset, steps):
    """Lecture 07's benchmark table: the launches `par.train.suite.run_suite` makes, from its own functions
    (`plan_rows`, `launches`, `launch_args`): first the 3D row, then the others (bf16 only on GPUs)."""
    from par.train import suite
    n_steps, gpus = bench_steps(steps), on_gpus(backend, W)
    out = []
    for cell, names in (("3D", ["3D"]), ("benchmark table", [n for n in LECTURE_07_ROWS if n != "bf16" or gpus])):
        rows = suite.plan_rows(names, W, preset, 2, n_steps, W if gpus else cores())
        for (n, _), group in sorted(suite.launches(rows).items()):
            if gpus and n > W:     # a row needing more GPUs than the server has (the 3D row's 8) is skipped
                continue
            out.append(launch("07_putting_it_together", cell, n, suite.launch_args(rows, group), backend))
    return out


LECTURE_07_ROWS = ("single", "pipeline", "TP", "DDP", "ZeRO-1", "ZeRO-3", "ZeRO-3+offload", "bf16")


def launches_07b(W, backend, preset, steps):
    """Lecture 07b launches nothing through the registry: its planner cells are pure, and its measurement across
    nodes (`par.train.placement.measure`) starts its own 2 hosts x 2 gloo ranks in network namespaces (root only,
    on the CPU), which no GPU server's dry run has to check."""
    return []


def launches_08(W, backend, preset, steps):
    """Lecture 08: one launch on the TP degree's ranks measures activation memory (DP, TP, TP+SP, CP),
    trains TP+SP and CP beside the dense model and records the ring-attention timeline (`par.cp.job`)."""
    cfg = model_preset(preset)
    return [launch("08_sequence_context_parallel", "memory, training, timeline", tp_degree(cfg, W), cp_job.Args(
        preset=preset, steps=max(2, min(steps, 5)), batch_size=per_rank_batch(cfg, 4)), backend)]


def launches_09(W, backend, preset, steps):
    """Lecture 09: a MoE GPT-lite with expert parallelism (ep = W), with and without the balancing loss;
    then EP inside DP (4 ranks, ep = 2) on CPU ranks or a server with 4 GPUs (`moe_work` costs them)."""
    nb, cfg = "09_mixture_of_experts", model_preset(preset)
    b = per_rank_batch(cfg, 4)
    check = cfg.block_size <= 256        # the single-process reference beside: only where it is small
    out = [launch(nb, "EP training", W, moe_job.Args(     # ep = W: at least one expert per rank
        preset=preset, steps=steps, batch=b, experts=max(4, W), k=2, check=check, alphas=(0.0, 0.1), torch_api=True),
                  backend)]
    if 4 in world_sizes({4}, W, backend):
        out.append(launch(nb, "EP inside DP", 4, moe_job.Args(
            preset=preset, steps=max(1, min(steps, 3)), batch=b, experts=4, k=2, ep=2, alphas=(0.1,), check=check),
                          backend))
    return out


REGISTRY = {
    "00_distributed_basics": launches_00,
    "01_memory": launches_01,
    "02_data_parallel": launches_02,
    "03_pipelines": launches_03,
    "04_tensor_parallel": launches_04,
    "05_mixed_precision": launches_05,
    "06_zero": launches_06,
    "07_putting_it_together": launches_07,
    "07b_at_scale": launches_07b,
    "08_sequence_context_parallel": launches_08,
    "09_mixture_of_experts": launches_09,
}

# The cells of each notebook that launch (`find`'s names): a cell may have no launch at some parameters
# (e.g. the world-size sweep when world_size is every size), never a name that is not here.
CELLS = {
    "00_distributed_basics": ("collectives", "world-size sweep"),
    "01_memory": ("measured model states",),
    "02_data_parallel": ("bucketed timeline", "torch DDP", "loss curves", "compression"),
    "03_pipelines": ("gantt", "bubble vs m", "zero bubble measured", "fixed batch", "torch pipelining", "dp x pp"),
    "04_tensor_parallel": ("TP training",),
    "05_mixed_precision": ("loss scaling", "fp32 / fp16 / bf16"),
    "06_zero": ("stages", "ZeRO-R"),
    "07_putting_it_together": ("3D", "benchmark table"),
    "07b_at_scale": (),
    "08_sequence_context_parallel": ("memory, training, timeline",),
    "09_mixture_of_experts": ("EP training", "EP inside DP"),
}


def launches(notebook: str, world_size: int, backend: str = "auto", preset: str = "tiny", steps: int = 20,
             registry=None) -> list[Launch]:
    """Every launch `notebook` makes with these parameters (a name such as "03_pipelines", or a path)."""
    registry = REGISTRY if registry is None else registry
    key = notebook.rsplit("/", 1)[-1].removesuffix(".ipynb")
    if key not in registry:
        raise CourseError(f"no launches registered for notebook {key!r}: known are {', '.join(sorted(registry))}")
    return registry[key](world_size, backend, preset, steps)


def find(notebook: str, cell: str, world_size: int, backend: str = "auto", preset: str = "tiny",
         steps: int = 20) -> list[Launch]:
    """The launches of one cell of a notebook (what that cell should run, in order; [] where the cell
    launches nothing at these parameters). A cell name the notebook does not have is an error."""
    key = notebook.rsplit("/", 1)[-1].removesuffix(".ipynb")
    if cell not in CELLS.get(key, ()):
        raise CourseError(f"{notebook} has no cell {cell!r}: its cells are {', '.join(CELLS.get(key, ()))}")
    return [l for l in launches(notebook, world_size, backend, preset, steps) if l.cell == cell]


def notebook_timeout(found: list[Launch]) -> float:
    """The cell timeout a batch should give a notebook: its busiest cell's launch timeouts + NOTEBOOK_S."""
    cells: dict = {}
    for l in found:
        cells[l.cell] = cells.get(l.cell, 0.0) + l.timeout
    return max(CELL_TIMEOUT_S, max(cells.values(), default=0.0) + NOTEBOOK_S)


# ---------------------------------------------------------------- work a notebook does in its own kernel
KERNEL_MEMORY = 8e9     # the most an in-kernel demo or reference is sized to (a laptop's share of its memory)
MIN_TOKENS = 128        # a demo shortens its sequences down to this before it is skipped


@dataclass(frozen=True)
class KernelWork:
    """Work a notebook does in its own process (the Jupyter kernel), not in a launched job: a demo, or a
    single-process reference. `kernel_work` sizes it from the batch's four parameters, as `launches` sizes the
    jobs, so the notebook runs it at that size and the dry run checks exactly that.

    batch, tokens   `batch` sequences of `tokens` tokens (<= model.block_size) of `model`, the model the notebook
                    builds; a demo halves them until `memory()` <= KERNEL_MEMORY (`sized`)
    device          where its tensors live: "gpu" (cuda:0 of a GPU server) or "host" (the CPU's memory)
    memory()        the planner's peak of `steps` steps of `batch` x `tokens` in `precision` with `optimizer`
                    (sgd: forward and backward only, no optimizer state) + `states` bytes per parameter of the
                    other models the notebook keeps alive meanwhile (an fp32 model and its gradients: 8)
    skipped         why it does not run at these parameters ("" when it runs): the notebook prints it"""
    notebook: str
    cell: str
    model: object            # par.model.GPTConfig
    batch: int
    tokens: int
    device: str              # gpu | host
    label: str = ""          # the model in a few words ('gpt3-small')
    precision: str = "fp32"
    optimizer: str = "sgd"
    steps: int = 1
    states: float = 0.0
    skipped: str = ""

    def training(self) -> Training:
        """The work in the planner's terms (the model's context cut to `tokens`)."""
        return Training(replace(self.model, block_size=self.tokens), self.batch, precision=self.precision,
                        optimizer=self.optimizer, steps=self.steps, label=self.cell)

    def memory(self) -> float:
        """Predicted bytes at the peak, on `device` (whether or not it is skipped)."""
        from par.memory.accounting import param_count
        return self.training().memory(CPU) + self.states * param_count(self.model)

    def name(self) -> str:
        return f"{self.notebook} [{self.cell}] in the notebook's kernel"

    def describe(self) -> str:
        return f"{self.batch} x {self.tokens} tokens of {self.label or 'GPT-lite'} on the {self.device}"


def kernel_device(backend: str, world_size: int) -> str:
    """Where a notebook's own demos run: GPU 0 on a GPU server (the launches on GPUs), else the host."""
    return "gpu" if on_gpus(backend, world_size) else "host"


def sized(notebook: str, cell: str, model, batch: int, device: str, shrink: bool = True, **fields_) -> KernelWork:
    """`batch` sequences of the model's whole context, halved (the batch first, then the tokens down to
    MIN_TOKENS) until the work fits KERNEL_MEMORY; skipped, with the reason, where even the smallest does not
    fit, or at once where `shrink` is False (a reference must see the batches of the job it checks)."""
    work = KernelWork(notebook, cell, model, batch, model.block_size, device, **fields_)
    while shrink and work.memory() > KERNEL_MEMORY and (work.batch > 1 or work.tokens > MIN_TOKENS):
        work = replace(work, batch=work.batch // 2) if work.batch > 1 else \
            replace(work, tokens=max(MIN_TOKENS, work.tokens // 2))
    if work.memory() > KERNEL_MEMORY:
        return replace(work, skipped=f"{work.describe()} would need {format_bytes(work.memory())} in the "
                                     f"notebook's kernel, more than the {format_bytes(KERNEL_MEMORY)} that in-kernel "
                                     f"work may take (par.course.batch.launches.KERNEL_MEMORY)")
    return work


def kernel_03(W, backend, preset, steps):
    """Naive model parallelism on 2-4 devices beside one model on the host, on the same 16 sequences (the single
    model and its gradients stay alive: 8 bytes per parameter). Counted on the host (the CPU devices when
    the machine has fewer GPUs; with GPUs the host holds only the single model)."""
    return [sized("03_pipelines", "naive model parallel", model_preset(preset), 16, "host", label=preset, states=8.0)]


def kernel_05(W, backend, preset, steps):
    """Sections 3-5: an fp32 model's gradients on 16 sequences, fp16 copies (MixedPrecision: fp16 weights and
    gradients, fp32 masters and their gradients) on the same batch, then the eight steps with Adam on at most 8
    of them. The fp32 model and the last fp16 copy stay alive until the launches: 8 + 12 bytes per parameter."""
    return [sized("05_mixed_precision", "fp16 demos", model_preset(preset), 16, kernel_device(backend, W),
                  label=preset, optimizer="adam", states=8.0 + 12.0)]


def kernel_06(W, backend, preset, steps):
    """The recomputation timing: steps on 16 sequences with and without full recomputation, on the preset where a
    GPU computes (on a CPU 'small', where compute dominates the step)."""
    device = kernel_device(backend, W)
    timing = preset if device == "gpu" else "small"
    return [sized("06_zero", "recomputation", model_preset(timing), 16, device, label=timing)]


def kernel_07(W, backend, preset, steps):
    """The one-process reference of the 3D row, trained on the host on the row's own global batches (never
    shrunk: it must see what the row saw); skipped where the row does not run (it needs 8 GPUs)."""
    from par.train import suite
    from par.train.config import model_config, parse
    gpus = on_gpus(backend, W)
    row = suite.plan_rows(["3D"], W, preset, 2, bench_steps(steps), W if gpus else cores())["3D"]
    if "error" in row:
        return [KernelWork("07_putting_it_together", "3D reference", model_preset(preset), 0, 0, "host",
                           label=preset, skipped=row["error"])]
    tc = parse(row["config"], row["nproc"])
    work = sized("07_putting_it_together", "3D reference", model_config(tc), tc.train_batch_size, "host",
                 shrink=False, label=suite.model_label(row["config"]["model"]), optimizer=tc.optimizer,
                 steps=tc.steps)
    if gpus and row["nproc"] > W:
        work = replace(work, skipped=f"the 3D row needs {row['nproc']} GPUs and this server has {W}: it does not "
                                     f"run, so there is nothing to compare with")
    return [work]


KERNEL = {
    "03_pipelines": kernel_03,
    "05_mixed_precision": kernel_05,
    "06_zero": kernel_06,
    "07_putting_it_together": kernel_07,
}


def kernel_work(notebook: str, world_size: int, backend: str = "auto", preset: str = "tiny", steps: int = 20,
                registry=None) -> list[KernelWork]:
    """What `notebook` computes in its own kernel with these parameters ([] for a notebook that only launches)."""
    registry = KERNEL if registry is None else registry
    key = notebook.rsplit("/", 1)[-1].removesuffix(".ipynb")
    return registry[key](world_size, backend, preset, steps) if key in registry else []


def in_kernel(notebook: str, cell: str, world_size: int, backend: str = "auto", preset: str = "tiny",
              steps: int = 20) -> KernelWork:
    """The in-kernel work of one cell of a notebook, sized for these parameters (`skipped` says why it does not run)."""
    found = [k for k in kernel_work(notebook, world_size, backend, preset, steps) if k.cell == cell]
    if len(found) != 1:
        known = ", ".join(k.cell for k in kernel_work(notebook, world_size, backend, preset, steps)) or "none"
        raise CourseError(f"{notebook} has no in-kernel work {cell!r}; it has: {known}")
    return found[0]


def host_memory_here() -> float:
    """Bytes of physical memory of this machine."""
    import os
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


# ---------------------------------------------------------------- the checker
@dataclass(frozen=True)
class Problem:
    where: str       # the launch (or cell) it concerns
    kind: str        # layout | memory | time
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


@dataclass
class Estimate:
    launch: Launch
    backend: str          # resolved: nccl or gloo
    memory: float         # bytes per device at the peak
    seconds: float        # predicted, start-up included


def resolve_backend(requested: str, nproc: int, gpus: int) -> str:
    """The backend a launch gets on the imagined server (auto: NCCL with a GPU per rank)."""
    from par.runtime.preflight import BackendError, choose_backend
    try:
        return choose_backend(nproc, requested, gpus=gpus)
    except BackendError:
        return "nccl"       # reported by check() as a layout problem


def check(launch_: Launch, world_size: int, gpu_memory: float, cell_timeout: float,
          gpu_flops: float | None = None) -> tuple[Estimate, list[Problem]]:
    """Predicted memory and time of one launch on `world_size` GPUs of `gpu_memory` bytes (and
    `gpu_flops` achieved FLOP/s, default the planner's A100); its problems."""
    backend = resolve_backend(launch_.backend, launch_.nproc, world_size)
    hw = gpu(gpu_memory, world_size) if backend == "nccl" else CPU
    if gpu_flops and backend == "nccl":
        hw = replace(hw, flops=gpu_flops)
    where = launch_.name()
    problems = []
    if backend == "nccl" and launch_.nproc > world_size:
        problems.append(Problem(where, "layout", f"needs {launch_.nproc} GPUs, the server has {world_size}"))
    for w in launch_.work:
        problems += [Problem(where, "layout", f"{w.describe()}: {reason}") for reason in w.problems(hw)]
    if problems:
        return Estimate(launch_, backend, float("nan"), float("nan")), problems
    memory = max((w.memory(hw) for w in launch_.work), default=0.0)
    seconds = STARTUP_S + sum(w.seconds(hw) for w in launch_.work)
    if backend == "nccl" and memory > gpu_memory:
        worst = max(launch_.work, key=lambda w: w.memory(hw))
        problems.append(Problem(where, "memory", f"predicted {format_bytes(memory)} per GPU > "
                                                 f"{format_bytes(gpu_memory)} ({worst.describe()})"))
    if seconds > launch_.timeout:
        device = "GPU" if backend == "nccl" else "CPU"
        problems.append(Problem(where, "time", f"predicted {seconds:.0f} s on {device} > its timeout "
                                               f"{launch_.timeout:.0f} s"))
    if launch_.timeout > cell_timeout:
        problems.append(Problem(where, "time", f"its timeout {launch_.timeout:.0f} s > the batch's cell timeout "
                                               f"{cell_timeout:.0f} s: pass --timeout {launch_.timeout:.0f}"))
    return Estimate(launch_, backend, memory, seconds), problems


def check_kernel(work: KernelWork, gpu_memory: float, host_memory: float) -> list[Problem]:
    """The problem of one piece of in-kernel work: its predicted memory above GPU 0's (device "gpu") or the
    host's (device "host"). A skipped one has none: the notebook says why and goes on."""
    if work.skipped:
        return []
    need = work.memory()
    if work.device == "gpu" and need > gpu_memory:
        return [Problem(work.name(), "memory", f"predicted {format_bytes(need)} per GPU > {format_bytes(gpu_memory)} "
                                              f"({work.describe()})")]
    if work.device == "host" and need > host_memory:
        return [Problem(work.name(), "memory", f"predicted {format_bytes(need)} of host memory > "
                                               f"{format_bytes(host_memory)} ({work.describe()})")]
    return []


def dry_run(world_size: int, backend: str = "nccl", preset: str = "gpt3-small", steps: int = 200,
            gpu_memory: float = 80e9, cell_timeout: float | None = None, notebooks=None, registry=None,
            gpu_flops: float | None = None, host_memory: float | None = None, kernel_registry=None):
    """(estimates, problems) for every launch of every notebook (default: all registered), in order, then
    the notebook's in-kernel work (`kernel_work`: against GPU 0's memory or `host_memory`, default this
    machine's: the dry run is meant to run on the server).

    `cell_timeout` None: each notebook gets the batch's automatic one (`notebook_timeout`). Backend
    "auto" is NCCL there: the imagined server has a GPU per rank. A custom `registry` comes without
    in-kernel work unless `kernel_registry` is given."""
    kernels = (KERNEL if registry is None else {}) if kernel_registry is None else kernel_registry
    registry = REGISTRY if registry is None else registry
    backend = "nccl" if backend == "auto" else backend     # the imagined server has a GPU per rank
    host = host_memory_here() if host_memory is None else host_memory
    estimates, problems = [], []
    for nb in (notebooks or list(registry)):
        cells: dict = {}
        found_ = launches(nb, world_size, backend, preset, steps, registry)
        timeout = cell_timeout or notebook_timeout(found_)
        for launch_ in found_:
            est, found = check(launch_, world_size, gpu_memory, timeout, gpu_flops)
            estimates.append(est)
            problems += found
            cells.setdefault(launch_.cell, []).append(est)
        for cell, ests in cells.items():
            total = sum(e.seconds for e in ests)
            if len(ests) > 1 and total > timeout:
                problems.append(Problem(f"{nb} [{cell}]", "time", f"its {len(ests)} launches together are predicted "
                                        f"{total:.0f} s > the batch's cell timeout {timeout:.0f} s: "
                                        f"pass --timeout {60 * math.ceil(total / 60):.0f}"))
        for work_ in kernel_work(nb, world_size, backend, preset, steps, kernels):
            problems += check_kernel(work_, gpu_memory, host)
    return estimates, problems


def format_estimates(estimates: list[Estimate]) -> str:
    """A table: one launch per line, predicted memory per device and time beside its timeout."""
    head = f"{'launch':<72} {'backend':>7} {'mem/device':>11} {'predicted':>10} {'timeout':>8}"
    lines = [head, "-" * len(head)]
    for e in estimates:
        mem = "?" if math.isnan(e.memory) else format_bytes(e.memory)
        sec = "?" if math.isnan(e.seconds) else f"{e.seconds:.0f} s"
        lines.append(f"{e.launch.name()[:72]:<72} {e.backend:>7} {mem:>11} {sec:>10} {e.launch.timeout:>6.0f} s")
    return "\n".join(lines)


def format_kernel(works: list[KernelWork]) -> str:
    """A table of the in-kernel work: one per line, its size and predicted memory on its device, or why it is skipped."""
    head = f"{'in-kernel work':<66} {'device':>6} {'memory':>11}  size"
    lines = [head, "-" * len(head)]
    for k in works:
        size = f"skipped: {k.skipped}" if k.skipped else f"{k.batch} x {k.tokens} tokens of {k.label}"
        mem = "-" if k.skipped else format_bytes(k.memory())
        lines.append(f"{k.name()[:66]:<66} {k.device:>6} {mem:>11}  {size}")
    return "\n".join(lines)
