"""Exercise 06's ZeRO-3 by hand, graded on real ranks (`par.course.grading.exercise_zero3`).

- The schedule judge, on hand-made records: the schedule of the solution passes, and so does one that prefetches
  the next unit's all-gather (forward and backward, as DeepSpeed and FSDP do); a unit not gathered before its
  forward, not gathered again before its backward, gathered more than one unit ahead (everything up front), its
  gradient reduce-scattered late or not at all, an all-reduce, an extra all-gather are each named.
- verify() on raw outputs and each rank's ledger: nothing (or forged types) earns nothing; the expected values'
  shards, as a correct rank would report them, pass; a gradient N times too large, a shard of the wrong size,
  bytes at rest beyond the formula, a unit not freed are each failed.
- What the grader measures on the rank: a unit is freed when the storages its parameters pointed to as its
  forward started hold nothing or are gone (not when the parameters point elsewhere while autograd keeps them);
  the bytes at rest count every storage the rank built, wherever it is kept, a `gc.freeze()` undone, the growth
  of one that existed before.
- The expected parameters the grader computes before the run are what `torch.optim.Adam` leaves after STEPS steps
  on the gradient averaged over the ranks.
- The class run (06's `exercise_class`, tests/classroom.py, graded once and shared with tests/test_grading.py):
  the solution earns every point of 06, the untouched exercise none, every wrong answer of
  tests/fixtures/wrong_answers/06_zero fails exactly the checks its file names (and loses exactly their points),
  and the cheats of tests/fixtures/cheats/06_zero aimed at the ZeRO-3 part (par's engine doing the work,
  collectives from behind the grader's recorder, full parameters kept out of sight, kept behind gc.freeze(), or
  kept by autograd while the parameters point elsewhere) lose exactly the points of the checks they dodge; a
  ZeRO-3 that prefetches the next unit (tests/fixtures/valid_answers/06_zero) earns every point
  (tests/test_grading_cheats.py).
"""
import re

import pytest
import torch
from tiers import slow

from classroom import fixture_files, full_marks, points_of
from par.course.grading import exercise_zero3 as zero3
from par.course.grading.units import Layer

NAME = "06_zero"
ZERO3_CHECKS = ("check-zero3-params", "check-zero3-memory", "check-zero3-gathers")
WRONG_ANSWERS = {f[1]: f for f in fixture_files("wrong_answers") if f[0] == NAME}
TAMPERED = {f[1]: f for f in fixture_files("cheats") if f[0] == NAME and f[2] == "zero3-ranks"}
FULL = full_marks(NAME)


# ---- the schedule judge, on logs written by hand ----------------------------------------------------------------

def log_of(*rows) -> list:
    return list(rows)


def ledger_of(steps, held: int) -> torch.Tensor:
    """One rank's ledger: each step's records after its STEP marker, the bytes at rest after the last."""
    rows = [row for s, step in enumerate(steps) for row in [(zero3.STEP, s, 0), *step]] + [(zero3.HELD, held, 0)]
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 3)


SIZES = [12, 8]             # two units, padded flat sizes
Fw, Fr, B, R, G, S, A, E = (zero3.FORWARD, zero3.FREED, zero3.BACKWARD, zero3.READY, zero3.GATHER, zero3.SCATTER,
                            zero3.ALLREDUCE, zero3.END)
GOOD = [(G, 0, 12), (Fw, 0, 0), (Fr, 0, 1), (G, 1, 8), (Fw, 1, 0), (Fr, 1, 1),
        (G, 2, 8), (B, 1, 0), (R, 1, 0), (S, 3, 8), (R, 1, 1),
        (G, 4, 12), (B, 0, 0), (R, 0, 0), (S, 5, 12), (R, 0, 1), (E, 0, 0)]


def without(rows, row):
    out = list(rows)
    out.remove(row)
    return out


PREFETCHED = [(G, 0, 12), (G, 1, 8), (Fw, 0, 0), (Fr, 0, 1), (Fw, 1, 0), (Fr, 1, 1),
              (G, 2, 8), (G, 4, 12), (B, 1, 0), (R, 1, 0), (S, 3, 8), (R, 1, 1),
              (B, 0, 0), (R, 0, 0), (S, 5, 12), (R, 0, 1), (E, 0, 0)]
SIZES3 = [12, 8, 4]
UP_FRONT = [(G, 0, 12), (G, 1, 8), (G, 2, 4), (Fw, 0, 0), (Fr, 0, 1), (Fw, 1, 0), (Fr, 1, 1), (Fw, 2, 0), (Fr, 2, 1),
            (G, 3, 4), (B, 2, 0), (R, 2, 0), (S, 4, 4), (R, 2, 1), (G, 5, 8), (B, 1, 0), (R, 1, 0), (S, 6, 8),
            (R, 1, 1), (G, 7, 12), (B, 0, 0), (R, 0, 0), (S, 8, 12), (R, 0, 1), (E, 0, 0)]


def test_the_schedule_of_a_unit_gathered_freed_regathered_and_reduce_scattered_passes():
    assert zero3.schedule_problem(log_of(*GOOD), SIZES) == ""


def test_a_prefetch_one_unit_ahead_passes_and_gathering_everything_up_front_does_not():
    assert zero3.schedule_problem(log_of(*PREFETCHED), SIZES) == "", "unit 1 gathered as unit 0 starts, unit 0 as 1's backward starts"
    ahead = zero3.schedule_problem(log_of(*UP_FRONT), SIZES3)
    assert "unit 2's forward: all-gathered more than one unit ahead" in ahead, ahead
    late = [(G, 0, 12), (Fw, 0, 0), (Fr, 0, 1), (G, 1, 8), (Fw, 1, 0), (Fr, 1, 1),
            (G, 2, 8), (G, 4, 12), (B, 1, 0), (R, 1, 0), (S, 3, 8), (R, 1, 1), (B, 0, 0), (R, 0, 0), (S, 5, 12),
            (R, 0, 1), (E, 0, 0)]
    assert zero3.schedule_problem(log_of(*late), SIZES) == "", "backward prefetch alone"
    swapped = [(G, 0, 12), (Fw, 0, 0), (Fr, 0, 1), (G, 1, 8), (Fw, 1, 0), (Fr, 1, 1),
               (G, 4, 12), (G, 2, 8), (B, 1, 0), (R, 1, 0), (S, 3, 8), (R, 1, 1), (B, 0, 0), (R, 0, 0),
               (S, 5, 12), (R, 0, 1), (E, 0, 0)]
    assert "unit 1's backward: its all-gather holds 12 elements" in zero3.schedule_problem(log_of(*swapped), SIZES)


@pytest.mark.parametrize("rows, problem", [
    (without(GOOD, (G, 0, 12)), "unit 0's forward: no all-gather of it before it"),
    (without(GOOD, (G, 1, 8)), "unit 1's forward: no all-gather of it before it"),
    (without(GOOD, (G, 4, 12)), "unit 0's backward: no all-gather of it before it"),
    (without(GOOD, (G, 2, 8)), "unit 1's backward: no all-gather of it before it"),
    ([(G, 0, 13) if r == (G, 0, 12) else r for r in GOOD], "holds 13 elements"),
    (without(GOOD, (S, 3, 8)) + [(S, 9, 8)], "unit 1's backward: 0 reduce-scatter(s)"),
    (GOOD[:-1] + [(S, 9, 8), (E, 0, 0)], "unit 0's backward: 2 reduce-scatter(s)"),
    ([(A, 3, 8) if r == (S, 3, 8) else r for r in GOOD], "an all-reduce of 8 elements"),
    (GOOD + [(G, 9, 12)], "the backward: 1 all-gather(s) more than one per unit"),
    (GOOD[:3] + [(G, 9, 8)] + GOOD[3:], "the forward: 1 all-gather(s) more than one per unit"),
    (GOOD[:-1] + [(S, 9, 4), (E, 0, 0)], "unit 0's backward: 2 reduce-scatter(s)"),
    (without(GOOD, (B, 0, 0)), "did not run through every unit"),
])
def test_each_fault_of_the_schedule_is_named(rows, problem):
    assert problem in zero3.schedule_problem(log_of(*rows), SIZES)


def test_a_missing_schedule_is_a_fault():
    assert zero3.schedule_problem(None, SIZES) == "no schedule was recorded"


# ---- verify, on raw outputs -------------------------------------------------------------------------------------

def honest(context: dict, n: int) -> list[dict]:
    """What n correct ranks report: their partitions of the expected values, a clean schedule, the formula's bytes."""
    sizes = context["padded"]
    parts = [s // n for s in sizes]

    def mine(flat, u, r):
        return flat[r * parts[u]:(r + 1) * parts[u]].clone()
    return [{"grads": [[mine(g, u, r) for u, g in enumerate(step)] for step in context["grads"]],
             "shards": [mine(f, u, r) for u, f in enumerate(context["final"])],
             "ledger": ledger_of([step_of(sizes)] * zero3.STEPS, 16 * sum(parts))} for r in range(n)]


def step_of(sizes: list[int], freed: int = 1) -> list:
    """A clean step's records: each unit gathered, computed and freed; gathered again, its gradient scattered."""
    rows = []
    for u, s in enumerate(sizes):
        rows += [(G, 0, s), (Fw, u, 0), (Fr, u, freed)]
    for u in reversed(range(len(sizes))):
        rows += [(G, 0, sizes[u]), (B, u, 0), (R, u, 0), (S, 0, sizes[u]), (R, u, 1)]
    return rows + [(E, 0, 0)]


def test_verify_passes_the_expected_values_and_fails_what_is_off():
    n = 3
    inputs, context = zero3.make_inputs(zero3.Args(), n, seed=7)
    sizes, params = context["padded"], inputs[0]["params"]
    numels = [params[k].numel() + params[k + 1].numel() for k in range(0, len(params), 2)]
    assert any(k % n for k in numels) and any(k % n == 0 for k in numels), "units with and without padding"
    good = zero3.verify(zero3.Args(), context, honest(context, n))
    assert good["params"]["ok"] and good["memory"]["ok"] and good["gathers"]["ok"], good
    assert good["memory"]["formula"] == 16 * sum(s // n for s in sizes)

    nothing = zero3.verify(zero3.Args(), context, [None] * n)
    assert not nothing["params"]["ok"] and not nothing["memory"]["ok"] and not nothing["gathers"]["ok"]
    forged = [{"grads": "all right", "shards": "all right", "ledger": "all right"}] * n
    result = zero3.verify(zero3.Args(), context, forged)
    assert not result["params"]["ok"] and not result["memory"]["ok"] and not result["gathers"]["ok"]

    summed = honest(context, n)
    for out in summed:
        out["grads"] = [[g * n for g in step] for step in out["grads"]]
    assert not zero3.verify(zero3.Args(), context, summed)["params"]["ok"]
    short = honest(context, n)
    short[1]["shards"][0] = short[1]["shards"][0][:-1]
    assert zero3.verify(zero3.Args(), context, short)["params"]["max_error"] == float("inf")
    heavy = honest(context, n)
    heavy[2]["ledger"] = ledger_of([step_of(sizes)] * zero3.STEPS, 16 * sum(s // n for s in sizes) + 4 * sizes[0])
    assert "bytes held at rest" in zero3.verify(zero3.Args(), context, heavy)["memory"]["problem"]
    kept = honest(context, n)
    kept[0]["ledger"] = ledger_of([step_of(sizes, freed=0)] * zero3.STEPS, 16 * sum(s // n for s in sizes))
    assert "still held memory after its forward" in zero3.verify(zero3.Args(), context, kept)["memory"]["problem"]
    unmeasured = honest(context, n)
    unmeasured[1]["ledger"] = unmeasured[1]["ledger"][:-1]
    assert zero3.verify(zero3.Args(), context, unmeasured)["memory"]["problem"] == "rank 1: no memory was measured"


# ---- the grader's own numbers ------------------------------------------------------------------------------------

@slow
def test_the_expected_parameters_are_what_torch_adam_leaves():     # torch's first Adam step imports its compiler
    n = 3
    inputs, context = zero3.make_inputs(zero3.Args(), n, seed=11)
    params = [p.clone().requires_grad_() for p in inputs[0]["params"]]
    adam = torch.optim.Adam(params, lr=zero3.LR)
    for step in range(zero3.STEPS):
        adam.zero_grad()
        sum(zero3.loss_of(params, inputs[r]["x"][step], inputs[r]["y"][step]) for r in range(n)).div(n).backward()
        for u, want in enumerate(context["grads"][step]):
            assert torch.allclose(zero3.flat([params[2 * u].grad, params[2 * u + 1].grad], n), want, atol=1e-7)
        adam.step()
    for u, want in enumerate(context["final"]):
        assert torch.allclose(zero3.flat([params[2 * u].detach(), params[2 * u + 1].detach()], n), want, atol=1e-6)
        numel = params[2 * u].numel() + params[2 * u + 1].numel()
        assert want.numel() == zero3.padded(numel, n) and not want[numel:].any(), "padded with zeros"


def test_the_bytes_at_rest_count_every_storage_the_rank_built_wherever_it_is_kept():
    import gc
    import types
    module = types.ModuleType("student")
    existing, grown = torch.zeros(7), torch.zeros(5)
    try:
        before = zero3.snapshot()            # (and everything alive now frozen, as the agent freezes)
        units = [Layer(torch.zeros(3, 2), torch.zeros(3), last=True)]
        hidden = (lambda box={}: box)()      # a default argument: no attribute of anything the grader reads
        hidden["kept"] = torch.zeros(100)
        frozen = [torch.zeros(20)]
        gc.freeze()                          # the student's: moves `frozen` (and everything) out of gc's lists
        hidden["storage"] = torch.zeros(30).untyped_storage()      # a storage object, no tensor left
        grown.untyped_storage().resize_(4 * 8)                     # existed before: its growth counts
        module.SHOWN = [torch.zeros(10)]
        records = [torch.zeros(1000)]
        held = zero3.held_bytes(units, module, [records], before)
    finally:
        gc.unfreeze()
    assert held == 4 * (100 + 20 + 30 + 3 + 10 + 3 * 2 + 3), (held, existing.shape, frozen)


def test_a_unit_is_freed_when_its_gathered_storage_is_empty_or_gone_not_when_its_parameters_point_elsewhere():
    w = torch.nn.Parameter(torch.zeros(3, 4))
    x = torch.randn(2, 4, requires_grad=True)

    def used():
        return [zero3.StorageRef(w.untyped_storage())]
    refs = used()
    y = torch.nn.functional.linear(x, w)                          # autograd saves a view of the weight
    w.data = torch.empty(0)
    assert not zero3.released(refs), "the gathered storage lives on in autograd's saved tensors"
    del y
    assert zero3.released(refs), "gone once nothing holds it"
    w.data = torch.zeros(3, 4)
    refs = used()
    y = torch.nn.functional.linear(x, w)
    w.untyped_storage().resize_(0)
    assert zero3.released(refs), "resized to 0 bytes: autograd's view holds nothing either"


# ---- the class run (06's `exercise_class`, tests/classroom.py, shared with tests/test_grading.py) --------------

def test_the_part_is_worth_seven_of_fifteen_points():
    assert points_of(NAME, ZERO3_CHECKS) == 7 and FULL == 15
    assert len([f for f in WRONG_ANSWERS.values() if f[2] == "zero3-ranks"]) >= 6 and len(TAMPERED) >= 3


@slow
def test_the_solution_earns_every_point_and_the_exercise_none(exercise_class):
    solved = exercise_class(NAME)[f"tampered-solved__{NAME}"]
    stub = exercise_class(NAME)[f"tampered-unsolved__{NAME}"]
    print(f"the solution graded in {solved.seconds:.1f} s")
    assert solved.status == "ok" and solved.points == solved.max_points == FULL, (solved.reason, solved.notes)
    assert stub.points == 0 and set(stub.failed_checks) >= set(ZERO3_CHECKS)
    first = next(c for c in stub.checks if c.id == ZERO3_CHECKS[0])
    assert re.search(r"NotImplementedError: your code here \(rank \d\)", first.error), first.error


@slow
@pytest.mark.parametrize("name", sorted(n for n, f in WRONG_ANSWERS.items() if f[2] == "zero3-ranks"))
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
    if name == "uses_par_zero":         # refused on the ranks, by name
        assert re.search(r"par\.zero\.engine\.Zero", next(c.error for c in g.checks if c.id == ZERO3_CHECKS[0]))
