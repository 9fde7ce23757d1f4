"""Expert parallelism's all-to-all through torch's own API, beside par's: `torch.distributed.all_to_all_single`.

    # buf: (E, C·d), the dispatch buffer's rows of expert e; blocks[p]: experts peer p owns; mine: my experts
    out = buf.new_empty(n * mine, C * d)
    dist.all_to_all_single(out, buf, output_split_sizes=[mine] * n, input_split_sizes=blocks, group=group)

The split sizes are rows of the first dimension: peer p gets the next blocks[p] experts' rows of my buffer, and
I get `mine` experts' rows from every peer, peer by peer: the exchange `par.moe.experts.p2p_all_to_all` writes by
hand with n - 1 pairwise `batch_isend_irecv` steps. `compare(layer, x)` routes the same tokens, dispatches them
both ways, and runs the whole expert-parallel layer forward and backward with either exchange.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from par.moe.experts import ExpertParallelMoE, all_to_all_rows
from par.moe.router import dispatch, route


def dispatch_all_to_all_single(buf: torch.Tensor, blocks: list[int], mine: int, group=None) -> torch.Tensor:
    """torch's dispatch: row block p of `buf` (blocks[p] experts) to peer p, `mine` experts' rows from each peer."""
    buf = buf.contiguous()
    out = buf.new_empty((len(blocks) * mine,) + tuple(buf.shape[1:]))
    dist.all_to_all_single(out, buf, output_split_sizes=[mine] * len(blocks), input_split_sizes=blocks, group=group)
    return out


def compare(layer: ExpertParallelMoE, x: torch.Tensor) -> dict:
    """This rank's largest |difference| between par's hand-written all-to-all and all_to_all_single on the
    same routed tokens: the dispatched rows, then the layer's output and every gradient (input included)."""
    tokens = x.reshape(-1, x.size(-1))
    with torch.no_grad():
        buf = dispatch(tokens, route(layer.router(tokens), layer.k, layer.capacity_factor))
    e, c, d = buf.shape
    blocks, mine = [b - a for a, b in layer.owned], layer.end - layer.start
    ours = all_to_all_rows(buf.reshape(e, c * d), blocks, [mine] * layer.n, layer.group, impl="p2p")
    theirs = dispatch_all_to_all_single(buf.reshape(e, c * d), blocks, mine, layer.group)
    out = {"split_sizes": {"send": blocks, "recv": [mine] * layer.n}, "dispatched_rows": ours.shape[0],
           "dispatch": (ours - theirs).abs().max().item() if ours.numel() else 0.0}
    results, impl = {}, layer.impl
    for name in ("p2p", "torch"):
        layer.impl = name
        layer.zero_grad(set_to_none=True)
        xi = x.detach().clone().requires_grad_()
        y = layer(xi)
        y.pow(2).mean().backward()
        results[name] = [y.detach(), xi.grad] + [p.grad for p in layer.parameters() if p.grad is not None]
    layer.impl = impl
    layer.zero_grad(set_to_none=True)
    a, b = results["p2p"], results["torch"]
    out["output"] = (a[0] - b[0]).abs().max().item()
    out["grads"] = max((u - v).abs().max().item() for u, v in zip(a[1:], b[1:]))
    out["max"] = max(out["dispatch"], out["output"], out["grads"])
    return out
