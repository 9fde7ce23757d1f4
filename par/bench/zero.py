"""Benchmark: par ZeRO-1 vs torch ZeroRedundancyOptimizer, par ZeRO-3 vs FSDP2 `fully_shard`.

    python -m par.bench.zero [--worlds 2,4] [--preset small] [--batch-size 8] [--steps 10]

One launch per world size (gloo on a CPU mesh here, NCCL when every rank has a GPU) trains the
same GPT-lite from the same seed with

* par ZeRO-1 (`par.zero.Zero(stage=1)`)  vs  DDP(gradient_as_bucket_view) + ZeroRedundancyOptimizer(Adam)
* par ZeRO-3 (`par.zero.Zero(stage=3)`, with and without prefetch)  vs  FSDP2: `fully_shard` on every
  `to_layers()` unit and the root (FSDP2 prefetches the next unit by default)

par's collectives run both as par's hand-written ring (`ring`) and through torch.distributed
(`torch`). Per step: forward, backward, Adam step; the time is the median over steps of the slowest
rank. Memory per rank: on a GPU the CUDA peak (max_memory_allocated); on the CPU the model-state
bytes alive right after backward (parameters + gradients + optimizer state, a DTensor counted by its
local shard), the point where model states peak. Ratios are par / torch; targets: time <= 1.25x,
memory <= 1.0x.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

TARGET_TIME, TARGET_MEMORY = 1.25, 1.0


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m par.bench.zero", description="par ZeRO vs torch ZeRO-1 / FSDP2")
    p.add_argument("--worlds", default="2,4", help="comma-separated world sizes")
    p.add_argument("--preset", default="small")
    p.add_argument("--batch-size", type=int, default=8, help="global batch (a multiple of every world size)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--impls", default="ring,torch", help="par collectives to try: ring, torch")
    p.add_argument("--backend", default="auto")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------- on every rank
def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes(tensors) -> int:
    from par.memory import tensor_bytes
    return tensor_bytes([_local(t) for t in tensors if t is not None])


def _torch_state_bytes(model, opt) -> int:
    params = list(model.parameters())
    states = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return _bytes(params) + _bytes([p.grad for p in params]) + _bytes(states)


class ParZero:
    def __init__(self, model, stage, impl, prefetch=False):
        from par.zero import Zero
        self.model = model
        self.zero = Zero(model, stage=stage, optimizer="adam", lr=1e-3, impl=impl, prefetch=prefetch)

    def backward(self, loss):
        self.zero.backward(loss)

    def state_bytes(self):
        return self.zero.memory()["model_states"]

    def step(self):
        self.zero.step()
        self.zero.zero_grad()


class TorchZero1:
    def __init__(self, model, device):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP
        self.model = DDP(model, device_ids=[device] if device.type == "cuda" else None,
                         gradient_as_bucket_view=True)
        self.opt = ZeroRedundancyOptimizer(self.model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)

    def backward(self, loss):
        loss.backward()

    def state_bytes(self):
        return _torch_state_bytes(self.model, self.opt.optim)

    def step(self):
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)


class TorchFSDP2:
    def __init__(self, model, device, n):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh(device.type, (n,))
        for unit in model.to_layers():
            fully_shard(unit, mesh=mesh)
        self.model = fully_shard(model, mesh=mesh)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)

    def backward(self, loss):
        loss.backward()

    def state_bytes(self):
        return _torch_state_bytes(self.model, self.opt)

    def step(self):
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)


def _measure(make, cfg, args, env) -> dict:
    import torch.distributed as dist
    from par import collectives, memory
    from par.model import build, lm_loss
    model = build(cfg, seed=0).to(env.device)
    engine = make(model)
    g = torch.Generator().manual_seed(1)
    n, r, per = env.world_size, env.rank, args.batch_size // env.world_size
    times, state = [], 0
    memory.reset_cuda_peak(env.device)
    for i in range(args.warmup + args.steps):
        x = torch.randint(0, cfg.vocab_size, (args.batch_size, cfg.block_size), generator=g)
        x = x[r * per:(r + 1) * per].to(env.device)
        dist.barrier()
        t0 = time.perf_counter()
        loss = lm_loss(engine.model(x), x)
        engine.backward(loss)
        if i == args.warmup:
            state = engine.state_bytes()
        engine.step()
        if env.device.type == "cuda":
            torch.cuda.synchronize(env.device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=env.device)
    collectives.all_reduce(t, op="max", impl="torch")
    peak = memory.cuda_peak_bytes(env.device)
    return {"time": t.item(), "state_bytes": state, "cuda_peak": peak, "memory": peak if peak else state,
            "loss": loss.item()}


def worker(args) -> int:
    import par.dist
    from par.model import preset
    env = par.dist.init()
    cfg = preset(args.preset)
    impls = args.impls.split(",")
    rows = {}
    for impl in impls:
        rows[f"par ZeRO-1 ({impl})"] = _measure(lambda m: ParZero(m, 1, impl), cfg, args, env)
    rows["torch ZeroRedundancyOptimizer"] = _measure(lambda m: TorchZero1(m, env.device), cfg, args, env)
    for impl in impls:
        rows[f"par ZeRO-3 ({impl})"] = _measure(lambda m: ParZero(m, 3, impl), cfg, args, env)
        rows[f"par ZeRO-3 ({impl}, prefetch)"] = _measure(lambda m: ParZero(m, 3, impl, True), cfg, args, env)
    rows["torch FSDP2 fully_shard"] = _measure(lambda m: TorchFSDP2(m, env.device, env.world_size), cfg, args, env)
    numel = sum(p.numel() for p in __import__("par.model", fromlist=["build"]).build(cfg).parameters())
    par.dist.save_result({"world": env.world_size, "backend": env.backend, "numel": numel, "rows": rows})
    par.dist.teardown()
    return 0


# ---------------------------------------------------------------- the report
def ratios(rows: dict) -> list[dict]:
    """par / torch for every par row against its torch counterpart (ZeRO-1 vs ZeRO-1, ZeRO-3 vs FSDP2)."""
    out = []
    for name, row in rows.items():
        if not name.startswith("par"):
            continue
        ref = rows["torch ZeroRedundancyOptimizer" if "ZeRO-1" in name else "torch FSDP2 fully_shard"]
        out.append({"name": name, "time_ratio": row["time"] / ref["time"],
                    "memory_ratio": row["memory"] / ref["memory"]})
    return out


def report(world: int, result: dict) -> str:
    lines = [f"world size {world} ({result['backend']}), Ψ = {result['numel']:,}",
             f"  {'':36}{'step ms':>10}{'memory MB':>12}"]
    for name, row in result["rows"].items():
        lines.append(f"  {name:36}{row['time'] * 1e3:10.1f}{row['memory'] / 1e6:12.3f}")
    for r in ratios(result["rows"]):
        ok = "ok" if r["time_ratio"] <= TARGET_TIME and r["memory_ratio"] <= TARGET_MEMORY else "MISSES TARGET"
        lines.append(f"  {r['name']:36} time x{r['time_ratio']:.2f}  memory x{r['memory_ratio']:.2f}  {ok}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.worker:
        return worker(args)
    import par.launch
    rest = [a for a in (sys.argv[1:] if argv is None else argv)]
    print(f"par ZeRO vs torch (targets: time <= {TARGET_TIME}x, memory <= {TARGET_MEMORY}x); "
          f"timings on a shared machine are noisy")
    for world in map(int, args.worlds.split(",")):
        if args.batch_size % world:
            raise SystemExit(f"--batch-size {args.batch_size} is not a multiple of world size {world}")
        result = par.launch.run("par.bench.zero", nproc=world, args=[*rest, "--worker"], timeout=args.timeout,
                                backend=args.backend, quiet=True)
        print(report(world, result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
