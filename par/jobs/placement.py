"""TP inside the node and DP across it, then the other way round: one launch, both placements.

On N nodes of K ranks (torchrun numbers the ranks node by node, so the K ranks of a node are
consecutive), GPT-lite is trained with tensor parallelism of degree K and data parallelism of
degree N, placed two ways:

    tp-in-node   tp groups = the ranks of one node       [0,1] [2,3]   dp groups cross the nodes [0,2] [1,3]
    tp-across    tp groups = one rank of every node      [0,2] [1,3]   dp groups stay in a node  [0,1] [2,3]

Every rank builds both placements' groups (in the same order, as dist.new_group requires). Each
placement: one warm-up step, then `--steps` timed steps between barriers. Around the timed steps
rank 0 prints `[par-mark] <placement> begin|end` lines and every rank then sleeps a moment, so
that `par.cluster.Cluster.run` can read the links' byte counters while nothing is sent.

Before both, `calibrate` measures what the planner needs about these ranks with all of them busy
(`par.placement.predictions` reads it): a dense step on 1/N of the batch, and an in-node all-reduce
of one TP message. Gradients are averaged in one flat all-reduce per step.

Result: world_size, backend, ranks_per_node, calibration {compute_s, node_bytes_s}, runs = [{placement,
layout, losses, step_s, per_rank: [{tp_bytes, dp_bytes, tp_group, dp_group}]}]; the tp/dp bytes are what
`par.commlog` counted per rank and timed step.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import par.dist
from par import commlog
from par.cluster import MARK
from par.model import GPTConfig, GPTLite, lm_loss
from par.collectives import all_reduce
from par.parallel3d import replica_rows
from par.placement import PLACEMENTS, axis_groups, groups_of
from par.reference import make_optimizer
from par.tensor_parallel import TensorParallelGPT

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


def timed(fn, repeats: int) -> float:
    """The median seconds of `fn()` over `repeats` runs after one warm-up, every rank running it at once."""
    fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def calibrate(cfg, x, y, env, node_groups, repeats: int) -> dict | None:
    """What the planner needs about these ranks, measured with all of them busy at once (as in training):
    compute_s, one rank's share of a step (a dense model on batch/N rows: forward, backward, Adam), and
    node_bytes_s, the bytes per second one rank sends in an all-reduce inside its node (no link crossed), for
    a message of a tensor-parallel all-reduce's size (b·s·d values, b the rows of one replica)."""
    torch.manual_seed(0)
    model = GPTLite(cfg)
    opt = make_optimizer(model.parameters(), "adam", lr=1e-3)
    rows = slice(env.rank, None, env.world_size)

    def dense_step():
        opt.zero_grad(set_to_none=True)
        lm_loss(model(x[rows]), y[rows]).backward()
        opt.step()
    compute_s = timed(dense_step, repeats)
    ranks, group = next((r, pg) for r, pg in node_groups if env.rank in r)
    buf = torch.ones(len(x[rows]) * env.world_size // len(ranks) * cfg.block_size * cfg.d_model)   # one TP message
    node_s = timed(lambda: all_reduce(buf, "sum", group), repeats)
    sent = 2 * (len(ranks) - 1) / len(ranks) * buf.numel() * 4
    mine = {"compute_s": compute_s, "node_bytes_s": sent / node_s}
    ranks_said = par.dist.gather_object(mine)
    if env.rank != 0:
        return None
    return {"compute_s": max(r["compute_s"] for r in ranks_said),
            "node_bytes_s": min(r["node_bytes_s"] for r in ranks_said), "rows_per_rank": len(x[rows])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d-model", type=int, default=16)
    ap.add_argument("--n-head", type=int, default=2)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=128, help="global batch (sequences)")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    env = par.dist.init()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size))
    kinds = groups_of(env.world_size, per_node)
    made = {kind: [(ranks, dist.new_group(ranks)) for ranks in kinds[kind]] for kind in ("node", "across")}
    cfg = GPTConfig(vocab_size=65, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head,
                    d_model=args.d_model)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)
    y = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)
    calibration = calibrate(cfg, x, y, env, made["node"], repeats=5)
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
            opt.zero_grad(set_to_none=True)
            loss = lm_loss(model(xb), yb)
            loss.backward()
            average_flat(list(model.parameters()), dp_group)
            opt.step()
            return loss.item()

        step()                                                   # warm-up
        mark(env.rank, f"{placement} begin")
        losses, times = [], []
        with commlog.capture() as log:
            for _ in range(args.steps):
                dist.barrier()
                t0 = time.perf_counter()
                losses.append(step())
                dist.barrier()
                times.append(time.perf_counter() - t0)
        mark(env.rank, f"{placement} end")
        dp_bytes = sum(e.bytes_sent for e in log.events if e.tag.startswith("dp"))
        mine = {"tp_bytes": (log.total_bytes() - dp_bytes) / args.steps, "dp_bytes": dp_bytes / args.steps,
                "tp_group": tp_ranks, "dp_group": dp_ranks}
        ranks = par.dist.gather_object(mine)
        if env.rank == 0:
            runs.append({"placement": placement, "layout": f"dp{dp}xpp1xtp{len(tp_ranks)}", "losses": losses,
                         "step_s": times, "per_rank": ranks, "model": cfg.to_dict(), "batch": args.batch})
    if env.rank == 0:
        par.dist.save_result({"world_size": env.world_size, "backend": env.backend, "ranks_per_node": per_node,
                              "calibration": calibration, "runs": runs})
    par.dist.teardown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
