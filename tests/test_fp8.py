"""FP8 emulation (`par.precision.fp8`): the formats bit for bit, nearest rounding, saturation, per-tensor and
delayed scaling and the error they leave. (autocast + GradScaler beside par's scaler: tests/test_torch_api.py.)"""
from __future__ import annotations

import pytest
import torch

from par.precision import fp8

BITS = {"e4m3": (4, 3, 7), "e5m2": (5, 2, 15)}   # exponent bits, mantissa bits, bias


def all_values(fmt: str) -> torch.Tensor:
    """Every finite value of the format, from its 256 bit patterns."""
    v = torch.arange(256, dtype=torch.uint8).view(fp8.FORMATS[fmt]).float()
    return v[torch.isfinite(v)]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_bit_patterns_decode_by_the_formula(fmt):
    e_bits, m_bits, bias = BITS[fmt]
    for code in range(256):
        value = torch.tensor([code], dtype=torch.uint8).view(fp8.FORMATS[fmt]).float().item()
        s, e, m = code >> 7, (code >> m_bits) & (2 ** e_bits - 1), code & (2 ** m_bits - 1)
        if not torch.isfinite(torch.tensor(value)):
            continue
        expect = 2.0 ** (1 - bias) * m / 2 ** m_bits if e == 0 else 2.0 ** (e - bias) * (1 + m / 2 ** m_bits)
        assert value == (-1) ** s * expect, (code, value)
    assert fp8.max_value(fmt) == all_values(fmt).max().item() == {"e4m3": 448.0, "e5m2": 57344.0}[fmt]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_cast_is_round_to_nearest_and_saturates(fmt):
    grid = all_values(fmt).unique()
    x = torch.randn(4000, generator=torch.Generator().manual_seed(0)) * torch.logspace(-6, 6, 4000)
    q = fp8.cast(x, fmt)
    inside = x.abs() <= fp8.max_value(fmt)
    nearest = (x[inside, None] - grid[None]).abs().min(1).values
    assert torch.equal((q[inside] - x[inside]).abs(), nearest)      # no value of the format is closer
    assert torch.equal(q[~inside], x[~inside].sign() * fp8.max_value(fmt))   # saturated, never inf or nan


def test_per_tensor_scaling_uses_the_range():
    x = torch.randn(10000, generator=torch.Generator().manual_seed(1)) * 1e-4    # a gradient-sized tensor
    _, raw = fp8.quantize(x, "e4m3")
    s = fp8.per_tensor_scale(x.abs().max().item(), "e4m3")
    x_hat, scaled = fp8.quantize(x, "e4m3", s)
    assert raw["flushed"] > 0.9 and scaled["flushed"] < 0.01 and scaled["saturated"] == 0
    assert scaled["rel_error"] < 2 ** -4                     # half an ulp at 3 mantissa bits, at most
    assert fp8.quantize(x, "e5m2", fp8.per_tensor_scale(x.abs().max().item(), "e5m2"))[1]["rel_error"] < 2 ** -3


def test_delayed_scaling_lags_a_spike():
    d = fp8.DelayedScaling("e4m3", history=4)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    assert d.scale() == 1.0
    for _ in range(4):
        d.quantize(x)
    assert d.scale() == fp8.per_tensor_scale(x.abs().max().item(), "e4m3")
    _, spike = d.quantize(8 * x)                              # the history has not seen it: saturates
    assert spike["saturated"] > 0
    for _ in range(4):
        d.quantize(x)                                         # the spike leaves the history after 4 steps
    assert d.scale() == fp8.per_tensor_scale(x.abs().max().item(), "e4m3")

