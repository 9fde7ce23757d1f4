"""Exercise 04's check on real ranks: the student's f/g operators and Megatron MLP against the dense MLP.

    par.runtime.launch.run("par.course.exercise_tp", nproc=2, args=["--answer", "my_tp.py"])

Every rank builds the same dense MLP (d → ffn → d, GeLU) and input, runs it forward and backward with a
fixed upstream gradient, then runs the student's `parallel_mlp(x, fc_w, fc_b, proj_w, proj_b)` on its
shards: the rows of fc (column parallel, `par.tp.layers.column_shard`), the columns of proj (row
parallel, `row_shard`), proj's bias whole. It compares the output and every gradient with the dense
ones (the shard of the dense gradient for sharded weights), and counts the calls of
`torch.distributed.all_reduce` in forward and in backward. par's own f/g (`par.tp.ops`) and collectives
are switched off while the student's code runs (`par.course.answers`).

Result (rank 0 saves it): world_size, backend, and
    errors     {output, input_grad, fc_w_grad, fc_b_grad, proj_w_grad, proj_b_grad}: the largest |student -
               dense| over the ranks
    all_reduce {forward, backward}: calls on rank 0
    per_rank   [{rank, errors, all_reduce}]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

import par.runtime.dist
from par.course import answers
from par.runtime.job_args import JobArgs, arg
from par.tp.layers import column_shard, row_shard

OFF_LIMITS = [("par.tp.ops", "_all_reduce"), ("par.comm.collectives", "all_reduce"), ("par.comm.collectives", "ring_all_reduce")]
WHY = "write f and g yourself with torch.distributed.all_reduce"


def dense(d: int, ffn: int, shape, device, seed: int = 0):
    """The dense MLP's pieces, its input and upstream gradient, and its output and gradients."""
    g = torch.Generator().manual_seed(seed)
    fc_w, fc_b = torch.randn(ffn, d, generator=g) / d ** 0.5, torch.randn(ffn, generator=g)
    proj_w, proj_b = torch.randn(d, ffn, generator=g) / ffn ** 0.5, torch.randn(d, generator=g) + 3.0
    x, upstream = torch.randn(*shape, d, generator=g), torch.randn(*shape, d, generator=g)
    x, fc_w, fc_b, proj_w, proj_b, upstream = (t.to(device) for t in (x, fc_w, fc_b, proj_w, proj_b, upstream))
    leaves = [t.clone().requires_grad_() for t in (x, fc_w, fc_b, proj_w, proj_b)]
    y = F.linear(F.gelu(F.linear(leaves[0], leaves[1], leaves[2])), leaves[3], leaves[4])
    (y * upstream).sum().backward()
    return (x, fc_w, fc_b, proj_w, proj_b), upstream, y.detach(), [t.grad for t in leaves]


@dataclass(frozen=True)
class Args(JobArgs):
    answer: str = arg("my_tp.py", "the student's module file")
    d: int = arg(12, "the model width")
    ffn: int = arg(24, "the MLP's hidden width")


def main(argv=None) -> int:
    args = Args.parse(argv)
    env = par.runtime.dist.init()
    n, r = env.world_size, env.rank
    with answers.forbidden(OFF_LIMITS, WHY):
        module = answers.load(args.answer)
    (x, fc_w, fc_b, proj_w, proj_b), upstream, y, grads = dense(args.d, args.ffn, (3, 5), env.device)
    mine = [x.clone(), column_shard(fc_w, n, r).clone(), column_shard(fc_b, n, r).clone(),
            row_shard(proj_w, n, r).clone(), proj_b.clone()]
    mine = [t.requires_grad_() for t in mine]
    with answers.forbidden(OFF_LIMITS, WHY), answers.counted(dist, "all_reduce") as calls:
        out = module.parallel_mlp(*mine)
        forward_calls = calls["all_reduce"]
        (out * upstream).sum().backward()
        backward_calls = calls["all_reduce"] - forward_calls
    expected = [grads[0], column_shard(grads[1], n, r), column_shard(grads[2], n, r), row_shard(grads[3], n, r),
                grads[4]]
    err = lambda a, b: float("inf") if a is None else (a.detach() - b).abs().max().item()  # noqa: E731
    errors = {"output": err(out, y)}
    for key, t, want in zip(("input_grad", "fc_w_grad", "fc_b_grad", "proj_w_grad", "proj_b_grad"), mine, expected):
        errors[key] = err(t.grad, want)
    mine_ = {"rank": r, "errors": errors, "all_reduce": {"forward": forward_calls, "backward": backward_calls}}
    everyone = par.runtime.dist.gather_object(mine_)
    if r == 0:
        par.runtime.dist.save_result({"world_size": n, "backend": env.backend,
                                      "errors": {k: max(p["errors"][k] for p in everyone) for k in errors},
                                      "all_reduce": mine_["all_reduce"], "per_rank": everyone})
    par.runtime.dist.teardown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
