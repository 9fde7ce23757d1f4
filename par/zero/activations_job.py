"""ZeRO-R on real ranks: activation checkpoints partitioned across the tensor-parallel group.

    torchrun --nproc-per-node=2 -m par.zero.activations_job --preset tiny --batch 4

All ranks form one tensor-parallel group (t = world size) and hold GPT-lite sharded by
`par.tp.layers`. For each mode of `par.zero.activations.checkpointed_forward` (none, full recomputation,
full recomputation with partitioned checkpoints) every rank runs one forward and backward on the
same batch and measures: the bytes autograd keeps for the transformer layers (parameters excluded,
`par.memory.accounting.saved_activation_bytes`) beside `par.memory.accounting.activation_peak_bytes`' kept part
(L x `activation_bytes_per_layer` with tp = t), the largest difference of its gradients from
those of mode "none", and the bytes it sent by collective (`par.comm.commlog`).

Result: {"world_size", "backend", "preset", "batch", "seq", "layers", "tp", "modes": {mode: {
"saved_bytes", "formula_bytes", "grad_max_diff", "bytes", "per_rank": [saved bytes of every rank]}}}.
"""
from __future__ import annotations

from dataclasses import dataclass

import par.runtime.dist
from par.comm import commlog
from par.data import CharDataset, global_batches
from par.measure import JobResult
from par.memory import accounting as memory
from par.model import build, lm_loss, preset
from par.runtime.job_args import arg, JobArgs
from par.runtime.job_work import Training
from par.tp.layers import TensorParallelGPT
from par.zero import activations as zero_r


def measure(model, x, y, mode: str) -> dict:
    """One forward + backward in `mode`; the transformer layers' saved bytes, gradients, bytes sent."""
    model.zero_grad(set_to_none=True)
    params = list(model.parameters())
    layers = model.to_layers()
    with commlog.capture() as log:
        h = layers[0](x)                                    # embedding and head: outside the meter
        out, saved = memory.saved_activation_bytes(lambda t: zero_r.run_layers(layers[1:-1], t, mode), h,
                                                   exclude=params)
        lm_loss(layers[-1](out).float(), y).backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    by_kind = {}
    for e in log.events:
        key = "checkpoint all-gather" if "checkpoint" in e.tag else e.kind
        by_kind[key] = by_kind.get(key, 0) + e.bytes_sent
    return {"saved_bytes": saved, "grads": grads, "bytes": by_kind}


@dataclass(frozen=True)
class Args(JobArgs):
    preset: str = arg("tiny")
    batch: int = arg(4, "sequences (every TP rank sees the same batch)")
    seed: int = arg(0)


@dataclass(frozen=True, kw_only=True)
class Result(JobResult):
    """The launch: the shape, and per ZeRO-R mode (`modes.none`, ...) the bytes saved beside the formula."""
    preset: str
    batch: int
    seq: int
    d_model: int
    layers: int
    tp: int
    bytes_per_value: int
    modes: dict

def work(args: Args, nproc: int) -> list:
    """What a launch of these arguments computes (the course's dry run costs it): one TP step whose activations
    are measured."""
    return [Training(model=preset(args.preset), global_batch=args.batch, tp=nproc, steps=1, label="ZeRO-R activations")]


def main(argv=None) -> None:
    args = Args.parse(argv)
    env = par.runtime.dist.init()
    cfg = preset(args.preset)
    t = env.world_size
    model = TensorParallelGPT.from_dense(build(cfg, seed=args.seed)).to(env.device)
    x, y = next(global_batches(CharDataset(block_size=cfg.block_size), args.batch, 1, seed=args.seed))
    x, y = x.to(env.device), y.to(env.device)
    e = next(model.parameters()).element_size()
    s, b, h, a, layers = cfg.block_size, args.batch, cfg.d_model, cfg.n_head, cfg.n_layer
    results = {mode: measure(model, x, y, mode) for mode in zero_r.MODES}
    base = results["none"]["grads"]
    modes = {}
    for mode, r in results.items():
        kept = "none" if mode == "none" else "full"
        per_layer = memory.activation_bytes_per_layer(s, b, h, a, kept, e, dropout=False, tp=t,
                                                      partitioned=mode == "partitioned")
        diff = max((g - base[k]).abs().max().item() for k, g in r["grads"].items())
        modes[mode] = {"saved_bytes": r["saved_bytes"], "formula_bytes": layers * per_layer,
                       "grad_max_diff": diff, "bytes": r["bytes"],
                       "per_rank": par.runtime.dist.gather_object(r["saved_bytes"])}
    par.runtime.dist.save_result({"world_size": t, "backend": env.backend, "preset": args.preset, "batch": b, "seq": s,
                                  "d_model": h, "layers": layers, "tp": t, "bytes_per_value": e, "modes": modes})
    par.runtime.dist.teardown()


if __name__ == "__main__":
    main()
