"""DeepSpeed-Ulysses (Jacobs et al. 2023): sequence parallelism by all-to-all, beside ring attention.

c ranks each hold T_r of the T tokens of every sequence, all a heads, as in ring attention (any layout:
positions, not slot numbers, decide the causal mask). Attention needs every key of a head, but not every
head at once. So one all-to-all turns "my tokens, all heads" into "all tokens, my heads" (rank r takes the
heads `head_groups(a, c)[r]`), attention runs locally on whole sequences of a_r ≈ a/c heads, and a second
all-to-all turns the output back into "my tokens, all heads":

    (B, a, T_r, d) --all-to-all--> (B, a_r, T, d) --attention--> (B, a_r, T, d) --all-to-all--> (B, a, T_r, d)

Bytes one rank sends per attention call, with X = B·T_r·(a - a_r)·d·e (my tokens of the others' heads)
and Y = B·a_r·(T - T_r)·d·e (my heads of the others' tokens):

    forward   Q, K, V out (3X), the output back (Y)          = 4·(c-1)/c²·B·T·w·e evenly (w = a·d)
    backward  dO out (X), dQ, dK, dV back (3Y)               = the same

Ring attention sends 2(c-1)/c·B·T·w·e forward: Ulysses sends 2/c of that, and the gap grows with c. Its
limits: c ≤ a (every rank needs a head), and the all-to-all sits on the critical path, where the ring hides
its K/V transfers behind compute. Memory per rank is ring attention's: every per-token tensor divided by c,
and with `flash_attention` no B·a·T² scores are kept (the backward rebuilds them from the log-sum-exp).
"""
from __future__ import annotations

import torch

from par.comm import commlog
from par.comm.collectives import chunk_bounds, group_rank, group_size
from par.cp.ring_attention import flash_attention
from par.moe.experts import p2p_all_to_all


def head_groups(n_head: int, n: int) -> list[tuple[int, int]]:
    """[start, end) of the heads each of the n ranks attends to (sizes differ by at most one)."""
    if n_head < n:
        raise ValueError(f"Ulysses gives every rank at least one head: {n_head} heads cannot be split over {n} "
                         f"ranks (use at most {n_head} ranks, or ring attention, which has no such limit)")
    return chunk_bounds(n_head, n)


def _all_to_all(sends, recvs, group) -> None:
    sent = p2p_all_to_all(sends, recvs, group)
    commlog.record("all_to_all", sum(s.numel() for s in sends), sent, len(sends), "p2p")


def seq_to_heads(x: torch.Tensor, lengths: list[int], group=None) -> torch.Tensor:
    """(B, a, T_r, d) my tokens of all heads -> (B, a_r, T, d) all tokens of my heads, rank by rank."""
    me, heads = group_rank(group), head_groups(x.size(1), group_size(group))
    sends = [x[:, h0:h1].contiguous() for h0, h1 in heads]
    a, b = heads[me]
    recvs = [x.new_empty(x.size(0), b - a, t, x.size(-1)) for t in lengths]
    _all_to_all(sends, recvs, group)
    return torch.cat(recvs, dim=2)


def heads_to_seq(y: torch.Tensor, lengths: list[int], n_head: int, group=None) -> torch.Tensor:
    """The inverse: (B, a_r, T, d) all tokens of my heads -> (B, a, T_r, d) my tokens of all heads."""
    me, heads = group_rank(group), head_groups(n_head, group_size(group))
    sends = [piece.contiguous() for piece in y.split(lengths, dim=2)]
    recvs = [y.new_empty(y.size(0), h1 - h0, lengths[me], y.size(-1)) for h0, h1 in heads]
    _all_to_all(sends, recvs, group)
    return torch.cat(recvs, dim=1)


class _SeqToHeads(torch.autograd.Function):
    """seq_to_heads forward; its gradient goes back by the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x, lengths, group):
        ctx.args = (lengths, x.size(1), group)
        with commlog.tag("ulysses/fwd"):
            return seq_to_heads(x, lengths, group)

    @staticmethod
    def backward(ctx, grad):
        with commlog.tag("ulysses/bwd"):
            return heads_to_seq(grad.contiguous(), *ctx.args), None, None


class _HeadsToSeq(torch.autograd.Function):
    """heads_to_seq forward; its gradient goes back by seq_to_heads."""

    @staticmethod
    def forward(ctx, y, lengths, n_head, group):
        ctx.args = (lengths, group)
        with commlog.tag("ulysses/fwd"):
            return heads_to_seq(y, lengths, n_head, group)

    @staticmethod
    def backward(ctx, grad):
        with commlog.tag("ulysses/bwd"):
            return seq_to_heads(grad.contiguous(), *ctx.args), None, None, None


def ulysses_attention(q, k, v, positions, group=None, recorder=None) -> torch.Tensor:
    """Causal attention of this rank's tokens q, k, v (B, a, T_r, d) against every rank's keys, by two all-to-alls.

    `positions[j]` are the token positions rank j holds (`par.cp.ring_attention.all_positions`); `recorder`
    is accepted for the ring's signature and unused."""
    lengths, n_head = [len(p) for p in positions], q.size(1)
    whole = torch.cat(list(positions))           # the token order after the all-to-all: rank 0's, rank 1's, ...
    q, k, v = (_SeqToHeads.apply(t, lengths, group) for t in (q, k, v))
    return _HeadsToSeq.apply(flash_attention(q, k, v, whole, whole), lengths, n_head, group)


def ulysses_bytes(lengths, n_head: int, rank: int, batch: int, head_dim: int, itemsize: int = 4) -> dict:
    """Bytes rank `rank` sends in one Ulysses attention forward and backward; `lengths[j]` tokens on rank j:

        X = B·T_r·(a - a_r)·d·e,  Y = B·a_r·(T - T_r)·d·e,   forward 3X + Y,   backward X + 3Y"""
    a0, a1 = head_groups(n_head, len(lengths))[rank]
    x = batch * lengths[rank] * (n_head - (a1 - a0)) * head_dim * itemsize
    y = batch * (a1 - a0) * (sum(lengths) - lengths[rank]) * head_dim * itemsize
    return {"forward": 3 * x + y, "backward": x + 3 * y}


def ulysses_bytes_even(batch: int, seq: int, width: int, n: int, itemsize: int = 4) -> dict:
    """The even-split form: forward = backward = 4(c-1)/c²·B·T·w·e (ring attention: 2(c-1)/c·B·T·w·e forward)."""
    s = batch * seq * width * itemsize
    return {"forward": 4 * (n - 1) * s / n ** 2, "backward": 4 * (n - 1) * s / n ** 2}
