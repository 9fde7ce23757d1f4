"""Worker: pipeline-parallel training equals single-process training (torchrun, p = world size ranks).

For every schedule (naive, GPipe, 1F1B, interleaved v=2) and m in {1, p-1, p, 2p+1} micro-batches
(interleaved also at m = 2p: p=2, m=4 is where par's old p2p grouping deadlocked under NCCL's rule):
three Adam steps with `par.pp.pipeline.Pipeline` on GPT-lite (and one TinyMLP case whose stage
boundaries have different widths), next to the single-process reference trained on the same
batches in the same micro-batches (`reference_step`). Every rank compares its own stage's parameters with its
copy of the reference: the gradients of step 1 (and with those of the whole batch in one backward), the loss of
every step (last stage), the parameters after step 3. It also
records one timeline, the measured in-flight peaks, and the p2p groups every rank posted in its
last step (`Pipeline.executed`). Rank 0 saves {case: result}. The test launches it twice: plain
gloo, and with PAR_NCCL_EMULATION=1 (one Work per batch, received data valid only after its wait).
"""
from __future__ import annotations

import torch

import par.runtime.dist
from par.pp import schedules
from par import timeline
from par.data import CharDataset, global_batches
from par.model import TinyMLP, build, lm_loss, preset
from par.pp.pipeline import Pipeline
from par.reference import make_optimizer

# Adam at lr 1e-3 for GPT-lite: the attention key bias has an exactly-zero true gradient (softmax
# ignores a constant per row), so both runs see only rounding noise there, and Adam divides it by
# its own size; at lr 1e-2 that noise alone moves those entries ~1e-5 apart in 3 steps.
STEPS, LR, MLP_LR, MB_ROWS = 3, 1e-3, 1e-2, 2


def layer_grads_and_params(layers):
    """{'<layer>.<name>': (grad, param)} of the reference model."""
    return {f"{i}.{n}": p for i, layer in enumerate(layers) for n, p in layer.named_parameters()}


def mse(out, target):
    return ((out - target) ** 2).mean()


def mlp_batches(rows, steps, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 10, generator=g), torch.randn(rows, 5, generator=g)) for _ in range(steps)]


def reference_step(ref, loss_fn, x, y, m: int) -> torch.Tensor:
    """One process doing the pipeline's job: the batch's m micro-batches in order, each backward of loss_i / m
    (gradients accumulated); the batch's loss. Summed in another order, the gradients agree only to rounding, and
    Adam divides an entry that is rounding noise (a hidden unit GeLU keeps near zero) by its own size: the
    parameters would drift apart by more than the gradients do (the whole-batch gradients are compared at step 1)."""
    total = 0.0
    for xi, yi in zip(x.chunk(m), y.chunk(m)):
        loss_i = loss_fn(ref(xi), yi) / m
        loss_i.backward()
        total += loss_i.detach()
    return total


def run_case(name, sched, make_model, loss_fn, batches, method, lr=LR):
    """Train pipeline and reference side by side; return max diffs seen on this rank."""
    model, ref = make_model(), make_model()
    pipe = Pipeline(model.to_layers(), sched, loss_fn, method=method, track_memory=True)
    ref_params = layer_grads_and_params(ref.to_layers())
    opt = make_optimizer(pipe.parameters(), "adam", lr)
    ref_opt = make_optimizer(ref.parameters(), "adam", lr)
    out = {"grad": 0.0, "loss": 0.0, "param": 0.0, "losses": []}
    rec = timeline.Recorder()
    for step, (x, y) in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        loss = pipe.step(x, y, recorder=rec if step == len(batches) - 1 else None)
        ref_loss = reference_step(ref, loss_fn, x, y, sched.microbatches)
        if step == 0:
            out["grad"] = max(((p.grad - ref_params[n].grad).abs().max().item()
                               for n, p in pipe.named_parameters()), default=0.0)
            whole = make_model()                         # and the whole batch in one backward
            loss_fn(whole(x), y).backward()
            whole_params = layer_grads_and_params(whole.to_layers())
            out["grad_whole_batch"] = max(((p.grad - whole_params[n].grad).abs().max().item()
                                           for n, p in pipe.named_parameters()), default=0.0)
        if loss is not None:
            out["loss"] = max(out["loss"], abs(loss - ref_loss.item()))
            out["losses"].append(loss)
        opt.step()
        ref_opt.step()
    out["param"] = max(((p - ref_params[n]).abs().max().item() for n, p in pipe.named_parameters()), default=0.0)
    out["n_params"] = sum(p.numel() for p in pipe.parameters())
    out["memory"] = pipe.memory
    out["executed"] = pipe.executed
    out["spans"] = rec.gather()
    return out


def main():
    env = par.runtime.dist.init()
    p = env.world_size
    ds = CharDataset(block_size=preset("tiny").block_size)
    results = {}
    cases = []
    for m in sorted({1, p - 1, p, 2 * p, 2 * p + 1} - {0}):
        for kind in ("gpipe", "1f1b", "naive", "interleaved"):
            if (kind == "naive" and m > p) or (kind != "interleaved" and m == 2 * p):
                continue
            cases.append((kind, m))
    for kind, m in cases:
        v = 2 if kind == "interleaved" else 1
        sched = schedules.make(kind, p, m, v)
        cfg = preset("tiny", n_layer=max(4, p * v - 2))  # to_layers() = embedding + blocks + head
        batches = list(global_batches(ds, m * MB_ROWS, STEPS, seed=m))
        name = f"{kind} m={m}"
        res = run_case(name, sched, lambda: build(cfg, seed=1), lm_loss, batches, "parameters")
        results[name] = gather(res)
    # a model whose stage boundaries have different widths, cut uniformly
    sizes = (10, 33, 17, 29, 5)
    m = p + 1
    res = run_case("1f1b mlp", schedules.one_f_one_b(p, m), lambda: TinyMLP(sizes, seed=2), mse,
                   mlp_batches(m * 3, STEPS), "uniform", lr=MLP_LR)
    results["1f1b mlp"] = gather(res)
    if p == 4:
        results["dp2 x pp2"] = gather(dp_times_pp(ds))
    par.runtime.dist.save_result(results)
    par.runtime.dist.teardown()


def dp_times_pp(ds, m=3):
    """4 ranks = 2 replicas x 2 stages: pipelines on ranks {0,1} and {2,3}, each on half of the batch;
    then the two copies of each stage average their gradients (ranks {0,2} and {1,3})."""
    import torch.distributed as dist
    from par.comm import collectives
    rank = dist.get_rank()
    pp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    replica, stage = divmod(rank, 2)
    cfg = preset("tiny")
    model, ref = build(cfg, seed=1), build(cfg, seed=1)
    pipe = Pipeline(model.to_layers(), schedules.one_f_one_b(2, m), lm_loss,
                    ranks=[2 * replica, 2 * replica + 1], group=pp_groups[replica])
    ref_params = layer_grads_and_params(ref.to_layers())
    opt, ref_opt = make_optimizer(pipe.parameters(), "adam", LR), make_optimizer(ref.parameters(), "adam", LR)
    out = {"grad": 0.0, "loss": 0.0, "param": 0.0, "losses": []}
    half = m * MB_ROWS
    for step, (x, y) in enumerate(global_batches(ds, 2 * half, STEPS, seed=9)):
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        loss = pipe.step(x[replica * half:(replica + 1) * half], y[replica * half:(replica + 1) * half])
        for param in pipe.parameters():
            collectives.all_reduce(param.grad, op="avg", group=dp_groups[stage])
        ref_loss = lm_loss(ref(x), y)
        ref_loss.backward()
        if step == 0:
            out["grad"] = max((p.grad - ref_params[n].grad).abs().max().item() for n, p in pipe.named_parameters())
        if loss is not None:  # each replica's loss is its half's: their mean is the batch's
            both = torch.tensor([loss])
            collectives.all_reduce(both, op="avg", group=dp_groups[stage])
            out["loss"] = max(out["loss"], abs(both.item() - ref_loss.item()))
            out["losses"].append(both.item())
        opt.step()
        ref_opt.step()
    out["param"] = max((p - ref_params[n]).abs().max().item() for n, p in pipe.named_parameters())
    out["n_params"] = sum(p.numel() for p in pipe.parameters()) if replica == 0 else 0
    out["memory"], out["executed"], out["spans"] = {}, pipe.executed, []
    return out


def gather(res):
    """Combine the per-rank results on rank 0: max diffs, losses from the last stage, per-rank memory."""
    parts = par.runtime.dist.gather_object({k: v for k, v in res.items() if k != "spans"})
    if parts is None:
        return None
    whole = [r["grad_whole_batch"] for r in parts if "grad_whole_batch" in r]
    return {"grad": max(r["grad"] for r in parts), "loss": max(r["loss"] for r in parts),
            **({"grad_whole_batch": max(whole)} if whole else {}),
            "param": max(r["param"] for r in parts), "losses": [l for r in parts for l in r["losses"]],
            "n_params": sum(r["n_params"] for r in parts), "memory": [r["memory"] for r in parts],
            "executed": [r["executed"] for r in parts], "spans": res["spans"]}


if __name__ == "__main__":
    main()
