"""Context parallelism: ring attention (Liu et al. 2023), each rank holding a slice of the sequence.

N ranks split the T tokens of every sequence. Everything in a transformer layer is per token,
except attention, where every query needs every (earlier) key and value. Ring attention keeps
each rank's queries Q_r where they are and sends the key/value blocks (K_j, V_j) around the
ring: at step i rank r holds the block of rank (r - i) mod N, computes its partial attention
against it, and meanwhile passes it on to rank r + 1. After N steps every query has met every key.

The online softmax merges the partial results exactly. For one query row and one block of
scores s_j, keep the state (m, l, o): the running max m, the normaliser l = Σ exp(s_j - m)
and the unnormalised output o = Σ exp(s_j - m) v_j. Two states merge as (`merge`)

    m = max(m_a, m_b),   l = e^(m_a - m) l_a + e^(m_b - m) l_b,   o = e^(m_a - m) o_a + e^(m_b - m) o_b

and the attention output is o / l (log-sum-exp lse = m + log l). A row that has seen only masked
scores has m = -inf, l = 0, o = 0 and merges as the identity.

Causal masking makes the work uneven: with contiguous slices (`naive` layout) rank 0's queries
see one block and rank N-1's see all N. The balanced layout cuts the sequence into 2N chunks and
gives rank r chunks r and 2N-1-r, one early and one late, so every rank does the same work
(`causal_pairs`). Positions, not slot numbers, decide the mask, so any layout is exact.

Bytes one rank sends per attention call, with |K_j| = B·h·|j|·e the bytes of block j (K and V alike):

    forward:   K and V of blocks r, r-1, ..., r-N+2         2·Σ_{i<N-1} |K_{r-i}|   (= 2(N-1)/N·B·T·h·e evenly)
    backward:  K, V and their gradients dK, dV travel on;   2·Σ_{i<N-1} |K_{r-i}| + 2·Σ_{i<N} |K_{r-i}|
               the gradients take one more step, home       (= (4N-2)/N·B·T·h·e evenly)

(`ring_attention_bytes`). The backward recomputes each block's probabilities from the saved
lse, so a rank keeps only its own Q, K, V, output and lse: activation memory falls as 1/N.
Every exchange is one `send_recv` group (one send right, one receive left per tensor), posted
by every rank in the same order and waited before its buffers are read, as NCCL requires.
"""
from __future__ import annotations

import math

import torch

from par.comm import collectives, commlog
from par.comm.collectives import chunk_bounds, group_rank, group_size, ring_neighbours
from par.model import merge_heads, split_heads
from par.tp.sequence import sum_gradients

LAYOUTS = ("balanced", "naive")


# ---------------------------------------------------------------- who holds which tokens
def chunk_positions(seq: int, n: int, rank: int, layout: str = "balanced") -> torch.Tensor:
    """The token positions rank `rank` of `n` holds, in the order it holds them.

    naive: contiguous slices (`chunk_bounds(seq, n)`). balanced: 2n chunks, rank r takes chunk r and
    chunk 2n-1-r. Sizes differ by at most one token, so any length works (at least 2n tokens)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown context-parallel layout {layout!r}: use one of {', '.join(LAYOUTS)}")
    need = 2 * n if layout == "balanced" else n
    if seq < need:
        raise ValueError(f"sequence length {seq} is too short for {n} context-parallel ranks with the {layout} "
                         f"layout: it needs at least {need} tokens (use fewer ranks or longer sequences)")
    if layout == "naive":
        a, b = chunk_bounds(seq, n)[rank]
        return torch.arange(a, b)
    bounds = chunk_bounds(seq, 2 * n)
    return torch.cat([torch.arange(*bounds[rank]), torch.arange(*bounds[2 * n - 1 - rank])])


def all_positions(seq: int, n: int, layout: str = "balanced") -> list[torch.Tensor]:
    return [chunk_positions(seq, n, r, layout) for r in range(n)]


def causal_pairs(seq: int, n: int, layout: str = "balanced") -> list[int]:
    """Query-key pairs each rank must score under the causal mask: Σ over its positions p of (p + 1)."""
    return [int((p + 1).sum()) for p in all_positions(seq, n, layout)]


def computed_pairs(seq: int, n: int, layout: str = "balanced") -> list[int]:
    """Scores each rank computes in one ring-attention forward: Σ over blocks of (visible rows × visible keys).

    Balanced: T_r² for its own block + (N-1) half blocks, the same on every rank; naive: r + 1 whole
    blocks on rank r (the last rank does N times the first's)."""
    pos = all_positions(seq, n, layout)
    out = []
    for r in range(n):
        seen = [visible(pos[r], pos[j]) for j in range(n)]
        out.append(sum((len(pos[r]) - v[0]) * v[1] for v in seen if v))
    return out


def shard_sequence(x: torch.Tensor, positions: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of a full tensor (no communication)."""
    return x.index_select(dim, positions.to(x.device))


# ---------------------------------------------------------------- the online softmax
def block_scores(q, k, pos_q, pos_k, scale: float) -> torch.Tensor:
    """Q Kᵀ · scale with -inf where the key comes after the query (causal, by position)."""
    s = (q @ k.transpose(-2, -1)) * scale
    future = pos_k.to(q.device)[None, :] > pos_q.to(q.device)[:, None]
    return s.masked_fill(future, float("-inf"))


def _finite(m: torch.Tensor) -> torch.Tensor:
    """m with -inf replaced by 0, so that exp(x - m) of an all-masked row is exp(-inf) = 0, not nan."""
    return torch.where(torch.isinf(m), torch.zeros_like(m), m)


def block_state(scores: torch.Tensor, v: torch.Tensor):
    """The softmax state (m, l, o) of one block: row max, Σ exp(s - m), Σ exp(s - m) v."""
    m = scores.amax(dim=-1, keepdim=True)
    p = torch.exp(scores - _finite(m))
    return m, p.sum(dim=-1, keepdim=True), p @ v


def merge(m_a, l_a, o_a, m_b, l_b, o_b):
    """Merge two softmax states: m = max(m_a, m_b); l and o rescaled by e^(m_x - m) and added."""
    m = torch.maximum(m_a, m_b)
    a, b = torch.exp(m_a - _finite(m)), torch.exp(m_b - _finite(m))
    return m, a * l_a + b * l_b, a * o_a + b * o_b


def finish(m, l, o):
    """The attention output o / l and the log-sum-exp m + log l of a final state."""
    return o / l, m + torch.log(l)


def softmax_shift(d_out, out):
    """delta_i = Σ_j P_ij dP_ij = Σ_d dO_id · O_id: the shift of the softmax backward, one number per row."""
    return (d_out * out).sum(dim=-1, keepdim=True)


def block_grads(q, k, v, d_out, lse, delta, pos_q, pos_k, scale: float):
    """dQ, dK, dV of one block of keys, the probabilities rebuilt from the saved log-sum-exp:

        P = exp(S - lse),   dS = P ∘ (dO Vᵀ - delta),   dQ = dS K · scale,   dK = dSᵀ Q · scale,   dV = Pᵀ dO"""
    p = torch.exp(block_scores(q, k, pos_q, pos_k, scale) - lse)
    ds = p * (d_out @ v.transpose(-2, -1) - delta)
    return (ds @ k) * scale, (ds.transpose(-2, -1) @ q) * scale, p.transpose(-2, -1) @ d_out


class _FlashAttention(torch.autograd.Function):
    """Causal attention that keeps Q, K, V, the output and the log-sum-exp, never the scores (as flash attention)."""

    @staticmethod
    def forward(ctx, q, k, v, pos_q, pos_k):
        scale = 1.0 / math.sqrt(q.size(-1))
        out, lse = finish(*block_state(block_scores(q, k, pos_q, pos_k, scale), v))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.pos, ctx.scale = (pos_q, pos_k), scale
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        d_out = d_out.contiguous()
        return (*block_grads(q, k, v, d_out, lse, softmax_shift(d_out, out), *ctx.pos, ctx.scale), None, None)


def flash_attention(q, k, v, pos_q, pos_k) -> torch.Tensor:
    """softmax(Q Kᵀ/√d + causal mask by position) V; saves e·(4·|Q| + B·h·T) bytes, no B·h·T² scores."""
    return _FlashAttention.apply(q, k, v, pos_q, pos_k)


# ---------------------------------------------------------------- the ring
def _pass_on(tensors, shapes, group, like):
    """Post: send `tensors` to the right neighbour, receive `shapes` from the left; return (works, buffers)."""
    me, n, right, left = ring_neighbours(group)
    bufs = [torch.empty(s, dtype=like.dtype, device=like.device) for s in shapes]
    works = collectives.send_recv(sends=[(t, right) for t in tensors], recvs=[(b, left) for b in bufs], group=group)
    return works, bufs


def _wait(works) -> None:
    for w in works:      # under NCCL one Work stands for the whole group: wait them all, index none
        w.wait()


def visible(pos_q, pos_k):
    """The rows and columns of a block that the causal mask leaves anything in: queries i0.. and keys ..j1.

    Positions are sorted on every rank, so the queries that see some key form a suffix (position >=
    the first key's) and the keys some query sees form a prefix (position <= the last query's).
    None when the block is entirely in the future. In the balanced layout a block from an earlier
    rank keeps half its keys (its early chunk) and one from a later rank half the queries (the late
    chunk): every off-diagonal block costs half a block, on every rank."""
    i0 = int(torch.searchsorted(pos_q, pos_k[:1]))
    j1 = int(torch.searchsorted(pos_k, pos_q[-1:], right=True))
    return None if i0 >= len(pos_q) or j1 == 0 else (i0, j1)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, positions, group, recorder):
        with commlog.tag("cp/fwd"):
            return _RingAttention._forward(ctx, q, k, v, positions, group, recorder)

    @staticmethod
    def backward(ctx, d_out):
        with commlog.tag("cp/bwd"):
            return _RingAttention._backward(ctx, d_out)

    @staticmethod
    def _forward(ctx, q, k, v, positions, group, recorder):
        me, n, _, _ = ring_neighbours(group)
        scale = 1.0 / math.sqrt(q.size(-1))
        shape = lambda j: (*k.shape[:-2], len(positions[j]), k.size(-1))
        pos_q = positions[me]
        m = torch.full((*q.shape[:-1], 1), float("-inf"), dtype=q.dtype, device=q.device)
        l, o = torch.zeros_like(m), torch.zeros_like(q)
        kj, vj = k, v
        for i in range(n):
            src = (me - i) % n
            if i < n - 1:                                   # block i+1 travels while block i is computed
                t_post = recorder.mark() if recorder else None
                works, (k_next, v_next) = _pass_on([kj, vj], [shape((src - 1) % n)] * 2, group, q)
            t0 = recorder.mark() if recorder else None
            seen = visible(pos_q, positions[src])
            if seen:                                        # rows a.., keys ..b: the rest is masked
                a, b = seen
                new = merge(m[..., a:, :], l[..., a:, :], o[..., a:, :], *block_state(
                    block_scores(q[..., a:, :], kj[..., :b, :], pos_q[a:], positions[src][:b], scale), vj[..., :b, :]))
                for state, part in zip((m, l, o), new):
                    state[..., a:, :] = part
            if recorder:
                recorder.add(f"Fwd: block {src}", t0, recorder.mark(), "compute")
            if i < n - 1:
                _wait(works)
                if recorder:
                    recorder.add(f"K,V block {(src - 1) % n}", t_post, recorder.mark(), "comm")
                kj, vj = k_next, v_next
        out, lse = finish(m, l, o)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.positions, ctx.group, ctx.scale = positions, group, scale
        return out

    @staticmethod
    def _backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        positions, group, scale = ctx.positions, ctx.group, ctx.scale
        me, n, _, _ = ring_neighbours(group)
        shape = lambda j: (*k.shape[:-2], len(positions[j]), k.size(-1))
        pos_q, d_out = positions[me], d_out.contiguous()
        delta = softmax_shift(d_out, out)
        dq = torch.zeros_like(q)
        kj, vj, dkj, dvj = k, v, torch.zeros_like(k), torch.zeros_like(v)
        for i in range(n):
            src = (me - i) % n
            if i < n - 1:                                        # prefetch the next K, V
                works, (k_next, v_next) = _pass_on([kj, vj], [shape((src - 1) % n)] * 2, group, q)
            seen = visible(pos_q, positions[src])
            if seen:
                a, b = seen
                dq_b, dk_b, dv_b = block_grads(q[..., a:, :], kj[..., :b, :], vj[..., :b, :], d_out[..., a:, :],
                                               lse[..., a:, :], delta[..., a:, :], pos_q[a:], positions[src][:b], scale)
                dq[..., a:, :] += dq_b
                dkj[..., :b, :] += dk_b
                dvj[..., :b, :] += dv_b
            if n == 1:
                break
            grads, (dk_next, dv_next) = _pass_on([dkj, dvj], [shape((src - 1) % n)] * 2, group, q)
            _wait(grads)                                         # block src's gradients move on (last: home)
            if i < n - 1:
                _wait(works)
                kj, vj = k_next, v_next
            dkj, dvj = dk_next, dv_next
        return dq, dkj, dvj, None, None, None


def ring_attention(q, k, v, positions, group=None, recorder=None) -> torch.Tensor:
    """Causal attention softmax(Q Kᵀ/√d + mask) V of this rank's queries against every rank's keys.

    q, k, v: (..., T_r, d) this rank's tokens; `positions[j]` the token positions rank j holds
    (`all_positions`). `recorder` (a `par.timeline.Recorder`) gets one compute span per block and one
    comm span per K/V transfer. Communication is logged under "cp/fwd" and "cp/bwd"."""
    me, n = group_rank(group), group_size(group)
    if len(positions) != n or len(positions[me]) != q.size(-2) or k.size(-2) != q.size(-2):
        raise ValueError(f"ring attention: rank {me} holds {q.size(-2)} queries and {k.size(-2)} keys but the layout "
                         f"gives it {len(positions[me])} of {len(positions)} ranks; build positions with all_positions")
    return _RingAttention.apply(q, k, v, positions, group, recorder)


# ---------------------------------------------------------------- formulas
def ring_attention_bytes(lengths, rank: int, batch: int, width: int, itemsize: int = 4) -> dict:
    """Bytes rank `rank` sends in one ring-attention forward and backward; `lengths[j]` tokens on rank j,
    `width` = heads × head size (K and V each B·|j|·width·itemsize per block j):

        forward  2·Σ_{i<N-1} |K_{r-i}|,   backward  2·Σ_{i<N-1} |K_{r-i}| + 2·Σ_{i<N} |K_{r-i}|."""
    n = len(lengths)
    if n == 1:                                    # one rank: nothing travels
        return {"forward": 0, "backward": 0}
    block = lambda i: batch * lengths[(rank - i) % n] * width * itemsize
    kv = 2 * sum(block(i) for i in range(n - 1))
    return {"forward": kv, "backward": kv + 2 * sum(block(i) for i in range(n))}


def ring_attention_bytes_even(batch: int, seq: int, width: int, n: int, itemsize: int = 4) -> dict:
    """The even-split form: forward 2(N-1)/N·B·T·w·e, backward (4N-2)/N·B·T·w·e."""
    s = batch * seq * width * itemsize
    return {"forward": 2 * (n - 1) * s / n, "backward": (4 * n - 2) * s / n}


# ---------------------------------------------------------------- a GPT-lite with its sequence split
def attention_forward(attn, x, positions, group=None, recorder=None, attend=None) -> torch.Tensor:
    """`par.model.Attention`'s forward with its core replaced by ring attention (or `attend`, e.g.
    `par.cp.ulysses.ulysses_attention`, with the same arguments); weights replicated."""
    q, k, v = attn.qkv(x).chunk(3, dim=-1)
    h = attn.n_head
    q, k, v = (split_heads(t, h).contiguous() for t in (q, k, v))   # own storages: the ring keeps only these
    return attn.proj(merge_heads((attend or ring_attention)(q, k, v, positions, group, recorder)))


def block_forward(block, x, positions, group=None, recorder=None, attend=None) -> torch.Tensor:
    """`par.model.Block` on this rank's tokens: x + Attn_ring(LN(x)), then x + MLP(LN(x))."""
    x = x + attention_forward(block.attn, block.ln1(x), positions, group, recorder, attend)
    return x + block.mlp(block.ln2(x))


def gpt_forward(model, idx, positions, group=None, recorder=None, attend=None) -> torch.Tensor:
    """Logits of this rank's tokens `idx` (B, T_r) of a `par.model.GPTLite` whose weights every rank holds whole.

    Embedding, LayerNorm, MLP and head act token by token; only attention talks to the other ranks."""
    me = group_rank(group)
    pos = positions[me].to(idx.device)
    x = model.embed.tok(idx) + model.embed.pos(pos)
    for block in model.blocks:
        x = block_forward(block, x, positions, group, recorder, attend)
    return model.head(x)


def sync_grads(model, group=None, impl: str = "ring") -> None:
    """Sum the replicated weights' gradients over the context-parallel group (each rank saw other tokens)."""
    sum_gradients(list(model.parameters()), group, impl, "cp/grads")
