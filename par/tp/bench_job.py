"""Time par's tensor parallelism against torch.distributed.tensor.parallel on every rank (`python -m par bench tp`).

    par.runtime.launch.run("par.tp.bench_job", nproc=2, args=["--preset", "small", "--batch-size", 8])

For the GPT-lite MLP and a whole transformer block it builds the same dense module on every rank,
then par TP (`from_dense`, all-reduces by par's ring and by torch) and torch TP (`parallelize_module`
with ColwiseParallel / RowwiseParallel on a 1-D DeviceMesh), and times training steps in rotating
turns. Rank 0 saves {"world_size", "backend", "preset", "batch_size", "rows": [{module, impl, step_s
(median, slowest rank), param_bytes, max_err}], "loadavg"}.
"""
from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass

import torch

import par.runtime.dist
from par.measure import timed_step
from par.model import Block, MLP, preset
from par.runtime.job_args import arg, JobArgs
from par.tp import layers as tp
from par.tp.layers import qkv_for_column_split

KINDS = ("mlp", "block")


@dataclass(frozen=True)
class Args(JobArgs):
    preset: str = arg("small")
    batch_size: int = arg(8)
    steps: int = arg(10, "timed steps per turn")
    warmup: int = arg(3)
    rounds: int = arg(3)


def _dense(kind, cfg, device):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return (MLP(cfg.d_model, cfg.ffn) if kind == "mlp" else Block(cfg)).to(device)


def _par_tp(kind, dense, impl):
    cls = tp.TensorParallelMLP if kind == "mlp" else tp.TensorParallelBlock
    return cls.from_dense(dense, impl=impl)


def _torch_tp(kind, dense, n, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    m = copy.deepcopy(dense)
    mesh = init_device_mesh(device.type, (n,))
    if kind == "mlp":
        plan = {"fc": ColwiseParallel(), "proj": RowwiseParallel()}
    else:
        with torch.no_grad():
            m.attn.qkv.weight.copy_(qkv_for_column_split(m.attn.qkv.weight, n))
            m.attn.qkv.bias.copy_(qkv_for_column_split(m.attn.qkv.bias, n))
        m.attn.n_head //= n  # each rank attends with its own heads
        plan = {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}
    return parallelize_module(m, mesh, plan)


def local_param_bytes(module) -> int:
    """Bytes of the parameters this rank really holds (a DTensor's local shard)."""
    total = 0
    for p in module.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        total += t.numel() * t.element_size()
    return total


def _time_steps(module, opt, x, w_out, steps, warmup, device) -> list[float]:
    times = []
    for i in range(warmup + steps):
        with timed_step(device, barrier=True) as clock:
            opt.zero_grad(set_to_none=True)
            (module(x) * w_out).sum().backward()
            opt.step()
        if i >= warmup:
            times.append(clock.seconds)
    return times


def main(argv=None) -> int:
    args = Args.parse(argv)
    env = par.runtime.dist.init()
    n, device = env.world_size, env.device
    cfg = preset(args.preset)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch_size, cfg.block_size, cfg.d_model, generator=g).to(device)
    w_out = torch.randn(x.shape, generator=g).to(device)
    rows = []
    for kind in KINDS:
        dense = _dense(kind, cfg, device)
        with torch.no_grad():
            ref = dense(x)
        impls = {"par ring": lambda: _par_tp(kind, dense, "ring"), "par torch-allreduce": lambda: _par_tp(kind, dense, "torch"),
                 "torch TP": lambda: _torch_tp(kind, dense, n, device)}
        models = {name: make() for name, make in impls.items()}
        with torch.no_grad():  # before any training step: each must compute the dense module's output
            errs = {name: (m(x) - ref).abs().max().item() for name, m in models.items()}
        opts = {name: torch.optim.Adam(m.parameters(), lr=1e-3) for name, m in models.items()}
        times = {name: [] for name in models}
        for rnd in range(args.rounds):
            for name, m in models.items():
                times[name] += _time_steps(m, opts[name], x, w_out, args.steps, args.warmup if rnd == 0 else 0,
                                           device)
        for name, m in models.items():
            t = statistics.median(times[name])
            worst = max(par.runtime.dist.gather_object(t) or [t])
            rows.append({"module": kind, "impl": name, "step_s": worst, "param_bytes": local_param_bytes(m),
                         "max_err": errs[name]})
    par.runtime.dist.save_result({"world_size": n, "backend": env.backend, "preset": args.preset,
                                  "batch_size": args.batch_size, "rows": rows, "loadavg": _loadavg()})
    par.runtime.dist.teardown()
    return 0


def _loadavg():
    import os
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


if __name__ == "__main__":
    raise SystemExit(main())
