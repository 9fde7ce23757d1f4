"""The single-process mixture of experts (`par.moe.router`): routing, capacity and dropping, the balancing loss,
and the layer against a token-by-token loop over the experts."""
from __future__ import annotations

import pytest
import torch

from par.moe import router as moe


def loop_reference(layer: moe.MoE, x: torch.Tensor) -> torch.Tensor:
    """y_s = Σ over kept choices of gate · Expert_e(x_s), one token at a time (no buffers)."""
    r = layer.routings[0]
    tokens = x.reshape(-1, x.size(-1))
    ex = layer.experts
    out = torch.zeros_like(tokens)
    for s in range(tokens.size(0)):
        for j in range(layer.k):
            if r.kept[s, j]:
                e = r.expert[s, j]
                h = torch.nn.functional.gelu(tokens[s] @ ex.w1[e] + ex.b1[e])
                out[s] += r.gate[s, j] * (h @ ex.w2[e] + ex.b2[e])
    return out.view_as(x)


def test_slots_put_first_choices_first_then_second_in_token_order():
    experts = torch.tensor([[0, 1], [0, 2], [1, 0], [0, 1]])
    # first choices: tokens 0, 1, 3 pick expert 0 (slots 0, 1, 2), token 2 picks 1 (slot 0);
    # second choices: token 0 -> 1 (slot 1), token 1 -> 2 (slot 0), token 2 -> 0 (slot 3), token 3 -> 1 (slot 2)
    assert moe.slots(experts, 3).tolist() == [[0, 1], [1, 0], [0, 3], [2, 2]]


@pytest.mark.parametrize("tokens,experts,k,f,want", [(16, 4, 1, 1.0, 4), (16, 4, 2, 1.0, 8), (10, 4, 1, 1.25, 4),
                                                       (3, 8, 1, 1.0, 1)])
def test_capacity_formula(tokens, experts, k, f, want):
    assert moe.capacity(tokens, experts, k, f) == want


def test_full_experts_drop_the_late_tokens_and_gate_them_to_zero():
    logits = torch.tensor([[5.0, 0, 0, 0]] * 6 + [[0, 5.0, 0, 0]] * 2)     # 6 tokens want expert 0, 2 want 1
    r = moe.route(logits, k=1, capacity_factor=1.0)                       # C = 8/4 = 2
    assert r.capacity == 2 and r.load.tolist() == [6, 2, 0, 0]
    assert r.kept[:, 0].tolist() == [True, True, False, False, False, False, True, True]
    assert r.dropped == 4 and torch.all(r.gate[~r.kept] == 0)
    layer = moe.MoE(4, 8, n_experts=4, k=1, capacity_factor=1.0)
    x = torch.randn(1, 8, 4)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0] = 100.0                                 # everything with x0 > 0 to expert 0
    y = layer(x)
    assert torch.allclose(y, loop_reference(layer, x), atol=1e-6)
    dropped = ~layer.routings[0].kept[:, 0]
    assert torch.all(y.view(8, 4)[dropped] == 0), "a dropped token leaves the layer with zero (the residual carries it)"


def test_balancing_loss_is_one_when_balanced_and_e_when_collapsed():
    e = 4
    balanced = torch.full((8, e), 1 / e)
    assert moe.load_balancing_loss(balanced, torch.arange(8)[:, None] % e, e).item() == pytest.approx(1.0)
    collapsed = torch.zeros(8, e)
    collapsed[:, 0] = 1
    assert moe.load_balancing_loss(collapsed, torch.zeros(8, 1, dtype=torch.long), e).item() == pytest.approx(e)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("factor", [0.5, 1.25, 4.0])
def test_layer_equals_the_token_loop_and_its_gradients(k, factor):
    torch.manual_seed(k)
    layer = moe.MoE(6, 10, n_experts=5, k=k, capacity_factor=factor)
    x = torch.randn(2, 7, 6, requires_grad=True)
    y = layer(x)
    assert torch.allclose(y, loop_reference(layer, x), atol=1e-6)
    if k == 2:
        gates = layer.routings[0].gate
        kept_both = layer.routings[0].kept.all(1)
        assert torch.allclose(gates[kept_both].sum(1), torch.ones(int(kept_both.sum())))
    if factor < 1:
        assert layer.routings[0].dropped > 0
    (y.square().sum() + layer.aux).backward()
    assert layer.router.weight.grad.abs().sum() > 0 and x.grad.abs().sum() > 0


def test_groups_route_each_group_on_its_own():
    torch.manual_seed(0)
    layer = moe.MoE(6, 10, n_experts=4, k=2, capacity_factor=1.0)
    x = torch.randn(6, 5, 6)
    y = layer(x, groups=3)
    aux = layer.aux
    parts, auxes = [], []
    for g in range(3):
        parts.append(layer(x[2 * g:2 * g + 2]))
        auxes.append(layer.aux)
    assert torch.allclose(y, torch.cat(parts), atol=1e-6)
    assert torch.allclose(aux, torch.stack(auxes).mean())
    assert not torch.allclose(y, layer(x), atol=1e-4), "one group of 30 tokens routes (drops) differently"
    with pytest.raises(moe.MoEError, match="multiple of 4"):
        layer(x, groups=4)


@pytest.mark.parametrize("kwargs,words", [({"k": 3}, "k = 1"), ({"n_experts": 1, "k": 2}, "at least 2 experts"),
                                          ({"capacity_factor": 0}, "must be > 0")])
def test_bad_settings_fail_in_one_line(kwargs, words):
    with pytest.raises(moe.MoEError, match=words):
        moe.MoE(4, 8, **{"n_experts": 4, **kwargs})


def test_moe_gpt_trains_and_reports_tokens_per_expert():
    model = moe.build_moe_gpt("tiny", n_experts=4, k=2)
    idx = torch.randint(0, 65, (2, 32))
    logits = model(idx)
    assert logits.shape == (2, 32, 65)
    loads = moe.tokens_per_expert(model)
    assert len(loads) == 4 and all(sum(l) == 2 * 32 * 2 for l in loads)
    assert moe.aux_loss(model).item() >= 1.0 - 1e-6
    assert torch.equal(model(idx), moe.build_moe_gpt("tiny", n_experts=4, k=2)(idx)), "same seed, same model"


# ---------------------------------------------------------------- the memory calculator and the planner learn ep
def test_moe_param_count_matches_the_model_and_its_shards():
    from par.memory import accounting as memory
    from par.moe.experts import expert_range
    from par.model import preset
    cfg = preset("tiny")
    model = moe.build_moe_gpt(cfg, n_experts=5, k=2)
    replicated, experts = memory.moe_param_count(cfg, 5, ep=1)
    assert replicated + experts == sum(p.numel() for p in model.parameters())
    assert experts == sum(p.numel() for layer in moe.moe_layers(model) for p in layer.experts.parameters())
    for ep in (2, 3, 4):
        busiest = max(b - a for a, b in (expert_range(5, ep, r) for r in range(ep)))
        shard = model.blocks[0].moe.experts.shard(0, busiest)
        assert memory.moe_param_count(cfg, 5, ep) == (replicated, cfg.n_layer * sum(p.numel() for p in shard.parameters()))
    assert memory.moe_block_params(32, 128, 5, 2) * cfg.n_layer == \
        memory.moe_param_count(cfg, 5, 2)[0] + memory.moe_param_count(cfg, 5, 2)[1] - \
        (memory.gpt_param_count(cfg) - cfg.n_layer * memory.gpt_block_params(32, 128))


def test_planner_places_the_ep_degree():
    from par.train import planner
    from par.moe.experts import moe_step_bytes
    from par.model import preset
    w = planner.Workload(preset("gpt3-small"), 64)
    spec = planner.MoE(n_experts=8, k=2, capacity_factor=1.25)
    plans = {ep: planner.predict_moe(w, spec, 8, ep) for ep in (1, 2, 4, 8)}
    states = [plans[ep].memory["total"] - plans[ep].memory["activations"] for ep in (1, 2, 4, 8)]
    assert states == sorted(states, reverse=True) and states[0] > 3 * states[-1], "experts sharded: less per rank"
    assert plans[1].bytes["ep"] == 0 and plans[8].ep == 8
    cap = moe.capacity(8 * 2048, 8, 2, 1.25)
    for ep in (2, 4, 8):    # the planner's bytes are the job's formula (fp16/bf16: 2 bytes a value)
        assert plans[ep].bytes["ep"] == moe_step_bytes(12, 8, cap, 768, ep, 0, itemsize=2)
    bad = planner.predict_moe(w, spec, 8, 3)
    assert not bad.valid and "ep 3 does not divide the 8 ranks" in bad.reason
    ranked = planner.moe_plans(w, spec, 8)
    assert ranked and {p.ep for p in ranked} == {1, 2, 4, 8} and ranked[0].fits


def test_router_z_loss_is_the_mean_squared_log_sum_exp_and_shrinks_the_logits():
    torch.manual_seed(0)
    logits = torch.randn(10, 4) * 3
    assert moe.router_z_loss(logits) == pytest.approx((logits.logsumexp(-1) ** 2).mean().item())
    layer = moe.MoE(8, 12, n_experts=4, k=2)
    x = torch.randn(2, 5, 8)
    layer(x)
    layer.z.backward()
    step = layer.router.weight - 0.1 * layer.router.weight.grad     # one step down the z-loss alone
    assert moe.router_z_loss(x.reshape(-1, 8) @ step.t()) < layer.z


def test_a_shared_expert_adds_one_mlp_every_token_goes_through():
    torch.manual_seed(1)
    routed, both = moe.MoE(8, 12, n_experts=4, k=1), moe.MoE(8, 12, n_experts=4, k=1, shared=2)
    both.router.load_state_dict(routed.router.state_dict())
    both.experts.load_state_dict(routed.experts.state_dict())
    x = torch.randn(2, 5, 8)
    assert torch.allclose(both(x), routed(x) + both.shared(x), atol=1e-6)
    assert both.shared.fc.out_features == 2 * 12
    model = moe.build_moe_gpt("tiny", n_experts=4, k=2, shared=1)
    idx = torch.randint(0, 65, (2, 16))
    loss = moe.moe_loss(model, model(idx), idx, alpha=0.01, beta=1e-3)
    assert loss > moe.moe_loss(model, model(idx), idx, alpha=0.01)        # the z-loss is added
    loss.backward()
    assert all(b.moe.shared.fc.weight.grad is not None for b in model.blocks)
    with pytest.raises(moe.MoEError, match="shared"):
        moe.MoE(8, 12, shared=-1)
