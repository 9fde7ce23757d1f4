"""Sequence and context parallelism vs the dense model, every case in one launch: torchrun on 2, 3 or 4 ranks.

Context parallelism (ring attention):
For each layout (balanced, naive) and sequence length (one a multiple of 2N, one not), rank r takes
its tokens of the same random Q, K, V, runs `ring_attention`, and compares its output and its Q, K, V
gradients with the dense `causal_attention`'s rows at its positions; the bytes it sent forward and
backward are compared with `ring_attention_bytes`. Then a whole GPT-lite: logits, every weight
gradient (after `sync_grads`) and three Adam steps against the dense model. Largest differences go
to the test as JSON, one dict per rank.

Sequence parallelism on TP (`par.tp.sequence`), with and without re-gathering: one block
(forward, input and weight gradients, bytes and saved activations against the formulas, beside the
TP block's) and a whole GPT-lite trained three Adam steps, compared with the dense model's shards.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import par.runtime.dist
from par.comm import commlog
from par.memory import accounting as memory
from par.runtime import nccl_emulation
from par.cp import ring_attention as cp, ulysses
from par.tp import sequence as sp, layers as tp
from par.tp.ops import my_sequence_slice
from par.data import CharDataset, global_batches
from par.comm.collectives import ring_all_reduce_bytes
from par.model import Block, GPTConfig, build, causal_attention, lm_loss
from par.reference import make_optimizer
from par.timeline import Recorder

B, H, D = 2, 3, 8
CFG = GPTConfig(vocab_size=65, block_size=32, n_layer=2, n_head=4, d_model=32, attention="math")


def attention_case(n: int, r: int, seq: int, layout: str, attend=cp.ring_attention, heads: int = H) -> dict:
    g = torch.Generator().manual_seed(seq)
    q, k, v, w = (torch.randn(B, heads, seq, D, generator=g) for _ in range(4))
    dense = [t.clone().requires_grad_() for t in (q, k, v)]
    y = causal_attention(*dense)
    (y * w).sum().backward()
    positions = cp.all_positions(seq, n, layout)
    mine = positions[r]
    local = [cp.shard_sequence(t, mine, dim=2).requires_grad_() for t in (q, k, v)]
    with commlog.capture() as fwd:
        out = attend(*local, positions)
    with commlog.capture() as bwd:
        (out * cp.shard_sequence(w, mine, dim=2)).sum().backward()
    res = {"forward": (out - cp.shard_sequence(y, mine, dim=2)).abs().max().item()}
    for name, a, b in zip("qkv", local, dense):
        res[f"d{name}"] = (a.grad - cp.shard_sequence(b.grad, mine, dim=2)).abs().max().item()
    lengths = [len(p) for p in positions]
    formula = (cp.ring_attention_bytes(lengths, r, B, heads * D) if attend is cp.ring_attention else
               ulysses.ulysses_bytes(lengths, heads, r, B, D))
    kind = "send" if attend is cp.ring_attention else "all_to_all"
    res["bytes"] = {"forward": fwd.total_bytes(kind), "backward": bwd.total_bytes(kind)}
    res["formula"] = formula
    res["tags"] = sorted({e.tag for e in fwd.events + bwd.events})
    return res


def gpt_case(n: int, r: int, seq: int, steps: int = 3, attend=None) -> dict:
    dense, model = build(CFG, seed=2), build(CFG, seed=2)
    positions = cp.all_positions(seq, n, "balanced")
    mine = positions[r]
    opt_d = make_optimizer(dense.parameters(), "adam", 1e-3, eps=1e-6)
    opt_c = make_optimizer(model.parameters(), "adam", 1e-3, eps=1e-6)
    res = {"logits": 0.0, "grads": 0.0, "loss": 0.0}
    for x, y in global_batches(CharDataset(block_size=seq), B, steps, seed=3):
        opt_d.zero_grad(set_to_none=True)
        opt_c.zero_grad(set_to_none=True)
        logits = dense(x)
        ld = lm_loss(logits, y)
        ld.backward()
        local = cp.gpt_forward(model, cp.shard_sequence(x, mine), positions, attend=attend)
        yl = cp.shard_sequence(y, mine)
        lc = F.cross_entropy(local.reshape(-1, local.size(-1)), yl.reshape(-1), reduction="sum") / y.numel()
        lc.backward()
        cp.sync_grads(model)
        total = lc.detach().clone()
        dist.all_reduce(total)
        res["logits"] = max(res["logits"], (local - cp.shard_sequence(logits, mine)).abs().max().item())
        res["loss"] = max(res["loss"], abs(total.item() - ld.item()))
        res["grads"] = max(res["grads"], max((p.grad - q.grad).abs().max().item()
                                             for p, q in zip(model.parameters(), dense.parameters())))
        opt_d.step()
        opt_c.step()
    res["params"] = max((p - q).abs().max().item() for p, q in zip(model.parameters(), dense.parameters()))
    return res


def timeline_case(n: int, seq: int) -> dict:
    rec = Recorder()
    g = torch.Generator().manual_seed(0)
    positions = cp.all_positions(seq, n)
    q, k, v = (cp.shard_sequence(torch.randn(B, H, seq, D, generator=g), positions[rec.rank], 2) for _ in range(3))
    cp.ring_attention(q, k, v, positions, recorder=rec)
    spans = rec.spans
    return {"compute": sum(s.lane == "compute" for s in spans), "comm": sum(s.lane == "comm" for s in spans)}


SP_CFG = GPTConfig(vocab_size=65, block_size=24, n_layer=2, n_head=12, d_model=48, attention="math")   # splits over 2, 3 and 4


def grads_as_module(m):
    g = build(SP_CFG, seed=0) if hasattr(m, "blocks") else Block(SP_CFG)
    g.load_state_dict({k: p.grad for k, p in m.named_parameters()})
    return g


def diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def sp_block_case(n: int, r: int, regather: bool) -> dict:
    torch.manual_seed(4)
    dense = Block(SP_CFG)
    seq = SP_CFG.block_size
    x, w = torch.randn(B, seq, SP_CFG.d_model), torch.randn(B, seq, SP_CFG.d_model)
    xd = x.clone().requires_grad_()
    (dense(xd) * w).sum().backward()
    yd = dense(x)
    block = sp.SequenceParallelBlock.from_dense(dense, regather=regather)
    xl = my_sequence_slice(x).requires_grad_()
    params = list(block.parameters())
    with commlog.capture() as fwd:
        y, saved = memory.saved_activation_bytes(block, xl, exclude=params)
    with commlog.capture() as bwd:
        (y * my_sequence_slice(w)).sum().backward()
    sp.sync_grads(block)
    res = {"forward": (y - my_sequence_slice(yd)).abs().max().item(),
           "input_grad": (xl.grad - my_sequence_slice(xd.grad)).abs().max().item(),
           "weight_grad": diff({k: p.grad for k, p in block.named_parameters()},
                               tp.TensorParallelBlock.from_dense(grads_as_module(dense)).state_dict()),
           "kinds": sorted({e.kind for e in fwd.events + bwd.events}),
           "bytes": fwd.total_bytes() + bwd.total_bytes(),
           "bytes_formula": sp.sp_bytes_per_layer(B, seq, SP_CFG.d_model, n, regather=regather),
           "tp_allreduce_bytes": 4 * ring_all_reduce_bytes(B * seq * SP_CFG.d_model, n, r),
           "saved": saved,
           "saved_formula": memory.activation_bytes_per_layer(seq, B, SP_CFG.d_model, SP_CFG.n_head, "none", 4,
                                                              dropout=False, tp=n, sequence_parallel=True)}
    tblock = tp.TensorParallelBlock.from_dense(dense)
    _, res["tp_saved"] = memory.saved_activation_bytes(tblock, x.clone().requires_grad_(),
                                                       exclude=list(tblock.parameters()))
    res["tp_saved_formula"] = memory.activation_bytes_per_layer(seq, B, SP_CFG.d_model, SP_CFG.n_head, "none", 4,
                                                                dropout=False, tp=n)
    return res


def sp_gpt_case(n: int, r: int, steps: int = 3) -> dict:
    dense = build(SP_CFG, seed=5)
    model = sp.SequenceParallelGPT.from_dense(dense)
    opt_d = make_optimizer(dense.parameters(), "adam", 1e-3, eps=1e-6)
    opt_s = make_optimizer(model.parameters(), "adam", 1e-3, eps=1e-6)
    res = {"logits": 0.0, "grads": 0.0, "loss": 0.0}
    for x, y in global_batches(CharDataset(block_size=SP_CFG.block_size), B, steps, seed=6):
        for m, opt in ((dense, opt_d), (model, opt_s)):
            opt.zero_grad(set_to_none=True)
        ld_logits = dense(x)
        ld = lm_loss(ld_logits, y)
        ld.backward()
        logits = model(x)
        ls = lm_loss(logits, y)
        ls.backward()
        sp.sync_grads(model)
        res["logits"] = max(res["logits"], (logits - ld_logits).abs().max().item())
        res["loss"] = max(res["loss"], abs(ls.item() - ld.item()))
        res["grads"] = max(res["grads"], diff({k: p.grad for k, p in model.named_parameters()},
                                              tp.TensorParallelGPT.from_dense(grads_as_module(dense)).state_dict()))
        opt_d.step()
        opt_s.step()
    res["params"] = diff(model.state_dict(), tp.TensorParallelGPT.from_dense(dense).state_dict())
    try:
        model(torch.zeros(1, n * 5 + 1, dtype=torch.long))
        res["error"] = "no error"
    except ValueError as e:
        res["error"] = str(e)
    return res


def main() -> int:
    env = par.runtime.dist.init()
    n, r = env.world_size, env.rank
    torch.manual_seed(0)
    res: dict = {}
    for seq in (6 * n, 6 * n + 1 + (n % 2)):
        for layout in cp.LAYOUTS:
            res[f"attention {layout} T={seq}"] = attention_case(n, r, seq, layout)
    res["gpt"] = gpt_case(n, r, 4 * n + 3)
    for layout in cp.LAYOUTS:                   # 5 heads: uneven head groups on 2, 3 and 4 ranks
        res[f"ulysses {layout}"] = attention_case(n, r, 6 * n + 1, layout, ulysses.ulysses_attention, heads=5)
    res["ulysses gpt"] = gpt_case(n, r, 4 * n + 3, attend=ulysses.ulysses_attention)
    res["timeline"] = timeline_case(n, 4 * n)
    for regather in (True, False):
        res[f"sp block regather={regather}"] = sp_block_case(n, r, regather)
    res["sp gpt"] = sp_gpt_case(n, r)
    errors = {}
    try:
        cp.chunk_positions(2 * n - 1, n, 0)
        errors["short"] = "no error"
    except ValueError as e:
        errors["short"] = str(e)
    try:
        ulysses.head_groups(n - 1, n)
        errors["heads"] = "no error"
    except ValueError as e:
        errors["heads"] = str(e)
    res["errors"] = errors
    allres = par.runtime.dist.gather_object(res)
    if r == 0:
        par.runtime.dist.save_result({"world_size": n, "ranks": allres,
                                      "nccl_emulation": dist.batch_isend_irecv is nccl_emulation.batch_isend_irecv})
    par.runtime.dist.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
