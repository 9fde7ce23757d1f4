"""Expert parallel vs the single-process MoE, every case in one launch: torchrun on N = 2, 3 or 4 ranks.

1. The layer (E = 5 experts: uneven over 2, 3 and 4 ranks; k = 1 and 2; capacity factor 1, so tokens
   drop), p2p and torch all-to-all: routing and dropped tokens, forward, input, router and expert
   gradients against `MoE(x, groups=N)`; the bytes of both all-to-alls against the formula.
2. A MoE GPT-lite trained for a few Adam steps with EP inside DP (ep = N, and ep = 2 on 4 ranks), and once with
   a shared expert and the router z-loss, losses and final weights against the single-process model with the N
   batches as routing groups.
Rank 0 saves the largest differences (max over ranks) as JSON.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import par.runtime.dist
from par.comm import commlog
from par.moe import experts as ep
from par.runtime import nccl_emulation
from par.data import CharDataset, global_batches
from par.model import preset
from par.moe.router import MoE, build_moe_gpt, moe_loss, set_groups
from par.reference import make_optimizer

D, FFN, E, B, T = 8, 12, 5, 2, 6


def worst(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, dist.ReduceOp.MAX)
    return t.item()


def layer_case(n: int, r: int, k: int, impl: str) -> dict:
    torch.manual_seed(k)
    dense = MoE(D, FFN, n_experts=E, k=k, capacity_factor=1.0)
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(n * B, T, D, generator=g), torch.randn(n * B, T, D, generator=g)
    groups = ep.EPGroups(n, n)
    layer = ep.ExpertParallelMoE(dense, None, impl)
    xd = x.clone().requires_grad_()
    yd = dense(xd, groups=n)
    ((yd * w).sum() + dense.aux).backward()
    mine = slice(r * B, (r + 1) * B)
    xr = x[mine].clone().requires_grad_()
    with commlog.capture() as fwd:
        yr = layer(xr)
    ((yr * w[mine]).sum() + layer.aux / n).backward()
    ep.sync_gradients(layer, groups, "torch")
    ref, got = dense.routings[r], layer.routings[0]
    a, b = layer.start, layer.end
    grads = {"router": (layer.router.weight.grad - dense.router.weight.grad).abs().max().item()}
    for name in ("w1", "b1", "w2", "b2"):
        grads[name] = (getattr(layer.experts, name).grad - getattr(dense.experts, name).grad[a:b]).abs().max().item()
    dispatch_b, combine_b = ep.alltoall_bytes(E, ref.capacity, D, n, r)
    sent = [e.bytes_sent for e in fwd.events if e.kind == "all_to_all"]
    return {"same_routing": bool(torch.equal(ref.expert, got.expert) and torch.equal(ref.kept, got.kept)),
            "dropped": ref.dropped, "forward": worst((yr - yd[mine]).abs().max().item()),
            "input_grad": worst((xr.grad - xd.grad[mine]).abs().max().item()),
            "grads": {k_: worst(v) for k_, v in grads.items()},
            "aux": worst(abs(layer.aux.item() - ref.aux.item())),
            "bytes_ok": sent == [dispatch_b, combine_b], "bytes": sent, "formula": [dispatch_b, combine_b]}


def training_case(n: int, ep_degree: int, impl: str, steps: int = 3, alpha: float = 0.01, beta: float = 0.0,
                  shared: int = 0) -> dict:
    cfg = preset("tiny", n_layer=2, block_size=8, d_model=16, n_head=2)
    data = CharDataset(block_size=cfg.block_size)
    batches = list(global_batches(data, 2 * n, steps, seed=3))
    dense = build_moe_gpt(cfg, n_experts=E, k=2, capacity_factor=1.0, seed=0, shared=shared)
    groups = ep.make_groups(ep_degree)
    model = ep.to_expert_parallel(dense, groups, impl)
    set_groups(dense, n)
    opt_d, opt = make_optimizer(dense.parameters(), "adam", 1e-2), make_optimizer(model.parameters(), "adam", 1e-2)
    r = dist.get_rank()
    losses, ref_losses = [], []
    for x, y in batches:
        opt_d.zero_grad(set_to_none=True)
        loss = moe_loss(dense, dense(x), y, alpha, beta)
        loss.backward()
        opt_d.step()
        ref_losses.append(loss.item())
        mine = slice(2 * r, 2 * r + 2)
        losses.append(ep.train_step(model, opt, x[mine], y[mine], groups, alpha, "torch", beta))
    want = ep.reference_shard(dense, model)
    weights, key_bias = weight_gaps(model.state_dict(), want)
    return {"ep": ep_degree, "dp": groups.dp, "loss": worst(max(abs(a - b) for a, b in zip(losses, ref_losses))),
            "weights": worst(weights), "key_bias": worst(key_bias), "losses": losses, "ref_losses": ref_losses}


def weight_gaps(state: dict, want: dict) -> tuple[float, float]:
    """(largest |weight − reference| over every weight but the key bias, the key bias's own).

    The key part of a qkv bias has a true gradient of exactly 0: it adds q·b_k to every score of a row, and softmax
    does not change when every score moves alike. What backward computes for it is rounding noise (~1e-9), and
    Adam divides each gradient by its own running size, so that noise becomes a step of up to lr per step whose
    sign the rounding decides. It is compared apart, within steps × lr."""
    weights = key_bias = 0.0
    for name, p in state.items():
        gap = (p - want[name]).abs()
        if name.endswith("attn.qkv.bias"):
            q, k, v = gap.chunk(3)
            key_bias = max(key_bias, k.max().item())
            gap = torch.cat([q, v])
        weights = max(weights, gap.max().item())
    return weights, key_bias


def main() -> int:
    env = par.runtime.dist.init()
    n, r = env.world_size, env.rank
    torch.use_deterministic_algorithms(True)
    layers = {f"k{k}-{impl}": layer_case(n, r, k, impl) for k in (1, 2) for impl in ep.IMPLS}
    train = {f"ep{e}": training_case(n, e, "p2p") for e in sorted({n, 2} if n % 2 == 0 else {n})}
    train["shared+z"] = training_case(n, n, "p2p", beta=1e-2, shared=1)     # a shared expert, the router z-loss
    if r == 0:
        par.runtime.dist.save_result({"world_size": n, "backend": env.backend, "nccl_emulation": nccl_emulation.enabled(),
                                      "layers": layers, "train": train})
    par.runtime.dist.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
