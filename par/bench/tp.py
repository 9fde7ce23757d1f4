"""Benchmark: par's tensor parallelism vs torch.distributed.tensor.parallel on the same MLP and block.

    python -m par bench tp [--nproc 2] [--preset small] [--batch-size 8] [--steps 20] [--rounds 3]

One launch on `nproc` ranks (gloo on CPU, NCCL when every rank has a GPU). For the GPT-lite MLP and a
whole transformer block it builds the same dense module on every rank, then

* par TP: `TensorParallelMLP/Block.from_dense`, all-reduces by par's ring and by torch (`impl`)
* torch TP: `parallelize_module` with ColwiseParallel / RowwiseParallel on a 1-D DeviceMesh (the block's
  fused QKV weight re-laid out first, as par does, so a column split hands each rank whole heads)

and times a training step (forward, backward, Adam step) in rotating turns (a few steps of each, then
again, `--rounds` times, so a load spike on a shared machine hits all three): median over steps, slowest
rank. It also reports live parameter bytes per rank and the largest output difference from the dense
module. Ratios are par / torch: the target is time <= 1.15x and memory equal. The load average is printed
with the timings: on a busy machine they are only as good as the machine is quiet.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch

KINDS = ("mlp", "block")


def parse(argv):
    p = argparse.ArgumentParser(description="par TP vs torch.distributed.tensor.parallel")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--preset", default="small")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=10, help="timed steps per turn")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--backend", default="auto")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------- on every rank
def _dense(kind, cfg, device):
    from par.model import MLP, Block
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return (MLP(cfg.d_model, cfg.ffn) if kind == "mlp" else Block(cfg)).to(device)


def _par_tp(kind, dense, impl):
    from par import tensor_parallel as tp
    cls = tp.TensorParallelMLP if kind == "mlp" else tp.TensorParallelBlock
    return cls.from_dense(dense, impl=impl)


def _torch_tp(kind, dense, n, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from par.tensor_parallel import qkv_for_column_split
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
    import torch.distributed as dist
    times = []
    for i in range(warmup + steps):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        (module(x) * w_out).sum().backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def worker(args) -> int:
    import par.dist
    from par.model import preset
    env = par.dist.init()
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
            worst = max(par.dist.gather_object(t) or [t])
            rows.append({"module": kind, "impl": name, "step_s": worst, "param_bytes": local_param_bytes(m),
                         "max_err": errs[name]})
    par.dist.save_result({"world_size": n, "backend": env.backend, "preset": args.preset,
                          "batch_size": args.batch_size, "rows": rows, "loadavg": _loadavg()})
    par.dist.teardown()
    return 0


def _loadavg():
    import os
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


# ---------------------------------------------------------------- the launcher side
def table(result) -> str:
    lines = [f"tensor parallel, {result['world_size']} ranks ({result['backend']}), preset {result['preset']}, "
             f"batch {result['batch_size']}; load average {result.get('loadavg')} (timings as noisy as that)",
             f"{'module':<7} {'implementation':<21} {'step ms':>8} {'vs torch':>9} {'param bytes/rank':>17} "
             f"{'mem vs torch':>13} {'max |y - dense|':>16}"]
    for kind in KINDS:
        rows = [r for r in result["rows"] if r["module"] == kind]
        ref = next(r for r in rows if r["impl"] == "torch TP")
        for r in rows:
            lines.append(f"{kind:<7} {r['impl']:<21} {r['step_s'] * 1e3:8.2f} {r['step_s'] / ref['step_s']:8.2f}x "
                         f"{r['param_bytes']:17d} {r['param_bytes'] / ref['param_bytes']:12.2f}x {r['max_err']:16.2e}")
    return "\n".join(lines)


def run(nproc=2, preset="small", batch_size=8, steps=20, warmup=3, rounds=3, backend="auto", timeout=600,
        quiet=True) -> dict:
    from par import launch
    argv = ["--worker", "--preset", preset, "--batch-size", batch_size, "--steps", steps, "--warmup", warmup,
            "--rounds", rounds]
    return launch.run("par.bench.tp", nproc=nproc, args=argv, backend=backend, timeout=timeout, quiet=quiet)


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.worker:
        return worker(args)
    result = run(args.nproc, args.preset, args.batch_size, args.steps, args.warmup, args.rounds, args.backend,
                 args.timeout)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
