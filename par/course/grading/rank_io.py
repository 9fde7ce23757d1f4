"""The raw inputs and outputs of a real-rank exercise job: what lets the grader judge the ranks' numbers itself.

A rank of a real-rank exercise (`exercise_ring`, `exercise_tp`, `exercise_alltoall`) imports the student's
module, so anything that rank reports is the student's to write. The grader therefore trusts no result the
ranks report. It draws the inputs itself, at random for this run, and judges the outputs itself:

    grader                                            every rank (`--io DIR`)
    inputs = exercise.make_inputs(args, n, seed)
    write_inputs(DIR, inputs)        ──files──▶       mine = take_inputs(DIR, rank): read, delete, barrier
                                                      module = answers.load(...)     (only now: the student's code)
                                                      put_outputs(DIR, rank, exercise.run_rank(module, mine))
    outputs = read_outputs(DIR, n)   ◀──files──
    exercise.verify(args, context, outputs)          (the result the check cell reads, computed in the grader)

What this guarantees: a forged result (a `result.json`, a line on stdout, `os._exit(0)` before the work) earns
nothing, since the check reads only what the grader computed from the raw output tensors, and a missing or
malformed output counts as wrong. Each rank reads its own inputs, which are deleted before any student code
runs on any rank (the barrier), so a rank cannot compute the others' numbers from a seed. `DIR` is a folder of
the grader's, mounted into the job's sandbox only (never into the student's kernel). Outputs are read with
`torch.load(weights_only=True)` (tensors, lists, dicts, numbers: no code) and checked for shape and type.

What it does not guarantee: how the numbers travelled. Ranks that pass their inputs to each other through a
shared file, or call a torch collective after undoing par's Python-level guards (`answers.on_the_wire`), still
produce the right numbers; the guards catch the ordinary ways of calling a forbidden collective, not a student
who hunts for the originals. Without the sandbox ("unsandboxed"), the student's kernel can reach `DIR` too.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

MAX_OUTPUT_BYTES = 64 << 20    # a rank's output file larger than this is not read (counts as missing)


def _in(folder, rank: int) -> Path:
    return Path(folder) / f"in-{rank}.pt"


def _out(folder, rank: int) -> Path:
    return Path(folder) / f"out-{rank}.pt"


def write_inputs(folder, inputs: list[dict]) -> None:
    """The grader: one file of inputs per rank."""
    for rank, data in enumerate(inputs):
        torch.save(data, _in(folder, rank))


def take_inputs(folder, rank: int) -> dict:
    """A rank, before it imports the student's module: its inputs, then the file is deleted, and every rank
    waits for the others to have done the same (no rank's inputs are on disk once student code runs)."""
    import torch.distributed as dist
    path = _in(folder, rank)
    data = torch.load(path, weights_only=True)
    os.unlink(path)
    if dist.is_initialized():
        dist.barrier()
    return data


def put_outputs(folder, rank: int, data: dict) -> None:
    torch.save(data, _out(folder, rank))


def read_outputs(folder, nproc: int) -> list[dict | None]:
    """The grader: each rank's outputs, or None where the file is missing, too large or not plain data."""
    out = []
    for rank in range(nproc):
        path = _out(folder, rank)
        try:
            if path.is_symlink() or not path.is_file() or path.stat().st_size > MAX_OUTPUT_BYTES:
                out.append(None)
                continue
            with warnings.catch_warnings():        # a forged file's pickle protocol: no warning in the grader
                warnings.simplefilter("ignore")
                data = torch.load(path, weights_only=True)
        except Exception:  # a truncated or forged file: this rank produced nothing the grader can read
            out.append(None)
            continue
        out.append(data if type(data) is dict else None)
    return out


# ---------------------------------------------------------------- reading one value out of a rank's outputs
def tensor(outputs: dict | None, key: str, index: int | None = None) -> torch.Tensor | None:
    """outputs[key] (or outputs[key][index]) when it is a plain dense tensor, else None."""
    if outputs is None:
        return None
    value = outputs.get(key)
    if index is not None:
        value = value[index] if type(value) is list and 0 <= index < len(value) else None
    if type(value) is not torch.Tensor or value.layout != torch.strided or value.is_complex():
        return None
    return value


def error(got: torch.Tensor | None, want: torch.Tensor) -> float:
    """max |got - want| (inf for a missing tensor, a wrong shape or a NaN; 0 for empty tensors)."""
    if got is None or tuple(got.shape) != tuple(want.shape):
        return float("inf")
    if want.numel() == 0:
        return 0.0
    err = (got.detach().double() - want.double()).abs().max().item()
    return float("inf") if err != err else err


def close(got: torch.Tensor | None, want: torch.Tensor, atol: float = 1e-5) -> bool:
    """`got` is a tensor of `want`'s shape, allclose to it (no NaN)."""
    return got is not None and tuple(got.shape) == tuple(want.shape) and \
        bool(torch.allclose(got.detach().double(), want.double(), atol=atol))


def exercise(module: str):
    """The exercise module (make_inputs, run_rank, verify) whose outputs the grader judges, or None."""
    if module not in ("par.course.grading.exercise_ring", "par.course.grading.exercise_tp", "par.course.grading.exercise_alltoall"):
        return None
    import importlib
    return importlib.import_module(module)


def main(exercise_module, args, module_loaded, guarded):
    """A rank of an exercise job, both ways it runs: under the grader (`args.io`: inputs and outputs as files,
    the grader verifies) or on its own (the student's notebook: fixed inputs, rank 0 verifies and saves the
    result). `module_loaded()`: the student's module; `guarded()`: the context the student's code runs in."""
    import par.runtime.dist
    env = par.runtime.dist.init()
    n, r = env.world_size, env.rank
    if args.io:
        mine = take_inputs(args.io, r)
    else:
        inputs, context = exercise_module.make_inputs(args, n, 0)
        mine = inputs[r]
    with guarded():
        module = module_loaded()
        outputs = exercise_module.run_rank(module, mine, r, env.device)
    outputs = {k: _to_cpu(v) for k, v in outputs.items()}
    if args.io:
        put_outputs(args.io, r, outputs)
    else:
        everyone = par.runtime.dist.gather_object(outputs)
        if r == 0:
            result = exercise_module.verify(args, context, everyone)
            par.runtime.dist.save_result({"world_size": n, "backend": env.backend, **result})
    par.runtime.dist.teardown()
    return 0


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value
