"""Ring attention (context parallelism) equals dense causal attention.

In-process: the layouts (who holds which tokens), the causal work per rank, the online-softmax merge,
the byte formulas. Multi-process: one launch per world size (2, 3, 4) runs tests/workers/seqctx_check.py:
attention for both layouts and lengths that do and do not divide, a GPT-lite trained three Adam steps,
bytes against `ring_attention_bytes`; the 3-rank launch runs with gloo and with NCCL emulation (`p2p_env`).
"""
from __future__ import annotations

import pytest
from tiers import slow, tiered
import torch

from par.cp import ring_attention as cp
from par.model import causal_attention
from seqctx_runs import ranks as run_worker

TOL = 5e-6


# ---------------------------------------------------------------- in-process
@pytest.mark.parametrize("seq,n", [(12, 2), (13, 3), (17, 4), (8, 4)])
@pytest.mark.parametrize("layout", cp.LAYOUTS)
def test_layouts_cover_every_token_once(seq, n, layout):
    pos = cp.all_positions(seq, n, layout)
    assert sorted(torch.cat(pos).tolist()) == list(range(seq))
    sizes = [len(p) for p in pos]
    assert max(sizes) - min(sizes) <= (2 if layout == "balanced" else 1)


def test_balanced_layout_holds_one_early_and_one_late_chunk():
    assert cp.chunk_positions(16, 4, 0).tolist() == [0, 1, 14, 15]
    assert cp.chunk_positions(16, 4, 3).tolist() == [6, 7, 8, 9]
    assert cp.chunk_positions(16, 4, 1, "naive").tolist() == [4, 5, 6, 7]


def test_balanced_layout_evens_out_the_causal_work():
    naive, balanced = cp.causal_pairs(1024, 4, "naive"), cp.causal_pairs(1024, 4)
    assert sum(naive) == sum(balanced) == 1024 * 1025 // 2
    assert max(naive) / min(naive) > 6                 # rank 3 scores 7x the pairs rank 0 does
    assert max(balanced) == min(balanced)


def test_ring_computes_half_of_every_off_diagonal_block_when_balanced():
    pos = cp.all_positions(16, 4)
    assert cp.visible(pos[2], pos[2]) == (0, 4)        # own block: all of it, masked inside
    assert cp.visible(pos[2], pos[0]) == (0, 2)        # earlier rank: its early chunk of keys
    assert cp.visible(pos[0], pos[2]) == (2, 4)        # later rank: my late chunk of queries
    naive = cp.all_positions(16, 4, "naive")
    assert cp.visible(naive[0], naive[3]) is None      # entirely in the future: skipped
    assert cp.computed_pairs(16, 4) == [16 + 3 * 8] * 4
    assert cp.computed_pairs(16, 4, "naive") == [16, 32, 48, 64]


def test_short_sequences_and_unknown_layouts_fail_in_one_line():
    with pytest.raises(ValueError, match="at least 8 tokens"):
        cp.chunk_positions(7, 4, 0)
    with pytest.raises(ValueError, match="layout"):
        cp.chunk_positions(16, 4, 0, "zigzag")


def test_merging_block_states_is_the_softmax_of_the_whole_row():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 5, 4), torch.randn(2, 9, 4), torch.randn(2, 9, 3)
    s = q @ k.transpose(-2, -1)
    s[:, 0, :6] = float("-inf")                         # a row whose first blocks are all masked
    state = cp.block_state(s[..., :3], v[:, :3])
    for a, b in ((3, 6), (6, 9)):
        state = cp.merge(*state, *cp.block_state(s[..., a:b], v[:, a:b]))
    out, lse = cp.finish(*state)
    assert torch.allclose(out, torch.softmax(s, -1) @ v, atol=1e-6)
    assert torch.allclose(lse, torch.logsumexp(s, -1, keepdim=True), atol=1e-6)
    assert not torch.isnan(out).any()


def test_one_rank_is_dense_attention():
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 3, 11, 8, requires_grad=True) for _ in range(3))
    out = cp.ring_attention(q, k, v, cp.all_positions(11, 1))
    assert (out - causal_attention(q, k, v)).abs().max() <= TOL
    out.sum().backward()
    assert q.grad is not None and k.grad is not None


def test_flash_attention_keeps_no_scores_and_equals_dense():
    from par.memory import accounting as memory
    torch.manual_seed(2)
    q, k, v = (torch.randn(2, 3, 16, 8, requires_grad=True) for _ in range(3))
    pos = torch.arange(16)
    out, saved = memory.saved_activation_bytes(lambda *t: cp.flash_attention(*t, pos, pos), q, k, v)
    ref = causal_attention(q, k, v)
    w = torch.randn_like(out)
    mine, dense = torch.autograd.grad((out * w).sum(), (q, k, v)), torch.autograd.grad((ref * w).sum(), (q, k, v))
    assert (out - ref).abs().max() <= TOL and all((a - b).abs().max() <= TOL for a, b in zip(mine, dense))
    assert saved == 4 * (4 * q.numel() + 2 * 3 * 16)       # Q, K, V, O and one log-sum-exp per row: no T² scores


def test_ulysses_bytes_are_two_over_c_of_the_rings():
    from par.cp import ulysses
    for c in (2, 4, 8):
        ring, uly = cp.ring_attention_bytes_even(1, 64, 32, c), ulysses.ulysses_bytes_even(1, 64, 32, c)
        assert uly["forward"] == pytest.approx(ring["forward"] * 2 / c)
    assert ulysses.ulysses_bytes([4, 4], 4, 0, 1, 8) == ulysses.ulysses_bytes_even(1, 8, 32, 2)
    # 3 heads on 2 ranks: rank 0 attends to heads 0-1; it sends Q, K, V of head 2 for its 5 tokens, and the output
    # of its 2 heads for rank 1's 4 tokens
    assert ulysses.ulysses_bytes([5, 4], 3, 0, 1, 1, 1) == {"forward": 3 * 5 + 2 * 4, "backward": 5 + 3 * 2 * 4}
    with pytest.raises(ValueError, match="at least one head"):
        ulysses.head_groups(3, 4)


def test_byte_formulas():
    assert cp.ring_attention_bytes([4, 4, 4, 4], 1, 2, 8) == cp.ring_attention_bytes_even(2, 16, 8, 4)
    # uneven: rank 0 of [5, 4, 4] sends its own block (5) then rank 2's (4), K and V
    assert cp.ring_attention_bytes([5, 4, 4], 0, 1, 1, 1) == {"forward": 2 * 9, "backward": 2 * 9 + 2 * 13}


# ---------------------------------------------------------------- multi-process
def _check_ranks(ranks, n):
    assert len(ranks) == n
    for r, res in enumerate(ranks):
        cases = [k for k in res if k.startswith("attention")]
        assert len(cases) == 4
        for case in cases:
            c = res[case]
            for key in ("forward", "dq", "dk", "dv"):
                assert c[key] <= TOL, (r, case, key, c[key])
            assert c["bytes"] == c["formula"], (r, case)
            assert c["tags"] == ["cp/bwd", "cp/fwd"]
        for case in ("ulysses balanced", "ulysses naive"):      # DeepSpeed-Ulysses: two all-to-alls
            c = res[case]
            for key in ("forward", "dq", "dk", "dv"):
                assert c[key] <= TOL, (r, case, key, c[key])
            assert c["bytes"] == c["formula"], (r, case)
            assert c["tags"] == ["ulysses/bwd", "ulysses/fwd"]
        for g in (res["gpt"], res["ulysses gpt"]):
            assert g["logits"] <= TOL and g["grads"] <= TOL and g["loss"] <= TOL and g["params"] <= 1e-5, g
        assert res["timeline"] == {"compute": n, "comm": n - 1}
        assert "at least" in res["errors"]["short"]
        assert "at least one head" in res["errors"]["heads"]


@pytest.mark.parametrize("n", tiered([2, 4]))
def test_ring_attention_equals_dense(n):
    _check_ranks(run_worker(n), n)


@slow
def test_ring_attention_equals_dense_three_ranks(p2p_env):
    _check_ranks(run_worker(3, p2p_env), 3)


def test_planner_places_a_context_parallel_degree():
    from par.train import planner
    from par.model import preset
    w = planner.Workload(preset("gpt3-small"), 8)
    one, two = planner.predict(w, 2, 1, 2), planner.predict(w, 2, 1, 2, cp=2)
    assert two.valid and two.cp == 2 and "cp2" in two.label
    assert two.memory["activations"] == pytest.approx(one.memory["activations"] / 2)
    assert two.time["compute"] == pytest.approx(one.time["compute"] / 2)
    ring = cp.ring_attention_bytes_even(4, 2048, 768 // 2, 2, 2)
    assert two.bytes["cp"] == 12 * (ring["forward"] + ring["backward"]) and "cp" not in one.bytes
    assert not planner.predict(planner.Workload(preset("tiny", block_size=6), 8), 1, 1, 1, cp=4).valid
