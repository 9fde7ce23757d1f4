"""Exercise 02's DDP by hand, graded on real ranks (`par.course.grading.exercise_ddp`).

- The schedule judge, on hand-made records: the schedule of the solution passes; a bucket launched after
  backward, a handle waited inside backward, a handle never waited, a bucket never launched are each named;
  verify reads them from each rank's ledger, cut at its STEP records.
- The handle's future, as ProcessGroupNCCL's behaves (emulated on a fake Work): NaN until the first wait of its
  chain, which records WAIT once, writes the reduced values and runs the then() callbacks in order.
- The expected gradients the grader computes before the run are what torch's `DistributedDataParallel` leaves
  in `.grad` on 2 gloo ranks (two steps of SGD in between).
- The class run (02's `exercise_class`, tests/classroom.py, graded once and shared with tests/test_grading.py):
  the solution earns every point of 02, the untouched exercise none, every wrong answer of
  tests/fixtures/wrong_answers/02_gradient_buckets fails exactly the checks its file names (and loses exactly
  their points), and the cheats of tests/fixtures/cheats/02_gradient_buckets aimed at it (an all-reduce from
  behind the grader's recorder, torch's DDP or par's BucketedDP doing the work, the grader's hooks silenced, the
  runner's schedule rewritten after backward) lose exactly the points of the checks they dodge; a DDP that waits
  through its all-reduces' futures (tests/fixtures/valid_answers/02_gradient_buckets) earns every point
  (tests/test_grading_cheats.py).
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiers import slow

from classroom import fixture_files, full_marks, points_of
from par.course.grading import exercise_ddp as ddp

ROOT = Path(__file__).resolve().parents[1]
NAME = "02_gradient_buckets"
DDP_CHECKS = ("check-ddp-grads", "check-ddp-overlap", "check-ddp-bytes")


# ---- the schedule judge, on records written by hand -------------------------------------------------------------

def log_of(*rows) -> list:
    return list(rows)


def ledger_of(*steps) -> torch.Tensor:
    """One rank's ledger: each step's records after its STEP marker."""
    rows = [row for s, step in enumerate(steps) for row in [(ddp.STEP, s, 0), *step]]
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 3)


BUCKETS, NUMELS = [[3, 2], [1, 0]], [4, 2, 6, 3]      # bucket 0: params 3, 2 (9 elements); bucket 1: 1, 0 (6)
R, L, W, B, F = ddp.READY, ddp.LAUNCH, ddp.WAIT, ddp.BACKWARD, ddp.FINISH
GOOD = [(R, 3, 0), (L, 0, 9), (R, 2, 0), (R, 1, 0), (L, 1, 6), (R, 0, 0), (B, 0, 0), (W, 0, 0), (W, 1, 0),
        (F, 0, 0)]


def test_the_schedule_of_hooks_that_launch_each_full_bucket_passes():
    assert ddp.schedule_problem(log_of(*GOOD), BUCKETS, NUMELS) == ""


@pytest.mark.parametrize("rows, problem", [
    ([(R, 3, 0), (R, 2, 0), (R, 1, 0), (R, 0, 0), (B, 0, 0), (L, 0, 9), (L, 1, 6), (W, 0, 0), (W, 1, 0), (F, 0, 0)],
     "bucket 0 was launched only after backward ended"),
    ([(R, 3, 0), (R, 2, 0), (L, 0, 9), (R, 1, 0), (L, 1, 6), (R, 0, 0), (B, 0, 0), (W, 0, 0), (W, 1, 0), (F, 0, 0)],
     "bucket 0 was not launched by the hook that filled it"),
    ([(R, 3, 0), (L, 0, 9), (W, 0, 0), (R, 2, 0), (R, 1, 0), (L, 1, 6), (R, 0, 0), (B, 0, 0), (W, 1, 0), (F, 0, 0)],
     "all-reduce 1 of the step was waited during backward"),
    ([(R, 3, 0), (L, 0, 9), (R, 2, 0), (R, 1, 0), (L, 1, 6), (R, 0, 0), (B, 0, 0), (W, 1, 0), (F, 0, 0)],
     "all-reduce 1 of the step was never waited"),
    ([(R, 3, 0), (L, 0, 9), (R, 2, 0), (R, 1, 0), (L, 1, 6), (R, 0, 0), (B, 0, 0), (W, 1, 0), (F, 0, 0), (W, 0, 0)],
     "all-reduce 1 of the step was never waited before the optimizer step"),
    ([(R, 3, 0), (L, 0, 9), (R, 2, 0), (R, 1, 0), (R, 0, 0), (B, 0, 0), (W, 0, 0), (F, 0, 0)],
     "bucket 1 was not launched by the hook that filled it"),
    ([(R, 3, 0), (R, 2, 0), (R, 1, 0), (B, 0, 0), (F, 0, 0)], "backward did not produce every gradient once"),
])
def test_each_fault_of_the_schedule_is_named(rows, problem):
    assert problem in ddp.schedule_problem(log_of(*rows), BUCKETS, NUMELS)


def test_a_missing_or_malformed_ledger_is_a_fault():
    assert ddp.schedule_problem(None, BUCKETS, NUMELS) == "no schedule was recorded"
    _, context = ddp.make_inputs(ddp.Args(), 2, seed=7)
    repeated = ledger_of(GOOD, GOOD)
    repeated[len(GOOD) + 1, 1] = 0                          # step 0's marker again: a marker out of order
    for ledger in (None, torch.zeros(3, 2, dtype=torch.int64), ledger_of(GOOD, GOOD).float(), ledger_of(GOOD),
                   repeated):
        result = ddp.verify(ddp.Args(), context, [{"ledger": ledger}] * 2)
        assert result["overlap"]["problem"] == "rank 0, step 1: no schedule was recorded", ledger


def test_verify_judges_gradients_schedule_and_bytes_from_raw_outputs():
    inputs, context = ddp.make_inputs(ddp.Args(), 2, seed=7)
    assert len(context["buckets"]) >= 2 and len(inputs) == 2
    nothing = ddp.verify(ddp.Args(), context, [None, None])
    assert not nothing["grads"]["ok"] and not nothing["overlap"]["ok"] and not nothing["bytes"]["ok"]
    forged = [{"grads": "all right", "ledger": ledger_of(*[GOOD] * ddp.STEPS)}] * 2     # the wrong model's schedule
    result = ddp.verify(ddp.Args(), context, forged)
    assert result["grads"]["max_error"] == float("inf") and not result["overlap"]["ok"]


# ---- the handle's future: ProcessGroupNCCL's, emulated ----------------------------------------------------------

class _Work:
    """A finished Work stand-in: what the wrapper's private copy was reduced by."""

    def __init__(self):
        self.waits = 0

    def wait(self, timeout=None):
        self.waits += 1
        return True


def launched(values):
    """(the student's tensor, its Handle, the records made) of an all-reduce whose reduced values are `values`."""
    from par.course.grading import ledger
    ledger.local()
    mine = torch.full((len(values),), float("nan"))
    return mine, ddp.Handle(_Work(), [mine], [torch.tensor(values)], call=4)


def test_the_future_is_nan_until_the_first_wait_of_its_chain_which_runs_the_callbacks():
    from par.course.grading import ledger
    mine, handle = launched([2.0, 4.0])
    fut = handle.get_future()
    assert fut is handle.get_future() and fut.done(), "NCCL's future is completed when the collective is enqueued"
    seen = []
    halved = fut.then(lambda f: seen.append(f.value()[0].clone()) or f.value()[0] / 2)
    quartered = halved.then(lambda f: f.value() / 2)
    assert not seen and torch.isnan(fut.value()[0]).all(), "unsynchronized before a wait: NaN, no callback yet"
    with pytest.raises(RuntimeError, match="before its wait"):
        halved.value()
    assert torch.equal(quartered.wait(), torch.tensor([0.5, 1.0]))
    assert torch.equal(seen[0], torch.tensor([2.0, 4.0])), "a callback sees the reduced values"
    assert torch.equal(mine, torch.tensor([2.0, 4.0])) and torch.equal(halved.value(), torch.tensor([1.0, 2.0]))
    handle.wait()
    fut.wait()
    assert ledger.kept().tolist() == [[ddp.WAIT, 4, 0]], "one WAIT, at the first wait of the chain"
    late = fut.then(lambda f: f.value()[0] + 1)
    assert torch.equal(late.value(), torch.tensor([3.0, 5.0])), "a callback added after the wait runs at once"


def test_a_callbacks_error_is_its_futures_and_what_the_handle_lacks_is_named():
    _, handle = launched([1.0])
    broken = handle.get_future().then(lambda f: 1 / 0)
    handle.wait()
    with pytest.raises(ZeroDivisionError):
        broken.wait()
    with pytest.raises(AttributeError, match="offers wait"):
        handle.get_future().set_result(1)
    with pytest.raises(AttributeError, match="get_future"):
        handle.result()


# ---- the expected gradients are DistributedDataParallel's --------------------------------------------------------

DDP_RANK = r"""
import os, sys, torch, torch.distributed as dist, torch.nn as nn
from par.course.grading import exercise_ddp as ddp
rank, folder = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
inputs, _ = ddp.make_inputs(ddp.Args(), 2, seed=11)
mine = inputs[rank]
layers = []
for w, b in zip(mine["params"][0::2], mine["params"][1::2]):
    layer = nn.Linear(w.shape[1], w.shape[0])
    with torch.no_grad():
        layer.weight.copy_(w); layer.bias.copy_(b)
    layers += [layer, nn.Tanh()]
model = nn.parallel.DistributedDataParallel(nn.Sequential(*layers[:-1]), bucket_cap_mb=1e-4)
opt = torch.optim.SGD(model.parameters(), lr=ddp.LR)
grads = []
for step in range(ddp.STEPS):
    nn.functional.mse_loss(model(mine["x"][step]), mine["y"][step]).backward()
    grads.append([p.grad.clone() for p in model.parameters()])
    opt.step(); opt.zero_grad(set_to_none=True)
torch.save(grads, f"{folder}/grads-{rank}.pt")
dist.barrier()
dist.destroy_process_group()
os._exit(0)      # as par.runtime.dist.teardown: a gloo thread coming back during finalization aborts the rank
"""


@slow
@pytest.mark.timeout(300)
def test_the_expected_gradients_are_what_distributed_data_parallel_leaves(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, "-c", DDP_RANK, str(r), str(tmp_path)], env=env, cwd=ROOT)
             for r in range(2)]
    assert [p.wait(timeout=240) for p in ranks] == [0, 0]
    _, context = ddp.make_inputs(ddp.Args(), 2, seed=11)
    for r in range(2):
        got = torch.load(tmp_path / f"grads-{r}.pt", weights_only=True)
        for step in range(ddp.STEPS):
            for g, want in zip(got[step], context["expected"][step], strict=True):
                assert torch.allclose(g, want, atol=1e-6), (r, step)


# ---- the class run (02's `exercise_class`, tests/classroom.py, shared with tests/test_grading.py) --------------

WRONG_ANSWERS = {f[1]: f for f in fixture_files("wrong_answers") if f[0] == NAME}
TAMPERED = {f[1]: f for f in fixture_files("cheats") if f[0] == NAME and f[2] == "ddp-ranks"}
FULL = full_marks(NAME)


def test_the_part_is_worth_six_of_ten_points():
    assert points_of(NAME, DDP_CHECKS) == 6 and FULL == 10
    assert len([f for f in WRONG_ANSWERS.values() if f[2] == "ddp-ranks"]) >= 6 and len(TAMPERED) >= 4


@slow
def test_the_solution_earns_every_point_and_the_exercise_none(exercise_class):
    solved, stub = exercise_class(NAME)[f"tampered-solved__{NAME}"], exercise_class(NAME)[f"tampered-unsolved__{NAME}"]
    print(f"the solution graded in {solved.seconds:.1f} s")
    assert solved.status == "ok" and solved.points == solved.max_points == FULL, (solved.reason, solved.notes)
    assert stub.points == 0 and set(stub.failed_checks) >= set(DDP_CHECKS)
    first = next(c for c in stub.checks if c.id == DDP_CHECKS[0])
    assert re.search(r"NotImplementedError: your code here \(rank \d\)", first.error), first.error


@slow
@pytest.mark.parametrize("name", sorted(WRONG_ANSWERS))
def test_every_wrong_answer_loses_exactly_the_points_of_what_it_breaks(exercise_class, name):
    must_fail = set(WRONG_ANSWERS[name][3])
    g = exercise_class(NAME)[f"wrong__{NAME}__{name}"]
    assert g.status == "failed" and set(g.failed_checks) == must_fail, (g.failed_checks, g.reason)
    assert g.points == FULL - points_of(NAME, must_fail)
    for check in g.checks:      # the feedback names what was compared, never a NameError of a broken check
        assert not re.match(r"(NameError|SyntaxError|ImportError)", check.error), (check.id, check.error)


@slow
@pytest.mark.parametrize("name", sorted(TAMPERED))
def test_tampered_modules_lose_the_points_of_what_they_dodge(exercise_class, name):
    must_fail = set(TAMPERED[name][3])
    g = exercise_class(NAME)[f"cheat__{NAME}__{name}"]
    assert set(g.failed_checks) == must_fail, (g.failed_checks, g.reason)
    assert g.points == FULL - points_of(NAME, must_fail)
    if name in ("wraps_torch_ddp", "uses_par_bucketed_dp"):     # refused on the ranks, by name
        assert re.search(r"DistributedDataParallel|BucketedDP", next(c.error for c in g.checks
                                                                    if c.id == "check-ddp-grads"))
