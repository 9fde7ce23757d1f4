"""Exercise 07's part 4: a layout of 2 CPU ranks under a memory budget, judged by the grader's measured ranking
(`par.course.grading.exercise_layout`).

- The scenario: for every model the grader draws, the budget leaves plain DDP and ZeRO-1 without accumulation out
  and ZeRO-2 with one micro-batch in, with a gap of at least GAP on both sides; tensor parallelism is never valid.
- The judge, on hand-made measurements: an answer that is not a dict of five ints (a bool, an extra key, a world of
  4) is refused by name; a layout over the budget or not valid is refused with the planner's numbers; a layout
  within BAND of the measured best passes, one outside fails with the measured ranking in the message.
- The measurement is made once per grading process, however many notebooks (and threads) ask for it.
- The class run (07's `exercise_class`, tests/classroom.py, shared with tests/test_grading.py): the solution earns
  every point, the untouched exercise none, every wrong answer and cheat of tests/fixtures/*/07_layout aimed at
  `my-layout` loses exactly the points of the checks its file names, and the feedback never shows the drawn
  model and its budget.
"""
import random
import re
import threading

import pytest
from tiers import slow

from classroom import fixture_files, full_marks, points_of
from par.course.grading import exercise_layout as judge
from par.model import preset

NAME = "07_layout"
CHECKS = ("check-layout-fits", "check-layout-fastest")
WRONG = {f[1]: f for f in fixture_files("wrong_answers") if f[0] == NAME and f[2] == "my-layout"}
CHEATS = {f[1]: f for f in fixture_files("cheats") if f[0] == NAME and f[2] == "my-layout"}
FULL = full_marks(NAME)


def scenario(heads=3, width=96):
    model = preset("tiny", n_head=heads, d_model=width, block_size=64)
    return judge.Scenario(model, judge.budget_for(model))


def answer(dp=2, pp=1, tp=1, zero_stage=1, microbatches=2):
    return {"dp": dp, "pp": pp, "tp": tp, "zero_stage": zero_stage, "microbatches": microbatches}


def runs_of(speeds: dict) -> dict:
    return {lay: {"samples_per_s": s, "memory": 1} for lay, s in speeds.items()}


# ---- the scenario ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("heads, width", judge.MODELS)
def test_the_budget_leaves_ddp_out_and_zero2_in_with_a_gap_on_both_sides(heads, width):
    sc = scenario(heads, width)
    memory = lambda lay: judge.predict(sc, lay).memory["total"]
    assert memory((2, 1, 1, 0, 1)) > sc.budget and memory((2, 1, 1, 1, 1)) > sc.budget
    assert memory((2, 1, 1, 2, 1)) <= sc.budget
    valid = [judge.predict(sc, lay) for lay in [(2, 1, 1, s, m) for s in judge.STAGES for m in judge.MICROBATCHES]
             + [(1, 2, 1, 0, m) for m in judge.MICROBATCHES] + [(1, 1, 2, 0, m) for m in judge.MICROBATCHES]]
    for plan in (p for p in valid if p.valid):      # no layout within a factor √GAP of the budget
        ratio = plan.memory["total"] / sc.budget
        assert ratio >= judge.GAP ** 0.5 - 1e-9 or ratio <= judge.GAP ** -0.5 + 1e-9, (plan.label, ratio)
    feasible = judge.feasible(sc)
    assert len(feasible) == 13 and (2, 1, 1, 2, 1) in feasible and (2, 1, 1, 3, 4) in feasible
    assert all(tp == 1 for _, _, tp, _, _ in feasible), "tp 2 never divides the odd number of heads"
    assert not judge.predict(sc, (1, 1, 2, 0, 1)).valid


def test_the_draw_is_one_of_the_models_and_configs_train_that_model():
    sc = judge.draw(random.Random(1))
    assert (sc.model.n_head, sc.model.d_model) in judge.MODELS and sc.budget == judge.budget_for(sc.model)
    from par.train.config import model_config, parse
    tc = parse(judge.config(sc, (1, 2, 1, 0, 4)), world_size=2)
    assert model_config(tc) == sc.model and (tc.dp, tc.pp, tc.tp, tc.grad_accum) == (1, 2, 1, 4)
    assert judge.canonical((1, 2, 1, 1, 2)) == (1, 2, 1, 0, 2) and judge.canonical((2, 1, 1, 3, 2)) == (2, 1, 1, 3, 2)


# ---- the judge, on hand-made measurements ---------------------------------------------------------------------

@pytest.mark.parametrize("bad, message", [
    ([2, 1, 1, 1, 2], "return a dict"),
    ({**answer(), "samples_per_s": 1e9}, "keys must be exactly"),
    ({k: v for k, v in answer().items() if k != "tp"}, "keys must be exactly"),
    (answer(pp=True, tp=True), "pp must be an int, got bool"),
    (answer(microbatches=2.0), "microbatches must be an int, got float"),
    (answer(tp=2), "must be the 2 ranks"),
    (answer(dp=-2, pp=-1), "must be the 2 ranks"),
    (answer(zero_stage=4), "zero_stage must be one of"),
    (answer(microbatches=8), "microbatches must be one of"),
])
def test_an_answer_that_is_not_a_layout_of_five_ints_is_refused_by_name(bad, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        judge.parse(bad)


def test_fit_is_the_planners_formula_against_the_budget():
    sc = scenario()
    assert judge.check_fits(answer(), sc).fits
    with pytest.raises(AssertionError, match=r"ZeRO-0 m=1 needs [\d.]+ MB per rank .*: more than the budget"):
        judge.check_fits(answer(zero_stage=0, microbatches=1), sc)
    with pytest.raises(AssertionError, match="cannot run: .*head"):
        judge.check_fits(answer(dp=1, tp=2, zero_stage=0), sc)
    with pytest.raises(AssertionError, match="cannot run"):
        judge.check_fits(answer(dp=1, pp=2, zero_stage=2), sc)


def test_a_layout_within_the_band_of_the_measured_best_passes_and_one_outside_fails_with_the_ranking():
    sc = scenario()
    runs = runs_of({(2, 1, 1, 1, 2): 300.0, (2, 1, 1, 2, 1): 200.0, (2, 1, 1, 3, 4): 50.0, (1, 2, 1, 0, 2): 180.0})
    text = judge.check_fastest(answer(), sc, runs)
    assert re.search(r"1\. dp 2 pp 1 tp 1 ZeRO-1 m=2 .* 300\.0 samples/s  x1\.00  <- yours", text), text
    judge.check_fastest(answer(zero_stage=2, microbatches=1), sc, runs)          # 1.5x slower: inside 2x
    with pytest.raises(AssertionError) as e:
        judge.check_fastest(answer(dp=1, pp=2, zero_stage=0), sc, runs_of({(2, 1, 1, 1, 2): 300.0,
                                                                          (1, 2, 1, 0, 2): 300.0 / 2.1}))
    assert "2.10 times slower than the fastest layout that fits (dp 2 pp 1 tp 1 ZeRO-1 m=2, 300.0" in str(e.value)
    with pytest.raises(AssertionError, match=r"(?s)ZeRO-3 m=4 fits but ran at 50\.0 samples/s.*<- yours"):
        judge.check_fastest(answer(zero_stage=3, microbatches=4), sc, runs)
    with pytest.raises(AssertionError, match="more than the budget"):    # over the budget: not ranked at all
        judge.check_fastest(answer(zero_stage=0, microbatches=1), sc, runs)
    with pytest.raises(AssertionError, match="was not measured"):
        judge.check_fastest(answer(zero_stage=1, microbatches=4), sc, runs)


def test_a_pipeline_with_a_zero_stage_is_ranked_as_the_pipeline_it_runs():
    sc = scenario()
    runs = runs_of({(2, 1, 1, 1, 2): 300.0, (1, 2, 1, 0, 2): 290.0})
    assert "ZeRO-0 m=2" in judge.check_fastest(answer(dp=1, pp=2, zero_stage=1), sc, runs)


def test_the_measurement_is_made_once_per_grading_process(monkeypatch):
    calls = []
    monkeypatch.setattr(judge, "_DRAWN", {})
    monkeypatch.setattr(judge, "draw", lambda: calls.append("draw") or scenario())
    monkeypatch.setattr(judge, "measure", lambda sc, lays: calls.append("measure") or runs_of({lays[0]: 1.0}))
    threads = [threading.Thread(target=judge.measured) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert judge.drawn() is judge.measured()[0] and calls == ["draw", "measure"]


# ---- the class run (07's `exercise_class`, tests/classroom.py, shared with tests/test_grading.py) --------------

def test_the_part_is_worth_three_of_thirteen_points_and_keeps_its_fixtures():
    assert points_of(NAME, CHECKS) == 3 and FULL == 13
    assert len(WRONG) >= 6 and len(CHEATS) >= 2


@slow
def test_the_solution_earns_every_point_and_the_exercise_none(exercise_class):
    solved = exercise_class(NAME)[f"tampered-solved__{NAME}"]
    stub = exercise_class(NAME)[f"tampered-unsolved__{NAME}"]
    print(f"the solution graded in {solved.seconds:.1f} s")
    assert solved.status == "ok" and solved.points == solved.max_points == FULL, (solved.reason, solved.notes)
    assert stub.points == 0 and set(stub.failed_checks) >= set(CHECKS)
    first = next(c for c in stub.checks if c.id == CHECKS[0])
    assert "my_layout raised NotImplementedError" in first.error, first.error


@slow
@pytest.mark.parametrize("name", sorted(WRONG) + sorted(CHEATS))
def test_every_wrong_layout_loses_exactly_the_points_of_what_it_breaks(exercise_class, name):
    kind, fixture = ("wrong", WRONG[name]) if name in WRONG else ("cheat", CHEATS[name])
    must_fail = set(fixture[3])
    g = exercise_class(NAME)[f"{kind}__{NAME}__{name}"]
    assert set(g.failed_checks) == must_fail, (g.failed_checks, g.reason)
    assert g.points == FULL - points_of(NAME, must_fail)
    for check in g.checks:      # the feedback names what was compared, never a NameError of a broken check
        assert not re.match(r"(NameError|SyntaxError|ImportError)", check.error), (check.id, check.error)
    errors = " ".join(c.error for c in g.checks if c.id in CHECKS)
    if name == "layout_least_memory":       # it fits: judged on the measured ranking, shown
        assert re.search(r"ZeRO-3 m=4 fits but ran at .* times slower than the fastest layout that fits", errors)
    if name == "layout_raises_with_its_arguments":      # the grader's model and budget stay out of the feedback
        assert "my_layout raised ValueError on the grader's model and budget" in errors
        budgets = [judge.budget_for(preset("tiny", n_head=h, d_model=d, block_size=64)) for h, d in judge.MODELS]
        assert "scenario" not in errors and "GPTConfig" not in errors, errors
        assert not any(repr(b) in errors or f"{b / 1e6:.2f}" in errors for b in budgets), errors
