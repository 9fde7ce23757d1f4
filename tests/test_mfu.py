"""par.mfu: the FLOPs per token against a hand count for gpt3-small, and the peak table's SKUs."""
from __future__ import annotations

import pytest

from par import mfu
from par.memory.accounting import param_count
from par.model import preset
from par.train import planner


def test_gpt3_small_flops_per_token_by_hand():
    cfg = preset("gpt3-small")                       # L 12, d 768, f 3072, V 50257, s 2048, head not tied
    L, d, f, V, s = 12, 768, 3072, 50257, 2048
    assert (cfg.n_layer, cfg.d_model, cfg.ffn, cfg.vocab_size, cfg.block_size) == (L, d, f, V, s)
    blocks = L * (4 * d * d + 2 * d * f)             # q, k, v, out + MLP in, MLP out: 84,934,656
    head = d * V                                     # 38,597,376
    assert mfu.matmul_params(cfg) == blocks + head == 123_532_032
    embeddings = V * d + s * d                       # lookups: 40,170,240 of Ψ = 163,823,616
    assert param_count(cfg) - embeddings - mfu.matmul_params(cfg) == L * (9 * d + f) + 2 * d   # biases, norms
    attention = 12 * L * s * d                       # QKᵀ and ·V, forward and backward: 226,492,416
    assert mfu.flops_per_token(cfg) == 6 * (blocks + head) + attention == 967_684_608
    assert round(mfu.flops_per_token(cfg) / 1e9, 2) == 0.97
    assert round((6 * param_count(cfg) + attention) / 1e9, 2) == 1.21, "the old count: 6Ψ, embeddings included"


def test_a_tied_head_is_still_a_matmul_and_a_shorter_sequence_has_less_attention():
    cfg = preset("gpt3-small")
    assert mfu.matmul_params(preset("gpt3-small", tie_embeddings=True)) == mfu.matmul_params(cfg)
    assert mfu.flops_per_token(cfg) - mfu.flops_per_token(cfg, seq=1024) == 12 * 12 * 1024 * 768


def test_the_planner_counts_the_same_flops():
    cfg = preset("gpt3-small")
    w = planner.Workload(cfg, 8)
    assert planner.step_flops(w) == mfu.flops_per_token(cfg) * 8 * 2048
    assert planner.step_flops(planner.Workload(cfg, 8, recompute="full")) == pytest.approx(
        planner.step_flops(w) * 4 / 3)


@pytest.mark.parametrize("name, sku, bf16", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM5 80GB", 989e12), ("NVIDIA H100 PCIe", "H100 PCIe 80GB", 756e12),
    ("NVIDIA H100 NVL", "H100 NVL 94GB", 835e12), ("NVIDIA H200", "H200 SXM 141GB", 989e12),
    ("NVIDIA A100-SXM4-80GB", "A100 SXM4 or PCIe, 40 or 80GB", 312e12), ("NVIDIA A10", "A10 24GB", 125e12),
    ("NVIDIA L4", "L4 24GB", 121e12), ("NVIDIA L40S", "L40S 48GB", 362e12)])
def test_the_peak_names_the_sku_it_assumes(name, sku, bf16):
    assert mfu.peak_of(name)[:2] == (sku, bf16) and mfu.peak_flops(name, "bf16") == bf16
    assert mfu.peak_flops(name, "fp32", tf32=True) == mfu.peak_of(name)[2]


def test_mfu_and_an_unknown_gpu():
    assert mfu.peak_flops("Some Future GPU") is None and mfu.peak_of("Some Future GPU") is None
    assert mfu.mfu(1e15, 2.0, 4, 250e12) == 0.5
