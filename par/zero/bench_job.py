"""The ZeRO benchmark on every rank: par ZeRO-1 / ZeRO-3 beside torch's ZeroRedundancyOptimizer / FSDP2.

    python -m par bench zero        (launches this job once per world size; `par.zero.bench`)

Every engine trains its own copy of the same GPT-lite from the same seed on the same batches. The
engines take turns: in each of `--rounds` rounds every engine runs one step (forward, backward,
Adam step), timed from a barrier to the slowest rank's end, so a change of machine load hits every
engine alike; `--warmup` rounds go first, untimed. Memory per rank: on a GPU the CUDA peak of a
separate run of that engine alone; on the CPU the model-state bytes alive right after backward
(a DTensor counted by its local shard).

Result: {"world_size", "backend", "numel", "rows": {name: {"times": [s per round], "state_bytes",
"cuda_peak", "memory", "loss"}}}.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass, replace

import torch

import par.runtime.dist
from par.measure import slowest, timed_step
from par.memory import accounting as memory
from par.model import build, lm_loss, preset
from par.runtime.job_args import arg, JobArgs
from par.zero import torch_api as torch_zero
from par.zero.engine import Zero


class ParZero:
    def __init__(self, model, stage, impl, prefetch=False):
        self.model = model
        self.zero = Zero(model, stage=stage, optimizer="adam", lr=1e-3, impl=impl, prefetch=prefetch)

    def backward(self, loss):
        self.zero.backward(loss)

    def state_bytes(self):
        return self.zero.memory()["model_states"]

    def step(self):
        self.zero.step()
        self.zero.zero_grad()

    def close(self):
        self.zero.close()


class TorchEngine:
    """A torch model and optimizer behind the calls `ParZero` answers."""

    def backward(self, loss):
        loss.backward()

    def state_bytes(self):
        return torch_zero.model_state_bytes(self.model, self.opt)["model_states"]

    def step(self):
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)

    def close(self):
        pass


class TorchZero1(TorchEngine):
    def __init__(self, model):
        self.model, self.opt = torch_zero.zero1(model, lr=1e-3)


class TorchFSDP2(TorchEngine):
    def __init__(self, model):
        self.model = torch_zero.fsdp2(model)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)


def engines(impls) -> dict:
    out = {}
    for impl in impls:
        out[f"par ZeRO-1 ({impl})"] = lambda m, impl=impl: ParZero(m, 1, impl)
    out["torch ZeroRedundancyOptimizer"] = TorchZero1
    for impl in impls:
        out[f"par ZeRO-3 ({impl})"] = lambda m, impl=impl: ParZero(m, 3, impl)
        out[f"par ZeRO-3 ({impl}, prefetch)"] = lambda m, impl=impl: ParZero(m, 3, impl, True)
    out["torch FSDP2 fully_shard"] = TorchFSDP2
    return out


def one_step(engine, x, device) -> tuple[float, torch.Tensor]:
    with timed_step(device, barrier=True) as clock:
        loss = lm_loss(engine.model(x), x)
        engine.backward(loss)
        engine.step()
    return clock.seconds, loss


@dataclass(frozen=True)
class Args(JobArgs):
    preset: str = arg("small")
    batch_size: int = arg(8)
    rounds: int = arg(9)
    warmup: int = arg(2, "untimed rounds first (at least 2)")
    impls: tuple[str, ...] = arg(("ring", "torch"))
    only: tuple[str, ...] = arg((), "comma-separated row names to run (default: all)")


def main(argv=None) -> None:
    args = Args.parse(argv)
    args = replace(args, warmup=max(2, args.warmup))        # round 1 measures the memory, untimed
    env = par.runtime.dist.init()
    cfg = preset(args.preset)
    n, r, per = env.world_size, env.rank, args.batch_size // env.world_size
    makers = {k: v for k, v in engines(args.impls).items() if not args.only or k in args.only}
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, cfg.vocab_size, (args.batch_size, cfg.block_size), generator=g)[r * per:(r + 1) * per]
               .to(env.device) for _ in range(args.warmup + args.rounds)]
    rows = {}
    if env.device.type == "cuda":           # the peak of each engine alone, before they share the device
        for name, make in makers.items():
            gc.collect()
            torch.cuda.empty_cache()
            memory.reset_cuda_peak(env.device)
            engine = make(build(cfg, seed=0).to(env.device))
            for x in batches[:2]:
                one_step(engine, x, env.device)
            rows[name] = {"cuda_peak": memory.cuda_peak_bytes(env.device)}
            engine.close()
            del engine
    live = {name: make(build(cfg, seed=0).to(env.device)) for name, make in makers.items()}
    times = {name: [] for name in live}
    state = {}
    for i, x in enumerate(batches):
        for name, engine in live.items():
            if i == 1:                       # model states at their peak: right after a backward (warm-up)
                loss = lm_loss(engine.model(x), x)
                engine.backward(loss)
                state[name] = engine.state_bytes()
                engine.step()
                continue
            dt, loss = one_step(engine, x, env.device)
            if i >= args.warmup:
                times[name].append(dt)
    for name in live:
        step_s = slowest(par.runtime.dist.gather_object(times[name]) or [times[name]])   # on rank 0, the slowest rank's
        peak = rows.get(name, {}).get("cuda_peak")
        rows[name] = {"times": step_s, "state_bytes": state[name], "cuda_peak": peak,
                      "memory": peak if peak else state[name]}
    numel = memory.param_count(cfg)
    par.runtime.dist.save_result({"world_size": n, "backend": env.backend, "numel": numel, "preset": args.preset,
                                  "rows": rows})
    for engine in live.values():
        engine.close()
    par.runtime.dist.teardown()


if __name__ == "__main__":
    main()
