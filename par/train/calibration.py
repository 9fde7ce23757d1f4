"""This machine's compute and collectives, measured where lecture 07's benchmark runs, as a `planner.Hardware`.

The planner predicts a step from a device's rates (`par.train.cost`); on a GPU they come from a datasheet and one
published run, on this CPU they are measured. `par.train.suite` asks every timed launch of `par.train.job` to
measure them just before each row (`--calibrate`), so each row is predicted from numbers taken seconds before
its steps, on as many ranks as it has, all ranks measuring at once (on 2 shared cores one rank computes at about
half the rate it reaches alone: the rows' ranks run side by side, and so do the measurements):

    GEMMs        every GEMM of the rows' blocks and LM head at their shapes (`cost.layer_gemms`, `cost.head_gemm`
                 for each row's micro-batch and tp), forward and both backward products (input and weight
                 gradients) as nn.Linear and the attention run them, the operands cycled over enough copies
                 that they come from memory as in a step, not from the cache: a table (intensity, FLOP/s)
                 (`cost.gemm_table`, shapes of one intensity together)
    launch       one block's forward and backward at a negligible size (width = heads, 2 tokens): what its
                 operations cost whatever their size, over the operations `cost.layer_seconds` charges a block
                 (`launches_per_block`): seconds per operation as the cost model counts them, the median of TURNS turns
    memory       the block's memory-bound operations (2 LayerNorms, the scaled, masked softmax of the scores,
                 GeLU, 2 residual adds), forward and backward at the rows' sizes, less the same at a negligible
                 size, the two in alternating turns (MEMORY_ROUNDS): bytes/s over what `cost.layer_memory_bytes`
                 counts for them (× 3: forward and backward)
    optimizer    the optimizer step over the model's parameters as flat fp32 units (as `par.zero` keeps them):
                 its bytes (`cost.optimizer_bytes_per_param`) per second; offload's host step is the same CPU
    host copy    offload's two copies of a rank's partition (gradients to the host, parameters back), bytes/s
    collectives  with more than one rank, par's own calls as its engines make them on this backend:
                 `par.comm.collectives.all_reduce` (TP's activations), `reduce_scatter`, `all_gather` (ZeRO's
                 units; par's ring on gloo, the received chunks added on the CPU) and `send_recv` (a pipeline's
                 exchange), each at SIZES, in REPEATS rounds of every kind and size once (a burst of load or a
                 drift of the machine's speed falls on all of them alike), every call after the same GEMM work
                 on every rank (a step's collective follows compute, and a rank that finished first waits for
                 the other: that wait is part of what a step pays per collective); each rank times its call, the
                 call costs the mean over the ranks; α + β·bytes fitted per kind to its own formula
                 (`cost.fitted_links`)
    straggle     with more than one rank, every kind at STRAGGLE_BYTES after a long GEMM gap (STRAGGLE_GAP_S)
                 and after the short one, in the same rounds: a collective waits for the last rank to arrive, and
                 on shared cores ranks drift apart by a share of the compute between two collectives; the slope
                 (seconds of call per second of gap, `straggle`) is what the planner adds per second of a
                 multi-rank row's compute (`planner.Hardware.straggle`)

A compute number is the slowest rank's (a step ends with its slowest rank), each the mean of calls back to back
for WINDOW_S (a step pays every call, the slow ones too); the launch and memory-bound ones, differences of small
times, the median of turns of such means (a stall of the machine falls on one turn, as the steps' median leaves out a
stalled step). Every time is on the load-proof clock (`par.clock`), as
the steps it predicts (`par.train.loop`): wall less the thread's run-queue wait and, for a call that waits on the
other ranks, theirs meanwhile (`par.clock.Waiting`); another program's turn on a core moves neither.
The whole measurement takes a second or two per row (`seconds` in the result says how long it took).
`hardware(calibration)` is the Hardware the planner predicts these rows on; nothing here is a constant of the
machine, everything is measured in the launch that uses it.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import replace

import torch
import torch.nn.functional as F

import par.runtime.dist
from par import clock
from par.comm import collectives as C, commlog
from par.measure import watch_ranks
from par.memory.accounting import param_count
from par.model import Block, GPTConfig, preset
from par.reference import make_optimizer
from par.runtime import preflight
from par.train import cost, planner
from par.train.config import model_config

SIZES = (64 << 10, 512 << 10, 4 << 20, 16 << 20)    # bytes of each measured collective
COLD_BYTES = 16 << 20        # distinct GEMM operands cycled through per shape: more than a core's caches hold
MAX_COPIES = 32
GAP_S = 1e-3                 # GEMM work before every timed collective (about what a TP row computes between two)
STRAGGLE_GAP_S = 4e-3        # and the long gap, at STRAGGLE_BYTES: what the longer compute adds to a collective
STRAGGLE_BYTES = 512 << 10
WINDOW_S = 0.02              # each compute number: calls back to back for at least this long
KINDS = ("all_reduce", "reduce_scatter", "all_gather", "p2p")
REPEATS = 12                 # timed rounds of the collectives: each (kind, size) once per round
MEMORY_ROUNDS = 8            # alternating turns of the memory-bound operations at the rows' sizes and a negligible one
TURNS = 5                    # turns of the launch measurement, WINDOW_S / TURNS each: their median


def _mean_s(fn, window: float = WINDOW_S, least: int = 3, warmup: int = 1) -> float:
    """Seconds per call of `fn`: calls back to back for at least `window` seconds (and `least` calls), their
    total over their number. A mean, not a median: a step pays every call's time, the ones another rank's or
    program's turn on the core stretched included (a median of short calls would hide a core shared in turns).
    Timed on the load-proof clock (`par.clock`: wall less this thread's run-queue wait), as the steps it predicts."""
    for _ in range(warmup):
        fn()
    calls, start = 0, clock.read()
    while calls < least or time.perf_counter() - start.wall < window:
        fn()
        calls += 1
    return clock.since(start).steady / calls


def _call_s(fn) -> float:
    """Seconds of one call of `fn` that waits on the other ranks, on the load-proof clock, as `par.train.loop` times
    a step: wall less this thread's run-queue wait, its process's other threads' and the other ranks' while it
    waited (`par.clock.Waiting`), never below the thread's CPU seconds in the call (not the process's: the CPU time of
    gloo's TCP thread grows with the load around it)."""
    waiting = clock.Waiting(others=True)
    start = clock.read()
    fn()
    took = clock.since(start)
    return clock.load_proof(took.wall, took.cpu, took.ready + waiting.done())


# ---------------------------------------------------------------- what the rows run
def shapes(tcs) -> dict:
    """{"gemms": [(m, n, k, batch)], "blocks": [(dims, b, s, tp)], "params", "partitions", "optimizer"} of the
    rows' configs (`par.train.config.TrainConfig`s): every GEMM of their blocks and head per micro-batch on one
    rank, the block sizes for the memory-bound operations, the parameters and each row's optimizer partition."""
    gemms, blocks, parts = [], [], []
    for tc in tcs:
        cfg = model_config(tc)
        dims, b, s = cost.dims_of(cfg), tc.micro_batch, cfg.block_size
        for g in [*cost.layer_gemms(dims, b, s, tc.tp), cost.head_gemm(dims, b, s)]:
            key = (int(g.m), int(g.n), int(g.k), int(g.batch))
            if key not in gemms:
                gemms.append(key)
        if (dims, b, s, tc.tp) not in blocks:
            blocks.append((dims, b, s, tc.tp))
        parts.append(param_count(cfg) / (tc.dp if tc.zero_stage >= 1 else 1))
    first = model_config(tcs[0])
    return {"gemms": gemms, "blocks": blocks, "params": param_count(first), "model": first,
            "partitions": parts, "optimizer": tcs[0].optimizer}


# ---------------------------------------------------------------- compute, one rank
def gemm_seconds(m: int, n: int, k: int, batch: int = 1) -> float:
    """Seconds of one m×k by k×n GEMM (one of `batch`), the mean of its forward and both backward products,
    operands cycled over copies (COLD_BYTES of them) so they are read from memory as in a step."""
    per = 4 * batch * (m * k + k * n + m * n)
    copies = max(2, min(MAX_COPIES, math.ceil(COLD_BYTES / per)))
    if batch == 1:     # nn.Linear: y = x Wᵀ, dx = g W, dW = gᵀ x
        xs = [torch.randn(m, k) for _ in range(copies)]
        ws = [torch.randn(n, k) for _ in range(copies)]
        gs = [torch.randn(m, n) for _ in range(copies)]
        passes = (lambda i: xs[i] @ ws[i].t(), lambda i: gs[i] @ ws[i], lambda i: gs[i].t() @ xs[i])
    else:              # attention: (b·a) of (s × d_h)(d_h × s), their gradients
        xs = [torch.randn(batch, m, k) for _ in range(copies)]
        ws = [torch.randn(batch, k, n) for _ in range(copies)]
        gs = [torch.randn(batch, m, n) for _ in range(copies)]
        passes = (lambda i: xs[i] @ ws[i], lambda i: gs[i] @ ws[i].transpose(1, 2),
                  lambda i: xs[i].transpose(1, 2) @ gs[i])
    total = 0.0
    for run in passes:
        turn = iter(range(1 << 30))
        total += _mean_s(lambda: run(next(turn) % copies), least=copies)
    return total / 3 / batch


def _block(dims, width: int | None = None):
    """A dense GPT-lite block of `dims` (fp32), or of width `width` (heads × 1) for the negligible size."""
    d = width or dims.d
    return Block(GPTConfig(vocab_size=dims.vocab, block_size=max(2, dims.positions), n_layer=1, n_head=dims.heads,
                           d_model=d, d_ff=None if width else dims.ffn, attention="math"))


def null_block_seconds(dims) -> float:
    """One block's forward and backward at width = heads over 2 tokens: its operations' fixed cost."""
    block = _block(dims, width=dims.heads)
    x = torch.randn(1, 2, dims.heads, requires_grad=True)
    g = torch.randn(1, 2, dims.heads)

    def step():
        torch.autograd.backward(block(x), g)
    return statistics.median(_mean_s(step, WINDOW_S / TURNS) for _ in range(TURNS))


def _memory_ops(x, scores, hidden, ln_w, ln_b):
    """The memory-bound operations of a block (`par.model.Block`, math attention), without its GEMMs."""
    d, t = x.size(-1), scores.size(-1)
    y1 = F.layer_norm(x, (d,), ln_w, ln_b)
    y2 = F.layer_norm(x, (d,), ln_w, ln_b)
    att = scores / 8.0
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    p = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1)
    h = F.gelu(hidden)
    r = x + y1
    return [p, h, r + y2]


def _memory_ops_step(dims, b: int, s: int, tp: int, null: bool = False):
    """Forward and backward of `_memory_ops` at a block's sizes on one tp rank (T = b·s tokens, a/tp heads,
    f/tp hidden), or at a negligible size (`null`: 1 sequence of 2 tokens, width and hidden 1 per head)."""
    heads = max(1, dims.heads // tp)
    if null:
        b, s, d, f = 1, 2, heads, heads
    else:
        d, f = dims.d, dims.ffn // tp
    x = torch.randn(b, s, d, requires_grad=True)
    scores = torch.randn(b, heads, s, s, requires_grad=True)
    hidden = torch.randn(b, s, f, requires_grad=True)
    w, bias = torch.ones(d, requires_grad=True), torch.zeros(d, requires_grad=True)
    outs = _memory_ops(x, scores, hidden, w, bias)
    grads = [torch.randn_like(o) for o in outs]

    def step():
        torch.autograd.backward(_memory_ops(x, scores, hidden, w, bias), grads)
    return step


def memory_ops_seconds(dims, b: int, s: int, tp: int, rounds: int = MEMORY_ROUNDS) -> tuple[float, float]:
    """(seconds at the block's sizes, seconds at the negligible size) of `_memory_ops_step`, measured in
    `rounds` alternating turns of WINDOW_S / rounds each, each size the median of its turns: load falls on both
    alike, and a stall of the machine in one turn is neither's, so their difference (what the bandwidth is fitted
    from) is not one burst's."""
    real, null = _memory_ops_step(dims, b, s, tp), _memory_ops_step(dims, b, s, tp, null=True)
    turns = [(_mean_s(real, WINDOW_S / rounds), _mean_s(null, WINDOW_S / rounds)) for _ in range(rounds)]
    return statistics.median(t for t, _ in turns), statistics.median(t for _, t in turns)


def memory_ops_bytes(dims, b: int, s: int, tp: int) -> float:
    """What `cost.layer_memory_bytes` counts for those operations (fp32), forward and backward (× 3)."""
    mem = cost.layer_memory_bytes(dims, b, s, tp, 1, 4)
    return 3 * (mem["norms"] + mem["softmax"] + mem["act"] + mem["residual"])


def optimizer_seconds(params: int, units: int, optimizer: str = "adam") -> float:
    """One optimizer step over `params` fp32 values in `units` flat tensors (as `par.zero` keeps a model)."""
    sizes = [params // units + (1 if i < params % units else 0) for i in range(units)]
    ps = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    for p in ps:
        p.grad = torch.randn_like(p)
    opt = make_optimizer(ps, optimizer, 1e-3)
    return _mean_s(opt.step, window=0.1)


def host_copy_seconds(numel: int) -> float:
    """Offload's two copies of a partition of `numel` fp32 values: the gradient to a fresh host tensor, the
    parameters back in place (`par.zero.updaters.CPUOffload`)."""
    g, p, m = torch.randn(numel), torch.empty(numel), torch.randn(numel)

    def both():
        g.detach().to("cpu", torch.float32, copy=True)
        p.copy_(m)
    return _mean_s(both, window=0.05)


def measure_compute(tcs) -> dict:
    """Every compute number of the rows' configs on this rank (module docstring)."""
    sh = shapes(tcs)
    out = {"gemms": [[m, n, k, batch, gemm_seconds(m, n, k, batch)] for m, n, k, batch in sh["gemms"]]}
    dims = sh["blocks"][0][0]
    out["null_block_s"] = null_block_seconds(dims)
    out["memory"] = [[memory_ops_bytes(d, b, s, tp), *memory_ops_seconds(d, b, s, tp)] for d, b, s, tp in sh["blocks"]]
    units = dims.layers + 2
    out["optimizer"] = [sh["params"], cost.optimizer_bytes_per_param("fp32", sh["optimizer"]),
                        optimizer_seconds(sh["params"], units, sh["optimizer"])]
    part = int(min(sh["partitions"]))
    out["host_copy"] = [part, host_copy_seconds(part)]
    return out


# ---------------------------------------------------------------- collectives, all ranks together
def _gap_work(seconds: float):
    """The same GEMM work on every rank before a timed collective (about `seconds`)."""
    a, w = torch.randn(128, 256), torch.randn(1024, 256)
    one = _mean_s(lambda: a @ w.t(), window=0.01)
    count = max(1, round(seconds / one))

    def work():
        for _ in range(count):
            a @ w.t()
    return work


def measure_collectives(sizes=SIZES, group=None) -> dict:
    """{kind: [[n, bytes, [this rank's seconds per call]], ...], "straggle": [[kind, short gap s, [seconds per
    call], long gap s, [seconds per call]], ...]}: par's collectives as its engines call them, each call after the
    same GEMM work (module docstring); at STRAGGLE_BYTES every kind also after STRAGGLE_GAP_S of it."""
    import torch.distributed as dist
    n, me = C.group_size(group), C.group_rank(group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(n))
    right, left = ranks[(me + 1) % n], ranks[(me - 1) % n]
    short, long = _gap_work(GAP_S), _gap_work(STRAGGLE_GAP_S)
    calls = {}
    for size in (*sizes, STRAGGLE_BYTES):
        x = torch.randn(size // 4)
        back = torch.empty_like(x)
        calls[size] = {"all_reduce": lambda x=x: C.all_reduce(x, "sum", group),
                       "reduce_scatter": lambda x=x: C.reduce_scatter(x, "avg", group),
                       "all_gather": lambda x=x: C.all_gather(x, group),
                       "p2p": lambda x=x, back=back: [w.wait() for w in C.send_recv([(x, right)], [(back, left)],
                                                                                     group)]}
    points = [(size, kind, short) for size in sizes for kind in KINDS]
    points += [("straggle", kind, gap) for gap in (short, long) for kind in KINDS]
    times = {(size, kind, gap): [] for size, kind, gap in points}
    gaps = {short: [], long: []}
    for i in range(REPEATS + 1):        # every point once per round: a burst of load falls on all of them alike
        for size, kind, gap in points:
            work = _mean_s(gap, window=0.0, least=1, warmup=0)
            call = _call_s(calls[STRAGGLE_BYTES if size == "straggle" else size][kind])
            if i:                       # the first round warms every buffer
                times[size, kind, gap].append(call)
                gaps[gap].append(work)
    out = {kind: [[n, size, times[size, kind, short]] for size in sizes] for kind in KINDS}
    out["straggle"] = [[kind, statistics.mean(gaps[short]), times["straggle", kind, short],
                        statistics.mean(gaps[long]), times["straggle", kind, long]] for kind in KINDS]
    return out


def _straggle_point(ranks, j: int) -> list:
    """[kind, short gap s, s per call, long gap s, s per call] of straggle point j over the ranks: each gap the
    ranks' mean, each call's time the mean over the ranks, then over the calls (as every collective's)."""
    rows = [r["collectives"]["straggle"][j] for r in ranks]
    gap = lambda k: statistics.mean(row[k] for row in rows)      # noqa: E731
    call = lambda k: statistics.mean(statistics.mean(row[k][i] for row in rows)     # noqa: E731
                                     for i in range(len(rows[0][k])))
    return [rows[0][0], gap(1), call(2), gap(3), call(4)]


def measure(tcs, env=None) -> dict:
    """The calibration of a launch (on every rank, after `par.runtime.dist.init()`; rank 0 gets the result, the
    others None): every rank measures its compute at the same time, then, on more than one rank, the
    collectives. Compute: the slowest rank's; collectives: each call the mean over the ranks, then over the calls."""
    import torch.distributed as dist
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    world = env.world_size if env is not None else 1
    if world > 1:
        watch_ranks()     # a call that waits on the other ranks counts their run-queue wait meanwhile
        dist.barrier()
    with commlog.capture():       # the calibration's bytes are nobody's step
        mine = {"compute": measure_compute(tcs)}
        if world > 1:
            dist.barrier()
            mine["collectives"] = measure_collectives()
    ranks = par.runtime.dist.gather_object(mine)
    if ranks is None:
        return None
    comp = [r["compute"] for r in ranks]
    slow = lambda path: max(path(c) for c in comp)      # noqa: E731
    out = {"ranks": world, "threads_per_rank": threads, "cores": preflight.physical_cores(),
           "gemms": [[*g[:4], slow(lambda c, i=i: c["gemms"][i][4])] for i, g in enumerate(comp[0]["gemms"])],
           "null_block_s": slow(lambda c: c["null_block_s"]),
           "memory": [[m[0], slow(lambda c, i=i: c["memory"][i][1]), slow(lambda c, i=i: c["memory"][i][2])]
                      for i, m in enumerate(comp[0]["memory"])],
           "optimizer": [*comp[0]["optimizer"][:2], slow(lambda c: c["optimizer"][2])],
           "host_copy": [comp[0]["host_copy"][0], slow(lambda c: c["host_copy"][1])]}
    if world > 1:
        out["collectives"] = {
            kind: [[n, size, statistics.mean(statistics.mean(r["collectives"][kind][j][2][i] for r in ranks)
                                             for i in range(len(times)))]
                   for j, (n, size, times) in enumerate(ranks[0]["collectives"][kind])]
            for kind in KINDS}
        out["straggle"] = [_straggle_point(ranks, j) for j in range(len(KINDS))]
    out["seconds"] = time.perf_counter() - t0
    return out


# ---------------------------------------------------------------- the Hardware
def launches_per_block() -> float:
    """The operations `cost.layer_seconds` charges one block's forward and backward (each GEMM and each
    memory-bound kind once per pass): its seconds on a device of launch 1 s that computes in no time."""
    free = cost.Compute(peak=math.inf, bandwidth=math.inf, launch=1.0)
    one = cost.layer_seconds(free, cost.dims_of(preset("tiny")), 1, 2, e=4)
    return one.forward + one.backward


def hardware(cal: dict, base: str = "cpu") -> "planner.Hardware":
    """The `planner.Hardware` of a launch's calibration (`measure`): the roofline of its GEMM table, launch,
    memory and optimizer bytes/s, the host copies, and the link of its collectives (each kind its own α, β);
    memory capacity and the links between nodes stay `base`'s (`planner.HARDWARE`)."""
    for key in ("gemms", "null_block_s", "memory", "optimizer", "host_copy"):
        if key not in cal:
            raise ValueError(f"a calibration without {key!r} (keys: {', '.join(cal)}): measure it with "
                             f"par.train.calibration.measure")
    table = cost.gemm_table([(m, n, k, s) for m, n, k, _, s in cal["gemms"]], e=4, combine="mean")
    roof = max(r for _, r in table)
    launch = cal["null_block_s"] / launches_per_block()
    spent = sum(real - null for _, real, null in cal["memory"])
    if spent <= 0:
        raise ValueError(f"the memory-bound operations took no longer at the rows' sizes than at a negligible one "
                         f"({cal['memory']}): no bandwidth to fit")
    bandwidth = sum(b for b, _, _ in cal["memory"]) / spent
    params, per_param, opt_s = cal["optimizer"]
    optimizer_bw = params * per_param / opt_s
    numel, copy_s = cal["host_copy"]
    hw = replace(planner.HARDWARE[base], name=f"this CPU, {cal['ranks']} rank{'s' if cal['ranks'] > 1 else ''}",
                 flops=roof, peak=roof, hbm=bandwidth, efficiency=1.0, launch=launch, gemm_table=table,
                 optimizer_bw=optimizer_bw, host_optimizer_bw=optimizer_bw, bw_host=8 * numel / copy_s)
    if cal.get("collectives"):
        link = cost.fitted_links({k: [tuple(x) for x in rows] for k, rows in cal["collectives"].items()})
        hw = replace(hw, bw_node=link.bandwidth, alpha_node=link.alpha, collectives=link.kinds,
                     straggle=straggle(cal))
    return hw


def straggle(cal: dict) -> float:
    """Seconds a collective waits per second of compute before it: over the kinds, the mean of
    max(0, (t_long − t_short) / (gap_long − gap_short)) (0 without a straggle measurement)."""
    slopes = [max(0.0, (t_long - t_short) / (g_long - g_short))
              for _, g_short, t_short, g_long, t_long in cal.get("straggle", ()) if g_long > g_short]
    return statistics.mean(slopes) if slopes else 0.0


def describe(cal: dict) -> str:
    """The calibration in a few lines: what was measured, what it fits to."""
    hw = hardware(cal)
    lines = [f"measured on {cal['ranks']} rank(s) at once, {cal['seconds']:.1f} s: GEMMs "
             f"{min(r for _, r in hw.gemm_table) / 1e9:.0f}-{hw.peak / 1e9:.0f} GFLOP/s over "
             f"{len(hw.gemm_table)} shapes; launch {hw.launch * 1e6:.1f} µs per operation; memory-bound "
             f"{hw.hbm / 1e9:.1f} GB/s; optimizer {hw.optimizer_bw / 1e9:.2f} GB/s; host copies "
             f"{hw.bw_host / 1e9:.1f} GB/s"]
    for kind, alpha, bw in hw.collectives:
        lines.append(f"  {kind:<15} α {alpha * 1e6:7.1f} µs per step, {bw / 1e9:5.2f} GB/s")
    if cal.get("straggle"):
        lines.append(f"  straggle        {hw.straggle:.3f} s waited per s of compute before a collective "
                     f"(after {cal['straggle'][0][3] * 1e3:.1f} ms of GEMMs against "
                     f"{cal['straggle'][0][1] * 1e3:.2f} ms)")
    return "\n".join(lines)
