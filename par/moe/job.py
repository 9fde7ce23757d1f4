"""Train a MoE GPT-lite with expert parallelism inside data parallelism, with and without the balancing loss.

    par.runtime.launch.run("par.moe.job", nproc=2, args=["--alphas", "0,0.1", "--steps", "20"])

W ranks = W/ep EP groups of `--ep` ranks (default ep = W): every rank trains on its own sequences (one
routing group), its MoE layers send tokens to the experts' owners with the all-to-all (`--impl p2p` by
hand, `torch` for all_to_all_single). One run per balancing-loss weight alpha (`--alphas`). Rank 0
saves {"world_size", "backend", "runs": [...]}; each run has the contract's keys (losses, step_s, per_rank:
bytes sent per step) and

    alpha, ep, dp, impl, n_experts, k, capacity_factor, capacity   the run's settings (capacity: C per rank)
    tokens_per_expert   [step][layer][expert]: choices each expert received, summed over every rank
    dropped             [step]: fraction of the choices dropped (expert full), all layers and ranks
    alltoall_bytes      rank 0's bytes in all-to-alls per step (measured by par.comm.commlog) and its formula
    reference_losses    (--check) the single-process model on the same batches, ranks as routing groups
    max_loss_diff, max_param_diff   (--check) against it: every step's loss, the weights after the last step
    several_steps, max_param_diff_after_several   (--check) the weights after the first SEVERAL_STEPS steps (5, or
                        fewer in a shorter run): the course's "fp32 ≤ 1e-5 after several Adam steps". Adam divides
                        each update by √v + ε, so a weight whose gradient is nearly zero turns the rounding of a sum
                        taken in another order into a whole step's worth of difference: the weights drift apart
                        by a few 1e-7 per step, while the losses stay equal
and, with --torch-api, beside "runs": torch_api = par's all-to-all vs torch's all_to_all_single on the same tokens
(`par.moe.torch_api.compare`: dispatched rows, layer output, gradients; the split sizes of every rank)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

import par.runtime.dist
from par.comm import commlog
from par.data import CharDataset, global_batches
from par.measure import JobResult, RankResult, RunResult, slowest, timed_step
from par.model import preset
from par.moe import experts as ep, torch_api as moe_torch
from par.moe.router import build_moe_gpt, capacity, moe_layers, moe_loss, set_groups
from par.reference import make_optimizer
from par.runtime.job_args import arg, JobArgs
from par.runtime.job_work import Training


@dataclass(frozen=True)
class Args(JobArgs):
    preset: str = arg("tiny")
    steps: int = arg(20, minimum=1)
    batch: int = arg(4, "sequences per rank", minimum=1)
    experts: int = arg(4)
    k: int = arg(2)
    capacity_factor: float = arg(1.25)
    alphas: tuple[float, ...] = arg((0.0, 0.1), "balancing-loss weights, one run each")
    impl: str = arg("p2p", choices=ep.IMPLS)     # before the field `ep`, which hides the module in this body
    ep: int = arg(0, "ranks per EP group (default: all)")
    lr: float = arg(3e-3)
    check: bool = arg(False, "train the single-process model beside and compare")
    torch_api: bool = arg(False, "before the first run: dispatch one batch's tokens with par's all-to-all and with "
                                 "torch's all_to_all_single, and run a MoE layer with each (result['torch_api'])")


@dataclass(frozen=True, kw_only=True)
class RankResult(RankResult):
    """One rank's all-to-all bytes per step and their formula."""
    alltoall_bytes_per_step: int
    formula: int


@dataclass(frozen=True, kw_only=True)
class RunResult(RunResult):
    """One balancing-loss weight alpha: the quantities of the module's docstring."""
    Rank = RankResult
    alpha: float
    ep: int
    dp: int
    impl: str
    n_experts: int
    k: int
    capacity_factor: float
    capacity: int
    losses: list
    step_s: list
    tokens_per_expert: list
    dropped: list
    reference_losses: list
    alltoall_bytes: dict
    max_loss_diff: float | None = None
    max_param_diff: float | None = None
    several_steps: int | None = None
    max_param_diff_after_several: float | None = None


@dataclass(frozen=True, kw_only=True)
class Result(JobResult):
    """The launch: one run per alpha, and with --torch-api par's all-to-all beside torch's."""
    Run = RunResult
    torch_api: dict | None = None
    runs: tuple

def work(args: Args, nproc: int) -> list:
    """What a launch of these arguments computes (the course's dry run costs it): one run per alpha. The planner
    has no MoE: a dense model whose FFN holds the experts a rank keeps (a go/no-go estimate), the
    single-process reference beside (--check)."""
    import math
    from dataclasses import replace
    cfg = preset(args.preset)
    held = replace(cfg, d_ff=cfg.ffn * max(args.k, math.ceil(args.experts / (args.ep or nproc))))
    batch = args.batch * nproc
    return [Training(model=held, global_batch=batch, dp=nproc, steps=args.steps,
                     reference_batch=batch if args.check else 0, label=f"alpha {a}") for a in args.alphas]


def device_of(model) -> torch.device:
    return next(model.parameters()).device


def global_load(model) -> list[list[int]]:
    """Choices per expert of the last forward, per layer, summed over every rank."""
    load = torch.stack([layer.routings[0].load for layer in moe_layers(model)]).double()
    dist.all_reduce(load)
    return load.long().tolist()


def global_dropped(model) -> float:
    counts = torch.tensor([[sum(r.dropped for r in layer.routings), layer.routings[0].kept.numel()]
                           for layer in moe_layers(model)], dtype=torch.float64).sum(0).to(device_of(model))
    dist.all_reduce(counts)
    return (counts[0] / counts[1]).item()


SEVERAL_STEPS = 5


def max_param_diff(dense, model, env) -> float:
    """max |w − w_single| over every rank's weights against the single-process model's matching shard."""
    want = ep.reference_shard(dense, model)
    diff = torch.tensor([max((p.cpu() - want[k]).abs().max().item() for k, p in model.state_dict().items())],
                        device=env.device)
    dist.all_reduce(diff, dist.ReduceOp.MAX)
    return diff.item()


def run(args, alpha: float, env) -> dict:
    n, r = env.world_size, env.rank
    cfg = preset(args.preset)
    groups = ep.make_groups(args.ep or n)
    dense = build_moe_gpt(cfg, args.experts, args.k, args.capacity_factor, seed=0)
    model = ep.to_expert_parallel(dense, groups, args.impl).to(env.device)
    opt = make_optimizer(model.parameters(), "adam", args.lr)
    if args.check:
        set_groups(dense, n)
        ref_opt = make_optimizer(dense.parameters(), "adam", args.lr)
    data = CharDataset(block_size=cfg.block_size)
    cap = capacity(args.batch * cfg.block_size, args.experts, args.k, args.capacity_factor)
    out = {"alpha": alpha, "ep": groups.ep, "dp": groups.dp, "impl": args.impl, "n_experts": args.experts, "k": args.k,
           "capacity_factor": args.capacity_factor, "capacity": cap, "losses": [], "step_s": [],
           "tokens_per_expert": [], "dropped": [], "reference_losses": []}
    sent, mine = [], slice(r * args.batch, (r + 1) * args.batch)
    for x, y in global_batches(data, args.batch * n, args.steps, seed=1):
        if args.check:
            ref_opt.zero_grad(set_to_none=True)
            loss = moe_loss(dense, dense(x), y, alpha)
            loss.backward()
            ref_opt.step()
            out["reference_losses"].append(loss.item())
        xs, ys = x[mine].to(env.device), y[mine].to(env.device)
        with timed_step(env.device, barrier=True) as clock, commlog.capture() as log:
            out["losses"].append(ep.train_step(model, opt, xs, ys, groups, alpha))
        out["step_s"].append(clock.seconds)
        sent.append(log.total_bytes("all_to_all"))
        out["tokens_per_expert"].append(global_load(model))
        out["dropped"].append(global_dropped(model))
        if args.check and len(out["losses"]) == min(SEVERAL_STEPS, args.steps):
            out["several_steps"] = len(out["losses"])
            out["max_param_diff_after_several"] = max_param_diff(dense, model, env)
    formula = ep.moe_step_bytes(cfg.n_layer, args.experts, cap, cfg.d_model, groups.ep, r % groups.ep)
    out["alltoall_bytes"] = {"measured": sent[-1], "formula": formula}
    if args.check:
        out["max_loss_diff"] = max(abs(a - b) for a, b in zip(out["losses"], out["reference_losses"]))
        out["max_param_diff"] = max_param_diff(dense, model, env)
    out["per_rank"] = par.runtime.dist.gather_object({"rank": r, "alltoall_bytes_per_step": sent[-1], "formula": formula})
    every_step_s = par.runtime.dist.gather_object(out["step_s"])
    if every_step_s is not None:
        out["step_s"] = slowest(every_step_s)
    return out


def torch_api(args, env) -> dict:
    """par's all-to-all vs torch's all_to_all_single on the first MoE layer, this rank's tokens of the first batch
    (`par.moe.torch_api.compare`): the worst rank's differences, and every rank's split sizes."""
    cfg = preset(args.preset)
    groups = ep.make_groups(args.ep or env.world_size)
    model = ep.to_expert_parallel(build_moe_gpt(cfg, args.experts, args.k, args.capacity_factor, seed=0), groups,
                                  args.impl).to(env.device)
    x, _ = next(global_batches(CharDataset(block_size=cfg.block_size), args.batch * env.world_size, 1, seed=1))
    mine = slice(env.rank * args.batch, (env.rank + 1) * args.batch)
    with torch.no_grad():
        h = model.embed(x[mine].to(env.device))          # the tokens the first MoE layer would see, roughly
    every = par.runtime.dist.gather_object(moe_torch.compare(ep.ep_layers(model)[0], h))
    if every is None:
        return {}
    return {**{k: max(r[k] for r in every) for k in ("dispatch", "output", "grads", "max")},
            "split_sizes": [r["split_sizes"] for r in every], "dispatched_rows": [r["dispatched_rows"] for r in every]}


def main(argv=None) -> int:
    args = Args.parse(argv)
    env = par.runtime.dist.init()
    torch.manual_seed(0)
    result = {"world_size": env.world_size, "backend": env.backend}
    if args.torch_api:
        result["torch_api"] = torch_api(args, env)
    result["runs"] = [run(args, a, env) for a in args.alphas]
    runs = result["runs"]
    par.runtime.dist.save_result(result)
    for run_ in runs:
        par.runtime.dist.print0(f"alpha {run_['alpha']}: loss {run_['losses'][0]:.3f} -> {run_['losses'][-1]:.3f}, "
                                f"dropped {run_['dropped'][-1]:.1%}, all-to-all {run_['alltoall_bytes']['measured']} B/step "
                                f"(formula {run_['alltoall_bytes']['formula']})")
    par.runtime.dist.teardown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
