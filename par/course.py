"""The course's launches as data, and the dry run that checks a GPU batch before any GPU is rented.

Every job a lecture notebook starts is one `Launch`: the module, the number of ranks, the
arguments, the backend, the timeout, and what it computes (`Training` runs in the planner's
terms, or `Collectives`). `launches(notebook, world_size, backend, preset, steps)` gives a
notebook's launches as a pure function of the batch's four parameters, so the notebook can run
exactly those (`launch.run()`), and the dry run checks exactly what will run.

`dry_run(world_size, backend, preset, steps, gpu_memory)` checks every launch of every notebook
for a server of `world_size` GPUs with `gpu_memory` bytes each, without touching a GPU:

    layout   the degrees divide what they split (heads and width for tp, the layer list for pp,
             the batch for dp × micro-batches: `par.planner.predict`), and a launch under NCCL
             asks for at most `world_size` ranks (one GPU each)
    memory   predicted bytes per GPU at the peak (`par.planner`: model states by ZeRO stage +
             activations, plus a single-process reference kept beside) <= gpu_memory
    time     predicted seconds = STARTUP_S + Σ steps × (planner step time + per-layer overhead)
             <= the launch's timeout <= the batch's cell timeout; the launches of one cell
             together <= the cell timeout

Timeouts scale with the work: `scaled_timeout(work, backend)` is SAFETY × the time predicted on
a deliberately slow reference device (fp32 without TF32 on a GPU, a few GFLOP/s on a CPU) plus
the start-up, never below MIN_TIMEOUT_S. The batch's cell timeout for a notebook
(`notebook_timeout`) is then the largest cell's launch timeouts added up, plus NOTEBOOK_S, at
least CELL_TIMEOUT_S: a launch's own timeout (which names the ranks that hang) always fires first.

The predictions are the planner's formulas; they are upper-bound estimates for a go/no-go
check, not a benchmark (the planner ignores latency and overlaps nothing).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from par import planner
from par.memory import format_bytes

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
        layout = f"dp{self.dp}×pp{self.pp}×tp{self.tp}" + (f" ZeRO-{self.zero_stage}" if self.zero_stage else "")
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
    """One `par.launch.run` a notebook makes: everything it needs, and what it computes (`work`, in order)."""
    notebook: str
    cell: str                        # which part of the notebook (the launches of one cell share it)
    module: str
    nproc: int
    args: tuple
    backend: str
    timeout: float
    work: tuple = field(default_factory=tuple)

    def run(self, **kwargs):
        """Run it: `par.launch.run` with exactly these parameters (quiet=..., env=... pass through)."""
        from par.launch import run
        return run(self.module, nproc=self.nproc, args=list(self.args), backend=self.backend,
                   timeout=self.timeout, **kwargs)

    def name(self) -> str:
        return f"{self.notebook} [{self.cell}] {self.module} on {self.nproc} rank{'s' if self.nproc > 1 else ''}"


def on_gpus(backend: str, world_size: int) -> bool:
    """Whether the launches run on GPUs: "nccl", or "auto" where this machine has a GPU per rank."""
    if backend != "auto":
        return backend == "nccl"
    from par.preflight import choose_backend
    return choose_backend(world_size, "auto") == "nccl"


def scaled_timeout(work, backend: str, nproc: int = 1) -> float:
    """SAFETY × (time on the slow reference device) + STARTUP_S, at least MIN_TIMEOUT_S, in whole minutes."""
    hw = gpu() if on_gpus(backend, nproc) else CPU
    predicted = sum(0.0 if math.isnan(s) else s for s in (w.seconds(hw) for w in work))
    return float(max(MIN_TIMEOUT_S, 60 * math.ceil((SAFETY * predicted + STARTUP_S) / 60)))


def launch(notebook, cell, module, nproc, args, backend, work, timeout=None) -> Launch:
    """A Launch whose timeout scales with its work (unless given)."""
    work = tuple(work)
    return Launch(notebook, cell, module, nproc, tuple(str(a) for a in args), backend,
                  timeout if timeout is not None else scaled_timeout(work, backend, nproc), work)


# ---------------------------------------------------------------- the registry: one function per notebook
def _model(preset: str):
    from par.model import preset as model_preset
    return model_preset(preset)


def per_rank_batch(cfg, small: int) -> int:
    """Sequences per rank: `small` for a short context (tiny, small); 1 for a long one (gpt3-small's 2048)."""
    return small if cfg.block_size <= 256 else 1


def world_sizes(candidates, world_size: int, backend: str) -> list[int]:
    """Extra world sizes a notebook sweeps: any on CPU ranks; on GPUs only those the server has."""
    return sorted(n for n in set(candidates) if not on_gpus(backend, world_size) or n <= world_size)


def launches_00(W, backend, preset, steps):
    nb = "00_distributed_basics"
    sizes = (64, 4096, 65536, 1 << 20, 1 << 22)
    out = [launch(nb, "collectives", "par.jobs.collectives", W, [
        "--parts", "env,show,trace,bytes,timing", "--sizes", ",".join(map(str, sizes)), "--reps", 9, "--warmup", 2],
        backend, [Collectives(sizes, 11)])]
    for n in world_sizes({2, 3, 4}, W, backend):
        if n != W:
            out.append(launch(nb, "world-size sweep", "par.jobs.collectives", n, [
                "--parts", "bytes,timing", "--bytes-sizes", 4096, "--sizes", 64, "--reps", 9, "--warmup", 2],
                backend, [Collectives((4096, 64), 11)]))
    return out


def launches_01(W, backend, preset, steps):
    cfg = _model(preset)
    b = per_rank_batch(cfg, 8)
    runs = [Training(cfg, b * W, dp=W, precision=p, optimizer=o, steps=steps, label=f"{p} {o}")
            for p in ("fp32", "bf16") for o in ("adam", "momentum", "sgd")]
    return [launch("01_memory", "measured model states", "par.jobs.memory", W, [
        "--preset", preset, "--steps", steps, "--optimizers", "adam,momentum,sgd", "--precisions", "fp32,bf16",
        "--batch", b], backend, runs)]


def launches_02(W, backend, preset, steps):
    nb, cfg = "02_data_parallel", _model(preset)
    from par.memory import param_count
    bucket_kb = max(1.0, 4 * param_count(cfg) / 4 / 1024)      # about 4 buckets, whatever the preset
    long = cfg.block_size > 256
    batch = 2 * W if long else 32                              # the global batch of every run

    def train(n, label, runs=1):
        """The runs of one launch on n ranks; a long context accumulates micro-batches of one sequence."""
        accum = batch // n if long else 1
        work = [Training(cfg, batch, dp=n, microbatches=accum, steps=steps, label=label)] * runs
        return work, (["--accum", accum] if long else [])
    work, accum = train(W, "naive, bucketed", 2)
    out = [launch(nb, "bucketed timeline", "par.jobs.train_dp", W, [
        "--dp", "naive,bucketed", "--impl", "ring", "--bucket-kb", f"{bucket_kb:.1f}", "--preset", preset,
        "--steps", steps, "--batch", batch, *accum], backend, work)]
    for n in world_sizes({1, 2, 4}, W, backend):
        if n != W and batch % n == 0:
            work, accum = train(n, f"{n} rank(s)")
            out.append(launch(nb, "loss curves", "par.jobs.train_dp", n, [
                "--dp", "none" if n == 1 else "bucketed", "--impl", "torch", "--preset", preset, "--steps", steps,
                "--batch", batch, *accum], backend, work))
    work, accum = train(W, "none, topk, randomk, int8", 4)
    out.append(launch(nb, "compression", "par.jobs.train_dp", W, [
        "--dp", "bucketed", "--impl", "torch", "--bucket-kb", f"{bucket_kb:.1f}", "--preset", preset,
        "--steps", steps, "--batch", batch, "--compression", "none,topk,randomk,int8", "--ratio", 0.05, *accum],
        backend, work))
    return out


def launches_03(W, backend, preset, steps):
    nb, cfg = "03_pipelines", _model(preset)
    stages = W if on_gpus(backend, W) else max(W, 4)    # GPUs: one stage per GPU; CPU ranks are cheap
    mbs = 16 if preset == "tiny" else (2 if cfg.block_size <= 256 else 1)
    timed = max(1, min(3, steps // 10))
    check = cfg.block_size <= 256        # a single-process reference of a long-context model would not fit
    out = []

    def pipe(cell, n, schedules, ms, extra=(), batch=None, reference=False):
        layers = max(cfg.n_layer, n - 2)
        model = replace(cfg, n_layer=layers)
        work = [Training(model, batch or m * mbs, pp=n, microbatches=m, steps=timed + 1,
                         reference_batch=(batch or m * mbs) if reference else 0, label=f"{s} m={m}")
                for s in schedules for m in ms]
        args = ["--schedules", ",".join(schedules), "--microbatches", ",".join(map(str, ms)), "--preset", preset,
                "--n-layer", layers, "--steps", timed, *(["--batch", batch] if batch else ["--micro-batch-size", mbs]),
                *extra]
        out.append(launch(nb, cell, "par.jobs.pipeline", n, args, backend, work))

    pipe("gantt", stages, ("gpipe", "1f1b"), (2 * stages,), ["--check"] if check else [], reference=check)
    pipe("bubble vs m", W, ("1f1b",), (1, 2, 4, 8, 16))
    batch = 64 if preset == "tiny" else 8
    pipe("fixed batch", W, ("1f1b",), tuple(m for m in (1, 2, 4, 8, 16) if batch % m == 0), batch=batch)
    return out


def tp_degree(cfg, world_size: int) -> int:
    """The largest TP degree <= world_size that divides the heads, the width and the FFN size."""
    return max(n for n in range(1, world_size + 1) if cfg.n_head % n == 0 and cfg.d_model % n == 0
               and cfg.ffn % n == 0)


def launches_04(W, backend, preset, steps):
    cfg = _model(preset)
    n = tp_degree(cfg, W)
    b = per_rank_batch(cfg, 8)
    dense = cfg.block_size <= 256        # the dense model beside the TP one: only where it is small
    work = [Training(cfg, b, tp=n, steps=steps, reference_batch=b if dense else 0, label=f"TP {n}")]
    return [launch("04_tensor_parallel", "TP training", "par.jobs.train_tp", n, [
        "--preset", preset, "--steps", steps, "--batch-size", b, *([] if dense else ["--no-reference"])],
        backend, work)]


def launches_05(W, backend, preset, steps):
    nb, cfg = "05_mixed_precision", _model(preset)
    batch = per_rank_batch(cfg, 8) * W
    inject = sorted({s for s in (2, 3, steps // 2, steps // 2 + 1) if s < steps})
    dtypes = ("fp32", "fp16", "bf16")       # bf16 is dropped by the notebook on a GPU without it
    return [
        launch(nb, "loss scaling", "par.jobs.train_mp", W, [
            "--dtype", "fp16", "--preset", preset, "--steps", steps, "--batch", batch, "--window", 5,
            "--inject", ",".join(map(str, inject)), "--inject-rank", 0, "--warmup", 4, "--max-grad-norm", 1.0],
            backend, [Training(cfg, batch, dp=W, precision="fp16", steps=steps, label="fp16")]),
        launch(nb, "fp32 / fp16 / bf16", "par.jobs.train_mp", W, [
            "--dtype", ",".join(dtypes), "--preset", preset, "--steps", steps, "--batch", batch,
            "--init-scale", 2 ** 13], backend,
            [Training(cfg, batch, dp=W, precision=d, steps=steps, label=d) for d in dtypes]),
    ]


def launches_06(W, backend, preset, steps):
    nb, cfg = "06_zero", _model(preset)
    batch = per_rank_batch(cfg, 4) * W

    def zero(label, precision="fp32", n_steps=steps):
        stage = int(label[0])
        return Training(cfg, batch, dp=W, zero_stage=stage, offload="offload" in label, precision=precision,
                        steps=n_steps, label=f"ZeRO {label}")
    runs = ("0", "1", "2", "3", "3+prefetch", "3+offload")
    return [
        launch(nb, "stages", "par.jobs.train_zero", W, [
            "--runs", ",".join(runs), "--preset", preset, "--steps", steps, "--batch", batch,
            "--timeline-runs", "3,3+prefetch,3+offload"], backend, [zero(r) for r in runs]),
        launch(nb, "mixed precision", "par.jobs.train_zero", W, [
            "--runs", "0,1,2,3", "--preset", preset, "--steps", 3, "--batch", batch, "--precision", "bf16",
            "--timeline-runs", ""], backend, [zero(r, "bf16", 3) for r in ("0", "1", "2", "3")]),
    ]


def launches_07(W, backend, preset, steps):
    """Lecture 07's benchmark table: `par.bench.suite`'s configurations, grouped into launches as
    `suite.run_suite` groups them (by ranks, and data-parallel family apart from pipeline/TP)."""
    import json

    from par.bench import suite
    from par.config import ConfigError, model_config, parse
    bench_steps = max(3, min(steps, 10))
    groups: dict = {}
    for name in suite.NAMES:
        cfg, n = suite.config_for(name, W, preset, 2, bench_steps)
        try:
            tc = parse(cfg, n)
        except ConfigError:
            continue            # the suite shows such a row as an error; it never launches it
        work = Training(model_config(tc), tc.train_batch_size, tc.dp, tc.pp, tc.tp, tc.zero_stage, tc.offload,
                        tc.grad_accum, tc.precision, tc.optimizer, bench_steps, label=name)
        key = (n, tc.pp * tc.tp > 1)
        groups.setdefault(key, ([], []))
        groups[key][0].extend(["--config", json.dumps(cfg)])
        groups[key][1].append(work)
    # on GPUs a row needing more ranks than the server has GPUs (the 3D row's 8) is skipped (par.bench.suite)
    return [launch("07_putting_it_together", "benchmark table", "par.jobs.train", n, args, backend, work)
            for (n, _), (args, work) in groups.items() if not (on_gpus(backend, W) and n > W)]


def launches_09(W, backend, preset, steps):
    """Lecture 09: a MoE GPT-lite with expert parallelism (ep = W), with and without the balancing loss;
    then EP inside DP (4 ranks, ep = 2) on CPU ranks or a server with 4 GPUs. The planner has no MoE: the
    work is a dense model whose FFN holds the experts a rank keeps (a go/no-go estimate)."""
    nb, cfg = "09_mixture_of_experts", _model(preset)
    experts, k, b = max(4, W), 2, per_rank_batch(cfg, 4)   # ep = W: at least one expert per rank
    check = cfg.block_size <= 256        # the single-process reference beside: only where it is small

    def work(n, ep, label, runs):
        held = replace(cfg, d_ff=cfg.ffn * max(k, math.ceil(experts / ep)))
        return [Training(held, b * n, dp=n, steps=steps, reference_batch=b * n if check else 0,
                         label=f"{label} {r}") for r in runs]
    args = ["--preset", preset, "--steps", steps, "--batch", b, "--experts", experts, "--k", k,
            *(["--check"] if check else [])]
    out = [launch(nb, "EP training", "par.jobs.train_moe", W, [*args, "--alphas", "0,0.1"], backend,
                  work(W, W, "EP alpha", ("0", "0.1")))]
    if 4 in world_sizes({4}, W, backend):
        short = max(1, min(steps, 3))
        out.append(launch(nb, "EP inside DP", "par.jobs.train_moe", 4, [
            "--preset", preset, "--steps", short, "--batch", b, "--experts", 4, "--k", k, "--ep", 2,
            "--alphas", "0.1", *(["--check"] if check else [])], backend,
            [replace(w, steps=short) for w in work(4, 2, "EP2 x DP2 alpha", ("0.1",))]))
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
    "09_mixture_of_experts": launches_09,
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
    """The launches of one cell of a notebook (what that cell should run, in order)."""
    found = [l for l in launches(notebook, world_size, backend, preset, steps) if l.cell == cell]
    if not found:
        raise CourseError(f"{notebook} has no cell {cell!r}")
    return found


def notebook_timeout(found: list[Launch]) -> float:
    """The cell timeout a batch should give a notebook: its busiest cell's launch timeouts + NOTEBOOK_S."""
    cells: dict = {}
    for l in found:
        cells[l.cell] = cells.get(l.cell, 0.0) + l.timeout
    return max(CELL_TIMEOUT_S, max(cells.values(), default=0.0) + NOTEBOOK_S)


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
    from par.preflight import BackendError, choose_backend
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


def dry_run(world_size: int, backend: str = "nccl", preset: str = "gpt3-small", steps: int = 200,
            gpu_memory: float = 80e9, cell_timeout: float | None = None, notebooks=None, registry=None,
            gpu_flops: float | None = None):
    """(estimates, problems) for every launch of every notebook (default: all registered), in order.

    `cell_timeout` None: each notebook gets the batch's automatic one (`notebook_timeout`). Backend
    "auto" is NCCL there: the imagined server has a GPU per rank."""
    registry = REGISTRY if registry is None else registry
    backend = "nccl" if backend == "auto" else backend     # the imagined server has a GPU per rank
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
