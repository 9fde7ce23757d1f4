"""Flash attention's idea, readable: causal attention computed tile by tile, the T × T scores never whole.

    for each tile of queries Q_i (rows i0..i1):
        state = empty                                       (m, l, o): row max, Σ e^(s−m), Σ e^(s−m)·v
        for each tile of keys K_j, V_j with j0 ≤ i1 (later tiles are all in the future, skipped):
            S = Q_i K_jᵀ / √d, masked where a key comes after its query
            state = merge(state, block_state(S, V_j))      the online softmax of lecture 08
        O_i, lse_i = o / l, m + log l

Each query tile reads every key and value tile once and writes only its output: memory traffic
≈ e·(|Q| + (T/t_q)·(|K| + |V|) + |O|) instead of the materialised path's e·(|Q| + |K| + |V| + |O|) plus
several passes over B·h·T² scores (the product, the scaling, the mask, the softmax, each written and read back).
On a GPU the tiles live in on-chip SRAM and the loop is one kernel (FlashAttention, Dao et al. 2022);
here it is the same arithmetic in torch, to read and to check against `F.scaled_dot_product_attention`.
The merge, the block state and the masked scores are lecture 08's (`par.cp.ring_attention`): one idea, one place.
"""
from __future__ import annotations

import math

import torch

from par.cp.ring_attention import block_scores, block_state, finish, merge


def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tile: int = 64):
    """(softmax(Q Kᵀ/√d + causal mask) V, log-sum-exp per row) for (..., T, d) tensors, `tile` rows at a time."""
    t, scale = q.size(-2), 1.0 / math.sqrt(q.size(-1))
    pos = torch.arange(t, device=q.device)
    outs, lses = [], []
    for i0 in range(0, t, tile):
        i1 = min(i0 + tile, t)
        state = None
        for j0 in range(0, i1, tile):                       # key tiles that start after i1 - 1 see nothing
            j1 = min(j0 + tile, t)
            s = block_scores(q[..., i0:i1, :], k[..., j0:j1, :], pos[i0:i1], pos[j0:j1], scale)
            block = block_state(s, v[..., j0:j1, :])
            state = block if state is None else merge(*state, *block)
        out, lse = finish(*state)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-2)


def tiles_computed(t: int, tile: int) -> int:
    """Key tiles the causal loop visits: Σ_i (i + 1) over ⌈T/t⌉ query tiles, about half of ⌈T/t⌉²."""
    n = -(-t // tile)
    return n * (n + 1) // 2


def score_bytes(batch: int, heads: int, t: int, itemsize: int = 4) -> int:
    """The materialised path's B·h·T² scores, once: e·B·h·T² bytes (each of its passes writes and reads this)."""
    return itemsize * batch * heads * t * t


def tiled_bytes(batch: int, heads: int, t: int, d: int, tile: int, itemsize: int = 4) -> int:
    """Memory traffic of the tiled loop: Q and O once, K and V once per query tile that reaches them,
    e·B·h·(2·T·d + 2·d·Σ_i min((i+1)·t, T)): no T² term."""
    n = -(-t // tile)
    kv_rows = sum(min((i + 1) * tile, t) for i in range(n))
    return itemsize * batch * heads * (2 * t * d + 2 * kv_rows * d)
