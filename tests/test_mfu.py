"""par.mfu: the FLOPs per token against a hand count and FlopCounterMode, the peak table's exact SKUs, MFU and HFU; the
roofline and `python -m par bench mfu` (lecture 10) on the CPU."""
from __future__ import annotations

import json

import pytest
import torch

from par import mfu
from par.memory.accounting import param_count
from par.model import GPTConfig, build, lm_loss, preset
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
    ("NVIDIA H200 NVL", "H200 NVL 141GB", 835e12),
    ("NVIDIA GH200 480GB", "GH200 Grace Hopper (its GPU is an H100/H200 SXM)", 989e12),
    ("NVIDIA A100-SXM4-80GB", "A100 SXM4 or PCIe, 40 or 80GB", 312e12),
    ("NVIDIA A100 80GB PCIe", "A100 SXM4 or PCIe, 40 or 80GB", 312e12), ("NVIDIA A10", "A10 24GB", 125e12),
    ("NVIDIA A10G", "A10G 24GB (AWS G5; the figures AWS quotes, no NVIDIA datasheet)", 70e12),
    ("NVIDIA L4", "L4 24GB", 121e12), ("NVIDIA L40", "L40 48GB", 181e12), ("NVIDIA L40S", "L40S 48GB", 362e12),
    ("Tesla V100-SXM2-16GB", "V100 SXM2 (fp16 only, no TF32: fp32 runs at the fp32 rate)", 125e12),
    ("NVIDIA GeForce RTX 4090", "GeForce RTX 4090", 165e12)])
def test_the_peak_names_the_sku_it_assumes(name, sku, bf16):
    assert mfu.peak_of(name)[:2] == (sku, bf16) and mfu.peak_flops(name, "bf16") == bf16
    assert mfu.peak_flops(name, "fp32", tf32=True) == mfu.peak_of(name)[2]
    assert mfu.peak_flops(name, "fp32") == mfu.peak_of(name)[3]


@pytest.mark.parametrize("a, b", [("NVIDIA L4", "NVIDIA L40"), ("NVIDIA L40", "NVIDIA L40S"),
                                  ("NVIDIA A10", "NVIDIA A10G"), ("NVIDIA H200", "NVIDIA GH200 480GB"),
                                  ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe"), ("NVIDIA H100 PCIe", "NVIDIA H100 NVL")])
def test_a_name_inside_another_is_a_different_sku(a, b):
    assert mfu.sku(a) != mfu.sku(b) and mfu.peak_of(a) != mfu.peak_of(b)


def test_mfu_and_an_unknown_gpu():
    for name in ("Some Future GPU", "NVIDIA L4000", "NVIDIA A1000", "", "NVIDIA"):
        assert mfu.peak_flops(name) is None and mfu.peak_of(name) is None and mfu.sku(name) is None
    assert mfu.mfu(1e15, 2.0, 4, 250e12) == 0.5


def counted_flops(cfg, batch: int) -> int:
    """FlopCounterMode's count of one forward and backward of GPT-lite on `batch` sequences of block_size."""
    from torch.utils.flop_counter import FlopCounterMode
    model = build(cfg)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        lm_loss(model(x), x).backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("cfg", [preset("tiny", attention="math"), preset("small", attention="math"),
                                 GPTConfig(vocab_size=100, block_size=24, n_layer=3, n_head=2, d_model=40, d_ff=72,
                                           attention="math", tie_embeddings=True)])
def test_flops_per_token_is_what_torch_counts_on_the_math_path(cfg):
    batch = 3
    assert counted_flops(cfg, batch) == mfu.flops_per_token(cfg) * batch * cfg.block_size


def test_causal_convention_hfu_padding_and_recomputation():
    cfg = preset("gpt3-small")
    L, d, s = 12, 768, 2048
    assert mfu.flops_per_token(cfg) - mfu.flops_per_token(cfg, attention="causal") == 6 * L * s * d
    assert mfu.hardware_flops_per_token(cfg) == mfu.flops_per_token(cfg)
    padded = preset("gpt3-small", padded_vocab=50304)
    assert mfu.flops_per_token(padded) == mfu.flops_per_token(cfg), "MFU counts the model's vocabulary"
    assert mfu.hardware_flops_per_token(padded) - mfu.flops_per_token(cfg) == 6 * d * (50304 - 50257)
    forward_blocks = 2 * L * (4 * d * d + 2 * d * 4 * d) + 4 * L * s * d
    assert mfu.hardware_flops_per_token(cfg, recompute=True) - mfu.flops_per_token(cfg) == forward_blocks
    with pytest.raises(ValueError, match="full or causal"):
        mfu.flops_per_token(cfg, attention="half")


def test_the_roofline_measures_this_device():
    from par.device import roofline
    p, b = roofline.matmul_flops_per_s("cpu", n=128, repeats=2), roofline.copy_bytes_per_s("cpu", mib=4, repeats=2)
    assert p > 0 and b > 0 and roofline.ridge_point(p, b) == p / b
    assert roofline.attainable(0.0, p, b) == 0 and roofline.attainable(1e9, p, b) == p
    assert roofline.attainable(roofline.ridge_point(p, b) / 2, p, b) == pytest.approx(p / 2)


def test_the_matmul_roof_is_the_fastest_size(monkeypatch):
    """P is the best square matmul over the sizes tried, not the rate at one size: a matmul whose matrices fit the
    cache runs faster per FLOP, and a roof measured at 1024 alone had a block's matmul at 1.15× it."""
    from par.device import roofline
    seconds = {256: 2 * 256 ** 3 / 150e9, 512: 2 * 512 ** 3 / 140e9, 1024: 2 * 1024 ** 3 / 120e9}
    timed = []

    def fastest(fn, device, repeats, warmup=2):
        timed.append(fn().shape[0])         # the size of the matmul timed
        return seconds[timed[-1]]
    monkeypatch.setattr(roofline, "SIZES", {"cpu": (256, 512, 1024), "cuda": (4096, 8192)})
    monkeypatch.setattr(roofline, "_fastest_seconds", fastest)
    assert roofline.matmul_flops_per_s("cpu") == pytest.approx(150e9)
    assert timed == [256, 512, 1024]


def test_bench_mfu_runs_the_three_variants_on_the_cpu(tmp_path, capsys):
    from par.device import bench
    threads = torch.get_num_threads()
    assert bench.main(["--device", "cpu", "--preset", "tiny", "--seq", "16,32", "--tokens", "64", "--steps", "1",
                       "--repeats", "2", "--warmup", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "mfu.json").read_text())
    printed = capsys.readouterr().out
    assert [(r["variant"], r["seq"], r["batch"]) for r in result["rows"]] == [
        (v, s, 64 // s) for s in (16, 32) for v in ("par eager", "par fast", "reference")]
    for r in result["rows"]:
        assert r["step_s_min"] <= r["step_s"] <= r["step_s_max"] and r["tokens_per_s"] > 0
        assert r["mfu_causal"] < r["mfu_full"] <= r["hfu_full"]
    fast = next(r for r in result["rows"] if r["variant"] == "par fast")
    assert fast["hfu_full"] > fast["mfu_full"], "the padded head's columns are hardware FLOPs, not model FLOPs"
    assert [q["seq"] for q in result["ratios"]] == [16, 32] and all(q["fast_over_reference"] > 0
                                                                     for q in result["ratios"])
    assert all(q["cpu_fast_over_eager"] > 0 for q in result["ratios"]) and "by CPU seconds" in printed
    assert result["threads"] == 1 and torch.get_num_threads() == threads, "one thread measured, the caller's kept"
    assert not result["compile"] and "torch.compile off on the CPU" in printed
    assert "par fast / reference" in printed and result["peak_source"].startswith("measured")


def test_bench_mfu_refuses_in_one_line(capsys):
    from par.device import bench
    with pytest.raises(SystemExit) as stop:
        bench.parse(["--device", "cuda"] if not torch.cuda.is_available() else ["--seq", "0"])
    assert stop.value.code == 2
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        bench.parse(["--device", "cpu", "--preset", "huge"])
    assert stop.value.code == 2 and "--preset: unknown preset 'huge': use one of tiny" in capsys.readouterr().err


def test_a_block_s_operations_add_up_to_flop_counter_mode():
    from torch.utils.flop_counter import FlopCounterMode
    from par.device.roofline import op_intensities
    block = build(preset("tiny")).blocks[0]
    x = torch.randn(2, 32, 32, requires_grad=True)
    ops = op_intensities(lambda t: block(t).sum().backward(), x)
    with FlopCounterMode(display=False) as counter:
        block(x).sum().backward()
    assert sum(o["flops"] for o in ops) == counter.get_total_flops() > 0
    names = {o["op"] for o in ops}
    assert {"addmm", "bmm", "_softmax", "masked_fill"} <= names and not names & {"view", "transpose", "expand", "t"}
    matmuls = [o for o in ops if o["op"] in ("addmm", "bmm", "mm")]
    assert min(o["intensity"] for o in matmuls) > max(o["intensity"] for o in ops if o["op"] == "_softmax")
