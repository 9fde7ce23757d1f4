"""The raw inputs and outputs of a real-rank exercise job: what lets the grader judge the ranks' numbers itself.

A rank of a real-rank exercise (the runner modules `exercise_*` whose record names them: `par.course.grading.exercise`)
imports the student's module, so anything that rank reports is the student's to write. The grader therefore trusts no result the
ranks report. It draws the inputs itself, at random for this run, and judges the outputs itself:

    grader                                            every rank (`--io DIR`)
    inputs = exercise.make_inputs(args, n, seed)
    write_inputs(DIR, inputs)        ──files──▶       mine = take_inputs(DIR, rank): read, delete, barrier
                                                      guards entered (`guarded`), then
                                                      module = guards.load(...)     (only now: the student's code)
                                                      put_outputs(DIR, rank, exercise.run_rank(module, mine, ..., wire))
    outputs = read_outputs(DIR, n)   ◀──files──
    exercise.verify(args, context, outputs)          (the result the check cell reads, computed in the grader)

What this guarantees: a forged result (a `result.json`, a line on stdout, `os._exit(0)` before the work) earns
nothing, since the check reads only what the grader computed from the raw output tensors, and a missing or
malformed output counts as wrong. Each rank reads its own inputs, which are deleted before any student code
runs on any rank (the barrier), so a rank cannot compute the others' numbers from a seed. `DIR` is a folder of
the grader's, mounted into the job's sandbox only (never into the student's kernel). Outputs are read with
`torch.load(weights_only=True)` (tensors, lists, dicts, numbers: no code) and checked for shape and type.

What it does not guarantee: how the numbers travelled. Ranks that pass their inputs to each other through a
shared file, or call a torch collective after undoing the guards in their own process (`answers`), still
produce the right numbers; the guards catch every way of calling a forbidden collective through torch (its
dispatcher included), not a student who hunts for the guards' own objects to undo them. Without the sandbox
("unsandboxed"), the student's kernel can reach `DIR` too.
"""
from __future__ import annotations

import os
import warnings
import zipfile
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

import par.runtime.dist
from par.course.grading import guards, ledger
from par.course.grading.exercise import of_runner

MAX_OUTPUT_BYTES = 64 << 20    # a rank's output file, and what its records hold once read, at most
MAX_PICKLE_BYTES = 1 << 20     # its pickle (the dicts and lists around the tensors), at most


def _in(folder, rank: int) -> Path:
    return Path(folder) / f"in-{rank}.pt"


def _out(folder, rank: int) -> Path:
    return Path(folder) / f"out-{rank}.pt"


def write_inputs(folder, inputs: list[dict]) -> None:
    """The grader: one file of inputs per rank."""
    for rank, data in enumerate(inputs):
        torch.save(data, _in(folder, rank))


def take_inputs(folder, rank: int) -> dict:
    """A rank, before it imports the student's module: its inputs, then the file is deleted, its connection to
    the grader's ledger made, and every rank waits for the others to have done the same (no rank's inputs are on
    disk, and no connection is left to make, once student code runs)."""
    import torch.distributed as dist
    path = _in(folder, rank)
    data = torch.load(path, weights_only=True)
    os.unlink(path)
    ledger.connect(folder, rank)
    if dist.is_initialized():
        dist.barrier()
    return data


def put_outputs(folder, rank: int, data: dict) -> None:
    torch.save(data, _out(folder, rank))


class OutputRefused(Exception):
    """A rank's output file that the grader does not read: what it would become in memory is over the caps."""


def read_outputs(folder, nproc: int, records: list | None = None) -> list[dict | None]:
    """The grader: each rank's outputs, or None where the file is missing, not a file or not plain data; with
    `records` (the grader's ledger, one entry per rank), each dict's "ledger" is the grader's entry. Raises
    OutputRefused for a file that would take more memory to read than the caps allow (`bounded`)."""
    out = []
    for rank in range(nproc):
        path = _out(folder, rank)
        try:
            if path.is_symlink() or not path.is_file():
                out.append(None)
                continue
            refused = bounded(path)
        except OSError:
            out.append(None)
            continue
        if refused:
            raise OutputRefused(f"rank {rank}'s output file {refused}: the grader does not read it")
        try:
            with warnings.catch_warnings():        # a forged file's pickle protocol: no warning in the grader
                warnings.simplefilter("ignore")
                data = torch.load(path, weights_only=True)
        except Exception:  # a truncated or forged file: this rank produced nothing the grader can read
            out.append(None)
            continue
        data = data if type(data) is dict else None
        if data is not None and records is not None:
            data["ledger"] = records[rank]
        out.append(data)
    return out


def bounded(path: Path) -> str:
    """Why the torch.save file at `path` is not read ("" when it may be): its records must be stored, not
    compressed (what torch.save writes), so that they take no more memory than their bytes on disk, at most
    MAX_OUTPUT_BYTES in all, and its pickle at most MAX_PICKLE_BYTES (its structure: a list or dict per byte or
    two at worst, ~64x once read)."""
    size = path.stat().st_size
    if size > MAX_OUTPUT_BYTES:
        return f"holds {size / 2**20:.1f} MiB, over {MAX_OUTPUT_BYTES >> 20} MiB"
    try:
        with zipfile.ZipFile(path) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError):
        return ""                                  # not a zip: torch.load refuses it, the rank counts as missing
    packed = [e.filename for e in entries if e.compress_type != zipfile.ZIP_STORED]
    if packed:
        inflated = sum(e.file_size for e in entries)
        return (f"holds compressed records ({packed[0]}, ...) that inflate to {inflated / 2**20:.1f} MiB "
                f"(torch.save stores them uncompressed)")
    stored = sum(e.file_size for e in entries)
    if stored > size:
        return f"claims {stored / 2**20:.1f} MiB of records in a file of {size / 2**20:.1f} MiB"
    pickles = [e for e in entries if e.filename.endswith(".pkl")]
    if sum(e.file_size for e in pickles) > MAX_PICKLE_BYTES:
        return (f"holds a pickle of {sum(e.file_size for e in pickles) / 2**20:.1f} MiB, over "
                f"{MAX_PICKLE_BYTES >> 20} MiB (its tensors aside)")
    return ""


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
    """The real-rank runner module `module` (make_inputs, run_rank, verify, its EXERCISE record) whose outputs the
    grader judges, or None for any other module (`par.course.grading.exercise.of_runner`)."""
    if of_runner(module) is None:
        return None
    import importlib
    return importlib.import_module(module)


def main(exercise, argv=None) -> int:
    """A rank of the real-rank exercise `exercise` (a runner module: Args, make_inputs, run_rank, verify, and its
    EXERCISE record), both ways it runs: under the grader (`--io`: inputs and outputs as files, the grader verifies) or
    on its own (the student's notebook: fixed inputs, rank 0 verifies and saves the result). The guards are
    entered before the student's module is imported (`guarded`); run_rank gets the wire's call counts."""
    args = exercise.Args.parse(argv)
    env = par.runtime.dist.init()
    n, r = env.world_size, env.rank
    if args.io:
        mine = take_inputs(args.io, r)
    else:
        inputs, context = exercise.make_inputs(args, n, 0)
        mine = inputs[r]
        ledger.local()
    with guarded(exercise) as wire:
        module = guards.load(args.answer)
        outputs = exercise.run_rank(module, mine, r, env.device, wire)
    outputs = {k: to_cpu(v) for k, v in outputs.items()}
    if args.io:
        put_outputs(args.io, r, outputs)
    else:
        outputs["ledger"] = ledger.kept()
        everyone = par.runtime.dist.gather_object(outputs)
        if r == 0:
            result = exercise.verify(args, context, everyone)
            par.runtime.dist.save_result({"world_size": n, "backend": env.backend, **result})
    par.runtime.dist.teardown()
    return 0


@contextmanager
def guarded(exercise):
    """The rules the student's code runs under: the grader's own modules out of reach (`guards.grader_hidden`);
    its record's `forbidden` (par's and torch's functions, by name) refused; with `p2p_only`, every collective
    refused on the process-group classes and in torch's dispatcher too (only sends and receives), else counted
    there. Yields the wire's call counts."""
    rules = exercise.EXERCISE
    with ExitStack() as stack:
        stack.enter_context(guards.forbidden(rules.forbidden, rules.why))
        stack.enter_context(guards.grader_hidden())
        wire = stack.enter_context(guards.on_the_wire(forbid=rules.why if rules.p2p_only else None))
        if rules.p2p_only:
            stack.enter_context(guards.refused_in_dispatcher(rules.why))
        yield wire


def to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, list):
        return [to_cpu(v) for v in value]
    return value
