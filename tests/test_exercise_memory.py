"""Exercise 01's part 5, a rank's model-state bytes under par's ZeRO measured on real ranks
(`par.course.grading.exercise_memory`).

- The grader's truth, from the layout alone: the padded flat buffers (or their partitions) per stage, before and
  after the step; the formula (4Ψ, 4Ψ, 8Ψ with the stage's 1/N); the gap between them = the padding.
- verify() on raw outputs made by hand: the expected values pass; nothing, forged types, an error, a byte too
  many, a formula off by a rounding, a gap of zero, NaN each fail the check they belong to (and only that one,
  but for the gap, explained only beside a right measurement), and a run whose own count differs from the layout
  fails the measurement.
- The drawn models always need some padding (so a gap of zero is wrong), on 2 and 3 ranks.
- The class run (01's `exercise_class`, tests/classroom.py, shared with tests/test_grading.py): the solution earns
  every point, the untouched exercise none, every wrong answer and cheat of part 5 loses exactly the points of the
  checks its file names.
"""
import math
import re

import pytest
import torch
from tiers import slow

from classroom import fixture_files, full_marks, points_of
from par.course.grading import exercise_memory as memory, rank_io

NAME = "01_model_state_bytes"
CHECKS = ("check-memory-measured", "check-memory-formula", "check-memory-gap")
WRONG = {f[1]: f for f in fixture_files("wrong_answers") if f[0] == NAME and f[2] == "memory-ranks"}
CHEATS = {f[1]: f for f in fixture_files("cheats") if f[0] == NAME and f[2] == "memory-ranks"}
FULL = full_marks(NAME)


# ---- the grader's truth ----------------------------------------------------------------------------------------

def test_expected_bytes_are_the_padded_buffers_or_their_partitions_per_stage():
    numels, n = [5, 4, 7], 2               # padded: 6, 4, 8 -> 18 elements, 9 per rank
    after = [memory.expected(numels, n, s) for s in memory.STAGES]
    assert after == [[72, 72, 144], [72, 72, 72], [72, 36, 72], [36, 36, 72]]
    before = [memory.expected(numels, n, s, stepped=False) for s in memory.STAGES]
    assert before == [[72, 0, 0], [72, 0, 0], [72, 36, 0], [36, 36, 0]]


def test_formula_is_lecture_01s_fp32_adam_and_the_gap_is_the_padding():
    psi, n = 16, 2
    assert [memory.formula(psi, n, s) for s in memory.STAGES] == [
        [64, 64, 128], [64, 64, 64], [64, 32, 64], [32, 32, 64]]
    inputs, want = memory.make_inputs(memory.Args(), 3, seed=11)
    for stage, gap in enumerate(want["padding"]):
        assert gap == [a - b for a, b in zip(want["measured"][2 * stage + 1], want["formula"][stage])]
        assert all(g > 0 for g in gap), gap       # the drawn model needs padding
        assert math.isclose(gap[2] * (3 if stage >= 1 else 1), 2 * gap[0] * (3 if stage >= 3 else 1))


@pytest.mark.parametrize("n", [2, 3])
def test_every_drawn_model_needs_padding_and_every_rank_gets_its_own_tokens(n):
    for seed in range(6):
        inputs, want = memory.make_inputs(memory.Args(), n, seed)
        assert len(inputs) == n and all(set(i) == {"config", "tokens"} for i in inputs)
        assert len(want["measured"]) == 2 * len(memory.STAGES) and len(want["formula"]) == len(memory.STAGES)
        assert all(g > 0 for g in want["padding"][0])


def test_par_s_accounting_is_refused_on_the_ranks_and_stubbed_in_the_sandbox():
    job = "par.course.grading.exercise_memory"
    assert rank_io.exercise(job) is memory
    assert ("par.memory.accounting", "tensor_bytes") in memory.EXERCISE.forbidden
    assert ("par.zero.engine", "tensor_bytes") in memory.EXERCISE.forbidden
    assert ("par.zero.engine", "Zero.memory") in memory.EXERCISE.stubs
    assert ("par.memory.accounting", "live_model_state_bytes") in memory.EXERCISE.stubs


# ---- verify() on raw outputs made by hand ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def case():
    return memory.make_inputs(memory.Args(), 2, seed=5)[1]


def rank_out(want, **changes):
    out = {"grader": [list(r) for r in want["measured"]], "measured": [[float(x) for x in r] for r in want["measured"]],
           "formula": [list(r) for r in want["formula"]], "padding": [list(r) for r in want["padding"]]}
    out.update(changes)
    return out


def failed(result) -> set:
    return {key for key in ("measured", "formula", "gap") if not result[key]["ok"]}


def test_the_expected_outputs_pass(case):
    result = memory.verify(memory.Args(), case, [rank_out(case), rank_out(case)])
    assert failed(result) == set(), result
    assert result["measured"]["held"] == case["measured"] and result["world_size"] == 2


@pytest.mark.parametrize("outputs", [[None, None], [{}, {}], [{"measured": "forged", "formula": {}, "padding": 3}] * 2])
def test_nothing_or_forged_types_earn_nothing(case, outputs):
    result = memory.verify(memory.Args(), case, outputs)
    assert failed(result) == {"measured", "formula", "gap"}
    assert re.match(r"rank 0: no measured\(zero\) came back", result["measured"]["problem"])


def with_row(rows, index, row):
    rows = [list(r) if isinstance(r, list) else r for r in rows]
    rows[index] = row
    return rows


def test_a_byte_too_many_fails_the_measurement_naming_rank_stage_moment_and_kind(case):
    wrong = with_row(case["measured"], 5, [case["measured"][5][0], case["measured"][5][1] + 1, case["measured"][5][2]])
    result = memory.verify(memory.Args(), case, [rank_out(case), rank_out(case, measured=wrong)])
    assert failed(result) == {"measured", "gap"}, "a right padding explains nothing beside a wrong measurement"
    assert result["measured"]["problem"].startswith("rank 1, stage 2, after the step: measured(zero) grads = ")
    assert result["gap"]["problem"].startswith("padding(zero) explains the gap only beside a right measurement")


def test_an_error_of_one_function_fails_only_its_check(case):
    errors = ["NotImplementedError: your code here"] * len(memory.STAGES)
    result = memory.verify(memory.Args(), case, [rank_out(case, padding=errors)] * 2)
    assert failed(result) == {"gap"}
    assert "padding(zero): NotImplementedError: your code here" in result["gap"]["problem"]


def test_a_formula_off_by_a_rounding_or_nan_fails_the_formula(case):
    off = with_row(case["formula"], 3, [case["formula"][3][0] * (1 + 1e-6), *case["formula"][3][1:]])
    assert failed(memory.verify(memory.Args(), case, [rank_out(case, formula=off)] * 2)) == {"formula"}
    nan = with_row(case["formula"], 0, [float("nan"), *case["formula"][0][1:]])
    assert failed(memory.verify(memory.Args(), case, [rank_out(case, formula=nan)] * 2)) == {"formula"}
    booleans = with_row(case["formula"], 0, [True, True, True])
    assert failed(memory.verify(memory.Args(), case, [rank_out(case, formula=booleans)] * 2)) == {"formula"}


def test_a_gap_of_zero_fails_the_gap(case):
    zero = [[0.0, 0.0, 0.0]] * len(memory.STAGES)
    result = memory.verify(memory.Args(), case, [rank_out(case, padding=zero)] * 2)
    assert failed(result) == {"gap"} and "stage 0: padding(zero) params = 0 bytes" in result["gap"]["problem"]


def test_a_run_that_held_other_bytes_than_the_layout_fails_the_measurement(case):
    grader = with_row(case["measured"], 0, [case["measured"][0][0] + 4, 0, 0])
    result = memory.verify(memory.Args(), case, [rank_out(case, grader=grader)] * 2)
    assert failed(result) == {"measured", "gap"} and "the run itself held other bytes" in result["measured"]["problem"]


# ---- the class run (01's `exercise_class`, tests/classroom.py, shared with tests/test_grading.py) --------------

def test_the_part_is_worth_four_of_fourteen_points():
    assert points_of(NAME, CHECKS) == 4 and FULL == 14
    assert len(WRONG) >= 6 and len(CHEATS) >= 2
    for checks in [set(f[3]) for f in [*WRONG.values(), *CHEATS.values()]]:
        assert checks and checks <= set(CHECKS), checks


@slow
def test_the_solution_earns_every_point_and_the_exercise_none(exercise_class):
    solved = exercise_class(NAME)[f"tampered-solved__{NAME}"]
    stub = exercise_class(NAME)[f"tampered-unsolved__{NAME}"]
    print(f"the solution graded in {solved.seconds:.1f} s")
    assert solved.status == "ok" and solved.points == solved.max_points == FULL, (solved.reason, solved.notes)
    assert stub.points == 0 and set(stub.failed_checks) >= set(CHECKS)
    first = next(c for c in stub.checks if c.id == CHECKS[0])
    assert "NotImplementedError" in first.error, first.error


@slow
@pytest.mark.parametrize("name", sorted(WRONG))
def test_every_wrong_answer_loses_exactly_the_points_of_what_it_breaks(exercise_class, name):
    must_fail = set(WRONG[name][3])
    g = exercise_class(NAME)[f"wrong__{NAME}__{name}"]
    assert g.status == "failed" and set(g.failed_checks) == must_fail, (g.failed_checks, g.reason)
    assert g.points == FULL - points_of(NAME, must_fail)
    for check in g.checks:      # the feedback names what was compared, never a NameError of a broken check
        assert not re.match(r"(NameError|SyntaxError|ImportError)", check.error), (check.id, check.error)


@slow
@pytest.mark.parametrize("name", sorted(CHEATS))
def test_cheats_lose_the_points_of_what_they_dodge(exercise_class, name):
    must_fail = set(CHEATS[name][3])
    g = exercise_class(NAME)[f"cheat__{NAME}__{name}"]
    assert set(g.failed_checks) == must_fail, (g.failed_checks, g.reason)
    assert g.points == FULL - points_of(NAME, must_fail)
    if name == "uses_zero_memory":      # refused on the ranks (or stubbed in the sandbox's par)
        error = next(c.error for c in g.checks if c.id == CHECKS[0])
        assert re.search(r"tensor_bytes|Zero\.memory", error), error
