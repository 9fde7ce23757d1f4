"""Cut a sequence of layers into pipeline stages.

Pipeline parallelism only works on a model that is a *sequence* of layers with a
tensor between each pair (DeepSpeed's PipelineModule, our `model.to_layers()`):
stage s gets the consecutive layers [start_s, end_s).

* uniform      the same number of layers per stage (sizes differ by at most one);
* parameters   stages with about the same number of parameters: the contiguous cut that
               minimises the largest stage (DeepSpeed's partition_method='parameters').

Balanced parameters balance the memory of model states, not the time: an embedding
has many parameters and little compute, the LM head the opposite.
"""
from __future__ import annotations

import torch.nn as nn

from par.comm.collectives import chunk_bounds

METHODS = ("parameters", "uniform")


def param_counts(layers) -> list[int]:
    """Number of parameters of each layer (0 for layers without any, e.g. an activation)."""
    return [sum(p.numel() for p in layer.parameters()) if isinstance(layer, nn.Module) else 0
            for layer in layers]


def _check(n_layers: int, stages: int) -> None:
    if stages < 1:
        raise ValueError(f"need at least one stage, got {stages}")
    if stages > n_layers:
        raise ValueError(f"cannot cut {n_layers} layers into {stages} stages: every stage needs a layer; "
                         f"use at most {n_layers} stages (or a model with more layers)")


def uniform(n_layers: int, stages: int) -> list[tuple[int, int]]:
    """[start, end) of each stage, with n_layers // stages layers each and one more for the first few."""
    _check(n_layers, stages)
    return chunk_bounds(n_layers, stages)


def balanced(weights, stages: int) -> list[tuple[int, int]]:
    """[start, end) of each stage so that the heaviest stage is as light as possible.

    Dynamic programming over "the first i layers in k stages": best[k][i] = min over j of
    max(best[k-1][j], weight(j..i)). Ties go to the cut that leaves earlier stages lighter.
    """
    n = len(weights)
    _check(n, stages)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds, i = [], n
    for k in range(stages, 0, -1):
        j = cut[k][i]
        bounds.append((j, i))
        i = j
    return bounds[::-1]


def bounds_for(layers, stages: int, method: str = "parameters") -> list[tuple[int, int]]:
    """The stage boundaries of `layers` under `method` ('parameters' or 'uniform')."""
    if method == "uniform":
        return uniform(len(layers), stages)
    if method == "parameters":
        return balanced(param_counts(layers), stages)
    raise ValueError(f"unknown partition method {method!r}: use one of {', '.join(METHODS)}")


def split(layers, stages: int, method: str = "parameters") -> list[list]:
    """`layers` cut into `stages` lists of consecutive layers."""
    layers = list(layers)
    return [layers[a:b] for a, b in bounds_for(layers, stages, method)]
