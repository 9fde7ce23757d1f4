"""Exercise 04's check on real ranks: the student's f/g operators and Megatron MLP against the dense MLP.

    par.runtime.launch.run("par.course.grading.exercise_tp", nproc=2, args=["--answer", "my_tp.py"])

A dense MLP (d → ffn → d, GeLU), its input and a fixed upstream gradient are drawn at random; every rank gets
only its shards: the rows of fc (column parallel, `par.tp.layers.column_shard`), the columns of proj (row
parallel, `row_shard`), proj's bias whole, and the input. It runs the student's
`parallel_mlp(x, fc_w, fc_b, proj_w, proj_b)` forward and backward, and counts the all-reduces it made in
forward and in backward (on the process group objects, `par.course.grading.guards.on_the_wire`). par's own f/g
(`par.tp.ops`) and collectives are switched off while the student's code runs. `verify` compares the output
and every gradient with the dense ones (the shard of the dense gradient for sharded weights): in the grader's
own process when the grader launched the job (`--io`, `par.course.grading.rank_io`), on rank 0 otherwise.

Result: world_size, backend, and
    errors     {output, input_grad, fc_w_grad, fc_b_grad, proj_w_grad, proj_b_grad}: the largest |student -
               dense| over the ranks (inf: missing, wrong shape or NaN)
    all_reduce {forward, backward}: calls on rank 0
    per_rank   [{rank, errors, all_reduce}]
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from par.course.grading import rank_io
from par.course.grading.exercise import Exercise
from par.runtime.job_args import JobArgs, arg
from par.tp.layers import column_shard, row_shard

PRELOAD = ("torch",)    # what par.runtime.agent imports before it forks the ranks: no optimizer step, no dispatch
#                         mode here, so the ranks never import torch._dynamo

EXERCISE = Exercise(
    "04_tensor_parallel", runner=__name__,
    why="write f and g yourself with torch.distributed.all_reduce",
    forbidden=[("par.tp.ops", "_all_reduce"), ("par.comm.collectives", "all_reduce"),
               ("par.comm.collectives", "ring_all_reduce")],
    p2p_only=False,
    stubs=[("par.tp.ops", n) for n in (
           "_all_reduce", "copy_to_region", "reduce_from_region", "_CopyToRegion.forward", "_CopyToRegion.backward",
           "_ReduceFromRegion.forward", "_ReduceFromRegion.backward")] +
           [("par.comm.collectives", n) for n in ("all_reduce", "ring_all_reduce")])
GRADS = ("input_grad", "fc_w_grad", "fc_b_grad", "proj_w_grad", "proj_b_grad")
SHAPE = (3, 5)


def dense(d: int, ffn: int, shape, seed: int = 0):
    """The dense MLP's pieces, its input and upstream gradient, and its output and gradients."""
    g = torch.Generator().manual_seed(seed)
    fc_w, fc_b = torch.randn(ffn, d, generator=g) / d ** 0.5, torch.randn(ffn, generator=g)
    proj_w, proj_b = torch.randn(d, ffn, generator=g) / ffn ** 0.5, torch.randn(d, generator=g) + 3.0
    x, upstream = torch.randn(*shape, d, generator=g), torch.randn(*shape, d, generator=g)
    leaves = [t.clone().requires_grad_() for t in (x, fc_w, fc_b, proj_w, proj_b)]
    y = F.linear(F.gelu(F.linear(leaves[0], leaves[1], leaves[2])), leaves[3], leaves[4])
    (y * upstream).sum().backward()
    return (x, fc_w, fc_b, proj_w, proj_b), upstream, y.detach(), [t.grad for t in leaves]


@dataclass(frozen=True)
class Args(JobArgs):
    answer: str = arg("my_tp.py", "the student's module file")
    d: int = arg(12, "the model width")
    ffn: int = arg(24, "the MLP's hidden width")
    io: str = arg("", "the grader's folder of inputs and outputs (par.course.grading.rank_io); none: rank 0 verifies")


def make_inputs(args: Args, n: int, seed: int):
    """(each rank's shards, input and upstream gradient; the dense output and each rank's share of its gradients)."""
    (x, fc_w, fc_b, proj_w, proj_b), upstream, y, grads = dense(args.d, args.ffn, SHAPE, seed)
    inputs = [{"x": x, "fc_w": column_shard(fc_w, n, r).clone(), "fc_b": column_shard(fc_b, n, r).clone(),
               "proj_w": row_shard(proj_w, n, r).clone(), "proj_b": proj_b, "upstream": upstream} for r in range(n)]
    expected = [{"output": y, "input_grad": grads[0], "fc_w_grad": column_shard(grads[1], n, r),
                 "fc_b_grad": column_shard(grads[2], n, r), "proj_w_grad": row_shard(grads[3], n, r),
                 "proj_b_grad": grads[4]} for r in range(n)]
    return inputs, expected


def run_rank(module, inputs: dict, rank: int, device, wire: dict) -> dict:
    mine = [inputs[k].clone().to(device).requires_grad_() for k in ("x", "fc_w", "fc_b", "proj_w", "proj_b")]
    count = lambda: wire["allreduce"] + wire["allreduce_coalesced"]     # noqa: E731  (bound before the import)
    before = count()
    out = module.parallel_mlp(*mine)
    forward = count() - before
    (out * inputs["upstream"].to(device)).sum().backward()
    backward = count() - before - forward
    outputs = {"output": out.detach() if isinstance(out, torch.Tensor) else None,
               "all_reduce": torch.tensor([forward, backward])}
    for key, t in zip(GRADS, mine):
        outputs[key] = t.grad
    return outputs


def verify(args: Args, expected: list, outputs: list) -> dict:
    per_rank = []
    for r, out in enumerate(outputs):
        errors = {k: rank_io.error(rank_io.tensor(out, k), expected[r][k]) for k in ("output", *GRADS)}
        counts = rank_io.tensor(out, "all_reduce")
        ok = counts is not None and tuple(counts.shape) == (2,) and not counts.is_floating_point()
        calls = {"forward": int(counts[0]), "backward": int(counts[1])} if ok else {"forward": -1, "backward": -1}
        per_rank.append({"rank": r, "errors": errors, "all_reduce": calls})
    return {"errors": {k: max(p["errors"][k] for p in per_rank) for k in ("output", *GRADS)},
            "all_reduce": per_rank[0]["all_reduce"], "per_rank": per_rank}


if __name__ == "__main__":
    raise SystemExit(rank_io.main(sys.modules[__name__]))
