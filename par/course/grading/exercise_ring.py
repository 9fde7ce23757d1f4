"""Exercise 00's check on real ranks: the student's ring all-reduce against the sum, judged by the grader.

    par.runtime.launch.run("par.course.grading.exercise_ring", nproc=3, args=["--answer", "my_ring.py"],
                   env={"PAR_NCCL_EMULATION": "1"})

Every rank gets one float32 tensor per size in `--sizes` (random, its own), loads the student's module (the
file the exercise's `%%writefile` cell wrote) and sums each tensor over the ranks with the student's
`ring_all_reduce(tensor)`. While the student's code runs, the collectives of torch.distributed and of par
raise (`par.course.grading.guards`: by name, on the process group objects, in torch's dispatcher): the
exercise asks for a ring built from sends and receives. With `PAR_NCCL_EMULATION=1` a received buffer holds
NaN until its Work has been waited, as under NCCL. What each rank's tensors hold afterwards is compared with the sum by
`verify`: in the grader's own process when the grader launched the job (`--io`, `par.course.grading.rank_io`), on
rank 0 otherwise.

Result: world_size, backend, and
    cases     [{numel, max_error (largest |ring - sum| over the ranks, inf for a NaN or a missing tensor),
              in_place (every rank's tensor holds the sum afterwards)}]
    per_rank  [{rank, max_error}]
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from par.course.grading import guards, rank_io
from par.course.grading.exercise import Exercise
from par.runtime.job_args import JobArgs, arg

PRELOAD = ("torch",)    # what par.runtime.agent imports before it forks the ranks: no optimizer step, no dispatch
#                         mode here, so the ranks never import torch._dynamo

SIZES = (1, 2, 5, 7, 64, 1000, 1001)
EXERCISE = Exercise(
    "00_ring_chunks", runner=__name__,
    why="the exercise asks for a ring of sends and receives",
    forbidden=guards.COLLECTIVES,
    p2p_only=True,
    stubs=[("par.comm.collectives", n) for n in (
           "ring_all_reduce", "all_reduce", "ring_reduce_scatter", "ring_all_gather", "reduce_scatter", "all_gather",
           "broadcast", "_ring_reduce_scatter", "_ring_all_gather", "exchange")])


@dataclass(frozen=True)
class Args(JobArgs):
    answer: str = arg("my_ring.py", "the student's module file")
    sizes: tuple[int, ...] = arg(SIZES, "comma-separated tensor sizes checked")
    io: str = arg("", "the grader's folder of inputs and outputs (par.course.grading.rank_io); none: rank 0 verifies")


def make_inputs(args: Args, n: int, seed: int):
    """(each rank's inputs, what verify needs): one random tensor per size and rank, and their sums."""
    g = torch.Generator().manual_seed(seed)
    inputs = [{"x": [torch.randn(numel, generator=g) * (r + 1) for numel in args.sizes]} for r in range(n)]
    sums = [sum(inputs[r]["x"][i].double() for r in range(n)) for i in range(len(args.sizes))]
    return inputs, sums


def run_rank(module, inputs: dict, rank: int, device, wire: dict) -> dict:
    outs, mines = [], []
    for x in inputs["x"]:
        mine = x.clone().to(device)
        out = module.ring_all_reduce(mine)
        outs.append(out if isinstance(out, torch.Tensor) and out.shape == mine.shape else None)
        mines.append(mine)
    return {"out": outs, "mine": mines}


def verify(args: Args, sums, outputs: list) -> dict:
    """The result, from the sums and what every rank's tensors held (None: a rank that produced nothing)."""
    cases, per_rank = [], [0.0] * len(outputs)
    for i, numel in enumerate(args.sizes):
        want = sums[i].float()
        worst, in_place = 0.0, True
        for r, out in enumerate(outputs):
            mine = rank_io.tensor(out, "mine", i)
            got = rank_io.tensor(out, "out", i)
            err = rank_io.error(got if got is not None else mine, want)
            worst, per_rank[r] = max(worst, err), max(per_rank[r], err)
            in_place &= rank_io.close(mine, want)
        cases.append({"numel": numel, "max_error": worst, "in_place": bool(in_place)})
    return {"cases": cases, "per_rank": [{"rank": r, "max_error": e} for r, e in enumerate(per_rank)]}


if __name__ == "__main__":
    raise SystemExit(rank_io.main(sys.modules[__name__]))
