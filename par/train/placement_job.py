"""TP inside the node and DP across it, then the other way round: one launch, both placements.

On N nodes of K ranks (torchrun numbers the ranks node by node, so the K ranks of a node are
consecutive), GPT-lite is trained with tensor parallelism of degree K and data parallelism of
degree N, placed two ways:

    tp-in-node   tp groups = the ranks of one node       [0,1] [2,3]   dp groups cross the nodes [0,2] [1,3]
    tp-across    tp groups = one rank of every node      [0,2] [1,3]   dp groups stay in a node  [0,1] [2,3]

Every rank builds both placements' groups (in the same order, as dist.new_group requires). Each
placement: one warm-up step, then `--steps` timed steps between barriers. Around the timed steps
rank 0 prints `[par-mark] <placement> begin|end` lines and every rank then sleeps a moment, so
that `par.runtime.cluster.Cluster.run` can read the links' byte counters while nothing is sent.

Before both, `calibrate` measures what the planner needs about these ranks with all of them busy
(`par.train.placement.predictions` reads it), with no byte crossing a link: a dense step on 1/N of the batch,
and a TP step inside each node with no data parallelism, which gives the in-node bandwidth a TP step
really gets. Gradients are averaged in one flat all-reduce per step.

Result: world_size, backend, ranks_per_node, calibration {compute_s, node_step_s, node_bytes_s,
allreduce_bytes_s, rows_per_rank}, runs = [{placement,
layout, losses, step_s, per_rank: [{tp_bytes, dp_bytes, tp_group, dp_group}]}]; the tp/dp bytes are what
`par.comm.commlog` counted per rank and timed step.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
import time

import torch
import torch.distributed as dist

import par.runtime.dist
from par.runtime.job_args import JobArgs, arg
from par.comm import commlog
from par.runtime.cluster import MARK
from par.measure import JobResult, RankResult, RunResult, timed_step
from par.model import GPTConfig, GPTLite, lm_loss
from par.comm.collectives import all_reduce, all_reduce_formula_bytes
from par.dp.naive import replica_rows
from par.train.placement import PLACEMENTS, axis_groups, groups_of, node_bandwidth
from par.reference import make_optimizer
from par.tp.layers import TensorParallelGPT

QUIET_S = 1.0


def mark(rank: int, text: str) -> None:
    """Everyone stops; rank 0 names the moment; the links stay quiet while it is read."""
    dist.barrier()
    if rank == 0:
        print(f"{MARK} {text}", flush=True)
    time.sleep(QUIET_S)
    dist.barrier()


def average_flat(params, group) -> None:
    """g <- mean over the dp group, all gradients in one flat all-reduce (one bucket: no per-tensor messages)."""
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    with commlog.tag("dp"):
        all_reduce(flat, "avg", group)
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


def train_step(model, opt, x, y, dp_group=None) -> float:
    """One step: forward, backward, gradients averaged over `dp_group` (if any), Adam; returns the loss."""
    opt.zero_grad(set_to_none=True)
    loss = lm_loss(model(x), y)
    loss.backward()
    if dp_group is not None:
        average_flat(list(model.parameters()), dp_group)
    opt.step()
    return loss.item()


def timed(fn, repeats: int, device) -> float:
    """The median seconds of `fn()` over `repeats` runs after one warm-up, every rank running it at once."""
    fn()
    times = []
    for _ in range(repeats):
        with timed_step(device, barrier=True) as clock:
            fn()
        times.append(clock.seconds)
    return sorted(times)[len(times) // 2]


def calibrate(cfg, x, y, env, node_groups, repeats: int) -> dict | None:
    """What the planner needs about these ranks, measured with all of them busy at once (as in training),
    with no byte crossing a link:

      compute_s     one rank's share of a step: a dense model on batch/N rows (forward, backward, Adam);
      node_step_s   a TP step inside each node on one replica's rows (b/n_nodes), no data parallelism;
      node_bytes_s  the in-node bandwidth a TP step gets (`par.train.placement.node_bandwidth`): its TP bytes over
                    node_step_s - compute_s. Besides moving bytes it pays for the waits at each of the step's
                    4·L·2 all-reduces, which grow when ranks outnumber cores (4 ranks on 2 cores here);
      allreduce_bytes_s  for comparison, one TP message's all-reduce back to back with nothing between."""
    torch.manual_seed(0)
    model = GPTLite(cfg)
    opt = make_optimizer(model.parameters(), "adam", lr=1e-3)
    rows = slice(env.rank, None, env.world_size)

    compute_s = timed(lambda: train_step(model, opt, x[rows], y[rows]), repeats, env.device)

    ranks, group = next((r, pg) for r, pg in node_groups if env.rank in r)
    nodes = env.world_size // len(ranks)
    node = env.rank // len(ranks)
    torch.manual_seed(0)
    tp_model = TensorParallelGPT.from_dense(GPTLite(cfg), group)
    tp_opt = make_optimizer(tp_model.parameters(), "adam", lr=1e-3)
    xb, yb = replica_rows(x, node, nodes), replica_rows(y, node, nodes)
    with commlog.capture() as log:
        train_step(tp_model, tp_opt, xb, yb)
    tp_bytes = log.total_bytes()
    node_step_s = timed(lambda: train_step(tp_model, tp_opt, xb, yb), repeats, env.device)

    buf = torch.ones(len(xb) * cfg.block_size * cfg.d_model)          # one TP message: b·s·d of a replica
    ar_s = timed(lambda: all_reduce(buf, "sum", group), repeats, env.device)
    mine = {"compute_s": compute_s, "node_step_s": node_step_s, "tp_bytes": tp_bytes,
            "allreduce_bytes_s": all_reduce_formula_bytes(buf.numel() * 4, len(ranks)) / ar_s}
    said = par.runtime.dist.gather_object(mine)
    if env.rank != 0:
        return None
    got = {"compute_s": max(r["compute_s"] for r in said), "node_step_s": max(r["node_step_s"] for r in said),
           "allreduce_bytes_s": min(r["allreduce_bytes_s"] for r in said), "rows_per_rank": len(x[rows])}
    got["node_bytes_s"] = node_bandwidth(max(r["tp_bytes"] for r in said), got["node_step_s"], got["compute_s"],
                                         got["allreduce_bytes_s"])
    return got


@dataclass(frozen=True)
class Args(JobArgs):
    d_model: int = arg(16)
    n_head: int = arg(2)
    n_layer: int = arg(2)
    seq: int = arg(64)
    batch: int = arg(128, "global batch (sequences)")
    steps: int = arg(3)


@dataclass(frozen=True, kw_only=True)
class RankResult(RankResult):
    """One rank's bytes per step in its TP and DP groups, and the groups."""
    tp_bytes: float
    dp_bytes: float
    tp_group: list
    dp_group: list


@dataclass(frozen=True, kw_only=True)
class RunResult(RunResult):
    """One placement of the TP groups (within or across hosts)."""
    Rank = RankResult
    placement: str
    layout: str
    losses: list
    step_s: list
    model: dict
    batch: int


@dataclass(frozen=True, kw_only=True)
class Result(JobResult):
    """The launch: the calibration and one run per placement; `par.train.placement.measure` adds the link, the
    steps and the sizes it ran, and the cluster the bytes each link carried."""
    Run = RunResult
    ranks_per_node: int
    calibration: dict
    runs: tuple
    link: str | None = None
    steps: int | None = None
    sizes: dict | None = None
    links: dict | None = None        # par.runtime.cluster's link byte counters: {mark: {host: bytes}}

def main(argv=None) -> int:
    args = Args.parse(argv)
    env = par.runtime.dist.init()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size))
    kinds = groups_of(env.world_size, per_node)
    made = {kind: [(ranks, dist.new_group(ranks)) for ranks in kinds[kind]] for kind in ("node", "across")}
    cfg = GPTConfig(vocab_size=65, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head,
                    d_model=args.d_model)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)
    y = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)
    calibration = calibrate(cfg, x, y, env, made["node"], repeats=9)
    runs = []
    for placement in PLACEMENTS:
        tp_kind, dp_kind = axis_groups(placement)["tp"], axis_groups(placement)["dp"]
        tp_ranks, tp_group = next((r, pg) for r, pg in made[tp_kind] if env.rank in r)
        dp_ranks, dp_group = next((r, pg) for r, pg in made[dp_kind] if env.rank in r)
        torch.manual_seed(0)
        model = TensorParallelGPT.from_dense(GPTLite(cfg), tp_group)
        opt = make_optimizer(model.parameters(), "adam", lr=1e-3)
        d, dp = dp_ranks.index(env.rank), len(dp_ranks)
        xb, yb = replica_rows(x, d, dp), replica_rows(y, d, dp)

        def step() -> float:
            return train_step(model, opt, xb, yb, dp_group)

        step()                                                   # warm-up
        mark(env.rank, f"{placement} begin")
        losses, times = [], []
        with commlog.capture() as log:
            for _ in range(args.steps):
                with timed_step(env.device, barrier=True) as clock:
                    losses.append(step())
                    dist.barrier()                       # the step is over when the slowest rank's is
                times.append(clock.seconds)
        mark(env.rank, f"{placement} end")
        dp_bytes = sum(e.bytes_sent for e in log.events if e.tag.startswith("dp"))
        mine = {"tp_bytes": (log.total_bytes() - dp_bytes) / args.steps, "dp_bytes": dp_bytes / args.steps,
                "tp_group": tp_ranks, "dp_group": dp_ranks}
        ranks = par.runtime.dist.gather_object(mine)
        if env.rank == 0:
            runs.append({"placement": placement, "layout": f"dp{dp}xpp1xtp{len(tp_ranks)}", "losses": losses,
                         "step_s": times, "per_rank": ranks, "model": cfg.to_dict(), "batch": args.batch})
    if env.rank == 0:
        par.runtime.dist.save_result({"world_size": env.world_size, "backend": env.backend, "ranks_per_node": per_node,
                                      "calibration": calibration, "runs": runs})
    par.runtime.dist.teardown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
