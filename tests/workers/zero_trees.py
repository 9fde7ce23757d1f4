"""No model crashes the ZeRO engine: random module trees, each trained under ZeRO 0-3 (and offload)
beside torch DistributedDataParallel, on every rank (tests/test_zero.py asserts on the JSON).

    python -m torch.distributed.run --nproc-per-node=2 tests/workers/zero_trees.py TREES SEED

A tree is built from: Linear (with or without bias), LayerNorm, Tanh, Sequential, a parent that walks
a ModuleList or a ModuleDict, a parent that uses an nn.ParameterList (elementwise) or an
nn.ParameterDict (a matmul) directly in its forward, a module called twice (shared weights),
a residual, an unused branch, buffers (constant, and a counter the forward increments), a frozen
parameter, two Linears with tied weights, a parent reading a child's weight functionally, a root
parameter, and sometimes a `to_layers()` on the root. For every tree and engine the case is either
"trained" (max |param - DDP's| after 3 Adam steps) or "refused" (the ValueError's message), never a
crash: a crash fails the whole launch.
"""
from __future__ import annotations

import copy
import random
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import par.runtime.dist
from par.zero.engine import Zero

D, STEPS, BATCH, LR = 5, 3, 8, 1e-2
ENGINES = [(0, False), (1, False), (2, False), (3, False), (2, True), (3, True)]   # (stage, offload)


class Chain(nn.Module):
    """Children in a ModuleList (a container without forward), applied in order."""

    def __init__(self, children):
        super().__init__()
        self.items = nn.ModuleList(children)

    def forward(self, x):
        for m in self.items:
            x = m(x)
        return x


class Named(nn.Module):
    """Children in a ModuleDict, applied in key order."""

    def __init__(self, children):
        super().__init__()
        self.parts = nn.ModuleDict({f"p{i}": c for i, c in enumerate(children)})

    def forward(self, x):
        for k in sorted(self.parts):
            x = self.parts[k](x)
        return x


class WithParamList(nn.Module):
    """The ParameterList's forward is never called: the parent uses its entries elementwise."""

    def __init__(self, child):
        super().__init__()
        self.child = child
        self.plist = nn.ParameterList([nn.Parameter(1 + 0.1 * torch.randn(D)), nn.Parameter(0.1 * torch.randn(D))])

    def forward(self, x):
        return self.child(x) * self.plist[0] + self.plist[1]


class WithParamDict(nn.Module):
    def __init__(self, child):
        super().__init__()
        self.child = child
        self.pdict = nn.ParameterDict({"w": nn.Parameter(torch.eye(D) + 0.1 * torch.randn(D, D)),
                                       "b": nn.Parameter(0.1 * torch.randn(D))})

    def forward(self, x):
        return self.child(x) @ self.pdict["w"] + self.pdict["b"]


class Twice(nn.Module):
    """One module called twice: its weights are shared by two uses."""

    def __init__(self, child):
        super().__init__()
        self.child = child

    def forward(self, x):
        return self.child(torch.tanh(self.child(x)))


class Residual(nn.Module):
    def __init__(self, child):
        super().__init__()
        self.child = child

    def forward(self, x):
        return x + self.child(x)


class Unused(nn.Module):
    """A branch whose forward never runs: its parameters get no gradient."""

    def __init__(self, child, spare):
        super().__init__()
        self.child, self.spare = child, spare

    def forward(self, x):
        return self.child(x)


class WithBuffers(nn.Module):
    def __init__(self, child):
        super().__init__()
        self.child = child
        self.register_buffer("shift", 0.1 * torch.randn(D))
        self.register_buffer("calls", torch.zeros(()), persistent=False)

    def forward(self, x):
        self.calls += 1
        return self.child(x) + self.shift


class WithFrozen(nn.Module):
    def __init__(self, child):
        super().__init__()
        self.child = child
        self.frozen = nn.Parameter(1 + 0.1 * torch.randn(D), requires_grad=False)

    def forward(self, x):
        return self.child(x) * self.frozen


class Tied(nn.Module):
    """Two Linears sharing one weight matrix (tied weights)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class Functional(nn.Module):
    """The parent reads its child's weight directly, after the child ran."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return F.linear(torch.tanh(self.lin(x)), self.lin.weight)


class Root(nn.Module):
    def __init__(self, body: Chain, gain: bool):
        super().__init__()
        self.body = body
        self.gain = nn.Parameter(1 + 0.1 * torch.randn(D)) if gain else None

    def forward(self, x):
        x = self.body(x)
        return x * self.gain if self.gain is not None else x


class LayeredRoot(Root):
    """The same, with `to_layers()`: the body's top-level subtrees are the units (the rest: the root)."""

    def to_layers(self):
        return list(self.body.items)


RISKY = ("tied", "functional")   # features only stage 3 may refuse


def leaf(rng):
    kind = rng.choice(["linear", "linear", "linear_nobias", "norm", "tanh"])
    if kind == "norm":
        return nn.LayerNorm(D), "LayerNorm"
    if kind == "tanh":
        return nn.Tanh(), "Tanh"
    return nn.Linear(D, D, bias=kind == "linear"), "Linear"


def tree(rng, depth: int, features: set):
    if depth == 0 or rng.random() < 0.25:
        m, name = leaf(rng)
        features.add(name)
        return m
    kind = rng.choice(["chain", "named", "seq", "plist", "pdict", "twice", "residual", "unused", "buffers",
                       "frozen", "tied", "functional"])
    features.add(kind)
    sub = lambda: tree(rng, depth - 1, features)
    if kind == "chain":
        return Chain([sub() for _ in range(rng.randint(1, 3))])
    if kind == "named":
        return Named([sub() for _ in range(rng.randint(1, 3))])
    if kind == "seq":
        return nn.Sequential(*[sub() for _ in range(rng.randint(1, 3))])
    if kind == "tied":
        return Tied()
    if kind == "functional":
        return Functional()
    if kind == "unused":
        return Unused(sub(), sub())
    return {"plist": WithParamList, "pdict": WithParamDict, "twice": Twice, "residual": Residual,
            "buffers": WithBuffers, "frozen": WithFrozen}[kind](sub())


def build(seed: int):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    features: set = set()
    body = Chain([tree(rng, 3, features) for _ in range(rng.randint(1, 3))])
    gain, layers = rng.random() < 0.4, rng.random() < 0.4
    model = (LayeredRoot if layers else Root)(body, gain)
    if not any(p.requires_grad for p in model.parameters()):   # all Tanh: give it something to train
        body.items.append(nn.Linear(D, D))
        features.add("Linear")
    return model, sorted(features | ({"root param"} if gain else set()) | ({"to_layers"} if layers else set()))


def batches(seed: int):
    g = torch.Generator().manual_seed(1000 + seed)
    return [(torch.randn(BATCH, D, generator=g), torch.randn(BATCH, D, generator=g)) for _ in range(STEPS)]


def train_ddp(model, data, rank, n):
    ddp = DDP(model, find_unused_parameters=True)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=LR)
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        F.mse_loss(ddp(x[rank::n]), y[rank::n]).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters(remove_duplicate=False)}


def train_zero(model, data, rank, n, stage, offload):
    zero = Zero(model, stage=stage, optimizer="adam", lr=LR, offload=offload)
    try:
        for x, y in data:
            zero.backward(F.mse_loss(model(x[rank::n]), y[rank::n]))
            zero.step()
            zero.zero_grad()
        return zero.full_state_dict()
    finally:
        zero.close()


def main():
    trees, seed0 = int(sys.argv[1]), int(sys.argv[2])
    env = par.runtime.dist.init()
    rank, n = env.rank, env.world_size
    cases = []
    for t in range(trees):
        seed = seed0 + t
        original, features = build(seed)
        data = batches(seed)
        ref = train_ddp(copy.deepcopy(original), data, rank, n)
        trainable = {k for k, p in original.named_parameters(remove_duplicate=False) if p.requires_grad}
        for stage, offload in ENGINES:
            case = {"tree": seed, "features": features, "stage": stage, "offload": offload,
                    "params": sorted(trainable), "risky": any(f in features for f in RISKY)}
            try:
                got = train_zero(copy.deepcopy(original), data, rank, n, stage, offload)
            except ValueError as e:
                case["refused"] = str(e)
            else:
                case["keys_equal"] = set(got) == trainable
                case["diff"] = max(((got[k] - ref[k]).abs().max().item() for k in trainable if k in got),
                                   default=0.0)
            cases.append(case)
    gathered = par.runtime.dist.gather_object(cases)
    if env.is_rank0:
        par.runtime.dist.save_result({"world_size": n, "backend": env.backend, "ranks": gathered})
    par.runtime.dist.teardown()


if __name__ == "__main__":
    main()
