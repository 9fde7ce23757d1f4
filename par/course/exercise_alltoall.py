"""Exercise 09's check on real ranks: the student's all-to-all against `dist.all_to_all_single`.

    par.runtime.launch.run("par.course.exercise_alltoall", nproc=3, args=["--answer", "my_alltoall.py"],
                   env={"PAR_NCCL_EMULATION": "1"})

Every rank loads the student's module and, for each case, builds one block for every peer (its size set
by the case: equal blocks, or the uneven expert blocks of E = 5 experts over the ranks, as
`par.moe.experts` dispatches them), with values that name the sender, the receiver and the position.
`dist.all_to_all_single` computes what each rank must receive; the student's `all_to_all(sends, recvs)`
fills `recvs` while torch's and par's collectives are switched off (`par.course.answers`): only sends and
receives. With `PAR_NCCL_EMULATION=1` a received buffer holds NaN until its Work has been waited.

Result (rank 0 saves it): world_size, backend, nccl_emulation, and
    cases     [{name, max_error (largest |yours - all_to_all_single| over the ranks, inf for NaN),
              own_block_ok (every rank's own block in place)}]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

import par.runtime.dist
from par.course import answers
from par.runtime.job_args import JobArgs, arg
from par.runtime import nccl_emulation
from par.comm.collectives import chunk_bounds

WHY = "the exercise asks for an all-to-all built from sends and receives"


def blocks(name: str, n: int, sender: int) -> list[int]:
    """Elements `sender` sends to each peer in a case."""
    if name == "equal":
        return [6] * n
    experts = chunk_bounds(5, n)                   # uneven expert blocks: (E_p · C · d) elements to peer p
    if name == "dispatch":
        return [(b - a) * 4 for a, b in experts]
    a, b = experts[sender]                         # combine: my E_r experts' outputs, the same to everyone
    return [(b - a) * 4] * n


def one_case(module, name: str, n: int, r: int, device) -> tuple[float, bool]:
    send_sizes = blocks(name, n, r)
    recv_sizes = [blocks(name, n, p)[r] for p in range(n)]
    sends = [torch.arange(s, dtype=torch.float32, device=device) + 1000 * r + 100 * p
             for p, s in enumerate(send_sizes)]
    expected = torch.empty(sum(recv_sizes), device=device)
    dist.all_to_all_single(expected, torch.cat(sends), recv_sizes, send_sizes)
    recvs = [torch.zeros(s, device=device) for s in recv_sizes]
    with answers.forbidden(answers.COLLECTIVES, WHY):
        module.all_to_all(sends, recvs)
    got = torch.cat(recvs)
    err = (got - expected).abs().max().item()
    own = expected.split(recv_sizes)[r]
    return (float("inf") if err != err else err), bool(torch.equal(recvs[r], own))


@dataclass(frozen=True)
class Args(JobArgs):
    answer: str = arg("my_alltoall.py", "the student's module file")


def main(argv=None) -> int:
    args = Args.parse(argv)
    env = par.runtime.dist.init()
    n, r = env.world_size, env.rank
    with answers.forbidden(answers.COLLECTIVES, WHY):
        module = answers.load(args.answer)
    cases = []
    for name in ("equal", "dispatch", "combine"):
        err, own = one_case(module, name, n, r, env.device)
        worst = torch.tensor([err, 0.0 if own else 1.0], dtype=torch.float64, device=env.device)
        dist.all_reduce(worst, dist.ReduceOp.MAX)
        cases.append({"name": name, "max_error": worst[0].item(), "own_block_ok": worst[1].item() == 0})
    par.runtime.dist.save_result({"world_size": n, "backend": env.backend, "nccl_emulation": nccl_emulation.enabled(),
                                  "cases": cases})
    par.runtime.dist.teardown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
