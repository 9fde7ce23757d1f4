"""Tensor parallel vs dense, every case in one launch: run with torchrun on N = 2, 3 or 4 ranks.

For each module (column, row, MLP, attention, block, whole GPT-lite) the TP version is built from a
dense module with `from_dense`; the worker checks the shards, then compares forward outputs, input
gradients and weight gradients with the dense module, counts the collectives, trains a few Adam
steps, and reports the largest differences (max over ranks) to the test as JSON.
"""
from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import par.runtime.dist
from par.comm import commlog
from par.runtime import nccl_emulation
from par.comm.collectives import all_reduce_formula_bytes, ring_all_reduce_bytes
from par.data import CharDataset, global_batches
from par.model import MLP, Attention, Block, GPTConfig, build, lm_loss
from par.reference import make_optimizer
from par.tp import layers as tp

CFG = GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=12, d_model=48)  # splits over 2, 3 and 4
B, T = 4, 16


def grads_as_module(m: nn.Module) -> nn.Module:
    """A copy of `m` whose parameters hold `m`'s gradients (so from_dense shards gradients)."""
    g = copy.deepcopy(m)
    with torch.no_grad():
        for p, q in zip(g.parameters(), m.parameters()):
            p.copy_(q.grad)
    return g


def diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(((a[k] - b[k]).abs().max().item() for k in a), default=0.0)


def my_slice(t: torch.Tensor, n: int, r: int) -> torch.Tensor:
    k = t.size(-1) // n
    return t[..., r * k:(r + 1) * k]


def compare(tp_mod, dense, x, group, n, r, *, x_parallel=False, y_parallel=False, loss=None):
    """Shard exactness, forward, input grad and weight grads of tp_mod vs dense on input x."""
    out = {"shard": diff(tp_mod.state_dict(), tp.shard_like(tp_mod, dense, group))}
    dense.zero_grad(set_to_none=True)
    xd = x.clone().requires_grad_(x.is_floating_point())
    xt = (my_slice(x, n, r) if x_parallel else x).clone().requires_grad_(x.is_floating_point())
    yd = dense(xd)
    with commlog.capture() as fwd:
        yt = tp_mod(xt)
    with commlog.capture() as bwd:
        w_out = torch.randn(yd.shape, generator=torch.Generator().manual_seed(7))
        if loss is not None:
            lt = loss(yt)
        else:
            lt = (yt * (my_slice(w_out, n, r) if y_parallel else w_out)).sum()
        lt.backward()
    ld = loss(yd) if loss is not None else (yd * w_out).sum()
    ld.backward()
    out["forward"] = (yt - (my_slice(yd, n, r) if y_parallel else yd)).abs().max().item()
    if x.is_floating_point():
        out["input_grad"] = (xt.grad - (my_slice(xd.grad, n, r) if x_parallel else xd.grad)).abs().max().item()
    out["weight_grad"] = diff({k: p.grad for k, p in tp_mod.named_parameters()},
                              tp.shard_like(tp_mod, grads_as_module(dense), group))
    out["events_fwd"], out["events_bwd"] = len(fwd), len(bwd)
    return out, commlog.Log(fwd.events + bwd.events)


def replicated_grads(tp_mod, dense) -> torch.Tensor:
    """Gradients of the parameters every rank holds whole (same shape as the dense parameter)."""
    shapes = dict((k, p.shape) for k, p in dense.named_parameters())
    return torch.cat([p.grad.flatten() for k, p in tp_mod.named_parameters() if p.shape == shapes[k]])


def main() -> int:
    impl = sys.argv[1] if len(sys.argv) > 1 else "ring"
    env = par.runtime.dist.init()
    n, r = env.world_size, env.rank
    torch.manual_seed(0)
    res: dict = {}
    x = torch.randn(B, T, CFG.d_model)

    # ---- linear layers, with and without the gather / scatter at the region's edges
    fc = nn.Linear(CFG.d_model, 5 * n * 4)
    for gather in (False, True):
        m = tp.ColumnParallelLinear.from_dense(fc, gather_output=gather, impl=impl)
        res[f"column gather={gather}"], _ = compare(m, fc, x, None, n, r, y_parallel=not gather)
    row = nn.Linear(CFG.ffn, CFG.d_model)
    xr = torch.randn(B, T, CFG.ffn)
    for parallel in (True, False):
        m = tp.RowParallelLinear.from_dense(row, input_is_parallel=parallel, impl=impl)
        res[f"row input_parallel={parallel}"], _ = compare(m, row, xr, None, n, r, x_parallel=parallel)
    res["column shard is W[r]"] = (tp.ColumnParallelLinear.from_dense(fc).weight
                                   - fc.weight[r * 20:(r + 1) * 20]).abs().max().item()
    k = CFG.ffn // n
    res["row shard is W[:, r]"] = (tp.RowParallelLinear.from_dense(row).weight
                                   - row.weight[:, r * k:(r + 1) * k]).abs().max().item()

    # ---- MLP, attention, block
    torch.manual_seed(1)
    mlp, attn, block = MLP(CFG.d_model, CFG.ffn), Attention(CFG), Block(CFG)
    res["mlp"], log = compare(tp.TensorParallelMLP.from_dense(mlp, impl=impl), mlp, x, None, n, r)
    res["mlp"]["all_reduces"] = log.count("all_reduce")
    tattn = tp.TensorParallelAttention.from_dense(attn, impl=impl)
    res["attention"], log = compare(tattn, attn, x, None, n, r)
    res["attention"]["all_reduces"] = log.count("all_reduce")
    d = CFG.d_model // n  # whole heads: rank r's Q, K, V rows are heads r*H/N .. of each
    expected_qkv = torch.cat([attn.qkv.weight[j * CFG.d_model + r * d: j * CFG.d_model + (r + 1) * d]
                              for j in range(3)])
    res["attention"]["qkv shard is whole heads"] = (tattn.qkv.weight - expected_qkv).abs().max().item()
    res["attention"]["local heads"] = tattn.n_head
    res["block"], log = compare(tp.TensorParallelBlock.from_dense(block, impl=impl), block, x, None, n, r)
    res["block"]["all_reduces"] = log.count("all_reduce")

    # ---- the whole model: outputs, gradients, counts, bytes
    dense = build(CFG, seed=3)
    tmodel = tp.TensorParallelGPT.from_dense(dense, impl=impl)
    ds = CharDataset(block_size=T)
    xb, yb = next(global_batches(ds, B, 1, seed=5))
    res["model"], log = compare(tmodel, dense, xb, None, n, r, loss=lambda logits: lm_loss(logits, yb))
    ev = [e for e in log.events]
    res["model"]["kinds"] = sorted({e.kind for e in ev})
    res["model"]["fwd_all_reduces"] = sum(e.kind == "all_reduce" and e.tag.endswith("/fwd") for e in ev)
    res["model"]["bwd_all_reduces"] = sum(e.kind == "all_reduce" and e.tag.endswith("/bwd") for e in ev)
    res["model"]["per_layer"] = [sum(e.tag.startswith(f"layer {i}/") for e in ev) for i in range(CFG.n_layer)]
    res["model"]["bytes"] = log.total_bytes("all_reduce")
    res["model"]["bytes_exact"] = 4 * CFG.n_layer * ring_all_reduce_bytes(B * T * CFG.d_model, n, r)
    res["model"]["bytes_formula"] = 4 * CFG.n_layer * all_reduce_formula_bytes(B * T * CFG.d_model * 4, n)
    res["model"]["bytes_function"] = tp.tp_bytes_per_step(CFG, B, T, n)
    res["model"]["param_bytes"] = tp.param_bytes(tmodel)
    res["model"]["param_bytes_formula"] = 4 * tp.tp_param_count(CFG, n)
    # the same through torch.distributed's all-reduce instead of par's ring
    res["model impl=torch"], log = compare(tp.TensorParallelGPT.from_dense(dense, impl="torch"), dense, xb, None, n, r,
                                           loss=lambda logits: lm_loss(logits, yb))
    res["model impl=torch"]["impls"] = sorted({e.impl for e in log.events})
    mine = replicated_grads(tmodel, dense)
    every = par.runtime.dist.gather_object(mine)
    if r == 0:
        res["model"]["replicated_grads_spread"] = max((g - every[0]).abs().max().item() for g in every)
        res["model"]["replicated_numel"] = mine.numel()

    # ---- a few Adam steps of TP training equal dense training.
    # Adam's step is lr * m / (sqrt(v) + eps): a gradient that is pure rounding noise (the key bias has true
    # gradient 0, softmax being shift invariant) becomes a step of size ~lr whose sign is the noise's. eps=1e-6
    # and lr=1e-3 keep that amplification below the tolerance, so the comparison is about TP, not about noise.
    dense, steps = build(CFG, seed=4), 4
    tmodel = tp.TensorParallelGPT.from_dense(dense, impl=impl)
    opt_d = make_optimizer(dense.parameters(), "adam", 1e-3, eps=1e-6)
    opt_t = make_optimizer(tmodel.parameters(), "adam", 1e-3, eps=1e-6)
    loss_gap = 0.0
    for xb, yb in global_batches(ds, B, steps, seed=6):
        for m, opt in ((dense, opt_d), (tmodel, opt_t)):
            opt.zero_grad(set_to_none=True)
            lv = lm_loss(m(xb), yb)
            lv.backward()
            opt.step()
            if m is dense:
                ld = lv.item()
        loss_gap = max(loss_gap, abs(lv.item() - ld))
    res["adam"] = {"params": diff(tmodel.state_dict(), tp.shard_like(tmodel, dense)), "loss": loss_gap}

    # ---- a TP group smaller than the world (TP inside, something else across)
    if n == 4:
        groups = [torch.distributed.new_group([0, 1]), torch.distributed.new_group([2, 3])]
        g = groups[r // 2]
        res["subgroup mlp"], log = compare(tp.TensorParallelMLP.from_dense(mlp, g, impl=impl), mlp, x, g, 2, r % 2)
        res["subgroup mlp"]["group_sizes"] = sorted({e.group_size for e in log.events})

    # ---- divisibility errors: one clear line naming the numbers
    errors = {}
    bad_heads = {2: 3, 3: 4, 4: 6}[n]
    for what, cfg in (("n_head", GPTConfig(n_head=bad_heads, d_model=48, n_layer=1)),
                      ("ffn size", GPTConfig(n_head=12, d_model=48, d_ff=4 * 48 + 1, n_layer=1))):
        try:
            tp.TensorParallelGPT.from_dense(build(cfg), impl=impl)
            errors[what] = "no error"
        except ValueError as e:
            errors[what] = str(e)
    res["errors"] = errors

    # every rank's numbers: keep the worst
    allres = par.runtime.dist.gather_object(res)
    if r == 0:
        par.runtime.dist.save_result({"world_size": n, "impl": impl, "ranks": allres,
                                      "nccl_emulation": dist.batch_isend_irecv is nccl_emulation.batch_isend_irecv})
    par.runtime.dist.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
