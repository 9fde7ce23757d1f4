"""Exercise 00's check on real ranks: the student's ring all-reduce against torch's `dist.all_reduce`.

    par.runtime.launch.run("par.course.exercise_ring", nproc=3, args=["--answer", "my_ring.py"],
                   env={"PAR_NCCL_EMULATION": "1"})

Every rank loads the student's module (the file the exercise's `%%writefile` cell wrote) and, for each
size in `--sizes`, fills a float32 tensor with numbers that depend on its rank, sums one copy over the
ranks with the student's `ring_all_reduce(tensor)` and another with `dist.all_reduce`, and compares.
While the student's code runs, the collectives of torch.distributed and of par raise (`par.course.answers`):
the exercise asks for a ring built from sends and receives. With `PAR_NCCL_EMULATION=1` a received
buffer holds NaN until its Work has been waited, as under NCCL.

Result (rank 0 saves it): world_size, backend, nccl_emulation, and
    cases     [{numel, max_error (largest |ring - dist.all_reduce| over the ranks), in_place (every rank's
              tensor holds the sum afterwards)}]
    per_rank  [{rank, max_error}]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

import par.runtime.dist
from par.course import answers
from par.runtime.job_args import JobArgs, arg
from par.runtime import nccl_emulation

SIZES = (1, 2, 5, 7, 64, 1000, 1001)


def one_case(module, numel: int, rank: int, device) -> tuple[float, bool]:
    """(max |student - torch| on this rank, whether the student's tensor itself holds the sum)."""
    g = torch.Generator().manual_seed(1000 * numel + rank)
    x = (torch.randn(numel, generator=g) * (rank + 1)).to(device)
    expected = x.clone()
    dist.all_reduce(expected)
    mine = x.clone()
    with answers.forbidden(answers.COLLECTIVES, "the exercise asks for a ring of sends and receives"):
        out = module.ring_all_reduce(mine)
    got = out if isinstance(out, torch.Tensor) and out.shape == mine.shape else mine
    err = (got.float() - expected).abs().max().item() if numel else 0.0
    return (float("inf") if err != err else err), bool(torch.allclose(mine, expected, atol=1e-5, equal_nan=False))


@dataclass(frozen=True)
class Args(JobArgs):
    answer: str = arg("my_ring.py", "the student's module file")
    sizes: tuple[int, ...] = arg(SIZES, "comma-separated tensor sizes checked")


def main(argv=None) -> int:
    args = Args.parse(argv)
    env = par.runtime.dist.init()
    with answers.forbidden(answers.COLLECTIVES, "the exercise asks for a ring of sends and receives"):
        module = answers.load(args.answer)
    cases = [(n, *one_case(module, n, env.rank, env.device)) for n in args.sizes]
    everyone = par.runtime.dist.gather_object(cases)
    if env.rank == 0:
        par.runtime.dist.save_result({
            "world_size": env.world_size, "backend": env.backend, "nccl_emulation": nccl_emulation.enabled(),
            "cases": [{"numel": n, "max_error": max(r[i][1] for r in everyone),
                       "in_place": all(r[i][2] for r in everyone)} for i, (n, _, _) in enumerate(cases)],
            "per_rank": [{"rank": k, "max_error": max(e for _, e, _ in r)} for k, r in enumerate(everyone)]})
    par.runtime.dist.teardown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
