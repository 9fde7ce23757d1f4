"""Worker: 3D-parallel GPT-lite (dp × pp × tp, 1F1B, DP or ZeRO-1) equals single-process training.

argv: layouts as 'dp,pp,tp[,zero]' (product = world size). For each: the grid's groups are
checked with real collectives (the sum of the ranks over each group equals the sum of its rank
list), then STEPS Adam steps of the engine beside the single-process reference on the same global
batches. Every rank compares its own (TP-sharded, stage-local) parameters with the reference cut
the same way. Rank 0 saves {layout: {"param": max diff, "loss": max loss gap, "groups_ok": bool}}.
"""
from __future__ import annotations

import math
import sys

import torch

import par.runtime.dist
from par.comm import collectives
from par.data import CharDataset, global_batches
from par.runtime.grid import Grid
from par.model import build, lm_loss, preset
from par.train.parallel3d import Parallel3D, reference_shards
from par.reference import make_optimizer

STEPS, LR, EPS, M, ROWS_PER_MB = 2, 1e-3, 1e-6, 2, 2


def worst(values) -> float:
    """The largest value, or inf when any is NaN/inf (Python's max() silently skips a NaN after the first)."""
    values = list(values)
    return max(values, default=0.0) if all(map(math.isfinite, values)) else math.inf


def groups_ok(grid: Grid) -> bool:
    ok = True
    for axis in ("dp", "pp", "tp"):
        t = torch.tensor([float(grid.rank)], device=par.runtime.dist.env().device)
        collectives.all_reduce(t, group=grid.groups[axis], impl="torch")
        ok &= t.item() == sum(grid.ranks[axis])
    return ok


def run(dp, pp, tp, zero):
    grid = Grid(dp, pp, tp)
    cfg = preset("tiny", n_layer=3)          # 5 layers: embedding, 3 blocks, head
    ds = CharDataset(block_size=cfg.block_size)
    batches = list(global_batches(ds, dp * M * ROWS_PER_MB, STEPS, seed=dp * 100 + pp * 10 + tp))
    engine = Parallel3D(build(cfg, seed=3), grid, microbatches=M, lr=LR, zero_stage=zero, eps=EPS)
    ref = build(cfg, seed=3)
    opt = make_optimizer(ref.parameters(), "adam", LR, eps=EPS)
    gaps, losses = [], []
    for x, y in batches:
        loss = engine.step(x, y)
        opt.zero_grad()
        ref_loss = lm_loss(ref(x), y)
        ref_loss.backward()
        opt.step()
        if loss is not None:
            gaps.append(abs(loss - ref_loss.item()))
            losses.append(loss)
    want = reference_shards(ref, grid)
    diff = worst((p.detach() - want[n]).abs().max().item() for n, p in engine.named_parameters())
    n_local = sum(p.numel() for p in engine.params)
    return {"param": diff, "loss": worst(gaps), "losses": losses, "groups_ok": groups_ok(grid), "n_local": n_local,
            "coords": (grid.dp_rank, grid.stage, grid.tp_rank)}


def main():
    env = par.runtime.dist.init()
    results = {}
    for spec in sys.argv[1:]:
        dp, pp, tp, *zero = (int(v) for v in spec.split(","))
        res = run(dp, pp, tp, zero[0] if zero else 0)
        parts = par.runtime.dist.gather_object(res)
        if env.rank == 0:
            results[spec] = {"param": worst(r["param"] for r in parts), "loss": worst(r["loss"] for r in parts),
                             "losses": [l for r in parts for l in r["losses"]],
                             "groups_ok": all(r["groups_ok"] for r in parts),
                             "n_local": [r["n_local"] for r in parts], "coords": [r["coords"] for r in parts]}
    par.runtime.dist.save_result(results)
    par.runtime.dist.teardown()


if __name__ == "__main__":
    main()
