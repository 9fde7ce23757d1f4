"""Exercise 09's check on real ranks: the student's all-to-all against what every rank sent, judged by the grader.

    par.runtime.launch.run("par.course.grading.exercise_alltoall", nproc=3, args=["--answer", "my_alltoall.py"],
                   env={"PAR_NCCL_EMULATION": "1"})

For each case, every rank gets one block for every peer (random values; their sizes set by the case: equal
blocks, or the uneven expert blocks of E = 5 experts over the ranks, as `par.moe.experts` dispatches them),
loads the student's module and calls `all_to_all(sends, recvs)`, which must fill `recvs` while torch's and
par's collectives are switched off (`par.course.grading.guards`: by name, on the process group objects, in
torch's dispatcher): only sends and receives. With `PAR_NCCL_EMULATION=1` a received buffer holds NaN until its
Work has been waited. `verify` compares every rank's `recvs` with the blocks its peers sent it: in the
grader's own process when the grader launched the job (`--io`, `par.course.grading.rank_io`), on rank 0 otherwise.

Result: world_size, backend, and
    cases     [{name, max_error (largest |yours - what was sent| over the ranks, inf for NaN or a missing
              block), own_block_ok (every rank's own block in place)}]
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from par.comm.collectives import chunk_bounds
from par.course.grading import guards, rank_io
from par.course.grading.exercise import Exercise
from par.runtime.job_args import JobArgs, arg

PRELOAD = ("torch",)    # what par.runtime.agent imports before it forks the ranks: no optimizer step, no dispatch
#                         mode here, so the ranks never import torch._dynamo

EXERCISE = Exercise(
    "09_expert_dispatch", runner=__name__,
    why="the exercise asks for an all-to-all built from sends and receives",
    forbidden=guards.COLLECTIVES,
    p2p_only=True,
    stubs=[("par.moe.experts", n) for n in (
           "p2p_all_to_all", "torch_all_to_all", "all_to_all_rows", "AllToAll.forward", "AllToAll.backward")] +
           [("par.comm.collectives", n) for n in ("send_recv", "_copy_to_self")])
CASES = ("equal", "dispatch", "combine")


def blocks(name: str, n: int, sender: int) -> list[int]:
    """Elements `sender` sends to each peer in a case."""
    if name == "equal":
        return [6] * n
    experts = chunk_bounds(5, n)                   # uneven expert blocks: (E_p · C · d) elements to peer p
    if name == "dispatch":
        return [(b - a) * 4 for a, b in experts]
    a, b = experts[sender]                         # combine: my E_r experts' outputs, the same to everyone
    return [(b - a) * 4] * n


@dataclass(frozen=True)
class Args(JobArgs):
    answer: str = arg("my_alltoall.py", "the student's module file")
    io: str = arg("", "the grader's folder of inputs and outputs (par.course.grading.rank_io); none: rank 0 verifies")


def make_inputs(args: Args, n: int, seed: int):
    """(each rank's blocks per case, as sends[p]; the same inputs, which verify reads as what each rank must get)."""
    g = torch.Generator().manual_seed(seed)
    inputs = [{name: [torch.randn(s, generator=g) for s in blocks(name, n, r)] for name in CASES} for r in range(n)]
    return inputs, inputs


def run_rank(module, inputs: dict, rank: int, device, wire: dict) -> dict:
    out = {}
    n = len(inputs[CASES[0]])
    for name in CASES:
        sends = [t.to(device) for t in inputs[name]]
        recvs = [torch.zeros(blocks(name, n, p)[rank], device=device) for p in range(n)]
        module.all_to_all(sends, recvs)
        out[name] = recvs
    return out


def verify(args: Args, inputs: list, outputs: list) -> dict:
    n, cases = len(inputs), []
    for name in CASES:
        worst, own = 0.0, True
        for r, out in enumerate(outputs):
            for p in range(n):
                want = inputs[p][name][r]                 # what p sent to r
                got = rank_io.tensor(out, name, p) if out is not None and type(out.get(name)) is list \
                    and len(out[name]) == n else None
                worst = max(worst, rank_io.error(got, want))
                if p == r:
                    own &= got is not None and tuple(got.shape) == tuple(want.shape) and bool(torch.equal(got, want))
        cases.append({"name": name, "max_error": worst, "own_block_ok": bool(own)})
    return {"cases": cases}


if __name__ == "__main__":
    raise SystemExit(rank_io.main(sys.modules[__name__]))
