"""Predicted vs measured model-state memory of GPT-lite, on every rank.

    torchrun --nproc-per-node=2 -m par.jobs.memory --preset tiny --optimizers adam,momentum,sgd

Each rank builds the same GPT-lite on its device, and for each optimizer takes
`--steps` real fp32 steps on batches of its own. It measures the live bytes of
parameters, gradients and optimizer state after building, after the first backward
and after every step (`par.memory.live_model_state_bytes`), beside the formula
`model_state_bytes` (fp32: 4 + 4 + K bytes per parameter; Adam K = 8, momentum 4,
SGD 0), and the CUDA peak on a GPU. Rank 0 saves every rank's numbers.
"""
from __future__ import annotations

import argparse

import torch

import par.dist
from par import memory
from par.data import CharDataset
from par.model import build, lm_loss, preset
from par.reference import make_optimizer


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--optimizers", default="adam,momentum,sgd", help="comma-separated: sgd, momentum, adam")
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank")
    ap.add_argument("--steps", type=int, default=1, help="optimizer steps (model states stay constant)")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def measure_one(cfg, optimizer: str, batch: int, steps: int, seed: int, env) -> dict:
    """`steps` fp32 steps; live model-state bytes after build, the first backward and each step."""
    memory.reset_cuda_peak(env.device)
    model = build(cfg, seed=seed).to(env.device)
    opt = make_optimizer(model.parameters(), optimizer, lr=1e-3)
    data = CharDataset(block_size=cfg.block_size)
    g = torch.Generator().manual_seed(seed * 1000 + env.rank)
    phases = {"built": memory.live_model_state_bytes(model, opt).to_dict()}
    totals = []
    for step in range(max(1, steps)):
        rows = torch.randint(len(data), (batch,), generator=g).tolist()
        x, y = (torch.stack(t).to(env.device) for t in zip(*(data[i] for i in rows)))
        opt.zero_grad(set_to_none=True)
        lm_loss(model(x), y).backward()
        if step == 0:
            phases["backward"] = memory.live_model_state_bytes(model, opt).to_dict()
        opt.step()
        totals.append(memory.live_model_state_bytes(model, opt).total)
    measured = memory.live_model_state_bytes(model, opt)
    phases["step"] = measured.to_dict()
    numel = sum(p.numel() for p in model.parameters())
    return {
        "numel": numel,
        "predicted": memory.model_state_bytes(numel, precision="fp32", optimizer=optimizer).to_dict(),
        "measured": measured.to_dict(),
        "phases": phases,
        "totals_per_step": totals,
        "scalar_bytes": memory.live_model_state_bytes(model, opt, include_scalars=True).optimizer - measured.optimizer,
        "cuda_peak": memory.cuda_peak_bytes(env.device),
    }


def main(argv=None):
    args = parse(argv)
    env = par.dist.init()
    cfg = preset(args.preset)
    names = [o.strip() for o in args.optimizers.split(",") if o.strip()]
    mine = {o: measure_one(cfg, o, args.batch, args.steps, args.seed, env) for o in names}
    for o, r in mine.items():
        ok = "equal" if r["predicted"] == r["measured"] else "DIFFERENT"
        print(f"rank {env.rank} {o:>8}: predicted {r['predicted']['total']:,.0f} B, "
              f"measured {r['measured']['total']:,.0f} B ({ok}), cuda peak {memory.format_bytes(r['cuda_peak'])}",
              flush=True)
    ranks = par.dist.gather_object(mine)
    if env.is_rank0:
        par.dist.save_result({
            "preset": args.preset, "steps": args.steps, "batch": args.batch, "world_size": env.world_size, "backend": env.backend,
            "device": str(env.device), "numel": mine[names[0]]["numel"] if names else 0,
            "runs": {o: {"predicted": mine[o]["predicted"],
                         "measured": [r[o]["measured"] for r in ranks],
                         "phases": [r[o]["phases"] for r in ranks],
                         "totals_per_step": [r[o]["totals_per_step"] for r in ranks],
                         "scalar_bytes": [r[o]["scalar_bytes"] for r in ranks],
                         "cuda_peak": [r[o]["cuda_peak"] for r in ranks]} for o in names},
        })
    par.dist.teardown()


if __name__ == "__main__":
    main()
