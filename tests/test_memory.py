"""Memory accounting: known figures, parameter counts, measured bytes == formula, the CLI and the job."""
from __future__ import annotations

import subprocess
import sys

import pytest
from tiers import slow
import torch
import torch.nn as nn

import par.runtime.launch
from par.memory import accounting as memory
from par.model import PRESETS, GPTLite, build, lm_loss, preset
from par.reference import make_optimizer

GB = 1e9


# ---------------------------------------------------------------- known figures
def test_zero_paper_example_7_5b_on_64_gpus():
    totals = [r["total"] / GB for r in memory.zero_table(7.5e9, 64, "mixed", "adam")]
    assert [round(t, 1) for t in totals[:3]] == [120.0, 31.4, 16.6]
    assert round(totals[3], 2) == 1.88
    assert memory.bytes_per_param("mixed", "adam").K == 12


def test_bytes_per_param_table():
    b = memory.bytes_per_param
    assert (b("fp32", "adam").weights, b("fp32", "adam").grads, b("fp32", "adam").K) == (4, 4, 8)
    assert (b("mixed", "adam").weights, b("mixed", "adam").grads, b("mixed", "adam").K) == (2, 2, 12)
    assert b("fp32", "adam").total == b("mixed", "adam").total == 16
    assert [b("fp32", o).K for o in ("sgd", "momentum", "adam")] == [0, 4, 8]
    assert [b("mixed", o).K for o in ("sgd", "momentum", "adam")] == [4, 8, 12]
    assert [b("pure16", o).total for o in ("sgd", "momentum", "adam")] == [4, 8, 12]
    assert b("bf16", "adamw") == b("fp16", "adam") == b("mixed", "adam")
    assert sum(v for _, v in b("mixed", "adam").optimizer_parts) == 12
    assert len(memory.bytes_per_param_table()) == 9
    with pytest.raises(ValueError, match="fp8"):
        b("fp8", "adam")
    with pytest.raises(ValueError, match="lion"):
        b("fp32", "lion")


def test_7b_and_65b_examples():
    assert memory.model_state_bytes(7e9, precision="fp32", optimizer="adam").total == 112e9
    assert memory.model_state_bytes(7e9, precision="fp32", optimizer="adam").params == 28e9
    # 16-bit finetuning of 65B: 2 (weights) + 2 (grads) + 8 (fp32 Adam m, v) = 12 bytes/param
    assert memory.model_state_bytes(65e9, precision="pure16", optimizer="adam").total == 780e9
    assert memory.model_state_bytes(memory.param_count("llama-65b"), precision="pure16").total > 780e9


def test_llama_counts():
    assert memory.param_count("llama-7b") == 6_738_415_616
    assert memory.param_count("llama-13b") == 13_015_864_320
    assert memory.param_count("llama-65b") == 65_285_660_672


class _TinyLlama(nn.Module):
    """A LLaMA-shaped module, only to count its parameters."""

    def __init__(self, c: memory.LlamaConfig):
        super().__init__()
        d, kv = c.d_model, (c.n_kv_heads or c.n_heads) * (c.d_model // c.n_heads)
        self.emb = nn.Embedding(c.vocab_size, d)
        self.layers = nn.ModuleList(nn.ModuleDict({
            "q": nn.Linear(d, d, bias=False), "k": nn.Linear(d, kv, bias=False),
            "v": nn.Linear(d, kv, bias=False), "o": nn.Linear(d, d, bias=False),
            "gate": nn.Linear(d, c.ffn_hidden, bias=False), "up": nn.Linear(d, c.ffn_hidden, bias=False),
            "down": nn.Linear(c.ffn_hidden, d, bias=False),
            "n1": nn.RMSNorm(d), "n2": nn.RMSNorm(d)}) for _ in range(c.n_layers))
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, c.vocab_size, bias=False)
        if c.tie_embeddings:
            self.head.weight = self.emb.weight


@pytest.mark.parametrize("cfg", [memory.LlamaConfig(101, 48, 3, 6, 130),
                                 memory.LlamaConfig(101, 48, 2, 6, 130, n_kv_heads=2),
                                 memory.LlamaConfig(77, 32, 2, 4, 96, tie_embeddings=True)])
def test_llama_count_equals_a_real_module(cfg):
    assert memory.param_count(cfg) == sum(p.numel() for p in _TinyLlama(cfg).parameters())


@pytest.mark.parametrize("name", list(PRESETS))
@pytest.mark.parametrize("tie", [False, True])
def test_gpt_count_equals_numel(name, tie):
    cfg = preset(name, tie_embeddings=tie)
    if name == "gpt3-small":
        with torch.device("meta"):  # counted without allocating 650 MB
            model = GPTLite(cfg)
    else:
        model = build(cfg)
    assert memory.param_count(cfg) == sum(p.numel() for p in model.parameters())
    assert memory.param_count(name) == memory.param_count(preset(name))


def test_gpt_count_with_custom_ffn():
    cfg = preset("tiny", d_ff=50, n_layer=3)
    assert memory.param_count(cfg) == sum(p.numel() for p in build(cfg).parameters())


# ---------------------------------------------------------------- ZeRO per rank
@pytest.mark.parametrize("precision,w,g,k", [("mixed", 2, 2, 12), ("fp32", 4, 4, 8)])
@pytest.mark.parametrize("psi,nd", [(7.5e9, 64), (1001, 3), (56064, 4)])
def test_zero_stage_formulas(precision, w, g, k, psi, nd):
    m = lambda s: memory.model_state_bytes(psi, nd, s, precision, "adam")
    assert m(0).total == pytest.approx((w + g + k) * psi)
    assert m(1).total == pytest.approx(w * psi + g * psi + k * psi / nd)
    assert m(2).total == pytest.approx(w * psi + (g + k) * psi / nd)
    assert m(3).total == pytest.approx((w + g + k) * psi / nd)
    assert (m(2).params, m(2).grads, m(2).optimizer) == pytest.approx((w * psi, g * psi / nd, k * psi / nd))


def test_zero_padded_and_errors():
    m = memory.model_state_bytes(1001, 4, 3, "fp32", "adam", padded=True)
    assert (m.params, m.grads, m.optimizer) == (4 * 251, 4 * 251, 8 * 251)
    assert memory.model_state_bytes(1001, 4, 1, "fp32", "sgd").optimizer == 0
    with pytest.raises(ValueError, match="stage"):
        memory.model_state_bytes(10, 2, 4)
    with pytest.raises(ValueError, match="data-parallel"):
        memory.model_state_bytes(10, 0, 1)


def test_table_text_and_calculator():
    text = memory.format_table(memory.zero_table(7.5e9, 64))
    for s in ("120.00 GB", "31.41 GB", "16.64 GB", "1.88 GB"):
        assert s in text
    line = memory.calculator(7.5e9, 64, "bf16", "adam", 1)
    assert "31.41 GB" in line and "2+2+12 = 16" in line
    assert "1.88 GB" in memory.calculator(7.5e9, 64, "mixed", "adam", 3)
    assert memory.parse_count("7.5B") == 7.5e9 and memory.parse_count("350M") == 350e6
    assert memory.format_bytes(512) == "512 B" and memory.format_bytes(None) == "n/a"


def test_cli(capsys):
    assert memory.main(["--params", "7.5e9", "--dp", "64"]) == 0
    out = capsys.readouterr().out
    assert "31.41 GB" in out and "1.88 GB" in out
    assert memory.main(["--model", "llama-7b", "--precision", "fp32"]) == 0
    assert "6,738,415,616" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        memory.main(["--params", "1e9", "--precision", "fp8"])
    assert "fp8" in capsys.readouterr().err


def test_cli_through_python_m_par():
    r = subprocess.run([sys.executable, "-m", "par", "memory", "--preset", "gpt3-small", "--dp", "4"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"{memory.param_count('gpt3-small'):,}" in r.stdout and "stage 3" in r.stdout


# ---------------------------------------------------------------- activations
def test_activation_formula():
    s, b, h, a = 2048, 4, 768, 12
    f = lambda **kw: memory.activation_bytes_per_layer(**{"seq": s, "batch": b, "d_model": h, "n_heads": a, **kw})
    assert f() == s * b * h * (34 + 5 * a * s / h)
    assert f(recompute="full") == 2 * s * b * h
    assert f(recompute="full") < f() / 50
    assert f(batch=3 * b) == 3 * f()                            # linear in b
    g = lambda seq: f(seq=seq)                                  # αs + βs²: second difference 2βΔ² > 0
    assert g(3 * 512) - 2 * g(2 * 512) + g(512) == 2 * (5 * a * b) * 512 ** 2
    assert f(bytes_per_value=4, dropout=False) == 2 * f(dropout=False)
    assert f(dropout=False) == 2 * (16 * s * b * h + a * s * s * b)
    assert memory.activation_bytes("gpt3-small", batch=b) == 12 * f()
    with pytest.raises(ValueError, match="recompute"):
        f(recompute="some")


@pytest.mark.parametrize("seq", [8, 32])
def test_saved_activations_of_a_gpt_block_match_formula(seq):
    """fp32 GPT-lite block, no dropout: e·(16sbh + as²b) plus LayerNorm statistics and the causal mask."""
    from torch.utils.checkpoint import checkpoint
    cfg = preset("tiny")
    block, batch = build(cfg).blocks[0], 4
    x = torch.randn(batch, seq, cfg.d_model, requires_grad=True)
    formula = memory.activation_bytes_per_layer(seq, batch, cfg.d_model, cfg.n_head, bytes_per_value=4,
                                                dropout=False)
    out, measured = memory.saved_activation_bytes(block, x, exclude=list(block.parameters()))
    assert formula <= measured <= 1.02 * formula
    _, with_params = memory.saved_activation_bytes(block, x)
    assert with_params > measured  # weights are saved too, and excluded above
    out, kept = memory.saved_activation_bytes(lambda t: checkpoint(block, t, use_reentrant=False), x,
                                              exclude=list(block.parameters()))
    assert kept == memory.activation_bytes_per_layer(seq, batch, cfg.d_model, cfg.n_head, "full",
                                                     bytes_per_value=4)
    out.sum().backward()  # the graph still works after measuring
    assert x.grad is not None


# ---------------------------------------------------------------- measurement
def _one_step(model, optimizer: str):
    opt = make_optimizer(model.parameters(), optimizer, lr=1e-3)
    x = torch.randint(65, (2, 16))
    lm_loss(model(x), x).backward()
    opt.step()
    return opt


@pytest.mark.parametrize("optimizer", ["adam", "momentum", "sgd", "adamw"])
@pytest.mark.parametrize("tie", [False, True])
def test_live_bytes_after_a_real_step_equal_formula(optimizer, tie):
    model = build(preset("tiny", tie_embeddings=tie))
    opt = _one_step(model, optimizer)
    numel = memory.param_count(model.cfg)
    measured = memory.live_model_state_bytes(model, opt)
    assert measured == memory.model_state_bytes(numel, precision="fp32", optimizer=optimizer)
    if optimizer.startswith("adam"):  # the step counters are 4 bytes per parameter tensor, kept apart
        n_tensors = len(list(model.parameters()))
        assert memory.live_model_state_bytes(model, opt, include_scalars=True).optimizer == \
            measured.optimizer + 4 * n_tensors


def test_live_bytes_counts_each_storage_once():
    flat = torch.zeros(100)
    a, b = flat[:60].view(6, 10), flat[60:]
    assert memory.tensor_bytes([a, b, flat]) == 400
    assert memory.tensor_bytes([torch.zeros(3, dtype=torch.float16), None]) == 6
    model = nn.Linear(4, 3)
    assert memory.live_model_state_bytes(model) == memory.ModelStateBytes(60, 0, 0)


def test_live_bytes_mixed_precision_masters():
    """16-bit model + an optimizer over fp32 master copies: 2 + 2 + 12 bytes per parameter."""
    model = build("tiny").to(torch.bfloat16)
    masters = [p.detach().float().requires_grad_() for p in model.parameters()]
    opt = torch.optim.Adam(masters, lr=1e-3)
    x = torch.randint(65, (2, 16))
    lm_loss(model(x).float(), x).backward()
    for m, p in zip(masters, model.parameters()):
        m.grad = p.grad.float()
    opt.step()
    for m in masters:  # the fp32 gradient copy is transient
        m.grad = None
    numel = memory.param_count(model.cfg)
    assert memory.live_model_state_bytes(model, opt) == memory.model_state_bytes(numel, precision="bf16")


def test_cuda_peak_is_none_on_cpu():
    assert memory.cuda_peak_bytes("cpu") is None
    memory.reset_cuda_peak("cpu")
    if not torch.cuda.is_available():
        assert memory.cuda_peak_bytes() is None


# ---------------------------------------------------------------- the launched job
@slow
def test_job_on_two_ranks_predicted_equals_measured():
    r = par.runtime.launch.run("par.memory.job", nproc=2, timeout=180, quiet=True,
                               args=["--optimizers", "adam,momentum,sgd", "--precisions", "fp32,bf16", "--steps", "3"])
    assert r["world_size"] == 2 and r["numel"] == memory.param_count("tiny")
    psi = r["numel"]
    for precision in ("fp32", "bf16"):
        for name, bpp in (("adam", 16), ("momentum", 12), ("sgd", 8)):
            run = r["runs"][f"{precision} {name}"]
            assert run["predicted"]["total"] == bpp * psi
            assert len(run["measured"]) == 2
            assert all(m == run["predicted"] for m in run["measured"]), (precision, name, run)
            assert run["totals_per_step"] == [[bpp * psi] * 3] * 2  # constant from the first step on
    w = {"fp32": 4, "bf16": 2}
    for precision in w:
        phases = r["runs"][f"{precision} adam"]["phases"][1]
        assert phases["built"]["grads"] == 0 and phases["built"]["params"] == w[precision] * psi
        assert phases["backward"]["grads"] == w[precision] * psi
    assert r["runs"]["bf16 adam"]["phases"][0]["built"]["optimizer"] == 4 * psi  # the fp32 masters
    # 16-bit activations: about half the bytes (the fp32 copy of the logits for the loss is the rest)
    fp32, bf16 = r["runs"]["fp32 adam"]["activation_bytes"][0], r["runs"]["bf16 adam"]["activation_bytes"][0]
    assert 0.45 * fp32 < bf16 < 0.6 * fp32


def test_memory_bars_draws_one_stack_per_stage():
    import matplotlib
    matplotlib.use("Agg")
    from par.course.plots import memory_bars
    rows = memory.zero_table(7.5e9, 64)
    ax = memory_bars(rows)
    assert len(ax.patches) == 3 * len(rows)
    tops = sorted(float(t.get_text()) for t in ax.texts)
    assert tops == sorted(float(f"{r['total'] / 1e9:.3g}") for r in rows)


# ---------------------------------------------------------------- peaks: recomputation, mixed precision, offload
def test_full_recomputation_peak_keeps_one_layer_rebuilt():
    s, b, h, a, L = 2048, 1, 768, 12, 12
    full = memory.activation_bytes_per_layer(s, b, h, a)
    kept = memory.activation_bytes_per_layer(s, b, h, a, "full")
    assert memory.activation_peak_bytes(s, b, h, a, L) == L * full
    assert memory.activation_peak_bytes(s, b, h, a, L, "full") == L * kept + full      # not L · 2sbh alone
    assert memory.activation_peak_bytes(s, b, h, a, L, "full", in_flight=3) == 3 * L * kept + full
    assert memory.activation_bytes("gpt3-small", batch=b, seq=s, recompute="full") == L * 2 * s * b * h + full
    assert memory.activation_bytes("gpt3-small", batch=b, seq=s) == L * full
    assert memory.activation_peak_bytes(s, b, h, a, 0, "full") == 0


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_tensor_parallel_activations_follow_korthikanti(t):
    s, b, h, a = 2048, 2, 1024, 16
    got = memory.activation_bytes_per_layer(s, b, h, a, tp=t)
    assert got == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)) if t > 1 else s * b * h * (34 + 5 * a * s / h))
    assert memory.activation_bytes_per_layer(s, b, h, a, "full", tp=t) == 2 * s * b * h              # replicated
    assert memory.activation_bytes_per_layer(s, b, h, a, "full", tp=t, partitioned=True) == 2 * s * b * h / t
    with pytest.raises(ValueError, match="tensor-parallel degree"):
        memory.activation_bytes_per_layer(s, b, h, a, tp=0)


def test_fp32_gradients_raise_the_mixed_precision_peak_only_when_activations_are_small():
    psi = 1e9
    small = memory.mixed_precision_peak_bytes(psi, activations=1e9)      # A < 4Ψ: the update is the peak
    assert small["fp32_grads_raise_peak"] and small["peak"] == 18 * psi
    assert small["peak_without_fp32_grads"] == 16 * psi                   # backward's end: 2 + 12 + 2
    edge = memory.mixed_precision_peak_bytes(psi, activations=4 * psi)   # A = 4Ψ: the forward's end ties it
    assert not edge["fp32_grads_raise_peak"] and edge["peak"] == 18 * psi
    large = memory.mixed_precision_peak_bytes(psi, activations=20 * psi)
    assert not large["fp32_grads_raise_peak"] and large["peak"] == 34 * psi
    g3 = memory.param_count("gpt3-small")
    assert not memory.mixed_precision_peak_bytes(g3, memory.activation_bytes("gpt3-small", 8, 2048))["fp32_grads_raise_peak"]
    l7 = memory.param_count("llama-7b")
    assert memory.mixed_precision_peak_bytes(l7, memory.activation_bytes("llama-7b", 1, 2048, recompute="full"))[
        "fp32_grads_raise_peak"]
    assert memory.mixed_precision_peak_bytes(psi, 0, "sgd")["update"] == (2 + 4 + 4) * psi


def test_offload_transfers_over_pcie():
    from par.zero import offload
    moved = offload.transfer_bytes_per_step(1001, 4, 2, 2)
    assert moved == {"to_host": 251 * 2, "to_device": 251 * 2}
    t = offload.transfer_seconds(1001, 4, 2, 2, bandwidth=1e3)
    assert t == {"to_host": 0.502, "to_device": 0.502, "total": 1.004}
    assert offload.transfer_seconds(8e9, 8)["total"] == pytest.approx(2 * 4e9 / offload.PCIE_BYTES_PER_S)


def test_free_device_memory_is_harmless_on_the_cpu():
    memory.free_device_memory()
