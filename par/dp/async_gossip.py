"""Two ways to stop waiting for everybody: stale (asynchronous) updates and ring gossip.

Simulated in one process with plain tensors: worker i holds its own loss f_i(w) = ½‖w − c_i‖²
(gradient w − c_i); the joint optimum of (1/N) Σ f_i is the mean of the c_i.

Asynchronous SGD. Nobody waits at a barrier, so a gradient is computed on a model that is τ
updates old by the time it is applied:

    w_{t+1} = w_t − γ ∇f(w_{t−τ})

Staleness slows convergence and, with a step size that is fine for τ = 0, can make it diverge.

Decentralized (gossip) SGD. The N workers stand in a logical ring; each step a worker averages
its model with its two neighbours and takes a local gradient step:

    w_{t+1,i} = (w_{t,i−1} + w_{t,i} + w_{t,i+1}) / 3 − γ ∇f_i(w_{t,i})

One round costs O(1) latency (two neighbours), against 2(N−1) sequential steps for a ring
all-reduce, but information needs about N/2 rounds to cross the ring, so replicas disagree.
"""
from __future__ import annotations

import math

import torch


def quadratic_grad(w: torch.Tensor, center: torch.Tensor) -> torch.Tensor:
    """∇ ½‖w − c‖² = w − c."""
    return w - center


def stale_sgd(centers: torch.Tensor, lr: float, steps: int, staleness: int, w0: torch.Tensor | None = None,
              curvature: float | torch.Tensor = 1.0) -> list[float]:
    """w_{t+1} = w_t − γ ∇F(w_{t−τ}) with F the mean of the workers' quadratics; returns ‖w_t − w*‖ per step.

    `centers` is (N, d), one row per worker, and ∇F(w) = h ⊙ (w − w*), w* = mean_i c_i, with curvature h (a number, or one per
    coordinate). τ = 0 is plain synchronous gradient descent. Runs in float64.
    """
    centers = centers.double()
    optimum = centers.mean(0)
    w = torch.zeros(centers.size(1), dtype=torch.float64) if w0 is None else w0.double().clone()
    history, distance = [w], []
    for _ in range(steps):
        old = history[max(0, len(history) - 1 - staleness)]
        w = w - lr * curvature * quadratic_grad(old, centers).mean(0)
        history.append(w)
        distance.append((w - optimum).norm().item())
    return distance


def max_stable_lr(staleness: int, curvature: float = 1.0) -> float:
    """Largest step size for which w ← w − γ·h·(w_{t−τ} − w*) still converges: (2/h)·sin(π / (4τ + 2)).

    τ = 0 gives the familiar γ < 2/h; every extra step of staleness shrinks it.
    """
    return 2 / curvature * math.sin(math.pi / (4 * staleness + 2))


def ring_mixing_matrix(n: int) -> torch.Tensor:
    """The N×N gossip matrix: 1/3 on the diagonal and on both ring neighbours (rows and columns sum to 1)."""
    if n < 3:
        raise ValueError(f"a ring with distinct left and right neighbours needs N >= 3 workers, got {n}")
    m = torch.zeros(n, n)
    for i in range(n):
        for j in (i - 1, i, i + 1):
            m[i, j % n] = 1 / 3
    return m


def gossip_sgd(centers: torch.Tensor, lr: float, steps: int, w0: torch.Tensor | None = None) -> dict:
    """Run ring gossip SGD on the workers' quadratics.

    Returns per step: `error` = ‖mean_i w_i − w*‖ and `disagreement` = max_i ‖w_i − mean_i w_i‖.
    """
    n, d = centers.shape
    mix = ring_mixing_matrix(n)
    optimum = centers.mean(0)
    w = torch.zeros(n, d) if w0 is None else w0.clone()
    error, disagreement = [], []
    for _ in range(steps):
        w = mix @ w - lr * quadratic_grad(w, centers)
        mean = w.mean(0)
        error.append((mean - optimum).norm().item())
        disagreement.append((w - mean).norm(dim=1).max().item())
    return {"error": error, "disagreement": disagreement, "final": w}


def rounds_to_spread(n: int) -> int:
    """Gossip rounds until worker 0's information has reached every worker: ⌊N/2⌋ (one hop each way per round)."""
    return n // 2


def latency_steps(n: int, scheme: str) -> int:
    """Sequential message steps per synchronization: ring all-reduce 2(N−1), gossip 1."""
    if scheme == "allreduce":
        return 2 * (n - 1)
    if scheme == "gossip":
        return 1
    raise ValueError(f"unknown scheme {scheme!r}: use 'allreduce' or 'gossip'")
