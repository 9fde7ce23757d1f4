"""Lecture 03, pipelines: the experiment design (`PipelineSetup`, shared with lecture 03b), the launches of each
cell, the naive model parallelism the notebook runs in its own kernel, and the key numbers with their targets (the
bubble as idle / step time: 1F1B's and GPipe's, measured on the load-proof clock and simulated with the run's
costs, each within a factor 2 of (p−1)/(m+p−1); GPipe's over 1F1B's in the same launch within 0.8 to 1.25)."""
from __future__ import annotations

from dataclasses import dataclass

from par.course.batch import cost
from par.course.batch.launches import launch, sized
from par.model import preset as model_preset
from par.pp import job as pp_job, vs_torch_job
from par.site.numbers import Key, Target, at_most, near

NOTEBOOK = "03_pipelines"
CELLS = ("gantt", "bubble vs m", "fixed batch", "torch pipelining", "dp x pp")


@dataclass(frozen=True, kw_only=True)
class PipelineSetup:
    """The design of the timed experiments of lectures 03 and 03b, from the batch's four parameters
    (`pipeline_setup`).

    The bubble formulas assume equal stages whose actions last far longer than the overhead around them (Python
    between actions, a message each way). So the bubble is timed on `par.pp.job --model square` (1F1B and GPipe by
    m in 03; 1F1B, ZB-H1 and ZB-V in 03b, each comparison in one launch on the same stages): equal stages whose F,
    I and W are one matmul each (F = I = W, the zero-bubble formulas' assumption): `square` = (width, rows per
    micro-batch, layers per stage), 12 layers of width 1024 on 256 rows per stage on a CPU (about 60 ms of CPU per
    action), 8 layers of 4096 on 2048 rows on a GPU. Each run reports its bubble three ways (`par.pp.job`): on the
    wall clock, on the load-proof clock (the step rebuilt from each rank's own CPU time, `par.pp.sim.as_executed`),
    and simulated with the run's median cost of every action; the median of `timed_steps` + 2 steps. The targets
    are relative to the schedule's own formula (`RELATIVE`).

    GPT-lite runs (the Gantt charts, the fixed-batch trade-off, the partition table) use identical blocks with a
    65-symbol vocabulary (embedding and head cost next to nothing):

        GPUs   one stage per GPU, GPT-3 Small's width on sequences of 1024 tokens, 4 blocks per stage
        CPU    one thread per rank on at most as many ranks as physical cores; width 256, 2 blocks per stage;
               the Gantt chart on 4 cheap ranks (timed only where each has a core: `chart_timed`)"""
    on_gpu: bool           # one GPU per rank; else CPU ranks on gloo
    backend: str           # what the timed launches use
    processors: int        # GPUs, or physical CPU cores: timing needs one per rank
    p_time: int            # ranks of the timed experiments (bubble vs m, zero bubble, fixed batch, torch)
    p_chart: int           # ranks of the Gantt charts
    timed_steps: int       # timed steps per launched run (the median is reported)
    time_cfg: object       # identical GPT-lite blocks, 2 or 4 per stage (the partition table)
    chart_cfg: object
    trade_cfg: object
    chart_mbs: int
    trade_batch: int       # the fixed batch of the step-time trade-off
    square: tuple          # bubble timing: width, rows per micro-batch, layers per stage

    @property
    def chart_timed(self) -> bool:
        """Whether the chart's ranks each have a processor (else their wall clock times the waiting for one)."""
        return self.p_chart <= self.processors


def pipeline_setup(W, backend, preset, steps) -> PipelineSetup:
    """The design above for a batch of W ranks on `backend`."""
    gpus = cost.on_gpus(backend, W)
    processors = W if gpus else cost.cores()
    p_time = W if gpus else max(2, min(W, processors))
    p_chart = p_time if gpus else 4
    if gpus:
        time_cfg = model_preset("gpt3-small", vocab_size=65, block_size=1024, n_layer=4 * p_time)
        chart_cfg = model_preset("gpt3-small", vocab_size=65, block_size=1024, n_layer=4 * p_chart)
        trade_cfg, chart_mbs, trade_batch = time_cfg, 2, 32
    else:
        time_cfg = model_preset("small", d_model=256, n_head=8, n_layer=2 * p_time)
        chart_cfg = model_preset("small", n_layer=p_chart)
        trade_cfg = model_preset("small", block_size=32, n_layer=2 * p_time)
        chart_mbs, trade_batch = 2, 32
    return PipelineSetup(on_gpu=gpus, backend=backend if gpus else "gloo", processors=processors, p_time=p_time,
                         p_chart=p_chart, timed_steps=max(2, min(3, steps // 6)), time_cfg=time_cfg,
                         chart_cfg=chart_cfg, trade_cfg=trade_cfg, chart_mbs=chart_mbs,
                         trade_batch=trade_batch, square=(4096, 2048, 8) if gpus else (1024, 256, 12))


def model_args(c) -> dict:
    """The arguments that give `par.pp.job` the GPT-lite configuration `c` (every size of 'tiny' overridden)."""
    return dict(preset="tiny", vocab_size=c.vocab_size, d_model=c.d_model, n_head=c.n_head, block_size=c.block_size,
                n_layer=c.n_layer)


def square_args(s: PipelineSetup, schedules, ms, more_steps: int = 2, **more) -> pp_job.Args:
    """`par.pp.job --model square` on `s.p_time` ranks: equal stages, F = I = W, the median of `timed_steps` +
    `more_steps` steps (more for bubbles of a few hundredths)."""
    width, rows, per_stage = s.square
    return pp_job.Args(model="square", schedules=schedules, microbatches=tuple(ms), d_model=width,
                       n_layer=per_stage * s.p_time, micro_batch_size=rows, partition="uniform", warmup_once=True,
                       steps=s.timed_steps + more_steps, **more)


def launches(W, backend, preset, steps):
    cfg, s = model_preset(preset), pipeline_setup(W, backend, preset, steps)
    m_chart, ms = 2 * s.p_chart, (1, 2, 4, 8, 16)
    check = s.chart_cfg.block_size <= 256     # a single-process reference of a long-context model would not fit
    out = [launch(NOTEBOOK, "gantt", s.p_chart, pp_job.Args(
        schedules=("gpipe", "1f1b"), microbatches=(m_chart,), **model_args(s.chart_cfg),
        micro_batch_size=s.chart_mbs, check=check, steps=1, profile_dir="{trace_dir}"), s.backend)]  # filled by 03
    out.append(launch(NOTEBOOK, "bubble vs m", s.p_time, square_args(s, ("1f1b", "gpipe"), ms, record_comm=True),
                      s.backend))
    out.append(launch(NOTEBOOK, "fixed batch", s.p_time, pp_job.Args(
        schedules=("1f1b",), microbatches=tuple(m for m in ms if s.trade_batch % m == 0), **model_args(s.trade_cfg),
        batch=s.trade_batch, steps=max(3, s.timed_steps)), s.backend))
    out.append(launch(NOTEBOOK, "torch pipelining", s.p_time, vs_torch_job.Args(
        schedule="1f1b", microbatches=2 * s.p_time, preset=preset, n_layer=max(cfg.n_layer, s.p_time - 2),
        micro_batch_size=2, steps=3), s.backend))
    if not s.on_gpu or W >= 4:      # dp 2 × pp 2: four ranks (on a smaller GPU server: skipped)
        out.append(launch(NOTEBOOK, "dp x pp", 4, pp_job.Args(
            dp=2, schedules=("1f1b",), microbatches=(3,), preset=preset, micro_batch_size=2,
            check=cfg.block_size <= 256, steps=2), s.backend))
    return out


def kernel(W, backend, preset, steps):
    """Naive model parallelism on 2-4 devices beside one model on the host, on the same 16 sequences (the single
    model and its gradients stay alive: 8 bytes per parameter). Counted on the host (the CPU devices when
    the machine has fewer GPUs; with GPUs the host holds only the single model)."""
    return [sized(NOTEBOOK, "naive model parallel", model_preset(preset), 16, "host", label=preset, states=8.0)]


# A measured bubble against its schedule's formula: the ratio within a factor 2 (measured − formula between −½ and
# +1 times the formula), a band that scales with the bubble itself. On the course's 2 shared cores the load-proof
# bubble of these runs lay between 1.0 and 1.7 times the formula; the bubbles it tells apart differ by more than
# that (ZB-H1's is 0.4 of 1F1B's at m = 3 and 4 on 2 ranks, ZB-V's 0.2).
RELATIVE = Target("½ to 2 × the formula", low=0.5, high=2.0)
SAME = Target("0.8 to 1.25", low=0.8, high=1.25)     # two schedules with the same formula, measured side by side

KEY_NUMBERS = [
    Key("bubble on the load-proof clock (idle / step), by schedule and m", "(p−1)/(m+p−1)", "bubble_measured_vs_m"),
    Key("bubble on the wall clock, by schedule and m", "(p−1)/(m+p−1)", "bubble_wall_vs_m"),
    Key("bubble simulated with this run's costs, by schedule and m", "(p−1)/(m+p−1)", "bubble_simulated_vs_m"),
    Key("bubble formula, by micro-batches m", "(p−1)/(m+p−1)", "bubble_formula_vs_m"),
    Key("1F1B and GPipe bubble measured / formula, by m", "1", "bubble_measured_over_formula", target=RELATIVE),
    Key("1F1B and GPipe bubble simulated with this run's costs / formula, by m", "1",
        "bubble_simulated_over_formula", target=RELATIVE),
    Key("GPipe bubble / 1F1B bubble, measured in one launch on the same stages, by m", "1 (the same formula)",
        "gpipe_over_1f1b_measured", target=SAME),
    Key("simulated 1F1B bubble, p = 4, m = 6", "3/9 = 0.333", "simulated_bubble_1f1b_p4_m6", target=near(1 / 3, 1e-9, "= 1/3")),
    Key("pipeline gradients vs one process (max |Δ|)", "≤ 1e-5", "pipeline_max_grad_diff_vs_single",
        target=at_most(1e-5)),
    Key("stage-0 activation peak, GPipe (MB)", "m micro-batches held", "activation_peak_MB_stage0_gpipe"),
    Key("stage-0 activation peak, 1F1B (MB)", "≤ p micro-batches held", "activation_peak_MB_stage0_1f1b"),
    Key("par 1F1B vs torch pipelining (max |Δ|)", "≤ 1e-5", "torch_api_max_diff", "pipelining", target=at_most(1e-5)),
]
