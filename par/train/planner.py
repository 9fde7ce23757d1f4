"""The parallelism planner: which (dp, pp, tp, cp, ZeRO stage, micro-batches, schedule) layout for this model and
cluster?

3D parallelism is a resource-allocation problem. For every layout of a world of N devices (dp · pp · tp · cp = N)
the planner predicts, with pure formulas, the memory per device and the step time. Its seconds all come from one
cost model, `par.train.cost` (a roofline per device, α + β·bytes per link and collective, overlap, the pipelines'
bubbles); its bytes from `par.memory.accounting`.

memory per device (bytes)
    Ψ_dev      parameters on the busiest device: the layer list [embedding, L blocks, head] with each block's matrices
               split over tp (`par.memory.accounting.gpt_block_params`, its LayerNorms and row-parallel biases
               replicated, as `par.tp.layers` holds them; embedding and head split too with `vocab_parallel`), cut into
               pp stages (×v chunks interleaved) with the balanced partition of `par.pp.partition` or, with
               partition="uniform", equal blocks per stage (Megatron-LM); the busiest rank's sum
    states     states="paper": `par.memory.accounting.model_state_bytes(Ψ_dev, dp·cp, stage, precision, optimizer)`
               (the ZeRO paper's count); states="deepspeed": `deepspeed_state_bytes` (DeepSpeed's, and Megatron-LM's
               fp16 optimizer's: + the fp32 gradients 4Ψ (/N_d with ZeRO), ZeRO-3's gathered largest layer
               4·L_max, the 16-bit gradients of ZeRO-3 only in that buffer). With offload the optimizer part (fp32 masters, moments,
               fp32 gradients) lives on the host; with offload_params (ZeRO-3) the 16-bit weights too
    activations  `par.memory.accounting.activation_peak_bytes` (Korthikanti et al. 2022: 34·sbh + 5·as²b per layer
               with dropout, its flash, selective, full and sequence-parallel forms) for the busiest rank's blocks and
               the micro-batches in flight on it, read off the schedule itself (`par.train.cost.in_flight`: 1F1B and
               ZB-H1 min(pp, m), ZB-V 2·min(pp, m) chunks of half a stage, interleaved v chunks of 1/v), divided by
               cp (exact with flash attention; without it an upper bound, ring attention never keeps the scores),
               plus the logits of one micro-batch (2·b·s·V values, V/tp when vocab-parallel): the last stage runs a
               micro-batch's backward right after its forward (added to the busiest stage: with a pipeline an
               over-count by those logits, since the first stage holds none). What ZB keeps from I to W is not counted.
               Recomputation keeps each layer's input (full) or all but the attention core (selective), plus one
               layer rebuilt during backward.

step time (seconds), `par.train.cost`:
    compute    per micro-batch and block on one rank, `cost.layer_seconds`: every GEMM (QKV, scores, values,
               projection, MLP in and out; the logits on the last stage) at its roofline rate, plus the memory-bound
               ops' bytes at the memory bandwidth; backward twice the forward; recomputation adds a forward (full) or
               the attention core (selective). On the busiest rank, × m micro-batches.
    tp         per block and micro-batch 2 all-reduces of e·b·s·d/cp bytes forward, 2 backward, 2 more with full
               recomputation (reduce-scatter + all-gather with sequence parallelism: the same bytes), on the
               critical path
    cp         per block and micro-batch: ring attention's K, V around the cp ring (`ring_attention_bytes_even`,
               cp-1 steps), Ulysses' 4 all-to-alls each way, or (cp_kind="all_gather", Llama 3) an all-gather of K, V
               forward and a reduce-scatter of their gradients backward; on the critical path
    pp         one activation forward, one gradient back per micro-batch and chunk: e·b·s·d/cp bytes (/tp with
               Megatron's scatter/gather or sequence parallelism), v of them with v chunks interleaved
    bubble     m·(f + b)·r, r the schedule's bubble over compute for the busiest rank's per-micro-batch costs
               (`cost.pipeline_bubble`: 1F1B (p-1)/m, interleaved (p-1)/(v·m), ZB-H1 and ZB-V theirs)
    dp         the gradients over the dp·cp ranks (`zero_bytes_per_step`, + one more gather per micro-batch for
               ZeRO-3 with full recomputation): ZeRO-0/1 one all-reduce (every unit in one coalesced ring), ZeRO-2
               a reduce-scatter per unit and micro-batch and one all-gather, ZeRO-3 two all-gathers and a
               reduce-scatter per unit and micro-batch (the units: the busiest rank's layers, embedding, blocks,
               head, each its own collective, so each pays its α); with overlap (bucketed DDP, ZeRO-3 prefetch)
               hidden behind backward up to what it leaves, `cost.exposed`: ZeRO-0/1 behind the last
               micro-batch's backward, ZeRO-2's reduce-scatters behind every backward, ZeRO-3 behind every
               forward and backward
    buffers    the gradient and gathered-parameter buffers (`cost.gradient_buffers`): ZeRO-0/1 accumulating each
               micro-batch's gradients into the last's, ZeRO-2/3 copying them into the units' flat buckets and
               adding the reduced shard, ZeRO-3 filling every gathered unit twice per micro-batch; at the memory
               bandwidth, a launch per operation
    optimizer  the step's bytes (`cost.optimizer_bytes_per_param` × the partition) at the optimizer's bytes/s
               (`cost.Compute.optimizer_seconds`); with offload on the host, at `host_optimizer_bw`
    offload    gradient partition down, parameters up, over the host link (`par.zero.offload`)
    straggle   on more than one rank, `straggle` × compute: every collective waits for the last rank to arrive, and
               ranks whose compute jitters (shared cores) arrive apart by a share of the compute before it; the
               share is measured (`par.train.calibration`: a collective after a long GEMM gap against a short one),
               0 on the datasheet presets
    A group's link is the node's (NVLink) when its ranks fit in one node under the grid's layout
    rank = t + tp·(d + dp·s) (`par.runtime.grid`; cp beside tp), the network's otherwise; every link α + β·bytes.
    The bytes of dp, tp, pp and cp per device and step are returned in `Plan.bytes`.

A `Hardware` is a device and its links: its compute is a roofline (peak, hbm, efficiency η, launch, a measured
gemm_table) or, with peak = 0, one flat FLOP/s for every GEMM (`flops`). HARDWARE["a100-80gb"], ["h100-80gb"] and
["h200-141gb"] are the datasheet rooflines of `par.train.cost.GPUS` with η calibrated on one published run each
(`calibrate`); "cpu" and "v100-32gb" stay flat (`par.train.suite.calibrated` sets the CPU's from what
`par.train.calibration` measured just before a row).

Measured against published runs (`published_error()`, par/train/published_runs.json, tests/test_published_runs.py;
TFLOP/s per GPU as each paper counts them, predicted / published − 1), η calibrated on one run per GPU type only:
    Megatron-LM SC21 Table 1, A100 (η = 0.717 from the 1.7B row, 137.0 / 137):
        3.6B +1.6%   7.5B +4.0%   18.4B +6.5%   39.1B +1.1%   76.1B +8.3%
        145.6B +3.7%   310.1B +3.9%   529.6B +2.2%   1008.0B -2.5%
        predicted 137 → 159 as the model grows, published 137 → 163 (rank correlation held >= 0.8)
    Megatron-LM SC21 Table 2: PTD-P rows -1.5% to +3.4%; ZeRO-3 rows +4.0% to +47.8% (the planner hides ZeRO-3's
        gathers behind compute up to what compute leaves; at 384 and 640 GPUs, micro-batch 4, the paper measured
        far less hidden: +38.3%, +47.8%)
    Megatron-LM SC21 Figure 13 (162B on 64 A100s, (p, t) from (2, 32) to (32, 2)): (8, 8) ranked first at
        both batch sizes, as published
    Llama 3 405B Table 4, H100 (η = 0.655 from row 1, 430 / 430): 16K GPUs DP128 -9.9%, CP16 at 131k tokens +1.1%
    memory: the ZeRO paper's Tables 1-2 to their printed digits, its bold cells where the states first fit 32 GB;
        DeepSpeed's estimate_zero2/3_model_states_mem_needs exactly (states="deepspeed"); every Megatron-LM and
        OPT-175B layout that ran fits its 80 GB; not resolved: Llama 3 405B without checkpointing (115 GB and
        80.3 GB predicted: its deallocations are not modelled) and Megatron-LM's 530B ZeRO-3 on 560 GPUs, which
        did not fit (predicted 77.1 GB of 80, 2.1 GB above the 640-GPU layout that ran)
Measured against this CPU (lecture 07's timed rows on 2 gloo ranks of a 2-core VM, `suite.predicted_step_times`:
each row on its own launch's calibration at the one in-step efficiency η fitted on single, step and calibration
on the load-proof clock): measured / predicted 0.86 to 1.19 over three batches with the machine to itself, 0.89 to
1.19 with a second batch beside it on the same cores (the pipeline lowest, ZeRO-3 with offload and TP highest)

A layout is invalid (`Plan.reason`, one line) when its degrees do not divide the model or the batch, and, with
Workload(engine="par") (the default), when par.train.job could not run it: ZeRO-2/3 with pp or tp > 1;
engine="any" states the FSDP / DeepSpeed layouts (ZeRO-3 with TP and PP) too.

`enumerate_plans` lists every layout, valid or not (with the reason), `rank_plans` puts the ones that fit first,
fastest first; `largest_model` grows a model's width until it no longer fits. `predict_run`, `predicted_tflops`,
`calibrate` and `published_error` hold the planner to par/train/published_runs.json.
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from par import mfu
from par.cp.ring_attention import ring_attention_bytes_even
from par.cp.ulysses import ulysses_bytes_even
from par.memory import accounting as memory
from par.model import GPTConfig, preset
from par.moe.experts import alltoall_formula_bytes
from par.moe.router import capacity
from par.pp import partition
from par.runtime.checks import int_at_most, positive_float, positive_int
from par.runtime.grid import groups_in_node, Layout, layout_label
from par.train import cost
from par.train.config import model_config
from par.zero.engine import zero_bytes_per_step


@dataclass(frozen=True)
class Hardware:
    """One device of a cluster and its links (bytes/s per device and direction). Compute: the roofline of `peak`
    matmul FLOP/s and `hbm` bytes/s reached at `efficiency`, `launch` seconds per kernel, an optional measured
    `gemm_table` of (intensity, FLOP/s) and optimizer step's bytes/s `optimizer_bw` (0: the memory bandwidth)
    (`par.train.cost.Compute`); with peak = 0, `flops` achieved FLOP/s for every GEMM and memory-bound work free.
    Links: α `alpha_node` / `alpha_network` seconds per message step; `collectives`, where measured, each
    collective kind's own (kind, α, bandwidth) inside the node (`par.train.cost.Link.kinds`). The host: `bw_host`
    for offload's copies, `host_optimizer_bw` the bytes/s of the optimizer step offload runs there (inf: not
    charged, the GPU presets state no host CPU). `straggle`: what ranks arriving apart add to a collective, per
    second of the compute before it (measured on this CPU; 0 where nothing measured it)."""
    name: str = "A100-80GB"
    memory: float = 80e9
    flops: float = 150e12          # the flat rate (peak = 0): about half of the 312 TFLOP/s bf16 peak
    gpus_per_node: int = 8
    bw_node: float = 250e9         # NVLink, per direction
    bw_network: float = 25e9       # 200 Gb/s InfiniBand per GPU
    bw_host: float = 20e9          # PCIe to the CPU (offload)
    peak: float = 0.0              # roofline: peak matmul FLOP/s (0: the flat rate `flops`)
    hbm: float = math.inf          # roofline: memory bandwidth, bytes/s
    efficiency: float = 1.0        # roofline: the fraction η of both roofs reached
    launch: float = 0.0            # seconds per kernel
    gemm_table: tuple = ()         # measured ((intensity FLOP/byte, FLOP/s), ...), replaces the GEMM roofline
    alpha_node: float = 0.0        # seconds per message step inside a node
    alpha_network: float = 0.0     # and across nodes
    optimizer_bw: float = 0.0      # the optimizer step's bytes/s on the device (0: `hbm`)
    host_optimizer_bw: float = math.inf    # the optimizer step's bytes/s on the host, with offload (inf: free)
    collectives: tuple = ()        # measured ((kind, alpha, bandwidth), ...) inside the node (`cost.Link.kinds`)
    straggle: float = 0.0          # measured: seconds a collective waits per second of compute before it

    @property
    def compute(self) -> cost.Compute:
        """The device's `par.train.cost.Compute`."""
        if self.peak <= 0:
            return replace(cost.Compute.flat(self.flops), launch=self.launch, table=self.gemm_table,
                           optimizer_bandwidth=self.optimizer_bw)
        return cost.Compute(self.peak, self.hbm, self.efficiency, self.launch, self.gemm_table,
                            optimizer_bandwidth=self.optimizer_bw)

    def link(self, inside_node: bool) -> cost.Link:
        if inside_node:
            return cost.Link(self.bw_node, self.alpha_node, self.collectives)
        return cost.Link(self.bw_network, self.alpha_network)


def gpu_hardware(gpu: str, network: float, gpus_per_node: int = 8, bw_host: float = 20e9, name: str = "") -> Hardware:
    """A Hardware of `par.train.cost.GPUS[gpu]` (its roofline, memory and NVLink) with `network` bytes/s per GPU."""
    g = cost.GPUS[gpu]
    c = g.compute
    return Hardware(name or g.name, g.memory, c.efficiency * c.peak, gpus_per_node, g.nvlink, network, bw_host,
                    c.peak, c.bandwidth, c.efficiency)


HARDWARE = {
    # (`Hardware()` itself is the flat-rate A100 of before: course.batch's dry run caps its FLOP/s for fp32 runs)
    # the datasheet rooflines, η calibrated on a published run (par.train.cost.GPUS); networks: 200 Gb/s HDR
    # InfiniBand per A100 (Megatron-LM SC21 §5, Selene), 400 Gb/s per H100/H200 (Llama 3 §3.3.1)
    "a100-80gb": gpu_hardware("A100", 25e9, name="A100-80GB"),
    "h100-80gb": gpu_hardware("H100", 50e9, bw_host=50e9, name="H100-80GB"),
    "h200-141gb": gpu_hardware("H200", 50e9, bw_host=50e9, name="H200-141GB"),
    "v100-32gb": Hardware("V100-32GB", 32e9, 60e12, 8, 120e9, 12.5e9, 12e9),
    # a laptop-class CPU, each rank a process: GB/s-ish shared memory, a few GFLOP/s per core
    "cpu": Hardware("CPU", 8e9, 5e9, 64, 2e9, 2e9, 10e9),
}

STATES = ("paper", "deepspeed")
RECOMPUTE = ("none", "selective", "full")
CP_KINDS = ("ring", "ulysses", "all_gather")
PARTITIONS = ("parameters", "uniform")
ENGINES = ("par", "any")


@dataclass(frozen=True)
class Workload:
    """What to train and how: a GPT config (par.model.GPTConfig) or a par.memory.accounting.LlamaConfig, the global
    batch (sequences), precision and optimizer, and the implementation's choices:

    recompute          "none", "selective" (the attention core) or "full" (keep only each block's input)
    seq_len            tokens per sequence (default: the GPTConfig's block_size; a LlamaConfig needs it)
    dropout, flash     the activations' dropout masks; flash attention (no s² scores kept or moved)
    sequence_parallel  Megatron's SP: LayerNorm/dropout regions split over tp too
    vocab_parallel     embedding and LM head split over tp (Megatron-LM); par's TP replicates them
    overlap            DP / ZeRO communication overlapped with backward (bucketed DDP, ZeRO-3 prefetch)
    scatter_gather     Megatron's pipeline send of 1/t of a stage's output per tp rank
    states             "paper" (the ZeRO paper's count) or "deepspeed" (DeepSpeed's, fp32 gradients and buffers)
    offload_params     ZeRO-3: the 16-bit weights on the host too (with offload)
    partition          "parameters" (balanced over parameters) or "uniform" (equal blocks per stage)
    cp_kind            "ring", "ulysses" or "all_gather" (Llama 3)
    engine             "par": the layouts par.train.job runs (ZeRO-2/3 only with pp = tp = 1, as DeepSpeed's pipeline
                       engine); "any": every layout the formulas cover (FSDP or ZeRO-3 with TP and PP: OPT-175B,
                       Llama 3)"""
    model: object
    global_batch: int
    precision: str = "mixed"       # par.memory.accounting names: fp32, mixed (fp16/bf16), pure16
    optimizer: str = "adam"
    recompute: str = "none"
    seq_len: int | None = None
    dropout: bool = False
    flash: bool = False
    sequence_parallel: bool = False
    vocab_parallel: bool = False
    overlap: bool = False
    scatter_gather: bool = False
    states: str = "paper"
    offload_params: bool = False
    partition: str = "parameters"
    cp_kind: str = "ring"
    engine: str = "par"

    @property
    def seq(self) -> int:
        if self.seq_len is not None:
            return self.seq_len
        if not hasattr(self.model, "block_size"):
            raise ValueError(f"a {type(self.model).__name__} has no context length: give the Workload seq_len")
        return self.model.block_size

    @property
    def bytes_per_value(self) -> int:
        return 4 if memory.canonical_precision(self.precision) == "fp32" else 2

    @property
    def dims(self) -> cost.ModelDims:
        return cost.dims_of(self.model)


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
    memory: dict = field(default_factory=dict)       # params, grads, optimizer, buffers, activations, total, host
    time: dict = field(default_factory=dict)         # compute, bubble, dp, tp, pp, (cp), optimizer, offload, total
    bytes: dict = field(default_factory=dict)        # sent per device per step: dp, tp, pp, (cp), total
    fits: bool = False
    samples_per_s: float = 0.0
    cp: int = 1                                      # context-parallel degree (ring attention); devices = dp·pp·tp·cp
    schedule: str = "1f1b"                           # the pipeline schedule (`PIPELINE_SCHEDULES`) when pp > 1
    ep: int = 1                                      # expert-parallel degree (MoE: `predict_moe`)
    virtual: int = 1                                 # chunks per rank (interleaved 1F1B)

    @property
    def layout(self) -> str:
        return layout_label(self.dp, self.pp, self.tp)

    @property
    def label(self) -> str:
        cp = f"×cp{self.cp}" if self.cp > 1 else ""
        zb = ""
        if self.pp > 1 and self.schedule != "1f1b":
            zb = f" {self.schedule}" + (f" v={self.virtual}" if self.schedule == "interleaved" else "")
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
    replicated pieces split over tp (replicated: the 2 LayerNorms (4d) and the biases of the two row-parallel
    projections (2d), added after the all-reduce, `par.tp.layers`); a LlamaConfig's `llama_block_params` with its
    matrices split and its 2 RMSNorms (2d) replicated."""
    if isinstance(cfg, memory.LlamaConfig):
        return (memory.llama_block_params(cfg) - 2 * cfg.d_model) / tp + 2 * cfg.d_model
    return memory.gpt_block_params(cfg.d_model, cfg.ffn, tp)


def layer_params(cfg, tp: int = 1, vocab_parallel: bool = False) -> list[float]:
    """Parameters one tp rank holds per entry of [embedding, block × L, head] (blocks split over tp; the token
    embedding and an untied head too when `vocab_parallel`)."""
    dims = cost.dims_of(cfg)
    d, v = dims.d, dims.vocab / (tp if vocab_parallel else 1)
    head = dims.norm_params * d + (0 if dims.tied else v * d)
    return [v * d + dims.positions * d, *([block_params(cfg, tp)] * dims.layers), head]


def largest_layer(cfg, tp: int = 1, vocab_parallel: bool = False) -> float:
    """The parameters of the largest module one tp rank holds (DeepSpeed's largest_layer_params: the token embedding,
    an untied head, or a block's largest matrix split over tp)."""
    dims = cost.dims_of(cfg)
    table = dims.vocab * dims.d / (tp if vocab_parallel else 1)
    mats = [(dims.d + 2 * dims.kv_width) * dims.d, (dims.mlp_mats - 1) * dims.ffn * dims.d, dims.ffn * dims.d]
    return max(table, max(mats) / tp)


@functools.lru_cache(maxsize=4096)
def rank_layers(cfg, pp: int, tp: int = 1, virtual: int = 1, how: str = "parameters",
                vocab_parallel: bool = False) -> tuple:
    """Per pipeline rank: (parameters, blocks, holds the embedding, holds the head), for pp·virtual stages cut from
    [embedding, block × L, head] (rank r holds stages r, r + pp, ...): how="parameters" the balanced cut of
    `par.pp.partition` (the largest stage as light as possible), how="uniform" L/(pp·v) blocks per stage with the
    embedding on the first stage and the head on the last (Megatron-LM)."""
    weights = layer_params(cfg, tp, vocab_parallel)
    n_blocks, stages = len(weights) - 2, pp * virtual
    if how == "uniform":
        if n_blocks % stages:
            raise ValueError(f"{n_blocks} blocks do not cut into {stages} equal stages")
        per = n_blocks // stages
        bounds = [(1 + k * per, 1 + (k + 1) * per) for k in range(stages)]
        bounds[0], bounds[-1] = (0, bounds[0][1]), (bounds[-1][0], len(weights))
    elif stages == 1:
        bounds = [(0, len(weights))]
    else:
        if stages > len(weights):
            raise ValueError(f"{stages} stages for {len(weights)} layers")
        bounds = partition.balanced([int(round(x)) for x in weights], stages)
    out = []
    for r in range(pp):
        mine = bounds[r::pp]
        out.append((sum(sum(weights[a:b]) for a, b in mine),
                    sum(sum(1 for i in range(a, b) if 1 <= i <= n_blocks) for a, b in mine),
                    any(a == 0 for a, _ in mine), any(b == len(weights) for _, b in mine)))
    return tuple(out)


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


@functools.lru_cache(maxsize=4096)
def group_link(axis: str, layout: Layout, hw: Hardware) -> cost.Link:
    """The `par.train.cost.Link` of the groups along `axis` (`group_bandwidth`'s choice, with its α)."""
    return hw.link(groups_in_node(axis, layout, hw.gpus_per_node))


def activation_bytes(w: Workload, micro_batch: int, layers: int, in_flight: float, tp: int,
                     last_stage: bool) -> float:
    """Activations one device keeps at the peak: `par.memory.accounting.activation_peak_bytes` for the stage's layers
    and the micro-batches in flight (with recomputation: what is kept plus one layer rebuilt), with the workload's
    dropout, flash attention and sequence parallelism, plus the logits of one micro-batch (2·b·s·V values, V/tp
    when vocab-parallel) on the last stage: its backward follows its forward."""
    dims, e = w.dims, w.bytes_per_value
    acts = memory.activation_peak_bytes(w.seq, micro_batch, dims.d, dims.heads, layers, w.recompute, e,
                                        dropout=w.dropout, tp=tp, in_flight=in_flight, flash=w.flash,
                                        sequence_parallel=w.sequence_parallel)
    vocab = dims.vocab / (tp if w.vocab_parallel else 1)
    logits = 2 * micro_batch * w.seq * vocab * e if last_stage else 0
    return acts + logits


def step_flops(w: Workload) -> float:
    """(6·N + 12·L·s·d)·B·s: the matmuls of forward and backward, N the weights that multiply activations
    (`par.mfu.flops_per_token`: no embedding lookup, the LM head counted, the attention scores included);
    × 4/3 with full recomputation (a second forward)."""
    flops = mfu.flops_per_token(w.model, w.seq) * w.global_batch * w.seq
    return flops * (4 / 3 if w.recompute == "full" else 1)


def gemm_flops(w: Workload) -> float:
    """Forward and backward FLOPs of a step, 3 × Σ of `par.train.cost.layer_gemms` and `head_gemm` over the
    batch: for a GPT exactly `par.mfu.flops_per_token` × B·s (tests/test_published_runs.py holds them equal)."""
    dims = w.dims
    per_seq = (dims.layers * sum(g.flops for g in cost.layer_gemms(dims, 1, w.seq))
               + cost.head_gemm(dims, 1, w.seq).flops)
    return 3 * per_seq * w.global_batch


PIPELINE_SCHEDULES = ("1f1b", "zb_h1", "zb_v", "interleaved", "gpipe")


def pipeline_bubble(schedule: str, pp: int, m: int) -> float:
    """Bubble time over compute time of `schedule` with F = I = W: `par.train.cost.pipeline_bubble`."""
    return cost.pipeline_bubble(schedule, pp, m)


def pipeline_in_flight(schedule: str, pp: int, m: int, v: int = 1) -> float:
    """Stage-sized micro-batch activations on the busiest rank at its peak: `par.train.cost.in_flight`."""
    return cost.in_flight(schedule, pp, m, v)


def _problems(w: Workload, dp, pp, tp, zero_stage, m, offload, cp, schedule, virtual) -> list[str]:
    """Why a layout cannot run ([] when it can)."""
    dims, problems = w.dims, []
    if dims.heads % tp or dims.d % tp or dims.ffn % tp or dims.kv_heads % tp and tp % dims.kv_heads:
        problems.append(f"tp {tp} does not divide n_head {dims.heads} / d_model {dims.d}")
    if pp * virtual > dims.layers + 2:
        problems.append(f"pp {pp} × v {virtual} > {dims.layers + 2} layers")
    if w.partition == "uniform" and dims.layers % (pp * virtual):
        problems.append(f"{dims.layers} blocks do not cut into pp {pp} × v {virtual} equal stages")
    if w.global_batch % (dp * m):
        problems.append(f"batch {w.global_batch} not divisible by dp {dp} × m {m}")
    if zero_stage > 1 and (pp > 1 or tp > 1) and w.engine == "par":
        problems.append(f"ZeRO-{zero_stage} with pp/tp > 1: par.train.job runs ZeRO-2/3 with pp = tp = 1 only "
                        f"(Workload(engine='any') for FSDP / DeepSpeed layouts)")
    if offload and zero_stage == 0:
        problems.append("offload needs ZeRO >= 1")
    if w.offload_params and (zero_stage != 3 or not offload):
        problems.append("offload_params needs ZeRO-3 with offload")
    if cp < 1 or w.seq < 2 * cp:
        problems.append(f"cp {cp} needs at least 2·cp = {2 * cp} tokens per sequence (seq {w.seq})")
    if schedule not in PIPELINE_SCHEDULES:
        problems.append(f"unknown schedule {schedule!r}: one of {', '.join(PIPELINE_SCHEDULES)}")
    elif schedule == "zb_v" and pp > 1 and m < pp:
        problems.append(f"zb_v needs m >= pp ({m} < {pp})")
    elif schedule in ("zb_h1", "zb_v") and pp > 1 and zero_stage > 1:
        problems.append(f"{schedule} with ZeRO-{zero_stage}")
    if virtual < 1 or (virtual > 1 and schedule != "interleaved"):
        problems.append(f"v = {virtual} chunks per rank needs schedule 'interleaved'")
    for name, value, allowed in (("recompute", w.recompute, RECOMPUTE), ("states", w.states, STATES),
                                 ("cp_kind", w.cp_kind, CP_KINDS), ("partition", w.partition, PARTITIONS),
                                 ("engine", w.engine, ENGINES)):
        if value not in allowed:
            problems.append(f"{name} {value!r}: one of {', '.join(allowed)}")
    if w.states == "deepspeed" and (memory.canonical_precision(w.precision), memory.canonical_optimizer(w.optimizer)) \
            != ("mixed", "adam"):
        problems.append("states='deepspeed' counts mixed-precision Adam only")
    return problems


def _states(w: Workload, psi: float, group: int, zero_stage: int, offload: bool, cfg, tp: int) -> dict:
    """{params, grads, optimizer, buffers, host} of one device: the paper's or DeepSpeed's count (module docstring)."""
    if w.states == "deepspeed":
        s = memory.deepspeed_state_bytes(psi, group, zero_stage, largest_layer(cfg, tp, w.vocab_parallel),
                                         offload, w.offload_params)
        return {"params": s["params"], "grads": s["grads"] + s["fp32_grads"], "optimizer": s["optimizer"],
                "buffers": s["gathered"], "host": s["host"]}
    s = memory.model_state_bytes(psi, group, zero_stage, w.precision, w.optimizer)
    return {"params": s.params, "grads": s.grads, "optimizer": 0.0 if offload else s.optimizer, "buffers": 0.0,
            "host": s.optimizer if offload else 0.0}


def predict(w: Workload, dp: int, pp: int, tp: int, zero_stage: int = 0, microbatches: int = 1,
            hw: Hardware = Hardware(), offload: bool = False, cp: int = 1, schedule: str = "1f1b",
            virtual: int = 1) -> Plan:
    """Memory per device and step time of one layout (see the module docstring); `valid` False with the reason
    when the layout cannot run. cp > 1: cp ranks split every sequence (`par.cp`), the gradients are summed over
    dp·cp ranks; virtual = v chunks per rank with schedule="interleaved"."""
    plan = Plan(dp, pp, tp, zero_stage, microbatches, offload, cp=cp, schedule=schedule, virtual=virtual)
    problems = _problems(w, dp, pp, tp, zero_stage, microbatches, offload, cp, schedule, virtual)
    if problems:
        plan.valid, plan.reason = False, "; ".join(problems)
        return plan
    cfg, dims, m, s, e = w.model, w.dims, microbatches, w.seq, w.bytes_per_value
    b = w.global_batch // (dp * m)
    plan.micro_batch = b
    ranks = rank_layers(cfg, pp, tp, virtual, w.partition, w.vocab_parallel)
    psi = max(r[0] for r in ranks)
    plan.params_per_device = psi
    # ---- memory
    states = _states(w, psi, dp * cp, zero_stage, offload, cfg, tp)
    busiest_blocks = max(r[1] for r in ranks)
    in_flight = pipeline_in_flight(schedule, pp, m, virtual)
    act = activation_bytes(w, b, busiest_blocks, in_flight, tp, last_stage=True) / cp
    plan.memory = {**states, "activations": act}
    plan.memory["total"] = sum(v for k, v in plan.memory.items() if k != "host")
    plan.fits = plan.memory["total"] <= hw.memory
    # ---- time: per micro-batch on every pipeline rank, then the busiest
    compute, bp = hw.compute, memory.bytes_per_param(w.precision, w.optimizer)
    lay, lay_cp = Layout(dp, pp, tp), Layout(dp, pp, tp * cp)
    layer = cost.layer_seconds(compute, dims, b, s, tp, cp, e, w.recompute, w.dropout, w.flash, w.sequence_parallel)
    head = cost.head_gemm(dims, b, s, tp, cp, w.vocab_parallel)
    head_f = compute.gemm_seconds(head.m, head.n, head.k, head.batch, e)
    msg = e * b * s * dims.d / cp                                  # one activation of a micro-batch on one rank
    tp_link = group_link("tp", lay, hw)
    ar = cost.collective_seconds("all_reduce", tp, msg, tp_link)
    tp_f, tp_b = 2 * ar, (4 if w.recompute == "full" else 2) * ar
    cp_f, cp_b, cp_bytes = _cp_seconds(w, b, s, tp, cp, hw)
    if w.recompute == "full":
        cp_b += cp_f
    p2p_msg = msg / (tp if (w.scatter_gather or w.sequence_parallel) else 1)
    p2p = virtual * cost.collective_seconds("p2p", 2, p2p_msg, group_link("pp", lay_cp, hw)) if pp > 1 else 0.0
    costs = []
    for _, blocks, has_embedding, has_head in ranks:
        f_c = blocks * layer.forward + (head_f if has_head else 0.0)
        i_c = blocks * (layer.backward_input + layer.recompute) + (head_f if has_head else 0.0)
        w_c = blocks * layer.backward_weight + (head_f if has_head else 0.0)
        comm_f, comm_b = blocks * (tp_f + cp_f) + p2p, blocks * (tp_b + cp_b) + p2p
        units = blocks + has_embedding + has_head                   # ZeRO's units: the rank's layers
        tensors = (blocks * dims.block_tensors + has_embedding * (1 + (dims.positions > 0))
                   + has_head * ((2 if dims.norm_params == 2 else 1) + (not dims.tied or not has_embedding)))
        costs.append((f_c + i_c + w_c + comm_f + comm_b, f_c, i_c, w_c, comm_f, comm_b, blocks, units, tensors))
    _, f_c, i_c, w_c, comm_f, comm_b, blocks, units, tensors = max(costs)
    f, bwd = f_c + comm_f, i_c + w_c + comm_b
    ratio = cost.pipeline_bubble(schedule, pp, m, virtual, f, i_c + comm_b, w_c)
    t = {"compute": m * (f_c + i_c + w_c), "bubble": m * (f + bwd) * ratio,
         "tp": m * blocks * (tp_f + tp_b), "pp": 2 * m * p2p}
    if cp > 1:
        t["cp"] = m * blocks * (cp_f + cp_b)
    # ---- data parallelism over dp·cp ranks
    group, dp_link = dp * cp, group_link("dp", lay_cp, hw)
    grads = psi * bp.grads
    extra = m if zero_stage == 3 and w.recompute == "full" else 0    # ZeRO-3 gathers again for the recomputation
    n_ar = 6 if w.recompute == "full" else 4                        # all-reduces per block and micro-batch
    plan.bytes = {"dp": zero_bytes_per_step(psi, group, zero_stage, m, bp.grads) + extra * (group - 1) / group * grads,
                  "tp": m * blocks * n_ar * 2 * (tp - 1) / tp * msg,
                  "pp": 2 * m * virtual * p2p_msg * (pp - 1) / pp}
    if cp > 1:
        plan.bytes["cp"] = m * blocks * cp_bytes
    plan.bytes["total"] = sum(plan.bytes.values())
    rs = functools.partial(cost.collective_seconds, n=group, nbytes=grads, link=dp_link)
    per_unit = lambda kind: units * cost.collective_seconds(kind, group, grads / units, dp_link)  # noqa: E731
    if zero_stage <= 1:                       # one coalesced ring of every unit's gradients (`par.comm.coalesced`)
        hidden, shown = rs("all_reduce"), 0.0
        behind = bwd
    elif zero_stage == 2:                     # each unit reduce-scattered as backward completes it
        hidden, shown = m * per_unit("reduce_scatter"), rs("all_gather")
        behind = m * bwd
    else:                                     # each unit gathered and reduce-scattered on its own
        hidden, shown = m * ((3 if extra else 2) * per_unit("all_gather") + per_unit("reduce_scatter")), 0.0
        behind = m * (f + bwd)
    t["dp"] = (cost.exposed(hidden, behind) if w.overlap else hidden) + shown
    buf_bytes, buf_ops = cost.gradient_buffers(psi, tensors, units, group, zero_stage, m, bp.grads, bp.weights)
    t["buffers"] = compute.memory_seconds(buf_bytes, buf_ops) if buf_ops else 0.0
    step_bytes = cost.optimizer_bytes_per_param(w.precision, w.optimizer) * (psi / group if zero_stage >= 1 else psi)
    t["optimizer"] = step_bytes / hw.host_optimizer_bw if offload else compute.optimizer_seconds(step_bytes)
    t["offload"] = (bp.grads + bp.weights) * math.ceil(psi / dp) / hw.bw_host if offload else 0.0
    t["straggle"] = hw.straggle * t["compute"] if dp * pp * tp * cp > 1 else 0.0
    t["total"] = sum(t.values())
    plan.time = t
    plan.samples_per_s = w.global_batch / t["total"]
    return plan


def _cp_seconds(w: Workload, b: int, s: int, tp: int, cp: int, hw: Hardware) -> tuple[float, float, float]:
    """(forward seconds, backward seconds, bytes) of one block's context-parallel communication per micro-batch
    (module docstring), over the node's link when tp·cp GPUs fit in one, else the network's."""
    if cp == 1:
        return 0.0, 0.0, 0.0
    dims, e = w.dims, w.bytes_per_value
    link = hw.link(tp * cp <= hw.gpus_per_node)
    if w.cp_kind == "ulysses":
        u = ulysses_bytes_even(b, s, dims.d // tp, cp, e)
        one = cost.collective_seconds("all_to_all", cp, b * s * dims.d / tp * e / cp, link)
        return 4 * one, 4 * one, u["forward"] + u["backward"]
    ring = ring_attention_bytes_even(b, s, dims.kv_width // tp, cp, e)   # K and V, d_kv wide (d without GQA)
    if w.cp_kind == "all_gather":
        kv = 2 * b * s * dims.kv_width / tp * e
        return (cost.collective_seconds("all_gather", cp, kv, link),
                cost.collective_seconds("reduce_scatter", cp, kv, link), 2 * ring["forward"])
    return (link.seconds(ring["forward"], steps=cp - 1), link.seconds(ring["backward"], steps=2 * (cp - 1)),
            ring["forward"] + ring["backward"])


def enumerate_plans(w: Workload, world: int, hw: Hardware = Hardware(), stages=(0, 1, 2, 3),
                    microbatches=(1, 2, 4, 8, 16, 32), offload=(False, True), schedules=("1f1b",),
                    virtuals=(2,)) -> list[Plan]:
    """`predict` for every layout of `world` × ZeRO stage × micro-batch count × offload × pipeline schedule (the
    schedules only where pp > 1; "interleaved" with each of `virtuals` chunks per rank; invalid ones included)."""
    out = []
    for dp, pp, tp in layouts(world):
        for z in stages:
            for m in microbatches:
                for off in offload:
                    for schedule in (schedules if pp > 1 else schedules[:1]):
                        for v in (virtuals if schedule == "interleaved" and pp > 1 else (1,)):
                            out.append(predict(w, dp, pp, tp, z, m, hw, off, schedule=schedule, virtual=v))
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


def from_config(tc, hw: Hardware = Hardware(), overlap: bool = False) -> Plan:
    """The prediction for a `par.train.config.TrainConfig` (what `python -m par train` would run); `overlap`:
    its data-parallel communication runs beside backward (`Workload.overlap`)."""
    w = Workload(model_config(tc), tc.train_batch_size, "fp32" if tc.precision == "fp32" else "mixed", tc.optimizer,
                 overlap=overlap)
    m = tc.grad_accum
    return predict(w, tc.dp, tc.pp, tc.tp, tc.zero_stage, m, hw, tc.offload)


def model_of(text: str, seq: int | None):
    """The GPTConfig of `--model`: a preset, or L,H,d (layers, heads, width) of GPT-2's vocabulary; `seq`
    tokens of context (default: the preset's, 2048). A name or numbers that make no model: ArgumentError."""
    import argparse
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
    ap.add_argument("--engine", default="par", choices=ENGINES,
                    help="par: what par.train.job runs (ZeRO-2/3 only without pp/tp); "
                         "any: FSDP / DeepSpeed layouts too")
    ap.add_argument("--top", type=positive_int, default=15)
    ap.add_argument("--schedules", default="1f1b", help="pipeline schedules to consider, comma-separated: "
                                                        f"{', '.join(PIPELINE_SCHEDULES)} (lecture 03)")
    args = ap.parse_args(argv)
    cfg = model_of(args.model, args.seq)
    hw = HARDWARE[args.hardware]
    hw = replace(hw, memory=args.memory) if args.memory else hw
    w = Workload(cfg, args.batch, args.precision, recompute="full" if args.recompute else "none", engine=args.engine)
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
    compute   the active parameters: the router picks k experts per token, so the compute of a dense model
              whose FFN is k times wider (its MLP matmuls k·L·2·d·f), `predict`'s (the cost model's)
    dp        gradients: Ψ_r over all ranks, Ψ_e over world/ep (`zero_bytes_per_step`)
    ep        4 all-to-alls per layer (dispatch, combine, and both backward), each
              (ep-1)/ep · E·C·d values, C = ceil(f·k·b·s/E) (`par.moe.experts.alltoall_formula_bytes`);
              inside a node when ep <= gpus_per_node (its ranks are consecutive)"""
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
    compute = predict(active, world, 1, 1, 0, 1, hw).time["compute"]
    cap = capacity(b * w.seq, moe.n_experts, moe.k, moe.capacity_factor)
    plan.bytes = {"dp": zero_bytes_per_step(replicated, world, zero_stage, 1, bp.grads)
                  + zero_bytes_per_step(experts, world // ep, zero_stage, 1, bp.grads),
                  "ep": 4 * cfg.n_layer * alltoall_formula_bytes(moe.n_experts, cap, cfg.d_model, ep, e)}
    plan.bytes["total"] = plan.bytes["dp"] + plan.bytes["ep"]
    link_dp, link_ep = hw.link(world <= hw.gpus_per_node), hw.link(ep <= hw.gpus_per_node)
    plan.time = {"compute": compute, "dp": link_dp.seconds(plan.bytes["dp"], steps=2 * (world - 1)),
                 "ep": link_ep.seconds(plan.bytes["ep"], steps=4 * cfg.n_layer * (ep - 1))}
    plan.time["total"] = sum(plan.time.values())
    plan.samples_per_s = w.global_batch / plan.time["total"]
    return plan


def moe_plans(w: Workload, moe: MoE, world: int, hw: Hardware = Hardware(), stages=(0, 1)) -> list[Plan]:
    """`predict_moe` for every ep degree dividing `world` (and at most E) × ZeRO stage, fitting first, fastest first."""
    return rank_plans([predict_moe(w, moe, world, ep, z, hw) for ep in range(1, world + 1)
                       if world % ep == 0 and ep <= moe.n_experts for z in stages])


# ---------------------------------------------------------------- published runs: the planner held to them
PUBLISHED = Path(__file__).with_name("published_runs.json")


@functools.lru_cache(maxsize=1)
def published_runs() -> dict:
    """par/train/published_runs.json: {"sources", "clusters", "runs", ...}, each run with its source, where in it
    (table, row, figure), the numbers quoted verbatim, and what the source leaves out and par assumes."""
    return json.loads(PUBLISHED.read_text())


def run_model(spec: dict):
    """The GPTConfig or LlamaConfig of a run's "model" entry."""
    spec = dict(spec)
    kind = spec.pop("kind")
    if kind == "gpt":
        return GPTConfig(**spec)
    if kind == "llama":
        return memory.LlamaConfig(**spec)
    raise ValueError(f"unknown model kind {kind!r} in {PUBLISHED.name}: gpt or llama")


def run_hardware(run: dict, efficiency: float | None = None) -> Hardware:
    """The Hardware of a run's cluster (published_runs.json "clusters"): its GPU's roofline (`par.train.cost.GPUS`,
    η = `efficiency` or the GPU's calibrated one), NVLink, and the network bytes/s per GPU the source states."""
    c = published_runs()["clusters"][run["cluster"]]
    hw = gpu_hardware(c["gpu"], c["network_bytes_s"], c.get("gpus_per_node", 8))
    if "memory_bytes" in c:
        hw = replace(hw, memory=c["memory_bytes"])
    return hw if efficiency is None else replace(hw, efficiency=efficiency, flops=efficiency * hw.peak)


def run_workload(run: dict, layout: dict | None = None) -> tuple[Workload, dict]:
    """(Workload, predict's keyword arguments) of a run: its model, batch, implementation choices and layout."""
    w = Workload(run_model(run["model"]), run["batch"], **run.get("workload", {}))
    lay = dict(run["layout"] if layout is None else layout)
    return w, lay


def predict_run(run: dict, efficiency: float | None = None, layout: dict | None = None) -> Plan:
    """`predict` for a published run (or one of its `layout`s) on its cluster."""
    w, lay = run_workload(run, layout)
    hw = run_hardware(run, efficiency)
    plan = predict(w, hw=hw, **lay)
    if not plan.valid:
        raise ValueError(f"{run['id']}: the planner cannot state {lay}: {plan.reason}")
    return plan


def megatron_flops(batch: int, seq: int, layers: int, d: int, vocab: int) -> float:
    """Megatron-LM SC21 eq. (3), the FLOPs per iteration the paper's TFLOP/s count (GEMMs only, activation
    recomputation included): F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))."""
    return 96 * batch * seq * layers * d * d * (1 + seq / (6 * d) + vocab / (16 * layers * d))


def counted_flops(run: dict) -> float:
    """The FLOPs of one step as the run's source counts them ("flops": "megatron_eq3", or "model": 3 × the GEMMs
    of forward, full s×s attention, `gemm_flops`)."""
    w, _ = run_workload(run)
    if run["flops"] == "megatron_eq3":
        dims = w.dims
        return megatron_flops(w.global_batch, w.seq, dims.layers, dims.d, dims.vocab)
    if run["flops"] == "model":
        return gemm_flops(w)
    raise ValueError(f"{run['id']}: unknown FLOP count {run['flops']!r}: megatron_eq3 or model")


def predicted_tflops(run: dict, efficiency: float | None = None, layout: dict | None = None) -> float:
    """TFLOP/s per GPU the planner predicts for a run: its counted FLOPs / (predicted step seconds × GPUs)."""
    plan = predict_run(run, efficiency, layout)
    gpus = plan.dp * plan.pp * plan.tp * plan.cp
    return counted_flops(run) / plan.time["total"] / gpus / 1e12


def calibrate(run: dict, lo: float = 0.05, hi: float = 1.0) -> float:
    """The η (roofline efficiency of the run's GPU) at which the planner predicts the run's published TFLOP/s per
    GPU: bisection, predicted TFLOP/s rises with η."""
    target = run["published"]["tflops_per_gpu"]
    if not predicted_tflops(run, lo) <= target <= predicted_tflops(run, hi):
        raise ValueError(f"{run['id']}: {target} TFLOP/s is outside what η in [{lo}, {hi}] predicts")
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predicted_tflops(run, mid) < target else (lo, mid)
    return (lo + hi) / 2


def published_error(kind: str = "tflops_per_gpu") -> list[dict]:
    """One row per published run with a measured `kind` (TFLOP/s per GPU): {"run", "where", "predicted",
    "published", "error" (predicted / published - 1), "calibrates"}; the GPU's η is its calibrated one
    (`par.train.cost.GPUS`), never fitted per row."""
    rows = []
    for run in published_runs()["runs"]:
        if kind not in run.get("published", {}):
            continue
        got, want = predicted_tflops(run), run["published"][kind]
        rows.append({"run": run["id"], "where": f"{run['source']}, {run['where']}", "predicted": round(got, 2),
                     "published": want, "error": round(got / want - 1, 4), "calibrates": run.get("calibrates", "")})
    return rows


def format_published_error(rows: list[dict] | None = None) -> str:
    """`published_error()` as a text table."""
    rows = published_error() if rows is None else rows
    lines = [f"{'run':<42} {'predicted':>9} {'published':>9} {'error':>7}"]
    lines += [f"{r['run']:<42} {r['predicted']:>9.1f} {r['published']:>9.1f} {r['error']:>+7.1%}"
              + (f"  (calibrates the {r['calibrates']})" if r["calibrates"] else "") for r in rows]
    return "\n".join(lines)


def published_memory() -> list[dict]:
    """One row per published layout with a memory verdict: {"run", "where", "predicted" (bytes per GPU), "capacity",
    "fits" (the planner's), "ran" (the source's), "held" (whether tests/test_published_runs.py holds fits == ran)}."""
    rows = []
    for run in published_runs()["runs"]:
        if "layout" not in run or "memory" not in run:
            continue
        plan, hw = predict_run(run), run_hardware(run)
        rows.append({"run": run["id"], "where": f"{run['source']}, {run['where']}", "predicted": plan.memory["total"],
                     "capacity": hw.memory, "fits": plan.fits, "ran": run["ran"], "held": run["memory"] == "held"})
    return rows


def published_layout_ranking(run_id: str = "megatron-sc21-figure13") -> list[dict]:
    """The (p, t) layouts of a published comparison (Megatron-LM SC21 Figure 13: 162B on 64 A100s) as the planner
    ranks them, per batch: {"batch", "pp", "tp", "step_s", "tflops_per_gpu", "rank" (1 = fastest), "best" (the
    source's)}."""
    fig = next(r for r in published_runs()["runs"] if r["id"] == run_id)
    hw, rows = run_hardware(fig), []
    for batch in fig["batches"]:
        w = Workload(run_model(fig["model"]), batch, **fig["workload"])
        plans = [predict(w, 1, p, fig["gpus"] // p, 0, batch, hw) for p in fig["pipeline_sizes"]]
        order = sorted(plans, key=lambda p: p.time["total"])
        dims = w.dims
        flops = megatron_flops(batch, w.seq, dims.layers, dims.d, dims.vocab)
        rows += [{"batch": batch, "pp": p.pp, "tp": p.tp, "step_s": p.time["total"],
                  "tflops_per_gpu": flops / p.time["total"] / fig["gpus"] / 1e12, "rank": order.index(p) + 1,
                  "best": (p.pp, p.tp) == (fig["best"]["pp"], fig["best"]["tp"])} for p in plans]
    return rows
