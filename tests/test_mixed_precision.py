"""Mixed precision: formats, the eight steps, fp16/bf16 training tracks fp32, underflow without scaling,
memory (16 bytes/param of model states, half the activations), and the global overflow decision on 2-3 ranks."""
import math
from pathlib import Path

import pytest
from tiers import slow, tiered_one
import torch

import par.runtime.launch
from par.comm import collectives
from par.precision import formats
from par.memory import accounting as memory
from par.data import CharDataset, global_batches
from par.precision.loss_scaler import DynamicLossScaler, StaticLossScaler
from par.memory.accounting import saved_activation_bytes
from par.precision.mixed_precision import MixedPrecision, UnsupportedPrecision, check_supported, warmup_cosine_lr
from par.model import TinyMLP, build, lm_loss
from par.reference import make_optimizer

WORKER = Path(__file__).parent / "workers" / "mp_global.py"


@pytest.fixture(autouse=True)
def one_thread():
    """The CPU is shared by many processes: one thread each is faster and steadier than oversubscribing."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------- formats
def test_formats_agree_with_torch_finfo():
    for name, f in formats.FORMATS.items():
        fi = torch.finfo(f.dtype)
        assert (f.bits, f.max_normal, f.min_normal, f.eps) == (fi.bits, fi.max, fi.smallest_normal, fi.eps), name
        assert f.min_subnormal == fi.smallest_normal * fi.eps
    fp16 = formats.get("fp16")
    assert (fp16.max_normal, fp16.min_normal, fp16.min_subnormal) == (65504.0, 2.0 ** -14, 2.0 ** -24)
    assert formats.get("bf16").decades > 75 > formats.get("fp16").decades > 12
    with pytest.raises(ValueError, match="fp8"):
        formats.get("fp8")


def test_bit_fields_decode_to_the_stored_value():
    values = [1.0, -2.5, 0.1, 1 / 3, 65504.0, 1e5, 2.0 ** -14, 3 * 2.0 ** -24, 2.0 ** -130, 1e-8, 0.0, math.inf]
    for name, f in formats.FORMATS.items():
        for v in values:
            s, e, m = formats.bit_fields(v, name)
            assert (len(s), len(e), len(m)) == (1, f.exponent_bits, f.mantissa_bits)
            assert formats.decode(s, e, m, name) == formats.round_to(v, name).item(), (name, v)
    assert formats.bit_fields(1.0, "fp16") == ("0", "01111", "0000000000")
    assert formats.bit_fields(-2.0, "bf16") == ("1", "10000000", "0000000")
    assert formats.bit_fields(2.0 ** -24, "fp16") == ("0", "00000", "0000000001")


def _next_up(x: float, name: str) -> float:
    """The next representable value above x > 0: add one to the stored bit pattern."""
    f = formats.get(name)
    as_int = {32: torch.int32, 16: torch.int16}[f.bits]
    t = torch.tensor([x], dtype=f.dtype).view(as_int) + 1
    return t.view(f.dtype).float().item()


def test_spacing_is_the_gap_to_the_next_value():
    for name in formats.FORMATS:
        for v in [1.0, 3.0, 1000.0, 0.001, 2.0 ** -14, 2.0 ** -20]:
            x = formats.round_to(v, name).item()
            assert formats.spacing(x, name) == _next_up(x, name) - x, (name, v)


def test_flush_and_overflow_fractions():
    x = torch.tensor([1e-9, 1e-8, 1e-4, 1.0, 7e4, 0.0])
    assert formats.flush_fraction(x, "fp16") == pytest.approx(2 / 5)     # 1e-9 and 1e-8 < 2^-25
    assert formats.flush_fraction(x, "bf16") == 0.0
    assert formats.overflow_fraction(x, "fp16") == pytest.approx(1 / 6)  # 7e4 > 65504
    assert formats.overflow_fraction(x, "bf16") == 0.0
    assert formats.relative_error(torch.tensor([1e-9]), "fp16").item() == 1.0


# ---------------------------------------------------------------- the eight steps
def test_masters_are_the_exact_fp32_weights_and_the_model_is_16_bit():
    ref = build("tiny", seed=2)
    model = build("tiny", seed=2)
    mp = MixedPrecision(model, lambda ps: make_optimizer(ps, "adam", 1e-3), "fp16")
    assert all(m.dtype == torch.float32 for m in mp.masters) and all(p.dtype == torch.float16 for p in model.parameters())
    assert all(torch.equal(m, r) for m, r in zip(mp.masters, ref.parameters()))
    assert all(torch.equal(p, m.half()) for p, m in zip(mp.params, mp.masters))
    assert mp.optimizer.param_groups[0]["params"][0] is mp.masters[0]
    assert isinstance(mp.scaler, DynamicLossScaler) and mp.scaler.scale == 2 ** 16


def test_eight_steps_by_hand_give_the_fp32_gradient():
    data = CharDataset(block_size=32)
    x, y = next(global_batches(data, 8, 1, seed=1))
    ref = build("tiny", seed=0)
    lm_loss(ref(x), y).backward()
    mp = MixedPrecision(build("tiny", seed=0), lambda ps: torch.optim.SGD(ps, lr=0.1), "fp16")
    mp.master_to_model()                                          # 1
    loss = lm_loss(mp.model(x).float(), y)                        # 2
    assert loss.dtype == torch.float32
    mp.scaled_loss(loss).backward()                               # 3-4
    assert all(p.grad.dtype == torch.float16 for p in mp.params)
    mp.grads_to_master()                                          # 5
    assert all(p.grad is None for p in mp.params) and all(m.grad.dtype == torch.float32 for m in mp.masters)
    mp.unscale_()                                                 # 6
    g16 = torch.cat([m.grad.flatten() for m in mp.masters])
    g32 = torch.cat([p.grad.flatten() for p in ref.parameters()])
    assert ((g16 - g32).norm() / g32.norm()).item() < 5e-3        # fp16 rounding, not a factor of S
    assert not mp.found_overflow()
    before = [m.clone() for m in mp.masters]
    mp.optimizer.step()                                           # 7
    mp.master_to_model()                                          # 8
    assert all(torch.equal(m, torch.add(b, m.grad, alpha=-0.1)) for m, b in zip(mp.masters, before))
    assert all(torch.equal(p, m.half()) for p, m in zip(mp.params, mp.masters))


def _train(dtype: str, steps: int = 20, batch: int = 16, lr: float = 3e-3):
    data = CharDataset(block_size=32)
    model = build("tiny", seed=0)
    make = lambda ps: make_optimizer(ps, "adam", lr)
    mp = MixedPrecision(model, make, dtype) if dtype != "fp32" else None
    opt = make(model.parameters()) if mp is None else None
    losses, max_logit = [], 0.0
    for x, y in global_batches(data, batch, steps, seed=0):
        logits = model(x).float()
        max_logit = max(max_logit, logits.abs().max().item())
        loss = lm_loss(logits, y)
        losses.append(loss.item())
        if mp is None:
            loss.backward()
            opt.step()
            opt.zero_grad()
        else:
            mp.backward(loss)
            mp.step()
    return losses, max_logit, mp


def test_fp16_and_bf16_training_track_fp32():
    """Tolerance: the cross-entropy of one token moves by at most 2·max|z|·u when every logit z carries a
    relative rounding error u (the gradient softmax - onehot has L1 norm <= 2), u = eps/2 of the 16-bit
    format. That is what 16-bit compute may cost at identical weights; we allow it at every step."""
    ref, max_logit, _ = _train("fp32")
    assert ref[0] - ref[-1] > 0.5, "the reference must really train"
    for dtype in ("fp16", "bf16"):
        losses, _, mp = _train(dtype)
        tol = 2 * max_logit * formats.get(dtype).eps / 2
        worst = max(abs(a - b) for a, b in zip(losses, ref))
        assert worst <= tol, f"{dtype}: loss differs from fp32 by {worst:.2e} > {tol:.2e}"
        assert losses[0] != ref[0] or dtype == "fp16"   # bf16 rounds visibly already at step 0
        assert mp.skipped == 0 and mp.scaler.scale == (2 ** 16 if dtype == "fp16" else 1.0)
    assert tol < 0.1


def test_fp16_without_loss_scaling_flushes_gradients_to_zero():
    """A 131k-token batch as 256 accumulated micro-batches of 512 tokens: each backward sees loss/256, so
    per-token gradients are tiny. fp16 unscaled flushes many of them to 0; a scale of 2^16 saves them."""
    data = CharDataset(block_size=32)
    x, y = next(global_batches(data, 16, 1, seed=99))
    accum = 256
    ref = build("tiny", seed=0)
    (lm_loss(ref(x), y) / accum).backward()
    g32 = torch.cat([p.grad.flatten() for p in ref.parameters()])
    result = {}
    for name, scaler in (("unscaled", StaticLossScaler(1.0)), ("scaled", StaticLossScaler(2.0 ** 16))):
        mp = MixedPrecision(build("tiny", seed=0), lambda ps: torch.optim.SGD(ps, lr=0.1), "fp16", scaler)
        mp.backward(lm_loss(mp.model(x).float(), y) / accum)
        mp.grads_to_master()
        mp.unscale_()
        assert not mp.found_overflow()
        g16 = torch.cat([m.grad.flatten() for m in mp.masters])
        flushed = ((g16 == 0) & (g32 != 0)).float().mean().item()
        result[name] = (flushed, ((g16 - g32).norm() / g32.norm()).item())
    (flush_u, err_u), (flush_s, err_s) = result["unscaled"], result["scaled"]
    assert flush_u > 0.05 and err_u > 0.05, result      # measured: ~15% of elements flushed, ~20% error
    assert flush_s < 1e-3 and err_s < 5e-3, result      # measured: ~0.01% flushed, ~0.05% error
    assert formats.flush_fraction(g32, "fp16") > 0.05 > formats.flush_fraction(g32 * 2 ** 16, "fp16")


# ---------------------------------------------------------------- memory
def test_model_states_cost_16_bytes_per_parameter_with_adam():
    data = CharDataset(block_size=32)
    model = build("tiny", seed=0)
    numel = sum(p.numel() for p in model.parameters())
    mp = MixedPrecision(model, lambda ps: make_optimizer(ps, "adam", 1e-3), "fp16")
    for i, (x, y) in enumerate(global_batches(data, 4, 2, seed=0)):
        mp.backward(lm_loss(model(x).float(), y))
        if i == 0:
            mp.step()
    # after a backward, once Adam has its moments: 2 + 2 + (4 + 4 + 4) bytes per parameter
    formula = memory.bytes_per_param("mixed", "adam")
    assert (formula.weights, formula.grads, formula.K, formula.total) == (2, 2, 12, 16)
    measured = memory.live_model_state_bytes(model, mp.optimizer)
    assert (measured.params, measured.grads, measured.optimizer) == (2 * numel, 2 * numel, 12 * numel)
    assert measured.total == formula.total * numel == memory.model_state_bytes(numel, precision="mixed").total
    kinds = mp.model_state_bytes()
    assert kinds == {"fp16 weights": 2 * numel, "fp16 grads": 2 * numel, "fp32 master weights": 4 * numel,
                     "fp32 master grads": 0, "fp32 momentum": 4 * numel, "fp32 variance": 4 * numel}


def test_activation_memory_halves_in_16_bit():
    data = CharDataset(block_size=32)
    x, y = next(global_batches(data, 8, 1, seed=0))
    saved = {}
    for dtype in ("fp32", "fp16", "bf16"):
        model = build("tiny", seed=0)
        if dtype != "fp32":
            model = MixedPrecision(model, lambda ps: torch.optim.SGD(ps, lr=0.1), dtype).model
        _, saved[dtype] = saved_activation_bytes(lambda: lm_loss(model(x).float(), y), exclude=list(model.parameters()))
    ratio = saved["fp16"] / saved["fp32"]
    # not exactly 1/2: token ids (int64), the boolean causal masks and the fp32 logits copy for the loss stay
    assert 0.45 < ratio < 0.6, saved
    assert saved["bf16"] == saved["fp16"]


# ---------------------------------------------------------------- clipping, schedule, errors
def test_clip_matches_torch_and_lr_schedule():
    torch.manual_seed(0)
    mp = MixedPrecision(TinyMLP(seed=3), lambda ps: torch.optim.SGD(ps, lr=0.1), "fp16", StaticLossScaler(8.0))
    mp.backward(mp.model(mp.cast_inputs(torch.randn(16, 10))).float().pow(2).sum())
    mp.grads_to_master()
    mp.unscale_()
    grads = [m.grad.clone() for m in mp.masters]
    copies = [torch.zeros_like(m) for m in mp.masters]
    for c, g in zip(copies, grads):
        c.grad = g.clone()
    expected = torch.nn.utils.clip_grad_norm_(copies, 0.5).item()
    norm = mp.clip_(0.5)
    assert norm == pytest.approx(expected, rel=1e-6) and norm > 0.5
    assert mp.grad_norm() == pytest.approx(0.5, rel=1e-4)
    assert all(torch.allclose(m.grad, c.grad, rtol=1e-5, atol=0) for m, c in zip(mp.masters, copies))
    lrs = [warmup_cosine_lr(s, 1.0, warmup=4, total=12) for s in range(12)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0] and lrs[4] == 1.0
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:])) and lrs[-1] == pytest.approx(0.5 * (1 + math.cos(math.pi * 7 / 8)))


def test_bad_input_is_one_clear_error():
    with pytest.raises(ValueError, match="'fp8'.*fp16.*bf16"):
        MixedPrecision(TinyMLP(), lambda ps: torch.optim.SGD(ps, lr=0.1), "fp8")
    with pytest.raises(ValueError, match="fp32"):
        MixedPrecision(TinyMLP().half(), lambda ps: torch.optim.SGD(ps, lr=0.1), "fp16")
    check_supported("bf16", "cpu")   # torch 2.13 computes bf16 (and fp16) matmuls on the CPU
    check_supported("fp16", "cpu")
    assert issubclass(UnsupportedPrecision, RuntimeError)


# ---------------------------------------------------------------- several ranks
_RESULTS: dict = {}


@pytest.fixture(params=tiered_one(((2, False), (3, False), (3, True)), lambda r: f"n{r[0]}" + ("-nccl-emulation" if r[1] else "")))
def ranks(request):
    n, emulated = request.param
    if request.param not in _RESULTS:   # emulated: batch_isend_irecv as under NCCL (one Work, data valid after wait)
        _RESULTS[request.param] = par.runtime.launch.run(str(WORKER), nproc=n, timeout=400, quiet=True,
                                                         env={"PAR_NCCL_EMULATION": "1"} if emulated else None)
    return n, _RESULTS[request.param]


@pytest.mark.parametrize("case", ["overflow fp16", "overflow bf16"])
def test_overflow_on_one_rank_makes_every_rank_skip(ranks, case):
    n, res = ranks
    inject = res["inject"]
    per_rank = [r[case] for r in res["ranks"]]
    for rank, r in enumerate(per_rank):
        mine = [s for i, s in enumerate(inject) if i % n == rank]
        assert [i for i, f in enumerate(r["local"]) if f] == mine          # only the injecting rank saw it
        assert [i for i, s in enumerate(r["skipped"]) if s] == inject      # ... but every rank skipped
    assert len({tuple(r["scales"]) for r in per_rank}) == 1
    assert len({r["hash"] for r in per_rank}) == 1
    if case == "overflow fp16":   # hysteresis 2: forgive step 2, then halve at 5, 6 and 9 (never 4 clean in a row)
        assert per_rank[0]["scales"] == [1024.0] * 6 + [512.0] + [256.0] * 3 + [128.0] * 2


def test_data_parallel_hook_averages_16_bit_gradients(ranks):
    n, res = ranks
    per_rank = [r["dp"] for r in res["ranks"]]
    assert len({r["hash"] for r in per_rank}) == 1, "replicas must stay identical"
    for rank, r in enumerate(per_rank):
        assert r["skipped"] == 0
        assert r["sent"] == r["expected"] and r["sent"][0] > 0        # fp16 all-reduce: 2 bytes per element
        # DP averages fp16 gradients of shards, the reference takes the fp16 gradient of the whole batch:
        # the same step up to 16-bit rounding (a sum instead of an average would double the step)
        assert r["diff"] < 0.02 * r["update"], r


@slow
def test_training_job_reports_skips_memory_and_16_bit_traffic():
    """par.precision.job on 2 ranks: inf injected on rank 1 only, 16-bit DP all-reduce, memory = formula."""
    res = par.runtime.launch.run("par.precision.job", nproc=2, timeout=400, quiet=True, args=[
        "--dtype", "fp32,fp16,bf16", "--steps", 4, "--batch", 4, "--init-scale", 2 ** 12, "--window", 2,
        "--inject", "1,2", "--inject-rank", 1, "--max-grad-norm", 1.0, "--warmup", 2])
    runs = {r["dtype"]: r for r in res["runs"]}
    numel = runs["fp32"]["numel"]
    grad_bytes = sum(collectives.ring_all_reduce_bytes(p.numel(), 2, 0, 4) for p in build("tiny").parameters())
    assert runs["fp32"]["skipped"] == [False] * 4                  # fp32 has no overflow check: no injection
    assert runs["fp32"]["grad_bytes"] == [grad_bytes] * 4
    for d in ("fp16", "bf16"):
        r = runs[d]
        assert r["skipped"] == [False, True, True, False] and r["same_skips_on_all_ranks"] and r["replicas_identical"]
        assert r["grad_bytes"] == [grad_bytes // 2] * 4             # 16-bit gradients: half the bytes
        assert r["memory"]["measured"] == r["memory"]["predicted"] and r["memory"]["measured"]["total"] == 16 * numel
        assert 0.45 < r["activation_bytes"] / runs["fp32"]["activation_bytes"] < 0.6
        assert r["grad_norm"][1] is None and r["grad_norm"][0] > 0
    assert runs["fp16"]["scale"] == [4096.0] * 3 + [2048.0]    # hysteresis 2: forgive step 1, halve after step 2
    assert runs["bf16"]["scale"] == [1.0] * 4
    assert runs["fp16"]["lr"][:2] == [1.5e-3, 3e-3]


def test_composes_with_the_naive_data_parallel_wrapper(ranks):
    n, res = ranks
    per_rank = [r["naive wrapper"] for r in res["ranks"]]
    assert len({r["start"] for r in per_rank}) == 1, "NaiveDP broadcast rank 0's weights before the masters were taken"
    assert len({r["hash"] for r in per_rank}) == 1 and per_rank[0]["hash"] != per_rank[0]["start"]
    assert all(r["dtype"] == "torch.float16" and r["skipped"] == 0 for r in per_rank)


def test_bf16_support_ignores_emulation(monkeypatch):
    """A pre-Ampere GPU emulates bf16: torch.cuda.is_bf16_supported() says True unless emulation is excluded."""
    from par.precision import mixed_precision
    assert mixed_precision.bf16_supported("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert not mixed_precision.bf16_supported("cuda")
    with pytest.raises(UnsupportedPrecision, match="Ampere .* sm_75"):
        check_supported("bf16", "cuda")


def test_step_six_is_one_set_of_functions():
    """ZeRO and MixedPrecision run the same unscale / overflow / norm / clip (par.precision.mixed_precision), and the
    default scaler is chosen in one place (par.precision.loss_scaler.default_scaler)."""
    import inspect

    from par.precision import loss_scaler, mixed_precision
    from par.zero import engine as zero
    g = [torch.tensor([3.0, 4.0]), torch.tensor([0.0])]
    mixed_precision.unscale_(g, 2.0)
    assert torch.equal(g[0], torch.tensor([1.5, 2.0]))
    assert mixed_precision.grad_norm(g) == 2.5
    assert mixed_precision.clip_(g, 1.0, 2.5) == 2.5 and abs(mixed_precision.grad_norm(g) - 1.0) < 1e-5
    assert not mixed_precision.found_overflow(g) and mixed_precision.found_overflow([torch.tensor([float("nan")])])
    assert isinstance(loss_scaler.default_scaler("fp16"), DynamicLossScaler)
    assert loss_scaler.default_scaler("bf16").scale == 1.0 and loss_scaler.default_scaler("fp32") is None
    source = inspect.getsource(zero)
    assert "isfinite" not in source and "DynamicLossScaler" not in source and ".pow(2)" not in source
    assert "import zero" not in inspect.getsource(__import__("par.zero.updaters", fromlist=["x"]))
