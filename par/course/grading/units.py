"""The small model the ZeRO-3 and resume exercises grade on: a list of units, each one Linear layer with tanh after
all but the last, built from a flat list of tensors [W₀, b₀, W₁, b₁, …] that the grader draws before any student
module is imported.

    y = tanh(x W_kᵀ + b_k)   for every unit k but the last, whose output is x W_kᵀ + b_k
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Layer(nn.Module):
    """One unit: y = tanh(x Wᵀ + b) (no tanh on the last unit)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, last: bool):
        super().__init__()
        self.weight, self.bias, self.last = nn.Parameter(weight), nn.Parameter(bias), last

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        return y if self.last else torch.tanh(y)


def units(params: list[torch.Tensor], device="cpu") -> list[Layer]:
    """The units of `params` = [W₀, b₀, W₁, b₁, …], each a copy on `device`, the last without tanh."""
    return [Layer(params[k].clone().to(device), params[k + 1].clone().to(device), k + 2 == len(params))
            for k in range(0, len(params), 2)]
