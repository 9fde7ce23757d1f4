"""Sequence parallelism on tensor parallelism equals the dense model, sends the TP all-reduce's bytes,
and keeps 1/t of a layer's activations.

In-process: the size-1 group (every operator a no-op), the divisibility error, the byte and memory
formulas. Multi-process: the launches of tests/seqctx_runs.py (2, 3, 4 ranks; 3 also with NCCL
emulation) return one block and a whole GPT-lite (three Adam steps) compared with the dense model.
"""
from __future__ import annotations

import pytest
from tiers import slow, tiered
import torch

from par.memory import accounting as memory
from par.tp import ops, sequence as sp
from par.comm.collectives import all_reduce_formula_bytes
from par.model import Block, build, preset
from seqctx_runs import ranks as run_worker

TOL = 5e-6


def test_one_rank_is_the_dense_model():
    model = build("tiny", seed=1)
    x = torch.randint(65, (2, 16))
    assert torch.equal(sp.SequenceParallelGPT.from_dense(model)(x), model(x))
    for op in (ops.gather_from_sequence_region, ops.reduce_scatter_to_sequence_region, ops.scatter_to_sequence,
               ops.gather_to_full):
        t = torch.randn(2, 4, 3)
        assert op(t) is t


def test_indivisible_sequence_fails_in_one_line():
    with pytest.raises(ValueError, match="sequence length 10 is not divisible by the sequence-parallel degree 4"):
        ops.check_sequence(10, 4)


def test_formulas():
    b, s, h, t = 2, 64, 32, 4
    S = b * s * h * 4
    assert sp.sp_bytes_per_layer(b, s, h, t, regather=False) == 4 * all_reduce_formula_bytes(S, t)
    assert sp.sp_bytes_per_layer(b, s, h, t) == 4 * all_reduce_formula_bytes(S, t) + 2 * 3 / 4 * S
    # Korthikanti et al.: sbh(34 + 5as/h)/t with SP, sbh(10 + 24/t + 5as/(ht)) without, 16-bit with dropout
    s, b, h, a = 2048, 1, 768, 12
    f = lambda **kw: memory.activation_bytes_per_layer(s, b, h, a, **kw)
    assert f(tp=t, sequence_parallel=True) == pytest.approx(s * b * h * (34 + 5 * a * s / h) / t)
    assert f(tp=t) == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    assert f(recompute="full", tp=t, sequence_parallel=True) == 2 * s * b * h / t
    assert f(dropout=False, bytes_per_value=4, cp=4) == 4 * (17 * s * b * h + a * s * b) / 4
    with pytest.raises(ValueError, match="context-parallel"):
        f(cp=2)


def test_saved_activations_of_one_rank_block_match_the_formula():
    cfg = preset("tiny")
    block = sp.SequenceParallelBlock.from_dense(Block(cfg))
    x = torch.randn(2, 16, cfg.d_model, requires_grad=True)
    _, saved = memory.saved_activation_bytes(block, x, exclude=list(block.parameters()))
    formula = memory.activation_bytes_per_layer(16, 2, cfg.d_model, cfg.n_head, "none", 4, dropout=False,
                                                sequence_parallel=True)
    assert formula <= saved <= 1.03 * formula


def _check(ranks, n):
    assert len(ranks) == n
    for r, res in enumerate(ranks):
        for regather in (True, False):
            c = res[f"sp block regather={regather}"]
            for key in ("forward", "input_grad", "weight_grad"):
                assert c[key] <= TOL, (r, regather, key, c[key])
            assert c["kinds"] == ["all_gather", "reduce_scatter"]
            assert c["bytes"] == c["bytes_formula"]
            assert c["saved_formula"] <= c["saved"]
            assert c["tp_saved_formula"] <= c["tp_saved"] <= 1.03 * c["tp_saved_formula"]
        keep, regather = res["sp block regather=True"], res["sp block regather=False"]
        assert regather["bytes"] == regather["tp_allreduce_bytes"]          # g, ḡ: the TP all-reduce's bytes
        assert keep["saved"] <= 1.03 * keep["saved_formula"]               # everything divided by t
        assert keep["saved"] < keep["tp_saved"]
        assert regather["saved"] - keep["saved"] == 2 * 4 * 24 * 2 * 48 * (n - 1) // n   # the gathered inputs
        g = res["sp gpt"]
        assert g["logits"] <= TOL and g["grads"] <= TOL and g["loss"] <= TOL and g["params"] <= 1e-5, g
        assert "not divisible by the sequence-parallel degree" in g["error"]


@pytest.mark.parametrize("n", tiered([2, 4]))
def test_sequence_parallel_equals_dense(n):
    _check(run_worker(n), n)


@slow
def test_sequence_parallel_equals_dense_three_ranks(p2p_env):
    _check(run_worker(3, p2p_env), 3)
