"""Lecture 08's measurements: activation memory per rank, SP and CP training beside the dense model, the ring timeline.

    par.runtime.launch.run("par.cp.job", nproc=tensor_parallel.tp_degree(cfg, world_size), args=["--steps", "5"])

Launch it on a number of ranks that divides the heads (sequence parallelism runs on TP). Rank 0 saves,
beside the job contract's keys (world_size, backend, losses = the dense model's loss per step, step_s =
the slowest rank's seconds per TP+SP step, per_rank):

    memory      per sequence length, the bytes autograd keeps for one transformer block on one rank
                (`par.memory.accounting.saved_activation_bytes`, the largest over the ranks) for DP (the whole
                sequence, a replica per rank; plain attention and `flash_attention`), TP, TP+SP, CP (ring
                attention) and Ulysses, each beside `par.memory.accounting.activation_bytes_per_layer`
    sp_losses, cp_losses, ulysses_losses    the same training with TP+SP, CP and Ulysses (each loss of the
                whole batch); max_param_diff {"sp", "cp", "ulysses"}: the largest gap to the dense weights
    attention_bytes  per kernel (ring, ulysses): the bytes each rank sent in one attention forward and
                backward at the training shape, counted by `par.comm.commlog`, beside the formulas
    timeline    per layout (balanced, naive): the spans of one ring-attention forward (compute per
                block, K/V transfers), every rank's; the scores each rank computes (`computed_pairs`) and the
                FLOPs `FlopCounterMode` counts in its forward (`flops`); and, for `--timeline-repeats` forwards
                of each layout run in turns (balanced, naive, balanced, ...: load drifts hit both alike), each
                rank's attention compute per forward on the wall and the steady clock (`compute_s`) and its
                exposed wait between blocks (`exposed_s`), [forward][rank] seconds
    oversubscribed  more ranks than physical cores (then the timeline's times are not to be trusted)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import par.runtime.dist
from par import clock
from par.comm import commlog
from par.cp import ring_attention as cp, ulysses
from par.data import CharDataset, global_batches
from par.measure import JobResult, RankResult, RunResult, slowest, timed_step
from par.memory import accounting as memory
from par.model import Block, build, lm_loss, preset
from par.reference import make_optimizer
from par.runtime.job_args import arg, JobArgs
from par.runtime.job_work import Training
from par.runtime.preflight import physical_cores
from par.timeline import Recorder
from par.tp import layers as tp, sequence as sp
from par.tp.ops import my_sequence_slice


@dataclass(frozen=True)
class Args(JobArgs):
    preset: str = arg("tiny")
    steps: int = arg(5, minimum=1)
    batch_size: int = arg(4, minimum=1)
    lr: float = arg(1e-3)
    seqs: tuple[int, ...] = arg((), "sequence lengths of the memory sweep (default: the context × 1, 2, 4, 8)")
    timeline_seq: int = arg(2048, "tokens of the ring-attention timeline")
    timeline_heads: int = arg(2)
    timeline_head_dim: int = arg(128, "wide heads: a block's matmuls outweigh its softmax")
    timeline_repeats: int = arg(7, "timed forwards of each layout, in turns", minimum=1)
    seed: int = arg(0)


@dataclass(frozen=True, kw_only=True)
class RankResult(RankResult):
    """One rank's activation bytes, per sequence length."""
    memory: list


@dataclass(frozen=True, kw_only=True)
class Result(JobResult, RunResult):
    """The launch (one run): the quantities of the module's docstring."""
    Rank = RankResult
    preset: str
    batch_size: int
    losses: list
    sp_losses: list
    cp_losses: list
    ulysses_losses: list
    max_param_diff: dict
    attention_bytes: list | None
    step_s: list
    memory: list
    timeline: dict | None
    oversubscribed: bool
    timeline_shape: list

def work(args: Args, nproc: int) -> list:
    """What a launch of these arguments computes (the course's dry run costs it): TP+SP and CP training (and a
    timeline) beside the dense model, costed as three TP trainings with the dense reference (the planner's TP
    activations bound TP+SP's and CP's)."""
    return [Training(model=preset(args.preset), global_batch=args.batch_size, tp=nproc, steps=3 * args.steps,
                     reference_batch=args.batch_size, label=f"TP+SP and CP on {nproc}")]


def sweep(cfg, n: int, seqs: tuple[int, ...]) -> list[int]:
    """Sequence lengths for the memory figure, rounded up to a multiple of 2n (SP and CP both split them)."""
    seqs = list(seqs) or (
        [cfg.block_size * k for k in (1, 2, 4, 8)] if cfg.block_size <= 256 else
        [cfg.block_size // 4, cfg.block_size // 2, cfg.block_size])
    return [-(-s // (2 * n)) * 2 * n for s in seqs]


def block_memory(cfg, n: int, r: int, seq: int, batch: int, device) -> dict:
    """Saved bytes of one block per strategy on this rank, and the formulas."""
    torch.manual_seed(0)
    dense = Block(cfg).to(device)
    x = torch.randn(batch, seq, cfg.d_model, device=device)
    e = x.element_size()
    positions, whole = cp.all_positions(seq, n), [torch.arange(seq)]
    flash = lambda q, k, v, pos, group, rec: cp.flash_attention(q, k, v, pos[0], pos[0])   # noqa: E731
    mine = cp.shard_sequence(x, positions[r])
    runs = {
        "DP": (dense, lambda t: dense(t), x),
        "DP flash": (dense, lambda t: cp.block_forward(dense, t, whole, attend=flash), x),
        "TP": (tp.TensorParallelBlock.from_dense(dense), None, x),
        "TP+SP": (sp.SequenceParallelBlock.from_dense(dense), None, my_sequence_slice(x)),
        "CP": (dense, lambda t: cp.block_forward(dense, t, positions), mine),
        "Ulysses": (dense, lambda t: cp.block_forward(dense, t, positions, attend=ulysses.ulysses_attention), mine),
    }
    out = {}
    for name, (module, fn, inp) in runs.items():
        _, saved = memory.saved_activation_bytes(fn or module, inp.clone().requires_grad_(),
                                                 exclude=list(module.parameters()))
        out[name] = saved
    f = lambda **kw: memory.activation_bytes_per_layer(seq, batch, cfg.d_model, cfg.n_head, "none", e,
                                                       dropout=False, **kw)
    formula = {"DP": f(), "DP flash": f(flash=True), "TP": f(tp=n), "TP+SP": f(tp=n, sequence_parallel=True),
               "CP": f(cp=n) if n > 1 else f(flash=True), "Ulysses": f(cp=n) if n > 1 else f(flash=True)}
    return {"seq": seq, "measured": out, "formula": formula}


def train(cfg, n: int, r: int, args, device) -> dict:
    """The dense model, TP+SP and CP trained on the same batches; losses and the final weight gaps."""
    dense = build(cfg, seed=args.seed).to(device)
    spm = sp.SequenceParallelGPT.from_dense(dense)
    seq = cfg.block_size - cfg.block_size % n          # SP cuts the sequence into n equal slices
    positions = cp.all_positions(seq, n)
    kernels = {"cp": cp.ring_attention, "ulysses": ulysses.ulysses_attention}
    models = {"dense": dense, "sp": spm} | {k: build(cfg, seed=args.seed).to(device) for k in kernels}
    opts = {k: make_optimizer(m.parameters(), "adam", args.lr, eps=1e-6) for k, m in models.items()}
    losses = {k: [] for k in models}
    step_s = []
    for x, y in global_batches(CharDataset(block_size=seq), args.batch_size, args.steps, seed=args.seed):
        x, y = x.to(device), y.to(device)
        for o in opts.values():
            o.zero_grad(set_to_none=True)
        loss = lm_loss(dense(x), y)
        loss.backward()
        losses["dense"].append(loss.item())
        with timed_step(device) as clock:
            loss = lm_loss(spm(x), y)
            loss.backward()
            sp.sync_grads(spm)
        step_s.append(clock.seconds)
        losses["sp"].append(loss.item())
        for name, attend in kernels.items():
            losses[name].append(sequence_split_step(models[name], x, y, positions, r, attend))
        for o in opts.values():
            o.step()
    gaps = {"sp": max((a - b).abs().max().item() for a, b in
                      zip(spm.state_dict().values(), tp.TensorParallelGPT.from_dense(dense).state_dict().values()))}
    gaps |= {k: max((a - b).abs().max().item() for a, b in zip(models[k].parameters(), dense.parameters()))
             for k in kernels}
    return {"losses": losses, "step_s": step_s, "max_param_diff": gaps}


def sequence_split_step(model, x, y, positions, r: int, attend) -> float:
    """Forward and backward of this rank's tokens with `attend` (ring or Ulysses), gradients summed; the batch's loss."""
    logits = cp.gpt_forward(model, cp.shard_sequence(x, positions[r]), positions, attend=attend)
    mine = F.cross_entropy(logits.reshape(-1, logits.size(-1)), cp.shard_sequence(y, positions[r]).reshape(-1),
                           reduction="sum") / y.numel()
    mine.backward()
    cp.sync_grads(model)
    total = mine.detach().clone()
    torch.distributed.all_reduce(total) if len(positions) > 1 else None
    return total.item()


def attention_bytes(cfg, n: int, r: int, batch: int, device) -> dict:
    """Bytes this rank sends in one attention forward and backward, ring vs Ulysses, counted beside the formulas."""
    seq = cfg.block_size - cfg.block_size % n
    positions, hd = cp.all_positions(seq, n), cfg.d_model // cfg.n_head
    lengths = [len(p) for p in positions]
    g = torch.Generator().manual_seed(2)
    qkv = [torch.randn(batch, cfg.n_head, lengths[r], hd, generator=g).to(device).requires_grad_() for _ in range(3)]
    formulas = {"ring": cp.ring_attention_bytes(lengths, r, batch, cfg.d_model),
                "ulysses": ulysses.ulysses_bytes(lengths, cfg.n_head, r, batch, hd)}
    out = {}
    for name, attend in (("ring", cp.ring_attention), ("ulysses", ulysses.ulysses_attention)):
        with commlog.capture() as fwd:
            y = attend(*qkv, positions)
        with commlog.capture() as bwd:
            y.sum().backward()
        out[name] = {"counted": {"forward": fwd.total_bytes(), "backward": bwd.total_bytes()},
                     "formula": formulas[name]}
    return out


def _exposed(spans) -> tuple[float, float]:
    """(wall, steady) seconds one rank waited between consecutive compute spans of one forward: each gap is the wait
    for the next K/V block, its run-queue and CPU seconds those of the transfer's span less the compute span inside
    it (`par.clock.load_proof`)."""
    compute = sorted((s for s in spans if s.lane == "compute"), key=lambda s: s.start)
    comm = [s for s in spans if s.lane == "comm"]
    wall = steady = 0.0
    for a, b in zip(compute, compute[1:]):
        gap = max(0.0, b.start - a.end)
        around = next((c for c in comm if c.start <= a.start and c.end >= a.end), None)
        ready = max(0.0, around.ready - a.ready) if around else 0.0
        cpu = max(0.0, around.cpu - a.cpu) if around else 0.0
        wall += gap
        steady += clock.load_proof(gap, min(cpu, gap), ready)
    return wall, steady


def timeline(n: int, r: int, args, device) -> dict:
    """Ring-attention forwards per layout at a size where a block's compute outweighs its transfer: one warm-up
    forward of each, then `timeline_repeats` of each in turns; the spans of the last one are kept for the figure."""
    from torch.utils.flop_counter import FlopCounterMode
    g = torch.Generator().manual_seed(1)
    shape = (1, args.timeline_heads, args.timeline_seq, args.timeline_head_dim)
    full = [torch.randn(shape, generator=g).to(device) for _ in range(3)]
    qkv = {layout: [cp.shard_sequence(t, p[r], dim=2) for t in full]
           for layout, p in ((layout, cp.all_positions(args.timeline_seq, n, layout)) for layout in cp.LAYOUTS)}
    out = {layout: {"compute_s": {"wall": [], "steady": []}, "exposed_s": {"wall": [], "steady": []}}
           for layout in cp.LAYOUTS}
    rec = Recorder()
    for i in range(1 + args.timeline_repeats):          # the first forward of each layout warms up
        for layout in cp.LAYOUTS:
            rec.reset()
            with torch.no_grad():
                cp.ring_attention(*qkv[layout], cp.all_positions(args.timeline_seq, n, layout), recorder=rec)
            mine = rec.spans
            if i == 0:
                continue
            compute = [s for s in mine if s.lane == "compute"]
            out[layout]["compute_s"]["wall"].append(sum(s.duration for s in compute))
            out[layout]["compute_s"]["steady"].append(sum(s.steady for s in compute))
            for clock_, x in zip(("wall", "steady"), _exposed(mine)):
                out[layout]["exposed_s"][clock_].append(x)
            if i == args.timeline_repeats:
                out[layout]["spans"] = rec.gather()
    for layout in cp.LAYOUTS:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            cp.ring_attention(*qkv[layout], cp.all_positions(args.timeline_seq, n, layout))
        flops = par.runtime.dist.gather_object(counter.get_total_flops())
        timed = par.runtime.dist.gather_object({k: out[layout][k] for k in ("compute_s", "exposed_s")})
        if timed is not None:       # rank 0: [forward][rank]
            for k in ("compute_s", "exposed_s"):
                out[layout][k] = {c: [list(x) for x in zip(*(t[k][c] for t in timed))] for c in timed[0][k]}
        out[layout] |= {"flops": flops, "computed_pairs": cp.computed_pairs(args.timeline_seq, n, layout),
                        "causal_pairs": cp.causal_pairs(args.timeline_seq, n, layout)}
    return out


def main(argv=None) -> None:
    args = Args.parse(argv)
    env = par.runtime.dist.init()
    n, r = env.world_size, env.rank
    cfg = preset(args.preset)
    tp.check_tp_degree(cfg, n)
    mem = [block_memory(cfg, n, r, s, args.batch_size, env.device) for s in sweep(cfg, n, args.seqs)]
    worst = par.runtime.dist.gather_object(mem)
    if r == 0:        # the largest over the ranks (CP's uneven slices differ by a token)
        for i, row in enumerate(mem):
            row["measured"] = {k: max(w[i]["measured"][k] for w in worst) for k in row["measured"]}
    trained = train(cfg, n, r, args, env.device)
    sent = par.runtime.dist.gather_object(attention_bytes(cfg, n, r, args.batch_size, env.device))
    every_step_s = par.runtime.dist.gather_object(trained["step_s"])
    spans = timeline(n, r, args, env.device)
    per_rank = par.runtime.dist.gather_object({"rank": r, "memory": [m["measured"] for m in mem]})
    par.runtime.dist.save_result({
        "world_size": n, "backend": env.backend, "preset": args.preset, "batch_size": args.batch_size,
        "losses": trained["losses"]["dense"], "sp_losses": trained["losses"]["sp"],
        "cp_losses": trained["losses"]["cp"], "ulysses_losses": trained["losses"]["ulysses"],
        "max_param_diff": trained["max_param_diff"], "attention_bytes": sent,
        "step_s": slowest(every_step_s) if every_step_s else [], "per_rank": per_rank,
        "memory": mem, "timeline": spans, "oversubscribed": n > physical_cores(),
        "timeline_shape": [1, args.timeline_heads, args.timeline_seq, args.timeline_head_dim]})
    par.runtime.dist.teardown()


if __name__ == "__main__":
    main()
