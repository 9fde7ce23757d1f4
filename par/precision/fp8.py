"""FP8 training's number formats and scaling, emulated exactly on any CPU.

Two 8-bit formats (torch.float8_e4m3fn, torch.float8_e5m2; the casts round to nearest even, bit for bit
what an H100's FP8 tensor cores read):

    e4m3   4 exponent bits, 3 mantissa: largest 448, smallest normal 2^-6, smallest subnormal 2^-9,
           relative precision 2^-3. No inf ("fn": finite). Forward tensors: weights, activations.
    e5m2   5 exponent bits, 2 mantissa: largest 57344, smallest normal 2^-14, smallest subnormal 2^-16,
           relative precision 2^-2. fp16's range. Backward tensors: gradients.

Both cover far fewer binades than a tensor's values may span, so every tensor travels with a **scale** s:
store q = fp8(x · s), compute with q, read back x̂ = q / s. Casts here saturate (|x · s| above the largest
value becomes ± the largest), as Transformer Engine does.

    per-tensor (current) scaling   s = max_fp8 / amax(x) · 2^-margin       the tensor's own amax: needs a pass
                                                                            over x before the cast
    delayed scaling                s_t = max_fp8 / max(amax_{t-H} .. amax_{t-1}) · 2^-margin
                                   the amax of the last H steps (the history), known before step t starts;
                                   x_t's own amax is recorded for later. A tensor that grows faster than the
                                   history saturates; one that shrinks loses bits at the bottom.

`quantize` returns x̂ and the error it leaves: ‖x̂ − x‖ / ‖x‖, the fraction of nonzeros flushed to 0 and the
fraction saturated.
"""
from __future__ import annotations

import torch

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def max_value(fmt: str) -> float:
    """The largest finite value: e4m3 448 = 1.75 · 2^8, e5m2 57344 = 1.75 · 2^15."""
    return float(torch.finfo(FORMATS[fmt]).max)


def cast(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp8(x), saturating: clamp to ± max_value, round to nearest even in `fmt`, back to fp32 (exact)."""
    m = max_value(fmt)
    return x.float().clamp(-m, m).to(FORMATS[fmt]).float()


def per_tensor_scale(amax: float, fmt: str, margin: int = 0) -> float:
    """s = max_fp8 / amax · 2^-margin: the tensor's largest |value| lands at the top of the format
    (1.0 when amax is 0: nothing to scale)."""
    return max_value(fmt) / amax * 2.0 ** -margin if amax > 0 else 1.0


def quantize(x: torch.Tensor, fmt: str, scale: float = 1.0) -> tuple[torch.Tensor, dict]:
    """(x̂ = fp8(x · s) / s, its error): relative L2 error, fractions of nonzeros flushed to 0 and saturated."""
    x = x.float()
    q = cast(x * scale, fmt)
    x_hat = q / scale
    nonzero = x != 0
    n = max(1, int(nonzero.sum()))
    return x_hat, {"rel_error": ((x_hat - x).norm() / x.norm().clamp_min(1e-30)).item(),
                   "flushed": ((q == 0) & nonzero).sum().item() / n,
                   "saturated": ((x * scale).abs() > max_value(fmt)).sum().item() / n, "scale": scale}


class DelayedScaling:
    """Delayed scaling: the scale of step t from the amax of the previous `history` steps.

        s_t = max_fp8 / max(amax_{t-H}, ..., amax_{t-1}) · 2^-margin;   then amax_t = max |x_t| joins the history
    """

    def __init__(self, fmt: str, history: int = 16, margin: int = 0):
        self.fmt, self.history, self.margin, self.amaxes = fmt, history, margin, []

    def scale(self) -> float:
        """The scale to use now, known before the tensor is seen (1.0 before any history)."""
        return per_tensor_scale(max(self.amaxes[-self.history:], default=0.0), self.fmt, self.margin)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """x̂ with the delayed scale, then record this tensor's amax for the steps after."""
        out = quantize(x, self.fmt, self.scale())
        self.amaxes.append(x.abs().max().item())
        return out
