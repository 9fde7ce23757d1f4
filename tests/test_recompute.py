"""Activation checkpointing (`par.recompute`, `GPTConfig(checkpoint=...)`): the same numbers as keeping every
activation, fewer bytes kept (none > selective > full, each as its formula says), and the model's layer list,
pipeline and ZeRO engine unchanged by it."""
from __future__ import annotations

import functools

import pytest
import torch

from par.data import CharDataset, global_batches
from par.memory.accounting import saved_activation_bytes
from par.model import build, lm_loss, preset
from par.recompute import MODES, bytes_kept, checkpointed, keep_matmuls, kept_values_per_block, saved_ops

SHAPE = dict(batch=4, seq=32)


def _batch(cfg, seed=0):
    return next(global_batches(CharDataset(block_size=cfg.block_size), SHAPE["batch"], 1, seed=seed))


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("attention", ["sdpa", "math"])
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_checkpointing_gives_the_outputs_and_gradients_of_none(mode, attention):
    cfg = preset("tiny", attention=attention)
    x, y = _batch(cfg)
    ref, mine = build(cfg, seed=1), build(preset("tiny", attention=attention, checkpoint=mode), seed=1)
    want, got = ref(x), mine(x)
    lm_loss(want, y).backward()
    lm_loss(got, y).backward()
    assert (got - want).abs().max().item() <= 1e-6
    g_ref, g_mine = _grads(ref), _grads(mine)
    assert g_ref.keys() == g_mine.keys()
    assert max((g_mine[k] - g_ref[k]).abs().max().item() for k in g_ref) <= 1e-6


@functools.cache
def _kept_by_blocks(mode, attention="sdpa"):
    """Bytes two blocks of `small`'s width keep for backward (the embedding's output is the input, outside the
    count)."""
    cfg = preset("small", n_layer=2, block_size=32, attention=attention, checkpoint=mode)
    model = build(cfg, seed=0)
    x, _ = next(global_batches(CharDataset(block_size=cfg.block_size), SHAPE["batch"], 1, seed=0))
    h = model.embed(x).detach().requires_grad_(True)

    def blocks(h):
        for block in model.blocks:
            h = block(h)
        return h

    out, kept = bytes_kept(blocks, h, exclude=list(model.parameters()))
    out.sum().backward()          # the graph was whole: backward runs through what was kept
    return cfg, kept


@pytest.mark.parametrize("attention", ["sdpa", "math"])
def test_bytes_kept_are_ordered_none_selective_full(attention):
    kept = {mode: _kept_by_blocks(mode, attention)[1] for mode in MODES}
    assert kept["none"] > kept["selective"] > kept["full"] > 0


def test_bytes_kept_follow_the_formulas_with_sdpa():
    """full keeps each block's input (n_layer · s·b·h fp32 values: the last block's output stands in for the
    first block's input, which the forward did not create); selective s·b·(11h + a) a block; none s·b·(16h + a)
    and the LayerNorms' statistics (17h when merging the heads copies)."""
    kept = {}
    for mode in MODES:
        cfg, kept[mode] = _kept_by_blocks(mode)
    values = {m: kept_values_per_block(m, cfg.block_size, SHAPE["batch"], cfg.d_model, cfg.n_head) * cfg.n_layer * 4
              for m in MODES}
    assert kept["full"] == values["full"]
    assert kept["selective"] == pytest.approx(values["selective"], rel=0.02)
    sbh = cfg.block_size * SHAPE["batch"] * cfg.d_model * 4 * cfg.n_layer
    assert values["none"] <= kept["none"] <= values["none"] + sbh
    assert kept["selective"] / kept["none"] <= (11 * cfg.d_model + cfg.n_head) / (16 * cfg.d_model + cfg.n_head) + 0.01


def test_bytes_kept_equal_the_saved_tensor_hooks_without_checkpointing():
    """Without checkpointing everything kept is saved by autograd: the two meters agree (here the input is
    created inside, so both count it)."""
    model = build(preset("tiny"), seed=0)
    x, _ = _batch(model.cfg)

    def forward(x):
        return model(x)

    out, by_hooks = saved_activation_bytes(forward, x, exclude=list(model.parameters()))
    out2, by_storage = bytes_kept(forward, x, exclude=list(model.parameters()))
    logits = out2.untyped_storage().nbytes()      # the output is alive but saved by nobody
    assert by_storage - logits == pytest.approx(by_hooks, rel=0.02)


def test_the_policy_saves_matmuls_and_recomputes_the_rest():
    aten = torch.ops.aten
    assert {aten.mm.default, aten.addmm.default, aten.bmm.default} <= saved_ops()
    assert keep_matmuls(None, aten.addmm.default).name == "MUST_SAVE"
    assert keep_matmuls(None, aten.gelu.default).name == "PREFER_RECOMPUTE"
    assert keep_matmuls(None, aten.native_layer_norm.default).name == "PREFER_RECOMPUTE"


def test_unknown_modes_are_refused_in_one_line():
    with pytest.raises(ValueError, match="unknown checkpoint 'some'"):
        preset("tiny", checkpoint="some")
    with pytest.raises(ValueError, match="unknown checkpoint mode 'some'"):
        checkpointed(lambda x: x, torch.zeros(1), "some")


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_layers_and_a_one_rank_pipeline_are_unchanged_by_checkpointing(mode):
    from par.pp import schedules
    from par.pp.pipeline import Pipeline
    cfg = preset("tiny")
    x, y = _batch(cfg, seed=4)
    ref, model = build(cfg, seed=3), build(preset("tiny", checkpoint=mode), seed=3)
    assert [type(m) for m in model.to_layers()] == [type(m) for m in ref.to_layers()]
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    pipe = Pipeline(model.to_layers(), schedules.interleaved(1, 2, 2), lm_loss, method="uniform", track_memory=True)
    loss = pipe.step(x, y)
    ref_loss = lm_loss(ref(x), y)
    ref_loss.backward()
    assert loss == pytest.approx(ref_loss.item(), abs=1e-6)
    assert max((a.grad - b.grad).abs().max().item() for a, b in zip(model.parameters(), ref.parameters())) <= 1e-6


@pytest.mark.parametrize("stage", [1, 3])
def test_zero_on_one_rank_trains_the_same_with_selective_checkpointing(stage):
    """ZeRO's hooks (stage 3 gathers each block's parameters in a forward pre-hook, again for the recomputation)
    see a checkpointed block like any other: three Adam steps equal the ones without checkpointing."""
    from par.zero.engine import Zero
    cfg = preset("tiny")
    data = list(global_batches(CharDataset(block_size=cfg.block_size), SHAPE["batch"], 3, seed=2))
    states = []
    for mode in ("none", "selective"):
        model = build(preset("tiny", checkpoint=mode), seed=5)
        zero = Zero(model, stage=stage, optimizer="adam", lr=1e-2)
        for x, y in data:
            zero.backward(lm_loss(model(x), y))
            zero.step()
            zero.zero_grad()
        states.append(zero.full_state_dict())
    assert max((states[1][k] - v).abs().max().item() for k, v in states[0].items()) <= 1e-5
