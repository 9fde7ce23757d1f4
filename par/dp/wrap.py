"""Data parallelism, the recipe: shard the data, wrap the model, step.

    sampler   DistributedSampler gives rank r the rows r, r+N, r+2N, ... of each shuffled global batch
    wrap      "naive"    (par.dp.naive)    all-reduce every gradient after backward
              "bucketed" (par.dp.bucketed) flat buckets, all-reduced while backward runs
              "ddp"      torch's DistributedDataParallel, for comparison (its bytes are not in par's log)
              "none"     a single process, no wrapper
    step      micro-batches under no_sync() except the last (gradient accumulation), then the optimizer

Batch sizes obey train_batch_size = micro_batch × grad_accum × world_size (`par.dp.batch_size`).
Limits, which ZeRO (lecture 06) removes: every rank holds the full parameters, gradients and
optimizer states, plus (bucketed) a gradient-sized bucket buffer.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler

from par.dp.bucketed import BucketedDP, DEFAULT_BUCKET_BYTES
from par.dp.naive import NaiveDP
from par.timeline import seconds

VARIANTS = ("none", "naive", "bucketed", "ddp")


def shard_loader(dataset, per_rank_batch: int, seed: int = 0, rank: int | None = None,
                 world_size: int | None = None) -> DataLoader:
    """This rank's non-overlapping shard: DistributedSampler(shuffle, seed, drop_last), batches of per_rank_batch."""
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                                 drop_last=True)
    return DataLoader(dataset, batch_size=per_rank_batch, sampler=sampler, drop_last=True)


def split_micro(x: torch.Tensor, y: torch.Tensor, accum: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Cut this rank's batch into `accum` equal micro-batches."""
    if x.size(0) % accum:
        raise ValueError(f"per-rank batch {x.size(0)} is not divisible by grad_accum {accum}")
    return list(zip(x.chunk(accum), y.chunk(accum)))


def wrap(model: nn.Module, variant: str = "bucketed", impl: str = "ring", bucket_bytes: int = DEFAULT_BUCKET_BYTES,
         compression=None, recorder=None, group=None) -> nn.Module:
    """The model wrapped for data parallelism (`variant` in VARIANTS)."""
    if variant == "none":
        return model
    if variant == "naive":
        return NaiveDP(model, impl, group, compression, recorder)
    if variant == "bucketed":
        return BucketedDP(model, bucket_bytes, impl, group, compression, recorder)
    if variant == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        if compression is not None:
            raise ValueError("compression is par's own: use variant 'naive' or 'bucketed'")
        device = next(model.parameters()).device
        return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                       bucket_cap_mb=bucket_bytes / 2 ** 20, process_group=group)
    raise ValueError(f"unknown data-parallel variant {variant!r}: use one of {', '.join(VARIANTS)}")


def _span(recorder, name: str, lane: str = "compute"):
    return recorder.span(name, lane) if recorder is not None else nullcontext()


def train_step(model: nn.Module, optimizer, micro_batches, loss_fn, recorder=None) -> float:
    """One optimizer step over this rank's micro-batches; returns this rank's mean loss.

    Each micro-batch loss is divided by the number of micro-batches, so the accumulated gradient is
    the mean over all of this rank's samples; the wrapper then averages it over the ranks.
    """
    optimizer.zero_grad(set_to_none=True)
    records_backward = isinstance(model, (NaiveDP, BucketedDP))  # they time their own backward
    k, total = len(micro_batches), 0.0
    for i, (x, y) in enumerate(micro_batches):
        quiet = i < k - 1 and hasattr(model, "no_sync")
        with model.no_sync() if quiet else nullcontext():
            with _span(recorder, "F"):
                loss = loss_fn(model(x), y) / k
            with nullcontext() if records_backward else _span(recorder, "B"):
                loss.backward()
        total += loss.item()
    if hasattr(model, "sync_gradients"):
        model.sync_gradients()
    with _span(recorder, "step"):
        optimizer.step()
    return total


def overlap_fraction(spans: list[dict], rank: int = 0) -> float:
    """Share of a rank's communication time ("comm" lane) that ran while backward ("B" spans) computed."""
    compute = [(s["start"], s["end"]) for s in spans if s["rank"] == rank and s["name"] == "B"]
    comm = [(s["start"], s["end"]) for s in spans if s["rank"] == rank and s["lane"] == "comm"]
    total = sum(e - s for s, e in comm)
    hidden = sum(max(0.0, min(e, ce) - max(s, cs)) for s, e in comm for cs, ce in compute)
    return hidden / total if total > 0 else 0.0


WAIT_SPAN = {"naive": "all-reduce", "bucketed": "sync"}   # the wrapper's span of the wait after backward


def step_parts(spans: list[dict], rank: int, variant: str) -> dict:
    """One recorded step of `rank` under `variant`, each part on both clocks ({"wall": s, "steady": s},
    `par.timeline.seconds`): forward, backward and optimizer (its "F", "B" and "step" spans), and for par's
    wrappers the wait after backward (`WAIT_SPAN`: naive DP's all-reduces, bucketed DP's wait for what is still in
    flight when backward ends)."""
    mine = [s for s in spans if s["rank"] == rank]
    names = {"forward": "F", "backward": "B", "optimizer": "step"}
    if variant in WAIT_SPAN:
        names["wait"] = WAIT_SPAN[variant]
    return {part: {clock_: sum(seconds(s, clock_) for s in mine if s["name"] == name) for clock_ in ("wall", "steady")}
            for part, name in names.items()}


def wrapper_buffer_bytes(model: nn.Module) -> int:
    """Extra memory a wrapper keeps: bucket buffers and compression residuals."""
    total = sum(b.nbytes for b in getattr(model, "buckets", []))
    comp = getattr(model, "compression", None)
    if comp is not None:
        total += sum(r.numel() * r.element_size() for r in comp.residuals.values())
    return total
