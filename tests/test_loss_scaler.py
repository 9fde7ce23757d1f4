"""Dynamic loss scaling: DeepSpeed's update rule, the skipped step, and agreement with torch.amp.GradScaler."""
import copy
import random

import pytest
import torch

from par.precision.loss_scaler import DynamicLossScaler, StaticLossScaler, replay
from par.precision.mixed_precision import MixedPrecision
from par.model import TinyMLP


def scales(scaler, overflows):
    return [r["scale"] for r in replay(scaler, overflows)]


def test_defaults_are_deepspeeds():
    s = DynamicLossScaler()
    assert (s.scale, s.window, s.hysteresis, s.factor, s.min_scale) == (2.0 ** 16, 1000, 2, 2.0, 1.0)
    assert s.raise_at_min and not s.consecutive_hysteresis


def test_growth_every_window_clean_steps():
    got = scales(DynamicLossScaler(init_scale=8, window=5), [False] * 16)
    assert got == [8] * 5 + [16] * 5 + [32] * 5 + [64]
    # the default window: the first doubling after exactly 1000 clean steps
    s = DynamicLossScaler()
    replay(s, [False] * 999)
    assert s.scale == 2 ** 16
    s.update(False)
    assert s.scale == 2 ** 17


def test_overflow_restarts_the_window():
    got = scales(DynamicLossScaler(init_scale=8, window=5, hysteresis=1), [False] * 4 + [True] + [False] * 6)
    # 4 clean steps, overflow (halve to 4), then 5 clean steps before the next doubling
    assert got == [8] * 5 + [4] * 5 + [8]


def test_hysteresis_two_forgives_one_overflow():
    s = DynamicLossScaler(init_scale=64, window=3, hysteresis=2)
    got = scales(s, [True, True, True, False, False, False, True, True])
    # 1st overflow uses the hysteresis, 2nd and 3rd halve; 3 clean steps double and refill it;
    # then again one overflow is forgiven before the next halving
    assert got == [64, 64, 32, 16, 16, 16, 32, 32]
    assert s.scale == 16


def test_hysteresis_is_not_refilled_by_clean_steps_unless_consecutive():
    flags = [True, False, True]
    assert scales(DynamicLossScaler(init_scale=64, window=100, hysteresis=2), flags + [False]) == [64, 64, 64, 32]
    assert scales(DynamicLossScaler(init_scale=64, window=100, hysteresis=2, consecutive_hysteresis=True),
                  flags + [False]) == [64, 64, 64, 64]


def test_never_below_minimum():
    s = DynamicLossScaler(init_scale=64, window=1000, hysteresis=1, factor=4, min_scale=2, raise_at_min=False)
    got = scales(s, [True] * 6)
    assert got == [64, 16, 4, 2, 2, 2] and s.scale == 2
    s = DynamicLossScaler(init_scale=4, hysteresis=1, min_scale=2)
    s.update(True)
    assert s.scale == 2
    with pytest.raises(FloatingPointError, match="minimum loss scale 2"):
        s.update(True)
    assert s.scale == 2


def test_static_scaler_and_bad_configs():
    s = StaticLossScaler(128.0)
    assert scales(s, [True, False] * 3) == [128.0] * 6
    for kw, msg in [({"window": 0}, "window"), ({"hysteresis": 0}, "hysteresis"), ({"factor": 1}, "factor"),
                    ({"min_scale": 4, "init_scale": 2}, "min_scale")]:
        with pytest.raises(ValueError, match=msg):
            DynamicLossScaler(**kw)
    with pytest.raises(ValueError, match="> 0"):
        StaticLossScaler(0)


def test_state_dict_round_trip():
    a = DynamicLossScaler(init_scale=64, window=3)
    replay(a, [True, False, False])
    b = DynamicLossScaler(init_scale=64, window=3)
    b.load_state_dict(a.state_dict())
    flags = [False, True, True, False, False, False]
    assert scales(a, flags) == scales(b, flags)


def _mp_tiny(scaler, dtype="fp16", seed=0):
    model = TinyMLP((6, 9, 4), seed=seed)
    return MixedPrecision(model, lambda ps: torch.optim.Adam(ps, lr=1e-2), dtype, scaler)


def _backward(mp, seed):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 4, generator=g)
    loss = torch.nn.functional.mse_loss(mp.model(mp.cast_inputs(x)).float(), y)
    mp.backward(loss)


@pytest.mark.parametrize("dtype,bad", [("fp16", "inf"), ("fp16", "nan"), ("bf16", "nan")])
def test_injected_overflow_skips_step_and_keeps_all_state(dtype, bad):
    mp = _mp_tiny(DynamicLossScaler(init_scale=2.0 ** 10, window=100, hysteresis=2), dtype)
    for s in range(2):                                  # two clean steps: Adam has moments and a step count
        _backward(mp, s)
        assert mp.step()
    masters = [m.clone() for m in mp.masters]
    params = [p.detach().clone() for p in mp.params]
    state = copy.deepcopy(mp.optimizer.state_dict())
    for attempt, expected_scale in [(1, 2.0 ** 10), (2, 2.0 ** 9)]:   # hysteresis 2: keep, then halve
        _backward(mp, 10 + attempt)
        mp.params[-1].grad.view(-1)[0] = float(bad)
        assert mp.step() is False and mp.last.overflow
        assert mp.skipped == attempt and mp.scaler.scale == expected_scale
        assert all(torch.equal(a, b) for a, b in zip(masters, mp.masters))
        assert all(torch.equal(a, b) for a, b in zip(params, mp.params))
        after = mp.optimizer.state_dict()
        for k, st in state["state"].items():
            assert all(torch.equal(st[n], after["state"][k][n]) for n in st)
        assert all(p.grad is None for p in mp.params) and all(m.grad is None for m in mp.masters)
    _backward(mp, 99)                                   # and training goes on
    assert mp.step() and not all(torch.equal(a, b) for a, b in zip(masters, mp.masters))


def _overflow_sequence(steps=60, seed=3):
    """Gradient magnitudes 2^-3 .. 2^3: with a scale near 2^13..2^16, some steps overflow fp16, some don't."""
    rng = random.Random(seed)
    return [2.0 ** rng.randint(-3, 3) for _ in range(steps)]


def test_same_decisions_as_torch_gradscaler():
    window, init = 3, 2.0 ** 16
    mags = _overflow_sequence()
    lin = torch.nn.Linear(4, 1, bias=False)
    torch.nn.init.constant_(lin.weight, 0.25)
    ref = copy.deepcopy(lin)
    # torch: fp32 parameters, fp16 compute under autocast, GradScaler with the same constants
    gs = torch.amp.GradScaler("cpu", init_scale=init, growth_factor=2.0, backoff_factor=0.5, growth_interval=window)
    opt = torch.optim.SGD(ref.parameters(), lr=1e-3)
    # par: fp16 model, fp32 masters, DynamicLossScaler without hysteresis
    mp = MixedPrecision(lin, lambda ps: torch.optim.SGD(ps, lr=1e-3), "fp16",
                        DynamicLossScaler(init, window, hysteresis=1))
    torch_log, par_log = [], []
    for m in mags:
        x = torch.full((16, 4), m)
        with torch.autocast("cpu", dtype=torch.float16):
            out = ref(x)
        before = ref.weight.detach().clone()
        used = gs.get_scale()
        gs.scale(out.float().mean()).backward()
        gs.step(opt)
        gs.update()
        opt.zero_grad(set_to_none=True)
        torch_log.append((used, torch.equal(before, ref.weight)))

        mp.backward(mp.model(mp.cast_inputs(x)).float().mean())
        stepped = mp.step()
        par_log.append((mp.last.scale, not stepped))
    assert torch_log == par_log
    skipped = sum(s for _, s in par_log)
    assert 5 <= skipped <= len(mags) - 5, f"the sequence should mix skips and steps, got {skipped} skips"
    assert len({s for s, _ in par_log}) >= 3, "the scale should move both ways"
    # the same updates in the same fp32 arithmetic: the master equals torch's fp32 parameter exactly
    assert torch.equal(mp.masters[0], ref.weight.detach())
