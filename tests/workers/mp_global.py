"""Worker: mixed precision on N ranks. The overflow decision is global; data parallel works through the hook.

Case "overflow <dtype>": every rank trains the same TinyMLP on the same data WITHOUT any gradient
communication; at some steps ONE rank (a different one each time) gets an inf (fp16) or a nan
(bf16) in its gradient. Every rank must skip exactly those steps, keep the same loss scale, and
end with identical weights; the local flags show that only one rank saw the overflow itself.

Case "dp": GPT-lite in fp16, each rank on its shard (rows r, r+N, ...) of a global batch, the
16-bit gradients averaged by par.dp.naive.average_gradients through the `reduce_grads` hook.
Compared with one process training the same fp16 setup on the whole batch (run here on every
rank, no communication), with SGD so that a wrong average would show.

Case "naive wrapper": the data-parallel helper's NaiveDP wrapper composes with MixedPrecision
(its sync_gradients is the reduce hook). Rank 0 saves the results.
"""
from __future__ import annotations

import torch

import par.runtime.dist
from par.comm import collectives, commlog
from par.data import CharDataset, global_batches
from par.dp.naive import NaiveDP, average_gradients
from par.precision.loss_scaler import DynamicLossScaler
from par.precision.mixed_precision import MixedPrecision
from par.model import TinyMLP, build, lm_loss
from par.reference import param_hash

INJECT = [2, 5, 6, 9]
STEPS = 12


def overflow_case(env, dtype: str, bad: str) -> dict:
    mp = MixedPrecision(TinyMLP((10, 33, 17, 5), seed=1), lambda ps: torch.optim.Adam(ps, lr=1e-2), dtype,
                        DynamicLossScaler(init_scale=2.0 ** 10, window=4, hysteresis=2))
    g = torch.Generator().manual_seed(7)
    local, skipped, scales = [], [], []
    for step in range(STEPS):
        x, y = torch.randn(8, 10, generator=g), torch.randn(8, 5, generator=g)
        loss = torch.nn.functional.mse_loss(mp.model(mp.cast_inputs(x.to(env.device))).float(), y.to(env.device))
        mp.backward(loss)
        if step in INJECT and env.rank == INJECT.index(step) % env.world_size:
            mp.params[1].grad.view(-1)[3] = float(bad)
        local.append(any(not torch.isfinite(p.grad).all() for p in mp.params))
        mp.step()
        skipped.append(mp.last.overflow)
        scales.append(mp.last.scale)
    return {"local": local, "skipped": skipped, "scales": scales, "hash": param_hash(mp.model)}


def dp_case(env, steps: int = 4, batch: int = 12, lr: float = 0.05) -> dict:
    data = CharDataset(block_size=16)
    batches = list(global_batches(data, batch, steps, seed=3))
    cfg = "tiny"
    make = lambda ps: torch.optim.SGD(ps, lr=lr)
    start = [p.detach().clone() for p in build(cfg, seed=4).parameters()]
    dp = MixedPrecision(build(cfg, seed=4).to(env.device), make, "fp16", DynamicLossScaler(2.0 ** 12),
                        reduce_grads=lambda ps: average_gradients(ps))
    one = MixedPrecision(build(cfg, seed=4).to(env.device), make, "fp16", DynamicLossScaler(2.0 ** 12))
    sent, expected = [], []
    n, r = env.world_size, env.rank
    for x, y in batches:
        x, y = x.to(env.device), y.to(env.device)
        dp.backward(lm_loss(dp.model(x[r::n]).float(), y[r::n]))
        with commlog.capture() as log:
            dp.step()
        sent.append(sum(e.bytes_sent for e in log.events if "overflow flag" not in e.tag))
        expected.append(sum(collectives.ring_all_reduce_bytes(p.numel(), n, r, itemsize=2) for p in dp.params))
        one.backward(lm_loss(one.model(x).float(), y))
        one.step()
    diff = max((a - b).abs().max().item() for a, b in zip(dp.masters, one.masters))
    update = max((a.cpu() - s).abs().max().item() for a, s in zip(one.masters, start))
    return {"hash": param_hash(dp.model), "diff": diff, "update": update, "sent": sent, "expected": expected,
            "skipped": dp.skipped + one.skipped}


def naive_wrapper_case(env, steps: int = 3) -> dict:
    """par.dp.naive.NaiveDP built before MixedPrecision: rank 0's fp32 weights become every rank's masters."""
    model = TinyMLP((10, 33, 17, 5), seed=100 + env.rank)          # different on purpose
    dp = NaiveDP(model)
    mp = MixedPrecision(model, lambda ps: torch.optim.Adam(ps, lr=1e-2), "fp16",
                        reduce_grads=lambda ps: dp.sync_gradients())
    start = param_hash(model)
    for s in range(steps):
        x = torch.randn(8, 10, generator=torch.Generator().manual_seed(10 * s + env.rank)).to(env.device)
        mp.backward(dp(mp.cast_inputs(x)).float().pow(2).mean())
        mp.step()
    return {"start": start, "hash": param_hash(model), "dtype": str(next(model.parameters()).dtype),
            "skipped": mp.skipped}


def main():
    env = par.runtime.dist.init()
    mine = {"overflow fp16": overflow_case(env, "fp16", "inf"), "overflow bf16": overflow_case(env, "bf16", "nan"),
            "dp": dp_case(env), "naive wrapper": naive_wrapper_case(env)}
    everyone = par.runtime.dist.gather_object(mine)
    if env.rank == 0:
        par.runtime.dist.save_result({"world_size": env.world_size, "inject": INJECT, "ranks": everyone})
    par.runtime.dist.teardown()


if __name__ == "__main__":
    main()
