"""The cost model: seconds of compute, of communication and of a pipeline, in one place.

The planner (`par.train.planner`) and every other prediction of time in par read their seconds here; a calibration
is data (a `Compute` or a `Link` with other numbers), never another formula.

compute (`Compute`, a roofline per device)
    a GEMM of m×k by k×n, `batch` times, in e-byte values, does F = 2·m·n·k·batch FLOPs on
    Q = e·(m·k + k·n + m·n)·batch bytes; its intensity is I = F / Q and it takes

        t = launch + F / rate(I),     rate(I) = η·min(P, I·B)        (the roofline of `par.device.roofline`)

    with P the peak matmul FLOP/s and B the memory bandwidth of the datasheet, η the fraction of both that the
    device reaches (calibrated on one published run per GPU type, `GPUS`). A measured `table` of
    (intensity, FLOP/s) points replaces η·min(P, I·B) by the points, interpolated in log-log (clamped at its ends):
    that is where lecture 10's roofline measurement on this machine goes (`gemm_table`). Memory-bound work
    (LayerNorm, softmax, dropout, GeLU, residual adds) takes launch + Q / (η·B), and the optimizer step
    launch + Q / (η·B_opt), B_opt its own measured bytes/s where one is given (`optimizer_bandwidth`), else B.
    `Compute.flat(rate)` is one achieved FLOP/s for every GEMM and nothing for the memory-bound work (what the
    planner did before the roofline; the "cpu" preset still is: `par.train.calibration` measures this machine's
    GEMMs, launch, bandwidths and collectives into a Hardware of its own).

    `layer_gemms` lists the GEMMs of one transformer block per micro-batch (QKV, attention scores, attention
    over V, output projection, MLP in, MLP out; the logits apart, `head_gemm`) with their shapes on one rank of
    tp tensor-parallel and cp context-parallel ranks; `layer_memory_bytes` the bytes its memory-bound ops move.
    Backward runs each GEMM twice (input and weight gradients: the same shapes, so the same rate) and moves the
    memory-bound bytes twice.

communication (`Link`: α + β·bytes, β = 1 / bandwidth, per direction and device)
    ring all-reduce        2(n-1)·α + 2(n-1)/n · S·β       (`par.comm.collectives.ring_all_reduce_time`)
    reduce-scatter         (n-1)·α + (n-1)/n · S·β
    all-gather             (n-1)·α + (n-1)/n · S·β
    all-to-all             (n-1)·α + (n-1)/n · S·β          (S: what one rank holds before and after)
    send / receive         α + S·β                          (p2p: one rank's send while it receives as much)
    S is the whole buffer's bytes (for all-gather and all-to-all too: the gathered or exchanged total);
    `collective_terms` gives each kind's (steps, bytes), the one home of this table. A Link may carry its own
    (α, bandwidth) per collective kind (`Link.kinds`, measured: `fitted_link(samples, kind)` fits one kind's
    measured calls to its own row of the table, `par.comm.collectives.fit_steps_bytes`), so a collective that
    costs more than its formula's bytes on some backend (par's ring on gloo adds the received chunks on the CPU)
    is charged what it was measured to cost; a kind without its own pair uses the Link's α and bandwidth.

overlap (`exposed`)
    communication that runs beside computation costs only what the computation leaves:
    exposed = max(0, comm − overlappable). Bucketed data parallelism overlaps its all-reduce with the last
    micro-batch's backward, ZeRO-2 its reduce-scatters with every backward, ZeRO-3 its prefetched gathers with
    every forward and backward; tensor-parallel and context-parallel collectives and pipeline sends are on the
    critical path (overlappable = 0).

pipelines (`pipeline_bubble`)
    on p stages with m micro-batches, per-micro-batch costs f (forward) and b = i + w (backward: input and
    weight halves) of the busiest stage, the step lasts m·(f + b)·(1 + r) with r the bubble over compute:
        GPipe, 1F1B            r = (p-1)/m
        interleaved, v chunks  r = (p-1)/(v·m)
        ZB-H1                  r = φ/(1-φ), φ = (p-1)(f+i-w) / (m(f+i+w) + (p-1)(f+i-w))
        ZB-V                   r = (p-1)/(6m) (m >= 2p-1; below, the simulator with F = I = W)
    `par.pp.sim` replays the schedules with these costs; tests/test_planner.py holds the closed forms to it (exact
    with equal stages; with a heavier last stage the busiest stage's form is an upper bound, within 15 % there).

GPU types (`GPUS`): A100, H100 and H200 rooflines from their datasheets (peak: `par.mfu.PEAK`), each η calibrated
on one published run (`par.train.planner.calibrate`, par/train/published_runs.json): A100 0.7173 on Megatron-LM SC21
Table 1's first row, H100 0.6554 on Llama 3 Table 4's first row, H200 the H100's (no H200 run is published here).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from par.comm.collectives import all_reduce_formula_bytes, fit_steps_bytes
from par.memory.accounting import bytes_per_param, canonical_precision, LlamaConfig
from par.pp import schedules, sim


# ---------------------------------------------------------------- compute: the roofline
@dataclass(frozen=True)
class Compute:
    """One device's roofline: peak matmul FLOP/s `peak`, memory bandwidth `bandwidth` (bytes/s), the fraction
    `efficiency` (η) of both it reaches, `launch` seconds per operation, optionally a measured `table` of
    (intensity FLOP/byte, achieved FLOP/s) for GEMMs and the optimizer step's own bytes/s `optimizer_bandwidth`
    (0: the memory bandwidth); `source` says where the numbers come from. With a measured table, η is the
    share of the measured rates a step reaches (`par.train.suite.in_step_efficiency`), and may exceed 1."""
    peak: float
    bandwidth: float = math.inf
    efficiency: float = 1.0
    launch: float = 0.0
    table: tuple = ()
    source: str = ""
    optimizer_bandwidth: float = 0.0

    def __post_init__(self):
        if not (self.peak > 0 and self.bandwidth > 0 and 0 < self.efficiency and (self.efficiency <= 1 or self.table)
                and self.launch >= 0 and self.optimizer_bandwidth >= 0):
            raise ValueError(f"a Compute needs peak, bandwidth > 0, 0 < efficiency (<= 1 on a datasheet roofline), "
                             f"launch >= 0, optimizer_bandwidth >= 0: got {self}")
        if any(i <= 0 or r <= 0 for i, r in self.table) or list(self.table) != sorted(self.table):
            raise ValueError(f"a GEMM table is (intensity, FLOP/s) pairs > 0, by rising intensity: {self.table}")

    @classmethod
    def flat(cls, rate: float, source: str = "one achieved FLOP/s for every GEMM") -> "Compute":
        """Every GEMM at `rate` FLOP/s and memory-bound work free (bandwidth infinite)."""
        return cls(peak=rate, bandwidth=math.inf, efficiency=1.0, source=source)

    @property
    def is_flat(self) -> bool:
        return math.isinf(self.bandwidth) and not self.table

    def rate(self, intensity: float) -> float:
        """Achieved FLOP/s of a GEMM of this intensity: η times the table, interpolated in log-log, else
        η·min(P, I·B)."""
        if self.table:
            return self.efficiency * self._measured_rate(intensity)
        return self.efficiency * min(self.peak, intensity * self.bandwidth)

    def _measured_rate(self, intensity: float) -> float:
        xs, ys = zip(*self.table)
        if intensity <= xs[0]:
            return ys[0] * intensity / xs[0]          # below the table: memory-bound, rate ∝ intensity
        if intensity >= xs[-1]:
            return ys[-1]
        j = next(j for j in range(1, len(xs)) if xs[j] >= intensity)
        t = math.log(intensity / xs[j - 1]) / math.log(xs[j] / xs[j - 1])
        return math.exp(math.log(ys[j - 1]) + t * math.log(ys[j] / ys[j - 1]))

    def gemm_seconds(self, m: float, n: float, k: float, batch: float = 1, e: int = 2) -> float:
        """launch + 2mnk·batch / rate(I), I = 2mnk / (e(mk + kn + mn)): one GEMM (or `batch` of them at once)."""
        flops = 2 * m * n * k * batch
        if flops == 0:
            return 0.0
        return self.launch + flops / self.rate(2 * m * n * k / (e * (m * k + k * n + m * n)))

    def memory_seconds(self, nbytes: float, ops: int = 1) -> float:
        """ops·launch + bytes / (η·B): memory-bound work that moves `nbytes` in `ops` kernels."""
        return ops * self.launch + nbytes / (self.efficiency * self.bandwidth)

    def optimizer_seconds(self, nbytes: float) -> float:
        """launch + bytes / (η·B_opt): an optimizer step that moves `nbytes` (`optimizer_bytes_per_param` × its
        partition), B_opt = `optimizer_bandwidth` where measured, else the memory bandwidth."""
        if nbytes == 0:
            return 0.0
        return self.launch + nbytes / (self.efficiency * (self.optimizer_bandwidth or self.bandwidth))


# ---------------------------------------------------------------- communication: α + β·bytes
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "p2p")


@dataclass(frozen=True)
class Link:
    """A link per device and direction: `bandwidth` bytes/s, `alpha` seconds per message step; `kinds`, where
    measured, ((kind, alpha, bandwidth), ...): a collective kind's own pair, which replaces the Link's for it."""
    bandwidth: float
    alpha: float = 0.0
    kinds: tuple = ()

    def __post_init__(self):
        if not (self.bandwidth > 0 and self.alpha >= 0):
            raise ValueError(f"a Link needs bandwidth > 0 and alpha >= 0: got {self}")
        bad = [k for k in self.kinds if len(k) != 3 or k[0] not in COLLECTIVES or not (k[1] >= 0 and k[2] > 0)]
        if bad:
            raise ValueError(f"a Link's kinds are (collective, alpha >= 0, bandwidth > 0), collective one of "
                             f"{', '.join(COLLECTIVES)}: got {bad}")

    def seconds(self, nbytes: float, steps: int = 1) -> float:
        """steps·α + bytes / bandwidth."""
        return steps * self.alpha + nbytes / self.bandwidth

    def of(self, kind: str) -> "Link":
        """The Link a collective of `kind` sees: its own measured (α, bandwidth) where `kinds` has them."""
        for k, alpha, bandwidth in self.kinds:
            if k == kind:
                return Link(bandwidth, alpha)
        return Link(self.bandwidth, self.alpha)


def collective_terms(kind: str, n: int, nbytes: float) -> tuple[float, float]:
    """(latency steps, bytes on each rank's link) of one collective of `nbytes` (the whole buffer) over n ranks:
    the module docstring's table (all-reduce: `par.comm.collectives.all_reduce_formula_bytes`)."""
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r}: one of {', '.join(COLLECTIVES)}")
    if kind == "p2p":
        return (1, nbytes) if nbytes else (0, 0.0)
    if n <= 1 or nbytes == 0:
        return 0, 0.0
    if kind == "all_reduce":
        return 2 * (n - 1), all_reduce_formula_bytes(nbytes, n)
    return n - 1, (n - 1) / n * nbytes


def collective_seconds(kind: str, n: int, nbytes: float, link: Link) -> float:
    """Seconds of one collective of `nbytes` (the whole buffer) over n ranks: steps·α + bytes·β of
    `collective_terms`, with the (α, β) of `link.of(kind)` (for an all-reduce `ring_all_reduce_time`)."""
    steps, moved = collective_terms(kind, n, nbytes)
    return link.of(kind).seconds(moved, steps) if steps else 0.0


def fitted_link(samples, kind: str = "all_reduce") -> Link:
    """The Link of measured collectives of one `kind`, (n, bytes, seconds) samples: α and 1/β fitted to the
    kind's row of the table (`collective_terms`) by `par.comm.collectives.fit_steps_bytes` (for ring all-reduces
    what `fit_alpha_beta` fits: lecture 00's measurement on this machine becomes data)."""
    terms = [(*collective_terms(kind, n, s), t) for n, s, t in samples]
    alpha, beta = fit_steps_bytes([(steps, moved, t) for steps, moved, t in terms if steps])
    if beta <= 0:
        raise ValueError(f"the {kind} samples fit no bandwidth (all latency): time larger ones")
    return Link(1 / beta, alpha)


def fitted_links(samples: dict) -> Link:
    """One Link of measured collectives of several kinds, {kind: [(n, bytes, seconds), ...]}: each kind with its
    own fitted (α, bandwidth) in `kinds`; the Link's own pair is the all-reduce's (or the first kind's)."""
    fits = {kind: fitted_link(rows, kind) for kind, rows in samples.items()}
    if not fits:
        raise ValueError("no measured collectives to fit a Link to")
    base = fits.get("all_reduce", next(iter(fits.values())))
    return Link(base.bandwidth, base.alpha, tuple((k, f.alpha, f.bandwidth) for k, f in fits.items()))


def gemm_table(samples, e: int = 2, combine: str = "fastest") -> tuple:
    """A `Compute.table` from measured GEMMs, (m, n, k, seconds) samples (lecture 10's roofline on this machine):
    ((intensity, FLOP/s), ...) by rising intensity. Shapes that share an intensity (m, n, k in any order) keep
    the fastest (`combine="fastest"`) or their FLOPs over their seconds together (`"mean"`: what a step that runs
    them all gets)."""
    if combine not in ("fastest", "mean"):
        raise ValueError(f"combine must be 'fastest' or 'mean', got {combine!r}")
    best, flops, secs = {}, {}, {}
    for m, n, k, seconds in samples:
        if seconds <= 0:
            raise ValueError(f"a GEMM {m}x{n}x{k} cannot take {seconds} s")
        intensity = 2 * m * n * k / (e * (m * k + k * n + m * n))
        best[intensity] = max(best.get(intensity, 0.0), 2 * m * n * k / seconds)
        flops[intensity] = flops.get(intensity, 0.0) + 2 * m * n * k
        secs[intensity] = secs.get(intensity, 0.0) + seconds
    if combine == "mean":
        return tuple(sorted((i, flops[i] / secs[i]) for i in flops))
    return tuple(sorted(best.items()))


def exposed(comm: float, overlappable: float) -> float:
    """max(0, comm − overlappable): what communication beside `overlappable` seconds of computation adds."""
    return max(0.0, comm - overlappable)


# ---------------------------------------------------------------- the model's shapes
@dataclass(frozen=True)
class ModelDims:
    """What the cost model reads off a model: L blocks of width d, a heads (kv of them for K and V), MLP width f
    with `mlp_mats` matrices (2: GeLU/ReLU, 3: SwiGLU), vocabulary V, learned position rows, tied head or not."""
    layers: int
    d: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    mlp_mats: int = 2
    positions: int = 0
    tied: bool = False
    norm_params: int = 2         # per norm: 2d (LayerNorm weight and bias) or d (RMSNorm)
    biases: bool = True

    @property
    def head_dim(self) -> int:
        return self.d // self.heads

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def block_tensors(self) -> int:
        """Parameter tensors of one block: 2 norms (weight, + bias for a LayerNorm), the attention's matrices (a
        GPT's fused QKV and its projection; a Llama's q, k, v, o) and the MLP's, each with its bias if any."""
        mats = (2 if self.biases else 4) + self.mlp_mats
        return 2 * (2 if self.norm_params == 2 else 1) + mats * (2 if self.biases else 1)


def dims_of(cfg) -> ModelDims:
    """The ModelDims of a `par.model.GPTConfig` (LayerNorm, GeLU, learned positions, biases) or a
    `par.memory.accounting.LlamaConfig` (RMSNorm, SwiGLU, rotary positions, GQA, no biases)."""
    if isinstance(cfg, LlamaConfig):
        return ModelDims(cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads or cfg.n_heads, cfg.ffn_hidden,
                         cfg.vocab_size, 3, 0, cfg.tie_embeddings, 1, False)
    return ModelDims(cfg.n_layer, cfg.d_model, cfg.n_head, cfg.n_head, cfg.ffn, getattr(cfg, "vocab", cfg.vocab_size),
                     2, cfg.block_size, cfg.tie_embeddings, 2, True)


@dataclass(frozen=True)
class Gemm:
    """m×k by k×n, `batch` of them; `name` says which."""
    name: str
    m: float
    n: float
    k: float
    batch: float = 1

    @property
    def flops(self) -> float:
        return 2 * self.m * self.n * self.k * self.batch


def layer_gemms(dims: ModelDims, b: int, s: int, tp: int = 1, cp: int = 1) -> list[Gemm]:
    """The forward GEMMs of one block for a micro-batch of b sequences of s tokens on one rank of tp × cp
    (T = b·s/cp tokens here, the heads split over tp, every key of the sequence seen by the local queries):

        qkv      T × d  by  d × (d + 2·d_kv)/tp
        scores   b·a/tp of (s/cp) × d_h by d_h × s
        values   b·a/tp of (s/cp) × s by s × d_h
        proj     T × d/tp by d/tp × d
        mlp_in   T × d by d × (mats-1)·f/tp         (GeLU: fc; SwiGLU: gate and up)
        mlp_out  T × f/tp by f/tp × d

    Per token and over the three passes (× 3), with the head, they are `par.mfu.flops_per_token`'s 6N + 12·L·s·d for
    a GPT (full s×s scores counted, as the papers count them; `par.train.planner.gemm_flops`)."""
    T, d, a, dh = b * s / cp, dims.d, dims.heads, dims.head_dim
    return [Gemm("qkv", T, (d + 2 * dims.kv_width) / tp, d),
            Gemm("scores", s / cp, s, dh, b * a / tp),
            Gemm("values", s / cp, dh, s, b * a / tp),
            Gemm("proj", T, d, d / tp),
            Gemm("mlp_in", T, (dims.mlp_mats - 1) * dims.ffn / tp, d),
            Gemm("mlp_out", T, d, dims.ffn / tp)]


def head_gemm(dims: ModelDims, b: int, s: int, tp: int = 1, cp: int = 1, vocab_parallel: bool = False) -> Gemm:
    """The logits: T × d by d × V (V/tp when the head is split over tp, Megatron's vocab-parallel head)."""
    return Gemm("logits", b * s / cp, dims.vocab / (tp if vocab_parallel else 1), dims.d)


def layer_memory_bytes(dims: ModelDims, b: int, s: int, tp: int = 1, cp: int = 1, e: int = 2,
                       dropout: bool = False, flash: bool = False, sequence_parallel: bool = False) -> dict:
    """Bytes one block's memory-bound forward ops read and write for a micro-batch on one rank (each tensor
    once per read or write; T = b·s/cp tokens, r = tp when sequence-parallel else 1):

        norms      2 × (read + write) e·T·d / r
        softmax    read + write of the b·a/tp·(s/cp)·s scores, e bytes each (0 with flash attention)
        attn_drop  read + write of the scores + a 1-byte mask (dropout, not flash)
        flash      Q, K, V read and the output written, e·T·(2d + 2·d_kv)/tp (flash only)
        act        GeLU: read + write e·T·f/tp;  SwiGLU: read gate and up, write e·T·f/tp
        residual   2 × (read x and the branch, write the sum) 3e·T·d / r, + a 1-byte mask each with dropout
    """
    T, d, a = b * s / cp, dims.d, dims.heads
    r = tp if sequence_parallel else 1
    scores = b * a / tp * (s / cp) * s
    out = {"norms": 2 * 2 * e * T * d / r,
           "softmax": 0.0 if flash else 2 * e * scores,
           "attn_drop": (2 * e + 1) * scores if dropout and not flash else 0.0,
           "flash": e * T * (2 * d + 2 * dims.kv_width) / tp if flash else 0.0,
           "act": (dims.mlp_mats if dims.mlp_mats == 3 else 2) * e * T * dims.ffn / tp,
           "residual": 2 * (3 * e + (1 if dropout else 0)) * T * d / r}
    return out


@dataclass(frozen=True)
class LayerSeconds:
    """One block, one micro-batch, on one rank: forward, backward (input + weight halves), the recomputation
    the backward adds, and the split of each into GEMMs and memory-bound work."""
    forward: float
    backward_input: float
    backward_weight: float
    recompute: float = 0.0
    gemm_forward: float = 0.0
    memory_forward: float = 0.0

    @property
    def backward(self) -> float:
        return self.backward_input + self.backward_weight + self.recompute


def layer_seconds(compute: Compute, dims: ModelDims, b: int, s: int, tp: int = 1, cp: int = 1, e: int = 2,
                  recompute: str = "none", dropout: bool = False, flash: bool = False,
                  sequence_parallel: bool = False) -> LayerSeconds:
    """Seconds of one block per micro-batch: forward = Σ gemm_seconds + memory_seconds(layer_memory_bytes);
    backward = 2 × each (input gradients: the GEMMs once and the memory-bound ops twice, weight gradients: the
    GEMMs once); recompute "full" adds a forward, "selective" the attention core (scores, softmax, dropout,
    values) again. With flash attention the scores and values GEMMs run at the compute roof (rate(∞))."""
    gemms = layer_gemms(dims, b, s, tp, cp)
    g = {x.name: compute.gemm_seconds(x.m, x.n, x.k, x.batch, e) for x in gemms}
    if flash:   # one fused kernel keeps the scores on chip: the attention GEMMs run at the compute roof
        for x in gemms[1:3]:
            g[x.name] = compute.launch + x.flops / compute.rate(math.inf)
    mem = layer_memory_bytes(dims, b, s, tp, cp, e, dropout, flash, sequence_parallel)
    mem_s = compute.memory_seconds(sum(mem.values()), ops=sum(1 for v in mem.values() if v))
    gemm_f = sum(g.values())
    forward = gemm_f + mem_s
    core = g["scores"] + g["values"] + compute.memory_seconds(mem["softmax"] + mem["attn_drop"] + mem["flash"],
                                                             ops=sum(1 for k in ("softmax", "attn_drop", "flash")
                                                                     if mem[k]))
    again = {"none": 0.0, "full": forward, "selective": core}
    if recompute not in again:
        raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}")
    return LayerSeconds(forward, gemm_f + 2 * mem_s, gemm_f, again[recompute], gemm_f, mem_s)


def gradient_buffers(psi: float, tensors: int, units: int, n: int, zero_stage: int, m: int, g: int = 2,
                     w: int = 2) -> tuple[float, int]:
    """(bytes, operations) of one step's memory-bound work on one rank's gradient and gathered-parameter
    buffers, beside the GEMMs and the collectives, for Ψ = `psi` parameters in `tensors` tensors and `units`
    flat units (ZeRO's), over n data-parallel ranks and m micro-batches, g and w bytes per gradient and weight:

        ZeRO-0/1  each micro-batch after the first adds its gradients into the accumulated ones (autograd's
                  AccumulateGrad: read both, write one): (m-1)·3g·Ψ bytes, one operation per tensor
        ZeRO-2    per micro-batch: the units' flat buckets zeroed (g·Ψ), every gradient copied in (2g·Ψ), the
                  reduced shard added into the partition (3g·Ψ/n): one operation per tensor, two per unit
        ZeRO-3    ZeRO-2's, and per micro-batch two gathers of every unit (forward, backward), each writing the
                  freshly allocated buffer (w·Ψ) and copying the rank's shard into it (2w·Ψ/n): one per unit

    What `par.zero.engine` and `par.train.parallel3d` do (and, bucket for bucket, DeepSpeed's and FSDP's flat
    buffers); Megatron-LM's fused accumulation into the weight-gradient GEMM would have none of ZeRO-0/1's."""
    if zero_stage <= 1:
        return (m - 1) * 3 * g * psi, (m - 1) * tensors
    nbytes, ops = m * (3 * g * psi + 3 * g * psi / n), m * (tensors + 2 * units)
    if zero_stage == 3:
        nbytes, ops = nbytes + m * 2 * (w * psi + 2 * w * psi / n), ops + m * 2 * units
    return nbytes, ops


def optimizer_bytes_per_param(precision: str = "mixed", optimizer: str = "adam") -> int:
    """Bytes the optimizer step moves per parameter of its partition: every optimizer state read and written
    (K of `par.memory.accounting.bytes_per_param`, the fp32 master included), the fp32 weights too when they are
    the working weights, the gradient read in fp32 (4), and the 16-bit working weights written (2) when there are
    any: mixed Adam 2·12 + 4 + 2 = 30, fp32 Adam 2·(8 + 4) + 4 = 28."""
    b = bytes_per_param(precision, optimizer)
    fp32 = canonical_precision(precision) == "fp32"
    return 2 * (b.optimizer + (4 if fp32 else 0)) + 4 + (0 if fp32 else 2)


# ---------------------------------------------------------------- pipelines
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb_h1", "zb_v")


def pipeline_bubble(schedule: str, p: int, m: int, v: int = 1, f: float = 1.0, i: float = 1.0,
                    w: float = 1.0) -> float:
    """Bubble time over compute time, r, of `schedule` on p stages and m micro-batches (module docstring), with the
    busiest stage's forward f and backward halves i, w per micro-batch. The closed forms (`par.pp.sim`'s);
    ZB-V below m = 2p - 1, where it has none, replays the schedule in the simulator with F = I = W."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: one of {', '.join(SCHEDULES)}")
    if p == 1:
        return 0.0
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / m
    if schedule == "interleaved":
        return sim.interleaved_bubble_ratio(p, m, v)
    if schedule == "zb_h1":
        phi = sim.zb_h1_bubble_formula(p, m, f, i, w)
        return phi / (1 - phi)
    phi = sim.bubble_formula_of("zb_v", p, m)
    if phi is None:
        phi = _simulated_bubble("zb_v", p, m)
    return phi / (1 - phi)


@functools.lru_cache(maxsize=1024)
def _simulated_bubble(schedule: str, p: int, m: int) -> float:
    return sim.simulate(schedules.make(schedule, p, m), forward=1.0, backward=2.0).bubble_fraction


@functools.lru_cache(maxsize=4096)
def in_flight(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Stage-sized micro-batch activations the busiest rank holds at its peak, counted on the schedule's own
    actions (`par.pp.sim.peak_in_flight_per_rank`; a chunk of a rank with v chunks holds 1/v of a stage)."""
    if p == 1:
        return 1.0
    sched = schedules.make(schedule, p, m, v if schedule == "interleaved" else 1)
    return max(sim.peak_in_flight_per_rank(sched)) / sched.virtual


# ---------------------------------------------------------------- GPU types
@dataclass(frozen=True)
class GPU:
    """A GPU type: its roofline (`Compute`), memory, NVLink per direction, and where the numbers come from."""
    name: str
    compute: Compute
    memory: float
    nvlink: float
    source: str = ""


# the datasheet rooflines; η of each is calibrated on one published run (par/train/published_runs.json,
# `par.train.planner.calibrate`): A100 on Megatron-LM SC21 Table 1's first row, H100 on Llama 3 Table 4's first
# row; the H200 is the H100's chip with faster memory, so it keeps the H100's η until a run of its own calibrates it.
A100_ETA = 0.7173
H100_ETA = 0.6554
GPUS = {
    "A100": GPU("A100-SXM4-80GB", Compute(312e12, 2.039e12, A100_ETA,
                                          source="peak: par.mfu.PEAK (A100 datasheet, dense bf16); HBM2e 2.039 TB/s "
                                                 "(A100 80GB SXM4); η calibrated on Megatron-LM SC21 Table 1 row 1"),
                80e9, 300e9, "NVLink 3: 300 + 300 GB/s per GPU"),
    "H100": GPU("H100-SXM5-80GB", Compute(989e12, 3.35e12, H100_ETA,
                                          source="peak: par.mfu.PEAK (H100 SXM5, dense bf16); HBM3 3.35 TB/s; "
                                                 "η calibrated on Llama 3 Table 4 row 1"),
                80e9, 450e9, "NVLink 4: 900 GB/s both ways, 450 per direction"),
    "H200": GPU("H200-SXM-141GB", Compute(989e12, 4.8e12, H100_ETA,
                                          source="peak: par.mfu.PEAK (H200 SXM, dense bf16); HBM3e 4.8 TB/s; "
                                                 "η the H100's (same chip), no published H200 run calibrates it"),
                141e9, 450e9, "NVLink 4: 900 GB/s both ways, 450 per direction"),
}


def with_efficiency(compute: Compute, efficiency: float) -> Compute:
    """`compute` reaching `efficiency` of its roofline instead."""
    return replace(compute, efficiency=efficiency)
