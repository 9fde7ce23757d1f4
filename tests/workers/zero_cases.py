"""Every ZeRO check for one world size, in one launch (tests/test_zero.py asserts on the JSON).

    python -m torch.distributed.run --nproc-per-node=N tests/workers/zero_cases.py CHECKPOINT_DIR

Cases: stages 0-3 with and without offload, Adam and AdamW, two models whose parameter
counts no world size divides, against the single-process reference; bytes per step;
measured model-state bytes against par.memory.accounting; stage 3 frees between units; sharded
checkpoint resume (bit-identical) and re-sharding to another data-parallel degree.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import par.runtime.dist
from par.zero import checkpoint
from par.comm import coalesced, collectives, commlog
from par.memory import accounting as memory
from par.precision.loss_scaler import DynamicLossScaler
from par.precision.mixed_precision import MixedPrecision
from par.model import GPTLite, TinyMLP, lm_loss, preset
from par.reference import max_abs_diff, train_single
from par.zero.engine import Zero

STEPS, BATCH, LR = 5, 12, 1e-3


def gpt():
    torch.manual_seed(3)
    return GPTLite(preset("tiny", n_layer=2, d_model=9, n_head=3, d_ff=25, block_size=9))


def mlp():
    return TinyMLP((10, 33, 17, 5), seed=1)


def data(name):
    g = torch.Generator().manual_seed(7)
    if name == "gpt":
        x = torch.randint(0, 65, (STEPS, BATCH, 9), generator=g)
        return list(zip(x, torch.randint(0, 65, (STEPS, BATCH, 9), generator=g))), lm_loss
    return list(zip(torch.randn(STEPS, BATCH, 10, generator=g), torch.randn(STEPS, BATCH, 5, generator=g))), F.mse_loss


MODELS = {"mlp": mlp, "gpt": gpt}


def train(zero, model, batches, loss_fn, rank, n, on_step=None, accum=1):
    """Each rank trains on rows rank, rank+n, ... of every batch, in `accum` micro-batches per step."""
    losses = []
    for s, (x, y) in enumerate(batches):
        loss = 0.0
        for xm, ym in zip(x[rank::n].chunk(accum), y[rank::n].chunk(accum)):
            micro = loss_fn(model(xm).float(), ym) / accum
            zero.backward(micro)
            loss = loss + micro.detach()
        if on_step:
            on_step(s)
        zero.step()
        zero.zero_grad()
        losses.append(loss.item())
    return losses


def equivalence(rank, n, out):
    for mname, make in MODELS.items():
        batches, loss_fn = data(mname)
        for opt in ("adam", "adamw"):
            ref = make()
            train_single(ref, batches, loss_fn, opt, LR)
            for stage in (0, 1, 2, 3):
                for offload in (False, True) if opt == "adam" else (False,):
                    model = make()
                    zero = Zero(model, stage=stage, optimizer=opt, lr=LR, offload=offload)
                    train(zero, model, batches, loss_fn, rank, n)
                    diff = max_abs_diff(zero.full_state_dict(), ref.state_dict())
                    out["equivalence"].append({"model": mname, "opt": opt, "stage": stage, "offload": offload,
                                               "numel": zero.numel, "diff": diff})
    # gradient accumulation: equal micro-batches per step (2, or 3 when each rank has 3 rows), every stage
    accum = 2 if (BATCH // n) % 2 == 0 else 3
    batches, loss_fn = data("mlp")
    ref = mlp()
    train_single(ref, batches, loss_fn, "adam", LR)
    for stage in (0, 1, 2, 3):
        model = mlp()
        zero = Zero(model, stage=stage, optimizer="adam", lr=LR)
        train(zero, model, batches, loss_fn, rank, n, accum=accum)
        out["accumulation"].append({"stage": stage, "diff": max_abs_diff(zero.full_state_dict(), ref.state_dict())})


def bytes_and_memory(rank, n, out):
    for mname, make in MODELS.items():
        batches, loss_fn = data(mname)
        for stage in (0, 1, 2, 3):
            for offload in (False, True) if mname == "gpt" else (False,):
                model = make()
                zero = Zero(model, stage=stage, optimizer="adam", lr=LR, offload=offload)
                seen = {}

                def measure(s):
                    if s == 2:
                        seen.update(zero.memory())
                for s, (x, y) in enumerate(batches[:3]):
                    with commlog.capture() as log:
                        zero.backward(loss_fn(model(x[rank::n]), y[rank::n]))
                        measure(s)
                        zero.step()
                        zero.zero_grad()
                formula = memory.model_state_bytes(zero.numel, n, stage, "fp32", "adam")
                out["bytes"].append({"model": mname, "stage": stage, "offload": offload, "numel": zero.numel,
                                     "padded": zero.padded, "units": len(zero.units), "by_kind": log.by_kind()})
                out["memory"].append({"model": mname, "stage": stage, "offload": offload, **seen,
                                      "formula": formula.to_dict(),
                                      "placement": zero.updater.placement() if offload else None})


def mixed_precision(rank, n, out):
    """fp16/bf16: every stage equals stage 0 (plain DP in the same precision) bit for bit; memory is
    2Ψ + 2Ψ + 12Ψ/N_d and friends; SGD (which feels a wrong unscale) matches single-process mixed
    precision; an fp16 overflow is skipped on every rank and lowers the scale."""
    batches, loss_fn = data("gpt")
    for prec in ("bf16", "fp16"):
        base = None
        for stage, offload in ((0, False), (1, False), (2, False), (3, False), (2, True)):
            model = gpt()
            zero = Zero(model, stage=stage, optimizer="adam", lr=LR, offload=offload, precision=prec)
            seen = {}
            train(zero, model, batches, loss_fn, rank, n, on_step=lambda s: s == 2 and seen.update(zero.memory()))
            full = zero.full_state_dict()
            base = base or full
            with commlog.capture() as log:   # one more step, counted: the model's bytes are 16-bit now
                x, y = batches[0]
                zero.backward(loss_fn(model(x[rank::n]).float(), y[rank::n]))
                zero.step()
            sent = sum(e.bytes_sent for e in log.events if "overflow flag" not in e.tag)
            out["mixed"].append({"precision": prec, "stage": stage, "offload": offload, "step_bytes": sent,
                                 "diff_vs_stage0": max_abs_diff(full, base), **seen,
                                 "formula": memory.model_state_bytes(zero.numel, n, stage, "mixed", "adam").to_dict()})
        ref = gpt()
        mp = MixedPrecision(ref, lambda ps: torch.optim.SGD(ps, lr=0.1), dtype=prec)
        for x, y in batches:
            mp.backward(loss_fn(ref(x).float(), y))
            mp.step()
        ref_sd = {name: m for (name, _), m in zip(ref.named_parameters(), mp.masters)}
        for stage in (1, 3):
            model = gpt()
            zero = Zero(model, stage=stage, optimizer="sgd", lr=0.1, precision=prec)
            train(zero, model, batches, loss_fn, rank, n)
            out["mixed_sgd"].append({"precision": prec, "stage": stage,
                                     "diff": max_abs_diff(zero.full_state_dict(), ref_sd)})
    model = gpt()
    zero = Zero(model, stage=3, optimizer="adam", lr=LR, precision="fp16",
                scaler=DynamicLossScaler(init_scale=2.0 ** 40, hysteresis=1))
    start = zero.full_state_dict()
    x, y = batches[0]
    zero.backward(loss_fn(model(x[rank::n]).float(), y[rank::n]))
    stepped = zero.step()
    zero.zero_grad()
    unchanged = all(torch.equal(v, start[k]) for k, v in zero.full_state_dict().items())
    train(zero, model, batches, loss_fn, rank, n)
    out["overflow"] = par.runtime.dist.gather_object({"stepped": stepped, "unchanged": unchanged, "scale": zero.scaler.scale,
                                                      "skipped": zero.skipped})


def stage3_frees(rank, n, out):
    model = gpt()
    batches, loss_fn = data("gpt")
    zero = Zero(model, stage=3, optimizer="adam", lr=LR)
    shard_bytes = sum(u.shard.numel() * u.shard.element_size() for u in zero.units)
    full_bytes = [u.flat.padded * 4 for u in zero.units]
    checks = []
    for u in zero.units:   # registered after the engine's hooks: they see the state right after its gather
        u.module.register_forward_pre_hook(
            lambda m, a, u=u: checks.append(("forward", u.index, zero.gathered_units(), zero.memory()["params"])))
        for p in u.params:
            p.register_post_accumulate_grad_hook(
                lambda p, u=u: checks.append(("backward", u.index, zero.gathered_units(), zero.memory()["params"])))
    before = zero.gathered_units()
    train(zero, model, batches[:2], loss_fn, rank, n)
    out["stage3"] = {"before": before, "after": zero.gathered_units(), "checks": checks,
                     "shard_bytes": shard_bytes, "full_bytes": full_bytes,
                     "params_after": zero.memory()["params"]}
    plain = zero.full_state_dict()
    # prefetch: the next unit's gather overlaps this one's compute; same numbers, same bytes, <= 2 units alive
    model = gpt()
    zero = Zero(model, stage=3, optimizer="adam", lr=LR, prefetch=True)
    alive = []
    for u in zero.units:
        u.module.register_forward_pre_hook(lambda m, a: alive.append(len(zero.gathered_units())))
        for p in u.params:
            p.register_post_accumulate_grad_hook(lambda p: alive.append(len(zero.gathered_units())))
    with commlog.capture() as log:
        train(zero, model, batches[:2], loss_fn, rank, n)
    full = zero.full_state_dict()
    out["prefetch"] = {"identical": all(torch.equal(full[k], plain[k]) for k in full), "max_alive": max(alive),
                       "after": zero.gathered_units(), "by_kind": log.by_kind(), "padded": zero.padded,
                       "units": len(zero.units)}


def checkpoint_cases(rank, n, root, out):
    batches, loss_fn = data("gpt")
    # resume: 2 steps, save, a fresh model and engine, load, 3 more steps == 5 steps straight
    for stage, offload, prec in ((1, False, "fp32"), (2, False, "fp32"), (3, False, "fp32"), (2, True, "fp32"),
                                 (3, False, "fp16")):
        def engine():
            m = gpt()
            scaler = DynamicLossScaler(init_scale=2.0 ** 20, window=2) if prec == "fp16" else None
            return m, Zero(m, stage=stage, optimizer="adam", lr=LR, offload=offload, precision=prec, scaler=scaler)
        model, zero = engine()
        straight = train(zero, model, batches, loss_fn, rank, n)
        full_straight = zero.full_state_dict()
        model, zero = engine()
        first = train(zero, model, batches[:2], loss_fn, rank, n)
        d = os.path.join(root, f"resume_s{stage}_o{int(offload)}_{prec}")
        checkpoint.save(zero, d, step=2)
        model, zero = engine()
        meta = checkpoint.load(zero, d)
        rest = train(zero, model, batches[meta["step"]:], loss_fn, rank, n)
        full = zero.full_state_dict()
        out["resume"].append({"stage": stage, "offload": offload, "precision": prec,
                              "identical": all(torch.equal(full[k], full_straight[k]) for k in full),
                              "losses_identical": first + rest == straight})
    # re-shard: save at one data-parallel degree, load at another (and another stage)
    m = n - 1
    sub = dist.new_group(list(range(m)))
    for save_world, load_world in ((n, m), (m, n)):
        d = os.path.join(root, f"reshard_{save_world}_to_{load_world}")
        groups = {n: None, m: sub}
        model = gpt()
        saved = None
        if rank < save_world:
            zero = Zero(model, stage=2, optimizer="adam", lr=LR, group=groups[save_world])
            train(zero, model, batches[:2], loss_fn, rank, save_world)
            saved = zero.full_state_dict()
            checkpoint.save(zero, d, step=2)
        dist.barrier()
        consolidated = checkpoint.load_full(d)
        case = {"from": save_world, "to": load_world}
        if saved is not None:
            case["load_full_equal"] = all(torch.equal(saved[k], consolidated[k]) for k in saved)
        if rank < load_world:
            model = gpt()
            zero = Zero(model, stage=3, optimizer="adam", lr=LR, group=groups[load_world])
            checkpoint.load(zero, d)
            loaded = zero.full_state_dict()
            case["same_full_model"] = all(torch.equal(loaded[k], consolidated[k]) for k in loaded)
            train(zero, model, batches[2:], loss_fn, rank, load_world)
            ref = gpt()
            batches_ref, _ = data("gpt")
            train_single(ref, batches_ref, loss_fn, "adam", LR)
            case["continued_diff"] = max_abs_diff(zero.full_state_dict(), ref.state_dict())
        dist.barrier()
        gathered = par.runtime.dist.gather_object(case)
        if rank == 0:
            out["reshard"].append(gathered)


def coalesced_cases(rank, n, out):
    """par.comm.coalesced against one par.comm.collectives call per buffer: the same bits, the same logged bytes."""
    sizes = [1, 7, 33, 1000, 3 * n + 1]
    for kind in ("reduce_scatter", "all_reduce", "all_gather"):
        for op in ("sum", "avg", "max") if kind != "all_gather" else ("-",):
            g = torch.Generator().manual_seed(11 + rank)
            a = [torch.randn(k, generator=g) for k in sizes]
            b = [t.clone() for t in a]
            kw = {} if kind == "all_gather" else {"op": op}
            with commlog.capture() as la:
                getattr(coalesced, kind)(a, **kw)
            with commlog.capture() as lb:
                for t in b:
                    getattr(collectives, kind)(t, **kw)
            out["coalesced"].append({"kind": kind, "op": op, "equal": all(torch.equal(x, y) for x, y in zip(a, b)),
                                     "events": [(e.kind, e.numel, e.bytes_sent) for e in la.events],
                                     "reference": [(e.kind, e.numel, e.bytes_sent) for e in lb.events]})


def main():
    root = sys.argv[1]
    env = par.runtime.dist.init()
    rank, n = env.rank, env.world_size
    out = {"world": n, "equivalence": [], "accumulation": [], "bytes": [], "memory": [], "resume": [], "reshard": [],
           "mixed": [], "mixed_sgd": [], "coalesced": []}
    coalesced_cases(rank, n, out)
    equivalence(rank, n, out)
    bytes_and_memory(rank, n, out)
    mixed_precision(rank, n, out)
    stage3_frees(rank, n, out)
    checkpoint_cases(rank, n, root, out)
    par.runtime.dist.save_result(out)
    par.runtime.dist.teardown()


if __name__ == "__main__":
    main()
