"""The parallelism planner: which (dp, pp, tp, ZeRO stage, micro-batches) layout for this model and cluster?

3D parallelism is a resource-allocation problem. For every layout of a world of N devices
(dp · pp · tp = N) the planner predicts, with pure formulas:

memory per device (bytes)
    Ψ_dev      parameters on the busiest device: the layer list [embedding, L blocks, head] with each
               block's matrices split over tp (`par.memory.accounting.gpt_block_params`, its LayerNorms and
               row-parallel biases replicated, as `par.tp.layers` holds them), cut into pp stages
               with the balanced partition of `par.pp.partition` (the largest stage)
    states     `par.memory.accounting.model_state_bytes(Ψ_dev, dp, stage, precision, optimizer)`; with offload the
               optimizer part (fp32 masters + moments) lives on the host instead
    activations  per micro-batch and layer `par.memory.accounting.activation_bytes_per_layer` (no dropout) / tp,
               times the layers of a stage, times the micro-batches in flight on the busiest rank, read off
               the schedule itself (`pipeline_in_flight`: 1F1B and ZB-H1 min(pp, m), ZB-V 2·min(pp, m) chunks of
               half a stage; no pipeline: 1), plus the logits of one micro-batch (2·b·s·V values): on every
               schedule the last stage runs a micro-batch's backward right after its forward, so one
               micro-batch's logits are alive at a time (added to the busiest stage: with a pipeline an
               over-count by those logits, since the first stage holds none). What ZB keeps from I to W
               (the dL/dy of each layer) is not counted.
               Dividing by tp is an approximation: layer norms and the block input stay replicated.
               Full recomputation keeps each layer's input (2·s·b·h in 16 bits) per micro-batch in flight,
               plus one layer rebuilt in full during backward: the peak is not L·2·s·b·h alone.

step time (seconds), with nothing overlapped (an upper bound):
    compute    (6·N_mm + 12·L·s·d)·B·s FLOPs / (N · achieved FLOP/s)    (forward 1/3, backward 2/3; N_mm the
               weights that multiply activations, `par.mfu.flops_per_token`)
    bubble     compute · φ/(1-φ), φ the schedule's idle fraction with equal costs (`pipeline_bubble`):
               1F1B (p-1)/m of compute, ZB-H1 (p-1)/(3m), ZB-V (p-1)/(6m) (lecture 03b)
    dp         gradients (`zero_bytes_per_step`): c·(dp-1)/dp · g·Ψ_dev bytes / bandwidth of the dp group, c = 2 for
               ZeRO-0/1 (all-reduce, or reduce-scatter + all-gather, once per step), m + 1 for ZeRO-2
               (a reduce-scatter per micro-batch, one all-gather) and 3m for ZeRO-3 (gather twice and
               reduce-scatter once per micro-batch): sharded gradients cost bytes under accumulation
    tp         4 all-reduces per layer and micro-batch: 4·L_stage·m · 2(tp-1)/tp · b·s·d·e / bandwidth
    pp         one activation forward, one gradient back per micro-batch: 2·m·b·s·d·e / bandwidth
               (a middle stage; per device on average 2·m·b·s·d·e·(pp-1)/pp bytes are sent)
    The bytes of dp, tp and pp per device and step are returned in `Plan.bytes`.
    offload    gradient partition down, parameters up, over the host link (`par.zero.offload`)

A group's bandwidth is the node's (NVLink) when its ranks fit in one node under the grid's
layout rank = t + tp·(d + dp·s) (`par.runtime.grid`), the network's otherwise.

`enumerate_plans` lists every layout, valid or not (with the reason), `rank_plans` puts the
ones that fit first, fastest first; `largest_model` grows a model's width until it no longer fits.
"""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field, replace

from par import mfu
from par.memory import accounting as memory
from par.pp import partition
from par.cp.ring_attention import ring_attention_bytes_even
from par.zero.engine import zero_bytes_per_step
from par.runtime.grid import Layout, groups_in_node, layout_label


@dataclass(frozen=True)
class Hardware:
    """One device of a cluster and its links (bytes/s per device, achieved FLOP/s, not peak)."""
    name: str = "A100-80GB"
    memory: float = 80e9
    flops: float = 150e12          # about half of the 312 TFLOP/s bf16 peak
    gpus_per_node: int = 8
    bw_node: float = 250e9         # NVLink, per direction
    bw_network: float = 25e9       # 200 Gb/s InfiniBand per GPU
    bw_host: float = 20e9          # PCIe to the CPU (offload)


HARDWARE = {
    "a100-80gb": Hardware(),
    "v100-32gb": Hardware("V100-32GB", 32e9, 60e12, 8, 120e9, 12.5e9, 12e9),
    "h100-80gb": Hardware("H100-80GB", 80e9, 400e12, 8, 450e9, 50e9, 50e9),
    # a laptop-class CPU, each rank a process: GB/s-ish shared memory, a few GFLOP/s per core
    "cpu": Hardware("CPU", 8e9, 5e9, 64, 2e9, 2e9, 10e9),
}


@dataclass(frozen=True)
class Workload:
    """What to train: a GPT config (par.model.GPTConfig), the global batch, precision and optimizer."""
    model: object
    global_batch: int
    precision: str = "mixed"       # par.memory.accounting names: fp32, mixed (fp16/bf16), pure16
    optimizer: str = "adam"
    recompute: str = "none"        # "full": keep only each layer's input, recompute in backward (+1 forward)

    @property
    def seq(self) -> int:
        return self.model.block_size

    @property
    def bytes_per_value(self) -> int:
        return 4 if memory.canonical_precision(self.precision) == "fp32" else 2


@dataclass
class Plan:
    dp: int
    pp: int
    tp: int
    zero_stage: int
    microbatches: int
    offload: bool = False
    valid: bool = True
    reason: str = ""
    micro_batch: int = 0
    params_per_device: float = 0.0
    memory: dict = field(default_factory=dict)       # params, grads, optimizer, activations, total, host
    time: dict = field(default_factory=dict)         # compute, bubble, dp, tp, pp, offload, total
    bytes: dict = field(default_factory=dict)        # sent per device per step: dp, tp, pp, total
    fits: bool = False
    samples_per_s: float = 0.0
    cp: int = 1                                      # context-parallel degree (ring attention); devices = dp·pp·tp·cp
    schedule: str = "1f1b"                           # the pipeline schedule (1f1b, zb_h1, zb_v) when pp > 1
    ep: int = 1                                      # expert-parallel degree (MoE: `predict_moe`)

    @property
    def layout(self) -> str:
        return layout_label(self.dp, self.pp, self.tp)

    @property
    def label(self) -> str:
        cp = f"×cp{self.cp}" if self.cp > 1 else ""
        zb = f" {self.schedule}" if self.pp > 1 and self.schedule != "1f1b" else ""
        return f"{self.layout}{cp} ZeRO-{self.zero_stage}{' +off' if self.offload else ''} m={self.microbatches}{zb}"

    def to_dict(self) -> dict:
        return {**asdict(self), "layout": self.layout, "label": self.label}


# ---------------------------------------------------------------- pure pieces
def divisors(n: int) -> list[int]:
    """The divisors of n, ascending, by trial division up to √n."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def layouts(world: int) -> list[tuple[int, int, int]]:
    """Every (dp, pp, tp) with dp · pp · tp = world: tp a divisor of world, pp a divisor of world / tp."""
    return [(world // (tp * pp), pp, tp) for tp in divisors(world) for pp in divisors(world // tp)]


# what `python -m par plan` searches: beyond these the answer would take minutes (or overflow), and no machine has them
MAX_WORLD = 1 << 20          # devices (the largest clusters have ~1e5)
MAX_LAYERS = 256             # blocks (the largest models have ~100-200; the balanced cut is O(L²·pp))
MAX_WIDTH = 1 << 20          # d_model
MAX_SEQ = 1 << 24            # tokens of context
MAX_BATCH = 1 << 30          # sequences per step


def block_params(cfg, tp: int = 1) -> float:
    """One block's parameters on one tp rank: `par.memory.accounting.gpt_block_params` with everything but the
    replicated pieces split over tp. Replicated: the 2 LayerNorms (4d) and the biases of the two
    row-parallel projections (2d), added after the all-reduce (`par.tp.layers`)."""
    return memory.gpt_block_params(cfg.d_model, cfg.ffn, tp)


def layer_params(cfg, tp: int = 1) -> list[float]:
    """Parameters one tp rank holds per entry of [embedding, block × L, head] (blocks split over tp)."""
    d, v, t = cfg.d_model, cfg.vocab_size, cfg.block_size
    head = 2 * d + (0 if cfg.tie_embeddings else v * d)
    return [v * d + t * d, *([block_params(cfg, tp)] * cfg.n_layer), head]


@functools.lru_cache(maxsize=4096)
def stage_params(cfg, pp: int, tp: int = 1) -> tuple[float, list[tuple[int, int]]]:
    """(parameters of the largest stage, stage bounds) for the balanced cut of `par.pp.partition`."""
    weights = layer_params(cfg, tp)
    if pp > len(weights):
        raise ValueError(f"{pp} stages for {len(weights)} layers")
    if pp == 1:
        return sum(weights), [(0, len(weights))]
    bounds = partition.balanced([int(round(w)) for w in weights], pp)
    return max(sum(weights[a:b]) for a, b in bounds), bounds


@functools.lru_cache(maxsize=4096)
def group_bandwidth(axis: str, layout: Layout, hw: Hardware) -> float:
    """The node's bandwidth when every group along `axis` stays inside one node, the network's otherwise."""
    inside = groups_in_node(axis, layout, hw.gpus_per_node)
    return hw.bw_node if inside else hw.bw_network


def activation_bytes(w: Workload, micro_batch: int, layers: int, in_flight: int, tp: int,
                     last_stage: bool) -> float:
    """Activations one device keeps at the peak: `par.memory.accounting.activation_peak_bytes` for the stage's layers
    and the micro-batches in flight (with full recomputation: the layer inputs plus one layer rebuilt),
    plus the logits of one micro-batch (2·b·s·V values) on the last stage: its backward follows its forward."""
    cfg, e = w.model, w.bytes_per_value
    acts = memory.activation_peak_bytes(w.seq, micro_batch, cfg.d_model, cfg.n_head, layers, w.recompute, e,
                                        dropout=False, tp=tp, in_flight=in_flight)
    logits = 2 * micro_batch * w.seq * cfg.vocab_size * e if last_stage else 0
    return acts + logits


def step_flops(w: Workload) -> float:
    """(6·N + 12·L·s·d)·B·s: the matmuls of forward and backward, N the weights that multiply activations
    (`par.mfu.flops_per_token`: no embedding lookup, the LM head counted, the attention scores included);
    × 4/3 with full recomputation (a second forward)."""
    flops = mfu.flops_per_token(w.model, w.seq) * w.global_batch * w.seq
    return flops * (4 / 3 if w.recompute == "full" else 1)


PIPELINE_SCHEDULES = ("1f1b", "zb_h1", "zb_v")


@functools.lru_cache(maxsize=4096)
def pipeline_bubble(schedule: str, pp: int, m: int) -> float:
    """Bubble time over compute time, φ/(1-φ), of `schedule` on pp stages and m micro-batches with equal costs
    (F = 1, I = W = 1, B = 2): the formula where it holds (`par.pp.sim.bubble_formula_of`), else the simulator."""
    from par.pp import schedules, sim
    if pp == 1:
        return 0.0
    phi = sim.bubble_formula_of(schedule, pp, m)
    if phi is None:
        phi = sim.simulate(schedules.make(schedule, pp, m), forward=1.0, backward=2.0).bubble_fraction
    return phi / (1 - phi)


@functools.lru_cache(maxsize=4096)
def pipeline_in_flight(schedule: str, pp: int, m: int) -> float:
    """Stage-sized micro-batch activations held at the peak on the busiest rank, counted on the schedule's own
    actions (`par.pp.sim.peak_in_flight_per_rank`; a V schedule's chunk holds half a stage)."""
    from par.pp import schedules, sim
    if pp == 1:
        return 1
    sched = schedules.make(schedule, pp, m)
    return max(sim.peak_in_flight_per_rank(sched)) / sched.virtual


def predict(w: Workload, dp: int, pp: int, tp: int, zero_stage: int = 0, microbatches: int = 1,
            hw: Hardware = Hardware(), offload: bool = False, cp: int = 1, schedule: str = "1f1b") -> Plan:
    """Memory per device and step time of one layout (see the module docstring); `valid` False with the reason
    when the layout cannot run.

    cp > 1 (context parallelism, `par.cp.ring_attention`): cp ranks split every sequence, so activations and
    compute per device are divided by cp (the TP activation formula / cp: an upper bound, ring attention also
    drops the as²b scores); each layer and micro-batch sends its K, V blocks around the cp ring,
    `ring_attention_bytes_even` forward + backward with width d/tp; the gradients are summed over dp·cp ranks."""
    plan = Plan(dp, pp, tp, zero_stage, microbatches, offload, cp=cp, schedule=schedule)
    cfg = w.model
    problems = []
    if cfg.n_head % tp or cfg.d_model % tp or cfg.ffn % tp:
        problems.append(f"tp {tp} does not divide n_head {cfg.n_head} / d_model {cfg.d_model}")
    if pp > cfg.n_layer + 2:
        problems.append(f"pp {pp} > {cfg.n_layer + 2} layers")
    if w.global_batch % (dp * microbatches):
        problems.append(f"batch {w.global_batch} not divisible by dp {dp} × m {microbatches}")
    if zero_stage > 1 and (pp > 1 or tp > 1):
        problems.append(f"ZeRO-{zero_stage} with pp/tp > 1")
    if offload and zero_stage == 0:
        problems.append("offload needs ZeRO >= 1")
    if cp < 1 or w.seq < 2 * cp:
        problems.append(f"cp {cp} needs at least 2·cp = {2 * cp} tokens per sequence (seq {w.seq})")
    if schedule not in PIPELINE_SCHEDULES:
        problems.append(f"unknown schedule {schedule!r}: one of {', '.join(PIPELINE_SCHEDULES)}")
    elif schedule == "zb_v" and pp > 1 and microbatches < pp:
        problems.append(f"zb_v needs m >= pp ({microbatches} < {pp})")
    elif schedule != "1f1b" and pp > 1 and zero_stage > 1:
        problems.append(f"{schedule} with ZeRO-{zero_stage}")
    if problems:
        plan.valid, plan.reason = False, "; ".join(problems)
        return plan
    b = w.global_batch // (dp * microbatches)
    plan.micro_batch = b
    psi, bounds = stage_params(cfg, pp, tp)
    plan.params_per_device = psi
    states = memory.model_state_bytes(psi, dp * cp, zero_stage, w.precision, w.optimizer)
    opt_device = 0.0 if offload else states.optimizer
    blocks_per_stage = max(sum(1 for i in range(a, c) if 1 <= i <= cfg.n_layer) for a, c in bounds)
    in_flight = pipeline_in_flight(schedule, pp, microbatches)
    act = activation_bytes(w, b, blocks_per_stage, in_flight, tp, last_stage=True) / cp
    plan.memory = {"params": states.params, "grads": states.grads, "optimizer": opt_device, "activations": act,
                   "host": states.optimizer if offload else 0.0}
    plan.memory["total"] = states.params + states.grads + opt_device + act
    plan.fits = plan.memory["total"] <= hw.memory
    # time
    lay = Layout(dp, pp, tp)
    e, bp = w.bytes_per_value, memory.bytes_per_param(w.precision, w.optimizer)
    compute = step_flops(w) / (dp * pp * tp * cp * hw.flops)
    bubble = compute * pipeline_bubble(schedule, pp, microbatches)
    act_msg = b * w.seq * cfg.d_model * e / cp
    ring = ring_attention_bytes_even(b, w.seq, cfg.d_model // tp, cp, e)
    plan.bytes = {"dp": zero_bytes_per_step(psi, dp * cp, zero_stage, microbatches, bp.grads),
                  "tp": 4 * blocks_per_stage * microbatches * 2 * (tp - 1) / tp * act_msg,
                  "pp": 2 * microbatches * act_msg * (pp - 1) / pp}
    if cp > 1:
        plan.bytes["cp"] = blocks_per_stage * microbatches * (ring["forward"] + ring["backward"])
    plan.bytes["total"] = sum(plan.bytes.values())
    t_dp = plan.bytes["dp"] / group_bandwidth("dp", lay, hw)
    t_tp = plan.bytes["tp"] / group_bandwidth("tp", lay, hw)
    t_pp = 2 * microbatches * act_msg / group_bandwidth("pp", lay, hw) if pp > 1 else 0.0   # a middle stage: both ways
    t_off = (bp.grads + bp.weights) * math.ceil(psi / dp) / hw.bw_host if offload else 0.0
    plan.time = {"compute": compute, "bubble": bubble, "dp": t_dp, "tp": t_tp, "pp": t_pp, "offload": t_off}
    if cp > 1:   # the cp ring inside a node when tp·cp GPUs fit in one, else across the network
        plan.time["cp"] = plan.bytes["cp"] / (hw.bw_node if tp * cp <= hw.gpus_per_node else hw.bw_network)
    plan.time["total"] = sum(plan.time.values())
    plan.samples_per_s = w.global_batch / plan.time["total"]
    return plan


def enumerate_plans(w: Workload, world: int, hw: Hardware = Hardware(), stages=(0, 1, 2, 3),
                    microbatches=(1, 2, 4, 8, 16, 32), offload=(False, True), schedules=("1f1b",)) -> list[Plan]:
    """`predict` for every layout of `world` × ZeRO stage × micro-batch count × offload × pipeline schedule (the
    schedules only where pp > 1; invalid ones included)."""
    out = []
    for dp, pp, tp in layouts(world):
        for z in stages:
            for m in microbatches:
                for off in offload:
                    for schedule in (schedules if pp > 1 else schedules[:1]):
                        out.append(predict(w, dp, pp, tp, z, m, hw, off, schedule=schedule))
    return out


def rank_plans(plans: list[Plan]) -> list[Plan]:
    """Valid plans that fit, fastest first (ties: fewer, larger micro-batches, then less memory); then valid
    plans that do not fit, smallest memory first."""
    valid = [p for p in plans if p.valid]
    fit = sorted((p for p in valid if p.fits), key=lambda p: (p.time["total"], p.microbatches, p.memory["total"]))
    over = sorted((p for p in valid if not p.fits), key=lambda p: p.memory["total"])
    return fit + over


def format_plans(plans: list[Plan], top: int = 10) -> str:
    """A text table of the first `top` plans: layout, memory per device, step time and its parts."""
    head = (f"{'layout':<30} {'fits':>4} {'mem/dev':>10} {'states':>10} {'activ.':>10} {'step s':>9} "
            f"{'bubble':>8} {'dp':>8} {'tp':>8} {'samples/s':>10}")
    lines = [head, "-" * len(head)]
    for p in plans[:top]:
        m, t = p.memory, p.time
        lines.append(f"{p.label:<30} {'yes' if p.fits else 'NO':>4} {memory.format_bytes(m['total']):>10} "
                     f"{memory.format_bytes(m['params'] + m['grads'] + m['optimizer']):>10} "
                     f"{memory.format_bytes(m['activations']):>10} {t['total']:>9.3g} {t['bubble']:>8.3g} "
                     f"{t['dp']:>8.3g} {t['tp']:>8.3g} {p.samples_per_s:>10.3g}")
    return "\n".join(lines)


def largest_model(w: Workload, dp: int, pp: int, tp: int, zero_stage: int, microbatches: int,
                  hw: Hardware, offload: bool = False, max_width: int = 1 << 16):
    """The widest d_model (a multiple of n_head·tp, other sizes fixed) whose plan fits `hw.memory`.
    Returns (GPTConfig, Ψ) or (None, 0) when even the narrowest does not fit."""
    step = w.model.n_head * tp
    lo, hi = 0, max_width // step     # d = k · step; fits(lo) is known true (or lo = 0: nothing)

    def fits(k):
        cfg = replace(w.model, d_model=k * step, d_ff=None)
        return predict(replace(w, model=cfg), dp, pp, tp, zero_stage, microbatches, hw, offload).fits
    if not fits(1):
        return None, 0
    lo = 1
    if fits(hi):
        lo = hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    cfg = replace(w.model, d_model=lo * step, d_ff=None)
    return cfg, memory.param_count(cfg)


def from_config(tc, hw: Hardware = Hardware()) -> Plan:
    """The prediction for a `par.train.config.TrainConfig` (what `python -m par train` would run)."""
    from par.train.config import model_config
    w = Workload(model_config(tc), tc.train_batch_size, "fp32" if tc.precision == "fp32" else "mixed", tc.optimizer)
    m = tc.grad_accum
    return predict(w, tc.dp, tc.pp, tc.tp, tc.zero_stage, m, hw, tc.offload)


def model_of(text: str, seq: int | None):
    """The GPTConfig of `--model`: a preset, or L,H,d (layers, heads, width) of GPT-2's vocabulary; `seq`
    tokens of context (default: the preset's, 2048). A name or numbers that make no model: ArgumentError."""
    import argparse
    from par.model import GPTConfig, preset
    from par.runtime.checks import positive_int
    if "," not in text:
        try:
            return preset(text, **({"block_size": seq} if seq else {}))
        except ValueError as e:
            raise argparse.ArgumentError(None, f"--model: {e}; or give L,H,d (layers,heads,width)") from None
    try:
        layers, heads, width = (positive_int(v) for v in text.split(","))
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentError(None, f"--model {text!r}: give L,H,d as three whole numbers >= 1 "
                                           f"(layers,heads,width, e.g. 100,96,12288) or a preset") from None
    if layers > MAX_LAYERS or width > MAX_WIDTH:
        raise argparse.ArgumentError(None, f"--model {text!r}: at most {MAX_LAYERS:,} layers and width {MAX_WIDTH:,} "
                                           f"(the planner's bounds; the largest models have ~200 layers)")
    if width % heads:
        raise argparse.ArgumentError(None, f"--model {text!r}: {heads} heads do not divide width {width}: "
                                           f"pick heads among the divisors of {width}")
    return GPTConfig(vocab_size=50257, block_size=seq or 2048, n_layer=layers, n_head=heads, d_model=width)


def main(argv=None) -> int:
    """`python -m par plan --model gpt3-small --world 64 --hardware a100-80gb --batch 512 [--recompute]`."""
    import argparse
    from par.runtime.checks import int_at_most, positive_float, positive_int
    ap = argparse.ArgumentParser(prog="python -m par plan", description="rank (dp, pp, tp, ZeRO, m) layouts")
    ap.add_argument("--model", default="gpt3-small", help="a GPT-lite preset, or L,H,d (layers,heads,width)")
    ap.add_argument("--seq", type=int_at_most(MAX_SEQ, "the planner's bound"), default=None,
                    help="sequence length (default: the preset's)")
    ap.add_argument("--world", type=int_at_most(MAX_WORLD, "the planner's bound: a million devices"), default=8)
    ap.add_argument("--hardware", default="a100-80gb", choices=sorted(HARDWARE))
    ap.add_argument("--memory", type=positive_float, default=None, help="bytes per device (default: the hardware's)")
    ap.add_argument("--batch", type=int_at_most(MAX_BATCH, "the planner's bound"), default=512,
                    help="global batch (sequences)")
    ap.add_argument("--precision", default="mixed", choices=("fp32", "mixed", "pure16"))
    ap.add_argument("--recompute", action="store_true", help="full activation recomputation")
    ap.add_argument("--top", type=positive_int, default=15)
    ap.add_argument("--schedules", default="1f1b", help="pipeline schedules to consider, comma-separated: "
                                                        f"{', '.join(PIPELINE_SCHEDULES)} (lecture 03)")
    args = ap.parse_args(argv)
    cfg = model_of(args.model, args.seq)
    hw = HARDWARE[args.hardware]
    hw = replace(hw, memory=args.memory) if args.memory else hw
    w = Workload(cfg, args.batch, args.precision, recompute="full" if args.recompute else "none")
    chosen = tuple(s.strip() for s in args.schedules.split(",") if s.strip())
    bad = [s for s in chosen if s not in PIPELINE_SCHEDULES]
    if bad or not chosen:
        raise argparse.ArgumentError(None, f"--schedules {args.schedules!r}: choose from {', '.join(PIPELINE_SCHEDULES)}")
    ranked = rank_plans(enumerate_plans(w, args.world, hw, microbatches=(1, 2, 4, 8, 16, 32, 64, 128, 256),
                                        schedules=chosen))
    print(f"Ψ = {memory.param_count(cfg):,} on {args.world} × {hw.name} ({memory.format_bytes(hw.memory)}); "
          f"{sum(p.fits for p in ranked)} of {len(ranked)} valid plans fit")
    print(format_plans(ranked, args.top))
    return 0


# ---------------------------------------------------------------- mixture of experts: the ep degree
@dataclass(frozen=True)
class MoE:
    """The MoE layers of a workload (`par.moe.router`): E experts per block, top-k, capacity factor f."""
    n_experts: int = 8
    k: int = 2
    capacity_factor: float = 1.25


def predict_moe(w: Workload, moe: MoE, world: int, ep: int, zero_stage: int = 0, hw: Hardware = Hardware()) -> Plan:
    """Memory per device and step time of EP inside DP: `world` data-parallel ranks, experts sharded over
    EP groups of `ep` consecutive ranks (`par.moe.experts`), every block a MoE block.

    memory    states of the replicated Ψ_r over `world` ranks + states of the rank's experts Ψ_e over the
              world/ep ranks that hold them (`par.memory.accounting.moe_param_count`, `model_state_bytes`); activations
              as the dense model's (the dispatch buffers, f·k·b·s·d per layer, are left out)
    compute   the active parameters: the router picks k experts per token, so `step_flops` of a dense model
              whose FFN is k times wider (its MLP matmuls k·L·2·d·f)
    dp        gradients: Ψ_r over all ranks, Ψ_e over world/ep (`zero_bytes_per_step`)
    ep        4 all-to-alls per layer (dispatch, combine, and both backward), each
              (ep-1)/ep · E·C·d values, C = ceil(f·k·b·s/E) (`par.moe.experts.alltoall_formula_bytes`);
              inside a node when ep <= gpus_per_node (its ranks are consecutive)"""
    from par.moe.experts import alltoall_formula_bytes
    from par.moe.router import capacity
    plan = Plan(world, 1, 1, zero_stage, 1, ep=ep)
    cfg, problems = w.model, []
    if ep < 1 or world % ep:
        problems.append(f"ep {ep} does not divide the {world} ranks")
    if ep > moe.n_experts:
        problems.append(f"ep {ep} > {moe.n_experts} experts")
    if w.global_batch % world:
        problems.append(f"batch {w.global_batch} not divisible by dp {world}")
    if zero_stage > 1:
        problems.append(f"ZeRO-{zero_stage} with expert parallelism (only 0 and 1 here)")
    if problems:
        plan.valid, plan.reason = False, "; ".join(problems)
        return plan
    b = w.global_batch // world
    plan.micro_batch = b
    replicated, experts = memory.moe_param_count(cfg, moe.n_experts, ep)
    plan.params_per_device = replicated + experts
    s_r = memory.model_state_bytes(replicated, world, zero_stage, w.precision, w.optimizer)
    s_e = memory.model_state_bytes(experts, world // ep, zero_stage, w.precision, w.optimizer)
    act = activation_bytes(w, b, cfg.n_layer, 1, 1, last_stage=True)
    plan.memory = {"params": s_r.params + s_e.params, "grads": s_r.grads + s_e.grads,
                   "optimizer": s_r.optimizer + s_e.optimizer, "activations": act, "host": 0.0}
    plan.memory["total"] = sum(v for k_, v in plan.memory.items() if k_ != "host")
    plan.fits = plan.memory["total"] <= hw.memory
    e, bp = w.bytes_per_value, memory.bytes_per_param(w.precision, w.optimizer)
    active = replace(w, model=replace(cfg, d_ff=cfg.ffn * moe.k))
    compute = step_flops(active) / (world * hw.flops)
    cap = capacity(b * w.seq, moe.n_experts, moe.k, moe.capacity_factor)
    plan.bytes = {"dp": zero_bytes_per_step(replicated, world, zero_stage, 1, bp.grads)
                  + zero_bytes_per_step(experts, world // ep, zero_stage, 1, bp.grads),
                  "ep": 4 * cfg.n_layer * alltoall_formula_bytes(moe.n_experts, cap, cfg.d_model, ep, e)}
    plan.bytes["total"] = plan.bytes["dp"] + plan.bytes["ep"]
    bw_dp = hw.bw_node if world <= hw.gpus_per_node else hw.bw_network
    bw_ep = hw.bw_node if ep <= hw.gpus_per_node else hw.bw_network
    plan.time = {"compute": compute, "dp": plan.bytes["dp"] / bw_dp, "ep": plan.bytes["ep"] / bw_ep}
    plan.time["total"] = sum(plan.time.values())
    plan.samples_per_s = w.global_batch / plan.time["total"]
    return plan


def moe_plans(w: Workload, moe: MoE, world: int, hw: Hardware = Hardware(), stages=(0, 1)) -> list[Plan]:
    """`predict_moe` for every ep degree dividing `world` (and at most E) × ZeRO stage, fitting first, fastest first."""
    return rank_plans([predict_moe(w, moe, world, ep, z, hw) for ep in range(1, world + 1)
                       if world % ep == 0 and ep <= moe.n_experts for z in stages])
