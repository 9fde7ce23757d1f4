"""Loss scaling: move fp16 gradients up, away from the underflow line, and back down in fp32.

The backward pass is linear in the loss, so back-propagating S · loss gives S · gradient
everywhere. Small gradients that fp16 would flush to zero (below 2^-24) survive when
multiplied by S = 2^16; after copying them to fp32 we divide by S again. If S is too large
some gradient overflows (above 65504 it becomes inf, or a nan appears): that step is
useless, so it is skipped and S is lowered.

`DynamicLossScaler` follows DeepSpeed's rule (its `fp16` config defaults in brackets):

    initial scale   2^initial_scale_power                 [2^16]
    on overflow     skip the step; if hysteresis is left, use one unit of it and keep
                    the scale; otherwise scale = max(scale / factor, min_scale)
                    [hysteresis 2, factor 2, min_loss_scale 1]
    on a clean step after `window` clean steps in a row (counted since the last
                    overflow or the last growth): scale = scale · factor, and the
                    hysteresis is refilled                  [loss_scale_window 1000]

With hysteresis 1 this is exactly torch.amp.GradScaler(init_scale, growth_factor=factor,
backoff_factor=1/factor, growth_interval=window), minus the floor at `min_scale`.
(Recent DeepSpeed versions grow on the clean step *after* the window-th; we use the
classic rule, which agrees with GradScaler.)

`consecutive_hysteresis=True` refills the hysteresis on every clean step, so only
`hysteresis` overflows in a row lower the scale. At the minimum scale an overflow that
would lower it further raises `FloatingPointError` (DeepSpeed stops the run there too);
pass `raise_at_min=False` to keep skipping instead.

`StaticLossScaler(scale)` multiplies by a fixed S; steps with inf/nan are still skipped.
`StaticLossScaler(1.0)` is no scaling at all (bf16, or fp16 to watch gradients underflow).

`default_scaler(precision)` is the choice every trainer makes when none is given: dynamic for
fp16, a static 1.0 for bf16 (fp32's range: nothing to scale, overflows still skipped), none for fp32.
"""
from __future__ import annotations


class StaticLossScaler:
    """A fixed loss scale S. `update` changes nothing; the step is still skipped on overflow."""

    dynamic = False

    def __init__(self, scale: float = 1.0):
        if not scale > 0:
            raise ValueError(f"loss scale must be > 0, got {scale}")
        self.scale = float(scale)

    def update(self, overflow: bool) -> None:
        """Nothing to adapt."""

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])

    def __repr__(self) -> str:
        return f"StaticLossScaler(scale={self.scale:g})"


class DynamicLossScaler:
    """Raise the scale after `window` clean steps, lower it on overflow (after `hysteresis` chances)."""

    dynamic = True

    def __init__(self, init_scale: float = 2.0 ** 16, window: int = 1000, hysteresis: int = 2,
                 factor: float = 2.0, min_scale: float = 1.0, consecutive_hysteresis: bool = False,
                 raise_at_min: bool = True):
        if window < 1 or int(window) != window:
            raise ValueError(f"window must be a positive integer number of steps, got {window}")
        if hysteresis < 1 or int(hysteresis) != hysteresis:
            raise ValueError(f"hysteresis must be an integer >= 1 (1 = no hysteresis), got {hysteresis}")
        if not factor > 1:
            raise ValueError(f"factor must be > 1 (the scale is multiplied and divided by it), got {factor}")
        if not 0 < min_scale <= init_scale:
            raise ValueError(f"need 0 < min_scale <= init_scale, got min_scale={min_scale}, init_scale={init_scale}")
        self.window, self.hysteresis, self.factor = int(window), int(hysteresis), float(factor)
        self.min_scale, self.consecutive_hysteresis, self.raise_at_min = float(min_scale), consecutive_hysteresis, raise_at_min
        self.scale = float(init_scale)
        self.hysteresis_left = self.hysteresis   # overflows we may still forgive without lowering the scale
        self.clean_steps = 0                     # clean steps since the last overflow or growth

    def update(self, overflow: bool) -> None:
        """Adapt the scale after a step; `overflow` says whether any gradient (on any rank) was inf/nan."""
        if overflow:
            self.clean_steps = 0
            if self.hysteresis_left > 1:
                self.hysteresis_left -= 1                       # forgive this one, keep the scale
            elif self.scale <= self.min_scale and self.raise_at_min:
                raise FloatingPointError(
                    f"gradient overflow at the minimum loss scale {self.min_scale:g}: the loss or the "
                    f"gradients are inf/nan even unscaled. Lower the learning rate, clip gradients, or "
                    f"check the data; pass min_scale < {self.min_scale:g} or raise_at_min=False to go on")
            else:
                self.scale = max(self.scale / self.factor, self.min_scale)
            return
        self.clean_steps += 1
        if self.consecutive_hysteresis:
            self.hysteresis_left = self.hysteresis
        if self.clean_steps == self.window:
            self.scale *= self.factor
            self.hysteresis_left = self.hysteresis
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "hysteresis_left": self.hysteresis_left, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.clean_steps = int(state["clean_steps"])

    def __repr__(self) -> str:
        return (f"DynamicLossScaler(scale={self.scale:g}, window={self.window}, hysteresis={self.hysteresis}, "
                f"factor={self.factor:g}, min_scale={self.min_scale:g})")


def default_scaler(precision: str):
    """The scaler for a precision when none is given: fp16 -> DynamicLossScaler() (DeepSpeed's defaults),
    bf16 -> StaticLossScaler(1.0), fp32 -> None (no scaling, no overflow check)."""
    if precision == "fp16":
        return DynamicLossScaler()
    if precision == "bf16":
        return StaticLossScaler(1.0)
    if precision == "fp32":
        return None
    raise ValueError(f"unknown precision {precision!r}: use 'fp32', 'fp16' or 'bf16'")


def replay(scaler, overflows) -> list[dict]:
    """Feed a sequence of overflow flags to `scaler`; for each step, the scale it used and whether it stepped.

    A step runs backward with the current scale, then the scaler updates, so the scale
    recorded for step t is the one *before* update t.
    """
    out = []
    for overflow in overflows:
        out.append({"scale": scaler.scale, "skipped": bool(overflow)})
        scaler.update(bool(overflow))
    return out
