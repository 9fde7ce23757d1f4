"""How often to checkpoint: Young/Daly's interval, and a simulated run that checks it.

A run checkpoints after every τ seconds of work; a checkpoint costs C seconds. Failures arrive at random,
exponentially with mean time between failures M; a failure loses the work since the last checkpoint, and the
restart costs R seconds. Two kinds of time are lost:

    checkpoints:  C every τ                       fraction C/τ
    rework:       on average τ/2 per failure,     fraction (τ/2)/M
                  one failure every M seconds

so the fraction of time lost is, to first order in τ/M (C ≪ τ ≪ M),

    lost(τ) ≈ C/τ + τ/(2M)

and d lost/dτ = -C/τ² + 1/(2M) = 0 gives Young's interval (Young 1974; Daly 2006 to higher order)

    τ* = √(2·C·M),     lost(τ*) ≈ √(2C/M).

With failures during the checkpoint and the restart too, one segment (τ of work and its checkpoint) takes on
average exactly (Daly 2006, eq. 10, per segment)

    E[segment] = M·e^{R/M}·(e^{(τ+C)/M} - 1)

and `simulate` measures it: a seeded run of exponential failures, segment by segment.
Pure Python (`random`): no torch.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass


def young_daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """τ* = √(2·C·M): the checkpoint interval (seconds of work) that loses the least time, to first order."""
    if checkpoint_s <= 0 or mtbf_s <= 0:
        raise ValueError(f"checkpoint cost {checkpoint_s} and MTBF {mtbf_s} must be > 0")
    return math.sqrt(2 * checkpoint_s * mtbf_s)


def lost_fraction(interval_s: float, checkpoint_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """C/τ + (τ/2 + R)/M: the fraction of wall time lost to checkpoints, rework and restarts (R per failure), to
    first order in τ/M. R adds a constant: the best τ is √(2CM) whatever the restart costs."""
    return checkpoint_s / interval_s + (interval_s / 2 + restart_s) / mtbf_s


def expected_segment_s(interval_s: float, checkpoint_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """M·e^{R/M}·(e^{(τ+C)/M} - 1): the mean wall time of τ seconds of work and its checkpoint, failures
    (exponential, mean M) striking during work, checkpoint and restart alike."""
    m = mtbf_s
    return m * math.exp(restart_s / m) * math.expm1((interval_s + checkpoint_s) / m)


def exact_lost_fraction(interval_s: float, checkpoint_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """1 - τ / E[segment]: the fraction of wall time lost, without the first-order approximation."""
    return 1 - interval_s / expected_segment_s(interval_s, checkpoint_s, mtbf_s, restart_s)


def exact_optimum(checkpoint_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """The τ that minimises `exact_lost_fraction` (a golden-section search over [C/100, 10·√(2CM)], where the lost
    fraction has one minimum); Daly's series for it is √(2CM)·(1 + ⅓√(C/2M) + C/18M) - C."""
    lo, hi = checkpoint_s / 100, 10 * young_daly_interval(checkpoint_s, mtbf_s)
    g = (math.sqrt(5) - 1) / 2
    for _ in range(200):
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        if exact_lost_fraction(a, checkpoint_s, mtbf_s, restart_s) < exact_lost_fraction(b, checkpoint_s, mtbf_s,
                                                                                         restart_s):
            hi = b
        else:
            lo = a
    return (lo + hi) / 2


@dataclass(frozen=True)
class Simulated:
    """One simulated run: `work_s` of useful work took `wall_s`; `failures` struck."""
    interval_s: float
    work_s: float
    wall_s: float
    failures: int
    segments: int

    @property
    def lost_fraction(self) -> float:
        """(wall - work) / wall: the fraction of the wall time that did no lasting work."""
        return (self.wall_s - self.work_s) / self.wall_s

    @property
    def lost_per_segment_s(self) -> float:
        """Seconds lost per checkpoint interval: (wall - work) / segments."""
        return (self.wall_s - self.work_s) / self.segments


def simulate(interval_s: float, checkpoint_s: float, mtbf_s: float, restart_s: float = 0.0,
             work_s: float = 1e6, seed: int = 0) -> Simulated:
    """Run `work_s` seconds of work in segments of τ = `interval_s` work + C checkpoint. A failure (exponential,
    mean M) at t seconds into a segment loses those t seconds, then a restart of R seconds (which a failure can
    also cut short) and the segment starts again from its checkpoint. Seeded: the same seed, the same failures."""
    rng = random.Random(seed)
    segments = math.ceil(work_s / interval_s)
    wall, failures = 0.0, 0
    for _ in range(segments):
        while True:
            t = rng.expovariate(1 / mtbf_s)
            if t >= interval_s + checkpoint_s:
                wall += interval_s + checkpoint_s
                break
            wall += t
            failures += 1
            while True:                      # the restart, itself exposed to failures
                t = rng.expovariate(1 / mtbf_s)
                if t >= restart_s:
                    wall += restart_s
                    break
                wall += t
                failures += 1
    return Simulated(interval_s, segments * interval_s, wall, failures, segments)


def fit_optimum(intervals, lost) -> tuple[float, float, float, float]:
    """Least squares of lost(τ) = a/τ + b·τ + c over measured points; returns (τ_opt = √(a/b), a, b, c).
    Young's model predicts a = C and b = 1/(2M)."""
    rows = [(1 / t, t, 1.0) for t in intervals]
    # normal equations (3x3), solved by Gaussian elimination
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
    aty = [sum(r[i] * y for r, y in zip(rows, lost)) for i in range(3)]
    a, b, c = _solve3(ata, aty)
    if a <= 0 or b <= 0:
        raise ValueError(f"the measured losses have no interior minimum (a = {a:.3g}, b = {b:.3g}): widen the grid")
    return math.sqrt(a / b), a, b, c


def _solve3(m: list[list[float]], y: list[float]) -> list[float]:
    m = [row[:] + [v] for row, v in zip(m, y)]
    for i in range(3):
        p = max(range(i, 3), key=lambda r: abs(m[r][i]))
        m[i], m[p] = m[p], m[i]
        for r in range(3):
            if r != i:
                f = m[r][i] / m[i][i]
                m[r] = [x - f * z for x, z in zip(m[r], m[i])]
    return [m[i][3] / m[i][i] for i in range(3)]


def sweep(checkpoint_s: float, mtbf_s: float, restart_s: float = 0.0, factors=(0.25, 0.35, 0.5, 0.7, 1.0, 1.4, 2.0,
          2.8, 4.0), work_s: float = 1e6, seed: int = 0) -> list[Simulated]:
    """`simulate` at τ = factor·√(2CM) for each factor, every τ with the same seed (the same failure draws)."""
    tau = young_daly_interval(checkpoint_s, mtbf_s)
    return [simulate(f * tau, checkpoint_s, mtbf_s, restart_s, work_s, seed) for f in factors]
