"""Expert parallelism: the E experts of a MoE layer sharded over the n ranks of an EP group.

Rank r holds experts `expert_range(E, n, r)` (`chunk_bounds`: sizes differ by at most one) and routes
its own tokens (one routing group, `par.moe.router`): its dispatch buffer (E, C, d) holds slots for every
expert, so the rows of expert e must travel to e's owner, and the outputs must come back:

    dispatch all-to-all   rank r sends the (E_p, C, d) rows of peer p's experts to p, for every p
    experts               rank r runs its E_r experts on (E_r, n·C, d): the slots of every rank's tokens
    combine all-to-all    the inverse: each (E_r, C, d) block of outputs goes home to the rank it came from

Bytes one rank sends in one all-to-all (`alltoall_bytes`): everything but the block it keeps,

    dispatch  (E - E_r) · C · d · bytes        combine  (n - 1) · E_r · C · d · bytes
    both = (n-1)/n · E · C · d · bytes when n divides E   (`alltoall_formula_bytes`)

and with C = f·k·S/E that is (n-1)/n · f · k · S · d · bytes: a MoE layer moves about f·k times the
activations it sees, twice forward (dispatch, combine) and twice backward (their gradients).

The all-to-all is written by hand on point-to-point (`impl="p2p"`): n-1 steps, at step s rank r sends to
r+s and receives from r-s, one `batch_isend_irecv` per step, waited before its data is read (NCCL's rule);
`impl="torch"` is `torch.distributed.all_to_all_single`. Both are logged in `par.comm.commlog` as
`all_to_all` with the bytes this rank sent, and both are autograd functions (backward is the all-to-all
back, with the send and receive sizes swapped).

EP inside DP (`EPGroups`): W ranks = W/e EP groups of e consecutive ranks; experts are replicated over the
W/e groups. Every rank back-propagates its loss / W; then the replicated weights (attention, router,
embeddings) are summed over all W ranks and each expert's gradient over the W/e ranks that hold it
(`sync_gradients`), so the step equals the single-process model with the W ranks' batches as routing groups.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from par.comm import commlog
from par.comm.collectives import all_reduce, chunk_bounds, group_rank, group_size
from par.moe.router import combine, dispatch, MoE, moe_loss, MoEError, route, set_groups

IMPLS = ("p2p", "torch")


def expert_range(n_experts: int, n: int, r: int) -> tuple[int, int]:
    """[start, end) of the experts rank r of n holds."""
    if n_experts < n:
        raise MoEError(f"{n_experts} experts cannot be sharded over {n} ranks: use an ep degree <= {n_experts}")
    return chunk_bounds(n_experts, n)[r]


def alltoall_bytes(n_experts: int, cap: int, d: int, n: int, r: int, itemsize: int = 4) -> tuple[int, int]:
    """(dispatch, combine) bytes rank r sends: (E - E_r)·C·d and (n-1)·E_r·C·d elements."""
    a, b = expert_range(n_experts, n, r)
    return (n_experts - (b - a)) * cap * d * itemsize, (n - 1) * (b - a) * cap * d * itemsize


def alltoall_formula_bytes(n_experts: int, cap: int, d: int, n: int, itemsize: int = 4) -> float:
    """The lecture's formula for one all-to-all: (n-1)/n · E · C · d · bytes per rank."""
    return (n - 1) / n * n_experts * cap * d * itemsize


# ---------------------------------------------------------------- the all-to-all
def _members(group) -> tuple[int, list[int]]:
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    return ranks.index(dist.get_rank()), ranks


def p2p_all_to_all(sends: list[torch.Tensor], recvs: list[torch.Tensor], group=None) -> int:
    """recvs[p] <- what peer p sent me as its sends[me]; n-1 pairwise steps; returns the bytes sent."""
    me, ranks = _members(group)
    n = len(ranks)
    recvs[me].copy_(sends[me])
    sent = 0
    for step in range(1, n):
        to, frm = (me + step) % n, (me - step) % n
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, sends[to].contiguous(), ranks[to], group),
                                        dist.P2POp(dist.irecv, recvs[frm], ranks[frm], group)])
        for work in works:        # under NCCL one Work for the batch: wait it before reading recvs[frm]
            work.wait()
        sent += sends[to].numel() * sends[to].element_size()
    return sent


def torch_all_to_all(sends: list[torch.Tensor], recvs: list[torch.Tensor], group=None) -> int:
    """The same exchange with `torch.distributed.all_to_all_single`; returns the bytes sent to others."""
    me = group_rank(group)
    inp = torch.cat([s.reshape(-1) for s in sends])
    out = inp.new_empty(sum(r.numel() for r in recvs))
    dist.all_to_all_single(out, inp, [r.numel() for r in recvs], [s.numel() for s in sends], group=group)
    for r, piece in zip(recvs, out.split([r.numel() for r in recvs])):
        r.copy_(piece.view_as(r))
    return sum(s.numel() * s.element_size() for p, s in enumerate(sends) if p != me)


def all_to_all_rows(x: torch.Tensor, send_rows: list[int], recv_rows: list[int], group=None,
                    impl: str = "p2p") -> torch.Tensor:
    """Rows send_rows[p] of x (in order) go to peer p; returns the rows every peer sent me, peer by peer."""
    if impl not in IMPLS:
        raise ValueError(f"unknown all-to-all impl {impl!r}: use one of {IMPLS}")
    x = x.contiguous()
    out = x.new_empty((sum(recv_rows),) + tuple(x.shape[1:]))
    sends, recvs = list(x.split(send_rows)), list(out.split(recv_rows))
    sent = (p2p_all_to_all if impl == "p2p" else torch_all_to_all)(sends, recvs, group)
    commlog.record("all_to_all", x.numel(), sent, len(send_rows), impl)
    return out


class AllToAll(torch.autograd.Function):
    """all_to_all_rows forward; backward sends each gradient block back where its rows came from."""

    @staticmethod
    def forward(ctx, x, send_rows, recv_rows, group, impl):
        ctx.args = (send_rows, recv_rows, group, impl)
        return all_to_all_rows(x, send_rows, recv_rows, group, impl)

    @staticmethod
    def backward(ctx, grad):
        send_rows, recv_rows, group, impl = ctx.args
        return all_to_all_rows(grad, recv_rows, send_rows, group, impl), None, None, None, None


# ---------------------------------------------------------------- the layer
class ExpertParallelMoE(nn.Module):
    """A `par.moe.router.MoE` whose experts are sharded over `group`: router whole, experts [start, end) here."""
    routes_tokens = True

    def __init__(self, dense: MoE, group=None, impl: str = "p2p"):
        super().__init__()
        n, r = group_size(group), group_rank(group)
        self.group, self.impl, self.n = group, impl, n
        self.k, self.capacity_factor, self.n_experts = dense.k, dense.capacity_factor, dense.n_experts
        self.owned = [expert_range(dense.n_experts, n, p) for p in range(n)]
        self.start, self.end = self.owned[r]
        self.router = copy.deepcopy(dense.router)
        self.experts = dense.experts.shard(self.start, self.end)
        self.shared = copy.deepcopy(dense.shared)          # replicated like the router; None without
        self.aux, self.z, self.routings = torch.zeros(()), torch.zeros(()), []

    def forward(self, x: torch.Tensor, groups: int = 1) -> torch.Tensor:
        if groups != 1:
            raise MoEError(f"an expert-parallel layer routes its rank's tokens as one group, not {groups}")
        tokens = x.reshape(-1, x.size(-1))
        r = route(self.router(tokens), self.k, self.capacity_factor)
        self.aux, self.z, self.routings = r.aux, r.z, [r]
        buf = dispatch(tokens, r)                                    # (E, C, d): slots for every expert
        e, c, d = buf.shape
        mine, n = self.end - self.start, self.n
        blocks = [b - a for a, b in self.owned]                      # experts per peer
        got = AllToAll.apply(buf.reshape(e, c * d), blocks, [mine] * n, self.group, self.impl)
        local = got.view(n, mine, c, d).transpose(0, 1).reshape(mine, n * c, d)   # my experts, every rank's slots
        out = self.experts(local).view(mine, n, c, d).transpose(0, 1).reshape(n * mine, c * d)
        back = AllToAll.apply(out, [mine] * n, blocks, self.group, self.impl)
        y = combine(back.view(e, c, d), r).view_as(x)
        return y + self.shared(x) if self.shared is not None else y


# ---------------------------------------------------------------- EP inside DP
@dataclass
class EPGroups:
    """W ranks as W/ep EP groups of ep consecutive ranks; `expert_dp` joins the ranks holding the same experts."""
    world: int
    ep: int
    ep_group: object = None
    expert_dp: object = None

    @property
    def dp(self) -> int:
        return self.world // self.ep


def make_groups(ep: int) -> EPGroups:
    """Build the process groups of EP inside DP (every rank calls it, in the same order)."""
    world, me = dist.get_world_size(), dist.get_rank()
    if ep < 1 or world % ep:
        raise MoEError(f"ep degree {ep} must divide the {world} ranks: use one of "
                       f"{[e for e in range(1, world + 1) if world % e == 0]}")
    out = EPGroups(world, ep)
    for start in range(0, world, ep):
        g = dist.new_group(list(range(start, start + ep)))
        if start <= me < start + ep:
            out.ep_group = g
    for i in range(ep):
        g = dist.new_group(list(range(i, world, ep)))
        if me % ep == i:
            out.expert_dp = g
    return out


def to_expert_parallel(model: nn.Module, groups: EPGroups, impl: str = "p2p") -> nn.Module:
    """A copy of a `par.moe.router` model whose MoE layers are `ExpertParallelMoE` over `groups.ep_group`."""
    model = copy.deepcopy(model)
    set_groups(model, 1)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, MoE):
                setattr(parent, name, ExpertParallelMoE(child, groups.ep_group, impl))
    return model


def expert_parameters(model: nn.Module) -> set:
    return {id(p) for m in model.modules() if isinstance(m, ExpertParallelMoE) for p in m.experts.parameters()}


def sync_gradients(model: nn.Module, groups: EPGroups, impl: str = "ring") -> None:
    """Sum replicated weights' gradients over all ranks, experts' over the ranks holding the same experts
    (each rank back-propagated loss / W): one all-reduce of each kind, on the gradients laid end to end."""
    experts = expert_parameters(model)
    with_grad = [p for p in model.parameters() if p.grad is not None]
    _sum_flat([p for p in with_grad if id(p) not in experts], None, impl)
    if groups.dp > 1:                           # pure EP (ep = W): each expert lives on one rank only
        _sum_flat([p for p in with_grad if id(p) in experts], groups.expert_dp, impl)


def _sum_flat(params, group, impl: str) -> None:
    if not params:
        return
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    all_reduce(flat, "sum", group, impl)
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(g.view_as(p.grad))


def ep_layers(model: nn.Module) -> list[ExpertParallelMoE]:
    return [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]


def reference_shard(dense_model: nn.Module, ep_model: nn.Module) -> dict:
    """The dense model's state, cut as `ep_model` holds it (experts sliced): for equality checks."""
    state = dense_model.state_dict()
    out = {}
    for name, t in ep_model.state_dict().items():
        want = state[name]
        if want.shape != t.shape:        # an expert tensor: find this rank's slice
            layer = ep_model.get_submodule(name.rsplit(".", 2)[0])
            want = want[layer.start:layer.end]
        out[name] = want
    return out


def train_step(model: nn.Module, opt, x: torch.Tensor, y: torch.Tensor, groups: EPGroups, alpha: float,
               impl: str = "ring", beta: float = 0.0) -> float:
    """One step of EP inside DP on this rank's batch (x, y): backward of loss / W, `sync_gradients`, the
    optimizer. Returns the loss of the global batch (mean over ranks, as the single process computes it)."""
    opt.zero_grad(set_to_none=True)
    loss = moe_loss(model, model(x), y, alpha, beta)
    (loss / groups.world).backward()
    sync_gradients(model, groups, impl)
    opt.step()
    total = loss.detach().clone().reshape(1)
    dist.all_reduce(total)
    return total.item() / groups.world


def moe_step_bytes(n_moe_layers: int, n_experts: int, cap: int, d: int, n: int, r: int, itemsize: int = 4) -> int:
    """Bytes rank r sends in all-to-alls per training step: per MoE layer dispatch + combine forward,
    and the same two backward (their gradients)."""
    return n_moe_layers * 2 * sum(alltoall_bytes(n_experts, cap, d, n, r, itemsize))
