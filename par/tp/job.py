"""Train a tensor-parallel GPT-lite on every rank of the job (TP degree = world size), beside the dense model.

    par.runtime.launch.run("par.tp.job", nproc=tensor_parallel.tp_degree(cfg, world_size), args=["--steps", "20"])
    torchrun --nproc-per-node=2 -m par.tp.job --steps 20

Launch it on `par.tp.layers.tp_degree(cfg, world_size)` ranks: the degree must divide the heads.
Every rank sees the same (whole) batch: tensor parallelism splits the layers, not the data. Rank 0
saves, beside the job contract's keys (world_size, backend, losses = the TP model's loss per step,
step_s = the slowest rank's seconds per step, per_rank):

    dense_losses      the dense model trained on the same batches (unless --no-reference)
    max_param_diff    the largest gap between a rank's shards and the matching slices of the dense
                      model after training, over every rank; max_param_diff_name says which parameter
    comm              the collectives of one step per layer (count and bytes vs the formula)
    memory            live parameter bytes per rank (measured vs formula, for every TP degree that
                      divides the world size) and model states after training
    torch_api         with --torch-api K: torch's DTensor `parallelize_module` trained K steps beside par's TP
                      from the same weights on the same batches; the largest |difference| over every rank of
                      the logits, loss, first gradients and final parameter shards (`par.tp.torch_api.compare`)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

import par.runtime.dist
from par.comm import commlog
from par.comm.collectives import all_reduce_formula_bytes, ring_all_reduce_bytes
from par.data import CharDataset, global_batches
from par.measure import JobResult, RankResult, RunResult, slowest, timed_step
from par.memory.accounting import live_model_state_bytes, model_state_bytes
from par.model import build, lm_loss, preset
from par.reference import make_optimizer
from par.runtime.job_args import arg, JobArgs
from par.runtime.job_work import Training
from par.tp import layers as tp, torch_api


@dataclass(frozen=True)
class Args(JobArgs):
    preset: str = arg("tiny")
    n_head: int | None = arg(None, "override the preset's number of heads")
    d_model: int | None = arg(None, "override the preset's hidden size")
    torch_api: int = arg(0, "also train torch's DTensor parallelize_module beside par's TP for this many steps on "
                            "the same weights and data (par.tp.torch_api.compare): result['torch_api']", minimum=0)
    steps: int = arg(20, minimum=1)
    batch_size: int = arg(8, minimum=1)
    lr: float = arg(3e-3)
    optimizer: str = arg("adam")
    eps: float = arg(1e-8, "Adam's epsilon")
    impl: str = arg("ring", "all-reduce: par's ring or torch's", choices=("ring", "torch"))
    seed: int = arg(0)
    no_reference: bool = arg(False, "skip the dense model (big presets)")


@dataclass(frozen=True, kw_only=True)
class RankResult(RankResult):
    """One rank's step times, parameter bytes and (unless --no-reference) its largest gap to the dense model."""
    step_s: list
    param_bytes: int
    max_param_diff: float | None = None
    max_param_diff_name: str | None = None


@dataclass(frozen=True, kw_only=True)
class Result(JobResult, RunResult):
    """The launch (one run): losses and step times, the bytes sent (`comm`) and held (`memory`) beside their
    formulas, the dense model's losses and the largest gap to it, torch's TP API beside par's."""
    Rank = RankResult
    device: str
    config: dict
    batch_size: int
    impl: str
    losses: list
    step_s: list
    comm: dict
    memory: dict
    torch_api: dict | None = None
    dense_losses: list | None = None
    max_param_diff: float | None = None
    max_param_diff_name: str | None = None

def work(args: Args, nproc: int) -> list:
    """What a launch of these arguments computes (the course's dry run costs it): TP training on nproc ranks, the
    dense model trained beside (unless --no-reference); --torch-api: par's TP and DTensor's side by side."""
    from dataclasses import replace
    sizes = {k: v for k, v in (("n_head", args.n_head), ("d_model", args.d_model)) if v is not None}
    one = Training(model=preset(args.preset, **sizes), global_batch=args.batch_size, tp=nproc,
                   optimizer=args.optimizer, steps=args.steps,
                   reference_batch=0 if args.no_reference else args.batch_size, label=f"TP {nproc}")
    return [one] + ([replace(one, steps=2 * args.torch_api, reference_batch=0, label=f"TP {nproc}: par and DTensor")]
                    if args.torch_api else [])


def train(model, batches, optimizer, lr, device, eps=1e-8):
    """Plain training loop; returns (losses, seconds per step, the first step's communication log, optimizer)."""
    opt = make_optimizer(model.parameters(), optimizer, lr, **({"eps": eps} if optimizer.startswith("adam") else {}))
    losses, times, first = [], [], None
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with timed_step(device) as clock, commlog.capture() as log:
            opt.zero_grad(set_to_none=True)
            loss = lm_loss(model(x), y)
            loss.backward()
            opt.step()
        times.append(clock.seconds)
        losses.append(loss.item())
        first = first if first is not None else log
    return losses, times, first, opt


def comm_per_layer(log, n_layer: int) -> list[dict]:
    """Count and bytes of the all-reduces each layer issued, forward and backward."""
    rows = []
    for i in range(n_layer):
        ev = [e for e in log.events if e.kind == "all_reduce" and e.tag.startswith(f"layer {i}/")]
        rows.append({"layer": i, "forward": sum(e.tag.endswith("/fwd") for e in ev),
                     "backward": sum(e.tag.endswith("/bwd") for e in ev), "bytes": sum(e.bytes_sent for e in ev)})
    return rows


def memory_by_degree(dense, world: int, rank: int) -> dict:
    """Live parameter bytes on this rank of a TP model for every degree d dividing the world size."""
    out = {}
    for d in [d for d in range(1, world + 1) if world % d == 0]:
        groups = [dist.new_group(list(range(s, s + d))) for s in range(0, world, d)]  # every rank makes every group
        try:
            model = tp.TensorParallelGPT.from_dense(dense, groups[rank // d])
        except ValueError:  # this degree does not divide the heads / sizes
            continue
        out[d] = tp.param_bytes(model)
        del model
    return out


def main(argv=None) -> int:
    args = Args.parse(argv)
    env = par.runtime.dist.init()
    n, r, device = env.world_size, env.rank, env.device
    overrides = {k: v for k, v in (("n_head", args.n_head), ("d_model", args.d_model)) if v is not None}
    cfg = preset(args.preset, **overrides)
    if tp.tp_degree(cfg, n) != n:
        raise ValueError(f"{n} ranks cannot split {cfg.n_head} heads (d_model {cfg.d_model}, ffn {cfg.ffn}) evenly: "
                         f"launch par.tp.layers.tp_degree(cfg, {n}) = {tp.tp_degree(cfg, n)} ranks")
    dense = build(cfg, seed=args.seed).to(device)
    model = tp.TensorParallelGPT.from_dense(dense, impl=args.impl)
    ds = CharDataset(block_size=cfg.block_size)
    batches = list(global_batches(ds, args.batch_size, args.steps, seed=args.seed))

    if args.torch_api:   # before training: both start from the dense weights
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device.type, (n,))
        mine_torch = torch_api.compare(dense, mesh, [(x.to(device), y.to(device)) for x, y in batches[:args.torch_api]],
                                       lr=args.lr, eps=args.eps)
        every = par.runtime.dist.gather_object(mine_torch)
    losses, times, first, opt = train(model, batches, args.optimizer, args.lr, device, args.eps)
    every_time = par.runtime.dist.gather_object(times)
    result = {"world_size": n, "backend": env.backend, "device": str(device), "config": cfg.to_dict(),
              "batch_size": args.batch_size, "impl": args.impl, "losses": losses,
              "step_s": slowest(every_time) if every_time else times}

    act = tp.activation_bytes(args.batch_size, cfg.block_size, cfg.d_model)
    result["comm"] = {
        "per_layer": comm_per_layer(first, cfg.n_layer),
        "kinds": first.by_kind(),
        "allreduce_bytes_formula": all_reduce_formula_bytes(act, n),
        "allreduce_bytes_exact": ring_all_reduce_bytes(act // 4, n, r),
        "expected_per_step": tp.allreduces_per_step(cfg.n_layer),
        "tp_bytes_per_step_formula": tp.tp_bytes_per_step(cfg, args.batch_size, cfg.block_size, n),
        "tp_bytes_per_step_measured": first.total_bytes(),
        "dp_bytes_per_step_formula": all_reduce_formula_bytes(4 * tp.tp_param_count(cfg, 1), n),
    }
    result["memory"] = {
        "param_bytes_per_rank": par.runtime.dist.gather_object(tp.param_bytes(model)),
        "param_bytes_formula": 4 * tp.tp_param_count(cfg, n),
        "dense_param_bytes": tp.param_bytes(dense),
        "by_degree_measured": memory_by_degree(build(cfg, seed=args.seed).to(device), n, r),
        "by_degree_formula": {d: 4 * tp.tp_param_count(cfg, d) for d in range(1, n + 1) if n % d == 0},
        # params + grads + optimizer state alive after training vs (4 + 4 + K) bytes x this rank's parameters
        "model_states_measured": live_model_state_bytes(model, opt).to_dict(),
        "model_states_formula": model_state_bytes(tp.tp_param_count(cfg, n), precision="fp32",
                                                  optimizer=args.optimizer).to_dict(),
    }

    if args.torch_api and every is not None:   # the worst rank, key by key
        result["torch_api"] = {k: max(r[k] for r in every) for k in every[0]}
    mine = {"step_s": times, "param_bytes": tp.param_bytes(model)}
    if not args.no_reference:
        dense_losses, _, _, _ = train(dense, batches, args.optimizer, args.lr, device, args.eps)
        gap = tp.shard_like(model, dense)
        mine["max_param_diff"], mine["max_param_diff_name"] = max(
            ((p - gap[k]).abs().max().item(), k) for k, p in model.state_dict().items())
        result["dense_losses"] = dense_losses
    per_rank = par.runtime.dist.gather_object(mine)
    if per_rank is not None:
        result["per_rank"] = per_rank
        if not args.no_reference:
            worst = max(per_rank, key=lambda r: r["max_param_diff"])
            result["max_param_diff"], result["max_param_diff_name"] = worst["max_param_diff"], worst["max_param_diff_name"]
    par.runtime.dist.save_result(result)
    timed = result["step_s"][1:] or result["step_s"]
    par.runtime.dist.print0(f"TP={n}: loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
                            f"{sum(timed) / len(timed) * 1e3:.1f} ms/step, "
                            f"{result['comm']['tp_bytes_per_step_measured']} bytes sent per step per rank")
    par.runtime.dist.teardown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
