"""par.model's fast path (lecture 10): SDPA equals the lecture's explicit attention, the padded and tied tables,
per-block compilation, the fused optimizer; the presets keep every course number."""
from __future__ import annotations

import pytest
import torch

from par.memory.accounting import param_count
from par.model import (PRESETS, GPTConfig, build, causal_attention, compile_blocks, fast, lm_loss, math_attention,
                       pad_to_multiple, preset, sdpa_attention)
from par.reference import fused_supported, make_optimizer, max_abs_diff, train_single
from tiers import slow


def qkv(b=2, h=3, t=17, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, t, d, generator=g, requires_grad=True) for _ in range(3)]


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-6) -> bool:
    """|a − b| ≤ tol · max(1, max |a|): fp32 agreement relative to the tensor's scale."""
    return (a - b).abs().max().item() <= tol * max(1.0, a.abs().max().item())


@pytest.mark.parametrize("seed", range(5))
def test_sdpa_equals_the_explicit_attention_outputs_and_gradients(seed):
    a, b = qkv(seed=seed), qkv(seed=seed)
    out_math, out_sdpa = math_attention(*a), sdpa_attention(*b)
    assert close(out_math, out_sdpa)
    grad = torch.randn(out_math.shape, generator=torch.Generator().manual_seed(seed))
    out_math.backward(grad)
    out_sdpa.backward(grad)
    for x, y in zip(a, b):
        assert close(x.grad, y.grad)
    assert torch.equal(causal_attention(*a, kind="math"), math_attention(*a))
    assert torch.equal(causal_attention(*a), sdpa_attention(*a))


def test_the_model_on_sdpa_equals_the_model_on_math():
    models = {kind: build(preset("small", attention=kind)) for kind in ("math", "sdpa")}
    x = torch.randint(0, 65, (3, 64), generator=torch.Generator().manual_seed(1))
    losses = {}
    for kind, model in models.items():
        losses[kind] = lm_loss(model(x), x)
        losses[kind].backward()
    assert abs(losses["math"].item() - losses["sdpa"].item()) <= 1e-6
    grads = [(p.grad - q.grad).abs().max().item()
             for p, q in zip(models["math"].parameters(), models["sdpa"].parameters())]
    assert max(grads) <= 1e-6


def test_the_presets_keep_the_lecture_attention_and_every_parameter_count():
    assert {cfg.attention for cfg in PRESETS.values()} == {"math"}, "the course's activation numbers are math's"
    assert GPTConfig().attention == "sdpa"
    counts = {name: param_count(cfg) for name, cfg in PRESETS.items()}
    assert counts["gpt3-small"] == 163_823_616
    for name in ("tiny", "small", "tiny-long"):
        assert counts[name] == sum(p.numel() for p in build(name).parameters())


@pytest.mark.parametrize("tie", [False, True])
def test_a_padded_vocabulary_and_a_tied_head(tie):
    cfg = preset("tiny", padded_vocab=128, tie_embeddings=tie)
    model = build(cfg)
    assert model.embed.tok.weight.shape == (128, 32) and model.head.lm_head.weight.shape == (128, 32)
    assert (model.head.lm_head.weight is model.embed.tok.weight) == tie
    assert param_count(cfg) == sum(p.numel() for p in model.parameters())
    x = torch.randint(0, 65, (2, 32))
    assert model(x).shape == (2, 32, 128)
    lm_loss(model(x), x).backward()


def test_fast_is_nanogpt_s_choices_and_bad_fields_fail_in_one_line():
    cfg = fast(preset("gpt3-small"))
    assert (cfg.attention, cfg.padded_vocab, cfg.tie_embeddings, cfg.vocab) == ("sdpa", 50304, True, 50304)
    assert pad_to_multiple(50257) == 50304 and pad_to_multiple(64) == 64 and pad_to_multiple(65) == 128
    with pytest.raises(ValueError, match="unknown attention 'flash': use one of sdpa, math"):
        preset("tiny", attention="flash")
    with pytest.raises(ValueError, match="padded_vocab 60 is smaller than vocab_size 65"):
        preset("tiny", padded_vocab=60)


def test_fused_adam_trains_like_the_for_each_adam():
    assert fused_supported("cpu")
    assert make_optimizer(build("tiny").parameters(), "adamw", 1e-3, fused=True).defaults["fused"]
    assert not make_optimizer(build("tiny").parameters(), "sgd", 1e-3, fused=True).defaults.get("fused")
    g = torch.Generator().manual_seed(2)
    data = [(x, x) for x in (torch.randint(0, 65, (4, 32), generator=g) for _ in range(4))]
    a, b = build("tiny"), build("tiny")
    la = train_single(a, data, lm_loss, "adamw", 1e-3)
    lb = train_single(b, data, lm_loss, "adamw", 1e-3, fused=True)
    assert max_abs_diff(a, b) <= 1e-5 and max(abs(x - y) for x, y in zip(la, lb)) <= 1e-5
    assert all(isinstance(x, float) for x in la) and len(la) == 4


@slow
def test_compiled_blocks_compute_the_same_and_keep_to_layers():
    eager, compiled = build(fast(preset("tiny"))), compile_blocks(build(fast(preset("tiny"))))
    assert [type(m) for m in compiled.to_layers()] == [type(m) for m in eager.to_layers()]
    x = torch.randint(0, 65, (2, 32))
    out_e, out_c = eager(x), compiled(x)
    assert (out_e - out_c).abs().max() <= 1e-5
    lm_loss(out_e, x).backward()
    lm_loss(out_c, x).backward()
    assert max((p.grad - q.grad).abs().max().item() for p, q in zip(eager.parameters(), compiled.parameters())) <= 1e-5


@pytest.mark.parametrize("t, tile", [(17, 4), (64, 16), (33, 64), (40, 40)])
def test_tiled_attention_equals_sdpa(t, tile):
    from par.device.tiled_attention import tiled_attention, tiles_computed
    q, k, v = (x.detach() for x in qkv(t=t))
    out, lse = tiled_attention(q, k, v, tile)
    assert close(sdpa_attention(q, k, v), out)
    scores = (q @ k.transpose(-2, -1) / 8 ** 0.5).masked_fill(torch.ones(t, t).tril() == 0, float("-inf"))
    assert close(torch.logsumexp(scores, dim=-1, keepdim=True), lse)
    n = -(-t // tile)
    assert tiles_computed(t, tile) == n * (n + 1) // 2


def test_tiled_attention_moves_no_t_squared_bytes():
    from par.device.tiled_attention import score_bytes, tiled_bytes
    b, h, d, tile = 8, 12, 64, 128
    assert tiled_bytes(b, h, 128, d, tile) == 4 * b * h * 4 * 128 * d      # one tile: Q, K, V, O once each
    ratios = [score_bytes(b, h, t) / tiled_bytes(b, h, t, d, tile) for t in (1024, 2048, 4096)]
    assert ratios[0] < ratios[1] < ratios[2], "the scores grow as T², the tiles' traffic slower"
