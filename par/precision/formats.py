"""Floating-point formats of deep learning: fp32, fp16 and bf16, as pure functions.

A binary float is three bit fields, sign s, exponent E (e bits) and mantissa M (m bits):

    normal      (E = 1 .. 2^e - 2):  (-1)^s · 2^(E - bias) · (1 + M / 2^m),   bias = 2^(e-1) - 1
    subnormal   (E = 0):             (-1)^s · 2^(1 - bias) · (M / 2^m)
    inf / nan   (E = 2^e - 1)

            sign  exponent  mantissa   largest        smallest normal   smallest subnormal   eps = 2^-m
    fp32      1       8        23      3.4e38         1.2e-38           1.4e-45              1.2e-7
    fp16      1       5        10      65504          6.1e-5  (2^-14)   6.0e-8  (2^-24)      9.8e-4
    bf16      1       8         7      3.4e38         1.2e-38           9.2e-41              7.8e-3

The exponent bits buy range, the mantissa bits buy precision. fp16 keeps more
precision than bf16 but its range is tiny: a gradient below 2^-24 becomes 0
(underflow) and anything above 65504 becomes inf (overflow); loss scaling exists
for that. bf16 has fp32's range with a quarter of fp16's precision, so it needs
no loss scaling (it needs an Ampere or newer GPU, though).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Format:
    name: str
    exponent_bits: int
    mantissa_bits: int
    dtype: torch.dtype

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def bias(self) -> int:
        """2^(e-1) - 1: stored exponent E means 2^(E - bias)."""
        return 2 ** (self.exponent_bits - 1) - 1

    @property
    def max_normal(self) -> float:
        """The largest finite value: (2 - 2^-m) · 2^bias."""
        return (2 - 2.0 ** -self.mantissa_bits) * 2.0 ** self.bias

    @property
    def min_normal(self) -> float:
        """The smallest value with full precision: 2^(1 - bias)."""
        return 2.0 ** (1 - self.bias)

    @property
    def min_subnormal(self) -> float:
        """The smallest value above zero: 2^(1 - bias - m). Anything below about half of it rounds to 0."""
        return 2.0 ** (1 - self.bias - self.mantissa_bits)

    @property
    def eps(self) -> float:
        """The gap between 1 and the next value, 2^-m: the relative precision of a normal number."""
        return 2.0 ** -self.mantissa_bits

    @property
    def decimal_digits(self) -> float:
        """Significant decimal digits: (m + 1) · log10(2)."""
        return (self.mantissa_bits + 1) * math.log10(2)

    @property
    def decades(self) -> float:
        """Dynamic range in powers of ten: log10(max_normal / min_subnormal)."""
        return math.log10(self.max_normal / self.min_subnormal)


FORMATS = {
    "fp32": Format("fp32", 8, 23, torch.float32),
    "fp16": Format("fp16", 5, 10, torch.float16),
    "bf16": Format("bf16", 8, 7, torch.bfloat16),
}
_INT_VIEW = {32: torch.int32, 16: torch.int16}


def get(name: str | Format) -> Format:
    """The Format called `name` ("fp32", "fp16" or "bf16")."""
    if isinstance(name, Format):
        return name
    if name not in FORMATS:
        raise ValueError(f"unknown format {name!r}: use one of {', '.join(FORMATS)}")
    return FORMATS[name]


def table() -> list[dict]:
    """One row per format with its layout, range and precision (the lecture's table)."""
    return [{"format": f.name, "sign": 1, "exponent": f.exponent_bits, "mantissa": f.mantissa_bits,
             "max": f.max_normal, "min normal": f.min_normal, "min subnormal": f.min_subnormal,
             "eps": f.eps, "decimal digits": round(f.decimal_digits, 2), "decades": round(f.decades, 1)}
            for f in FORMATS.values()]


def round_to(x, name: str) -> torch.Tensor:
    """`x` stored in format `name` and read back as fp32: what the format can actually hold."""
    return torch.as_tensor(x, dtype=torch.float32).to(get(name).dtype).float()


def bit_fields(x: float, name: str) -> tuple[str, str, str]:
    """The sign, exponent and mantissa bits of `x` stored in format `name`, as strings of 0 and 1."""
    f = get(name)
    raw = torch.tensor([x], dtype=torch.float32).to(f.dtype).view(_INT_VIEW[f.bits]).item()
    bits = format(raw & ((1 << f.bits) - 1), f"0{f.bits}b")
    return bits[0], bits[1:1 + f.exponent_bits], bits[1 + f.exponent_bits:]


def decode(sign: str, exponent: str, mantissa: str, name: str) -> float:
    """The value the bit fields stand for (the formula in the module docstring, evaluated by hand)."""
    f = get(name)
    s, e, m = int(sign, 2), int(exponent, 2), int(mantissa, 2)
    if e == 2 ** f.exponent_bits - 1:
        return math.nan if m else (-1) ** s * math.inf
    if e == 0:
        return (-1) ** s * 2.0 ** (1 - f.bias) * (m / 2 ** f.mantissa_bits)
    return (-1) ** s * 2.0 ** (e - f.bias) * (1 + m / 2 ** f.mantissa_bits)


def spacing(x: float, name: str) -> float:
    """The gap between |x| and the next larger value of format `name` (the unit in the last place).

    Normal range: 2^(floor(log2|x|) - m), so the relative gap stays about eps; subnormal
    range: the fixed step min_subnormal, so the relative gap grows as x shrinks.
    """
    f = get(name)
    x = abs(x)
    if x < f.min_normal:
        return f.min_subnormal
    return 2.0 ** (math.floor(math.log2(x)) - f.mantissa_bits)


def relative_error(x, name: str) -> torch.Tensor:
    """|round_to(x) - x| / |x| for nonzero x: 1.0 means the value was flushed to zero."""
    x = torch.as_tensor(x, dtype=torch.float32)
    return (round_to(x, name) - x).abs() / x.abs()


def flush_fraction(x, name: str) -> float:
    """Fraction of the nonzero values in `x` that become exactly 0 in format `name` (underflow)."""
    x = torch.as_tensor(x, dtype=torch.float32).flatten()
    nonzero = x != 0
    if not nonzero.any():
        return 0.0
    return ((round_to(x, name) == 0) & nonzero).sum().item() / nonzero.sum().item()


def overflow_fraction(x, name: str) -> float:
    """Fraction of the finite values in `x` that become inf in format `name` (overflow)."""
    x = torch.as_tensor(x, dtype=torch.float32).flatten()
    finite = torch.isfinite(x)
    if not finite.any():
        return 0.0
    return ((~torch.isfinite(round_to(x, name))) & finite).sum().item() / finite.sum().item()
