"""Mixture of experts: a router sends each token to k of E expert MLPs (Switch k = 1, GShard k = 2).

    p = softmax(x W_r)                       router probabilities, (S, E) for S tokens
    top-k of p per token                     its experts e_1..e_k; gates g = p[e] (k = 2: renormalised to sum 1)
    C = ceil(f · k · S / E)                  capacity: slots per expert (f = capacity factor)
    slot of (token, choice) in its expert    first choices of every token first, then second choices, in
                                             token order; a slot >= C is DROPPED (gate 0: the token skips
                                             the layer, the residual carries it)
    y_s = Σ_j g_sj · Expert_{e_sj}(x_s)      over the kept choices
    aux = E · Σ_e f_e · P_e                  load-balancing loss (Switch Transformer): f_e the fraction of the
                                             k·S choices that picked e, P_e the mean router probability of e;
                                             1 when balanced, up to E when every token picks one expert
    z = mean_s (log Σ_e exp z_se)²           router z-loss (ST-MoE, Zoph et al. 2022): keeps the router's logits
                                             z small, so its softmax stays out of the range where bf16/fp16
                                             round it badly; added as beta · z (beta about 1e-3)
    y_s += Shared(x_s)                       shared experts (DeepSeekMoE): `shared` MLPs every token goes
                                             through, beside the routed ones; what all tokens need is learnt
                                             once there, and the routed experts specialise

Tokens are routed in G groups (GShard): each group of S = tokens / G has its own capacity and its own
aux loss (the layer's aux is the mean over groups). With expert parallelism a group is one rank's tokens,
so the single-process layer with `groups=n` routes and drops exactly the tokens n ranks route and drop
(`par.moe.experts`).

The experts are stacked: w1 (E, d, ffn), b1 (E, ffn), w2 (E, ffn, d), b2 (E, d), so a slice of the
expert dimension is a shard of experts. `dispatch` fills the (E, C, d) buffer the experts run on;
`combine` takes their (E, C, d) output back to the tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from par.model import Attention, GPTConfig, GPTLite, init_weights, lm_loss, MLP, preset


class MoEError(ValueError):
    """A mixture-of-experts setting that cannot work (k, capacity, groups)."""


def capacity(tokens: int, n_experts: int, k: int, factor: float) -> int:
    """C = ceil(f · k · S / E): slots per expert for S tokens of one group (at least 1)."""
    return max(1, math.ceil(factor * k * tokens / n_experts))


@dataclass
class Routing:
    """Where one group's S tokens go: (S, k) tensors, choice j of token s in column j."""
    expert: torch.Tensor     # long: the expert of each choice
    slot: torch.Tensor       # long: its position inside that expert's C slots
    gate: torch.Tensor       # float, differentiable: the weight of the expert's output (0 when dropped)
    kept: torch.Tensor       # bool: slot < capacity
    capacity: int
    n_experts: int
    aux: torch.Tensor        # the load-balancing loss of this group (differentiable)
    load: torch.Tensor       # long (E,): choices per expert before dropping
    z: torch.Tensor          # the router z-loss of this group (differentiable)

    @property
    def dropped(self) -> int:
        """Choices that found their expert full."""
        return int((~self.kept).sum())


def top_k(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts, gates) of the k most probable experts per token; k = 2 gates renormalised to sum 1."""
    if k not in (1, 2):
        raise MoEError(f"top-k routing with k={k}: use k = 1 (Switch) or k = 2 (GShard)")
    gates, experts = probs.topk(k, dim=-1)
    if k > 1:
        gates = gates / gates.sum(-1, keepdim=True)
    return experts, gates


def slots(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Position of each (token, choice) inside its expert: first choices of all tokens before second
    choices, token order within; (S, k) long."""
    s, k = experts.shape
    order = experts.t().reshape(-1)                       # choice-major: all first choices, then all second
    one_hot = F.one_hot(order, n_experts)
    position = (one_hot.cumsum(0) - 1).gather(1, order[:, None]).squeeze(1)
    return position.view(k, s).t()


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """aux = E · Σ_e f_e · P_e: f_e the fraction of choices that picked e (no gradient), P_e the mean prob."""
    f = F.one_hot(experts.reshape(-1), n_experts).float().mean(0)
    return n_experts * (f * probs.mean(0)).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """z = mean over tokens of (log Σ_e exp logit_se)²: large when the router's logits are large."""
    return logits.float().logsumexp(-1).square().mean()


def route(logits: torch.Tensor, k: int, capacity_factor: float) -> Routing:
    """Route one group of S tokens from its router logits (S, E)."""
    s, e = logits.shape
    probs = logits.softmax(-1)
    experts, gates = top_k(probs, k)
    c = capacity(s, e, k, capacity_factor)
    slot = slots(experts, e)
    kept = slot < c
    return Routing(experts, slot, gates * kept, kept, c, e, load_balancing_loss(probs, experts, e),
                   torch.bincount(experts.reshape(-1), minlength=e), router_z_loss(logits))


def dispatch(x: torch.Tensor, r: Routing) -> torch.Tensor:
    """The experts' input buffer (E, C, d): x[s] in slot `slot` of expert `expert` for every kept choice."""
    tokens = torch.arange(x.size(0), device=x.device)[:, None].expand_as(r.expert)
    index = (r.expert * r.capacity + r.slot)[r.kept]
    buf = x.new_zeros(r.n_experts * r.capacity, x.size(-1)).index_copy(0, index, x[tokens[r.kept]])
    return buf.view(r.n_experts, r.capacity, x.size(-1))


def combine(out: torch.Tensor, r: Routing) -> torch.Tensor:
    """y_s = Σ_j gate_sj · out[expert_sj, slot_sj] over kept choices: (E, C, d) -> (S, d)."""
    s, d = r.expert.size(0), out.size(-1)
    tokens = torch.arange(s, device=out.device)[:, None].expand_as(r.expert)[r.kept]
    index = (r.expert * r.capacity + r.slot)[r.kept]
    picked = out.reshape(-1, d)[index] * r.gate[r.kept][:, None]
    return out.new_zeros(s, d).index_add(0, tokens, picked)


class Experts(nn.Module):
    """E expert MLPs stacked: Expert_e(x) = gelu(x w1_e + b1_e) w2_e + b2_e, run on an (E, C, d) buffer."""

    def __init__(self, n_experts: int, d_model: int, ffn: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n_experts, d_model, ffn) * 0.02)
        self.b1 = nn.Parameter(torch.zeros(n_experts, ffn))
        self.w2 = nn.Parameter(torch.randn(n_experts, ffn, d_model) * 0.02)
        self.b2 = nn.Parameter(torch.zeros(n_experts, d_model))

    def forward(self, buf: torch.Tensor) -> torch.Tensor:
        h = F.gelu(torch.bmm(buf, self.w1) + self.b1[:, None])
        return torch.bmm(h, self.w2) + self.b2[:, None]

    def shard(self, start: int, end: int) -> "Experts":
        """Experts start..end-1 as a module of their own (copies of their weights)."""
        out = Experts(end - start, self.w1.size(1), self.w1.size(2))
        with torch.no_grad():
            for name in ("w1", "b1", "w2", "b2"):
                getattr(out, name).copy_(getattr(self, name)[start:end])
        return out


def split_groups(x: torch.Tensor, groups: int) -> list[torch.Tensor]:
    """(B, T, d) -> G groups of (B/G · T, d) tokens, split along the batch (as data parallelism splits it)."""
    if x.size(0) % groups:
        raise MoEError(f"a batch of {x.size(0)} sequences does not split into {groups} equal routing groups: "
                       f"use a batch that is a multiple of {groups}")
    return [g.reshape(-1, x.size(-1)) for g in x.chunk(groups, dim=0)]


class MoE(nn.Module):
    """The mixture-of-experts MLP: router + E experts, top-k routing with capacity, in G groups.

    forward(x (B, T, d), groups) -> (B, T, d); afterwards `self.aux` and `self.z` (means over groups) and
    `self.routings` (one `Routing` per group) describe what happened. `shared` > 0: one MLP of shared · ffn
    hidden units (the shared experts side by side) that every token goes through, added to the routed output."""
    routes_tokens = True

    def __init__(self, d_model: int, ffn: int, n_experts: int = 4, k: int = 1, capacity_factor: float = 1.25,
                 shared: int = 0):
        super().__init__()
        if n_experts < k:
            raise MoEError(f"top-{k} routing needs at least {k} experts, got {n_experts}")
        top_k(torch.zeros(1, n_experts), k)          # k in (1, 2), or one line saying so
        if capacity_factor <= 0:
            raise MoEError(f"capacity factor {capacity_factor} must be > 0 (1.0 to 2.0 is usual)")
        self.k, self.capacity_factor, self.n_experts = k, capacity_factor, n_experts
        if shared < 0:
            raise MoEError(f"shared experts: {shared} must be >= 0")
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = Experts(n_experts, d_model, ffn)
        self.shared = MLP(d_model, shared * ffn) if shared else None
        self.aux, self.z, self.routings = torch.zeros(()), torch.zeros(()), []

    def route_groups(self, x: torch.Tensor, groups: int) -> tuple[list[torch.Tensor], list[Routing]]:
        tokens = split_groups(x, groups)
        self.routings = [route(self.router(t), self.k, self.capacity_factor) for t in tokens]
        self.aux = torch.stack([r.aux for r in self.routings]).mean()
        self.z = torch.stack([r.z for r in self.routings]).mean()
        return tokens, self.routings

    def forward(self, x: torch.Tensor, groups: int = 1) -> torch.Tensor:
        tokens, routings = self.route_groups(x, groups)
        bufs = torch.stack([dispatch(t, r) for t, r in zip(tokens, routings)])    # (G, E, C, d)
        g, e, c, d = bufs.shape
        out = self.experts(bufs.transpose(0, 1).reshape(e, g * c, d))             # each expert: all groups' slots
        out = out.view(e, g, c, d).transpose(0, 1)
        y = torch.cat([combine(o, r) for o, r in zip(out, routings)]).view_as(x)
        return y + self.shared(x) if self.shared is not None else y


class MoEBlock(nn.Module):
    """GPT-lite's block with the MLP replaced by a MoE: x + Attn(LN(x)), then x + MoE(LN(x))."""

    def __init__(self, cfg: GPTConfig, n_experts: int, k: int, capacity_factor: float, shared: int = 0):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.moe = MoE(cfg.d_model, cfg.ffn, n_experts, k, capacity_factor, shared)
        self.groups = 1

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x), self.groups)


def build_moe_gpt(cfg: GPTConfig | str = "tiny", n_experts: int = 4, k: int = 1, capacity_factor: float = 1.25,
                  seed: int = 0, shared: int = 0) -> GPTLite:
    """GPT-lite whose every block is a `MoEBlock` (with `shared` shared experts): the same weights on every rank
    (config and seed)."""
    cfg = preset(cfg) if isinstance(cfg, str) else cfg
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPTLite(cfg)
        model.blocks = nn.ModuleList(MoEBlock(cfg, n_experts, k, capacity_factor, shared) for _ in range(cfg.n_layer))
        model.blocks.apply(init_weights)
        for block in model.blocks:
            nn.init.normal_(block.moe.experts.w1, std=0.02)
            nn.init.normal_(block.moe.experts.w2, std=0.02)
    return model


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """The layers that route tokens (`MoE`, and `par.moe.experts.ExpertParallelMoE`): `routes_tokens`."""
    return [m for m in model.modules() if getattr(m, "routes_tokens", False)]


def aux_loss(model: nn.Module) -> torch.Tensor:
    """Σ over the model's MoE layers of their last forward's load-balancing loss."""
    return sum((m.aux for m in moe_layers(model)), torch.zeros(()))


def z_loss(model: nn.Module) -> torch.Tensor:
    """Σ over the model's MoE layers of their last forward's router z-loss."""
    return sum((m.z for m in moe_layers(model)), torch.zeros(()))


def tokens_per_expert(model: nn.Module) -> list[list[int]]:
    """Per MoE layer, the choices each expert received in the last forward (summed over groups)."""
    return [sum(r.load for r in m.routings).tolist() for m in moe_layers(model)]


def set_groups(model: nn.Module, groups: int) -> None:
    for block in model.modules():
        if isinstance(block, MoEBlock):
            block.groups = groups


def moe_loss(model: nn.Module, logits: torch.Tensor, targets: torch.Tensor, alpha: float,
             beta: float = 0.0) -> torch.Tensor:
    """Next-token cross-entropy + alpha · Σ_layers aux (the balancing loss of the forward just run)
    + beta · Σ_layers z (the router z-loss)."""
    loss = lm_loss(logits, targets) + alpha * aux_loss(model)
    return loss + beta * z_loss(model) if beta else loss
