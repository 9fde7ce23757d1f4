"""Exercise 08's part 3: the student's ring attention on real ranks (`par.course.grading.exercise_ring_attention`).

- Without ranks: the grader's inputs (drawn per run, SDPA's output computed from them before any rank starts),
  and `verify` judging outputs and records that are right, missing, forged or sent off the ring; the profiler's
  FLOP count (`profiled`), which sees the matmuls FlopCounterMode does not (dispatch modes switched off, another
  thread), counts each op once, and counts nothing once the student's code stopped or replaced its session.
- The class run (slow; 08's `exercise_class`, tests/classroom.py, shared with tests/test_grading.py): the solution,
  the unsolved exercise, every wrong answer of part 3 (tests/fixtures/wrong_answers/08_online_softmax, cell
  `ring-attention`) and every cheat of it (tests/fixtures/cheats/08_online_softmax). The solution earns 11 of 11;
  each wrong answer and each cheat fails exactly the checks its file names, and loses exactly their points.
"""
import math
import re

import pytest
import torch
from tiers import slow

import test_grading as tg
import test_grading_cheats as tc
from par.course.grading import exercise_ring_attention as ex
from par.course.grading import rank_io
from par.course.grading.report import format_grade

NAME = "08_online_softmax"
CELL = "ring-attention"
RING = {"check-ring-attention": 4, "check-ring-bytes": 1, "check-ring-skipping": 1}
WRONG = [w for w in tg.WRONG_ANSWERS if w[0] == NAME and w[2] == CELL]
CHEATS = [c for c in tc.CHEATS_ALL if c[0] == NAME and c[2] == CELL]


def ledger_of(cases: list[list]) -> torch.Tensor:
    """One rank's ledger: each case's records after its CASE marker."""
    rows = [row for c, case in enumerate(cases) for row in [(ex.CASE, c, 0), *case]]
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 3)


def records(context: dict, n: int, r: int, name: str, flops: float = 1.0) -> list:
    """A right ring's records of one case on rank r: the formula's bytes to the right neighbour, in two sends,
    r + 1 blocks' FLOPs (times `flops`) by both counters."""
    half = context[name]["bytes"][r] // 2
    f = int(flops * context[name]["flops"][r])
    return [(ex.SENT, (r + 1) % n, half), (ex.SENT, (r + 1) % n, context[name]["bytes"][r] - half),
            (ex.FLOPS, ex.MODES, f), (ex.FLOPS, ex.PROFILER, f)]


def perfect_outputs(context: dict, n: int) -> list[dict]:
    """What n ranks of a right ring leave: SDPA's rows, and their records."""
    return [{"out": {c: context[c]["want"][r].clone() for c in ex.CASES},
             "ledger": ledger_of([records(context, n, r, c) for c in ex.CASES])} for r in range(n)]


# ---- without ranks ---------------------------------------------------------------------------------------------

def test_the_inputs_are_drawn_per_run_and_sdpa_computed_from_them():
    args = ex.Args()
    inputs, context = ex.make_inputs(args, 3, seed=11)
    again, _ = ex.make_inputs(args, 3, seed=11)
    other, _ = ex.make_inputs(args, 3, seed=12)
    assert torch.equal(inputs[1]["wide"]["q"], again[1]["wide"]["q"])
    assert not any(torch.equal(inputs[0][c]["k"], other[0][c]["k"]) for c in ex.CASES if
                   inputs[0][c]["k"].shape == other[0][c]["k"].shape), "fresh values per seed"
    for case in ex.CASES:
        q, k, v = (torch.cat([inputs[r][case][x] for r in range(3)], -2) for x in "qkv")
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert torch.equal(torch.cat(context[case]["want"], -2), want), case
        b, h, t, d = inputs[0][case]["k"].shape
        assert context[case]["bytes"] == [2 * 2 * b * h * t * d * 4] * 3, "2(N-1)|K_r| bytes on every rank"
        assert context[case]["flops"] == [(r + 1) * 4 * b * h * t * t * d for r in range(3)]
    scores = inputs[0]["large_scores"]["q"] @ inputs[0]["large_scores"]["k"].transpose(-2, -1) / 2
    assert scores.abs().max() > 89, "exp overflows float32 in the large-score case unless the max is subtracted"
    assert math.isinf(torch.exp(scores.abs().max()).item())


def test_verify_passes_a_right_ring_and_fails_what_is_missing_forged_or_off_the_ring():
    args = ex.Args()
    _, context = ex.make_inputs(args, 4, seed=3)
    result = ex.verify(args, context, perfect_outputs(context, 4))
    for case in result["cases"]:
        assert case["max_error"] == 0 and case["sent_ratio"] == [1.0] * 4 and case["off_ring"] == [False] * 4
        assert case["flops_ratio"] == [1.0] * 4
    outputs = perfect_outputs(context, 4)
    outputs[1] = None                                             # a rank that left nothing
    outputs[2]["out"]["small"] = outputs[2]["out"]["small"][..., :1, :]          # a wrong shape
    outputs[2]["ledger"] = outputs[2]["ledger"][1:]              # its first marker lost: no records are read
    wide = [records(context, 4, 3, c) for c in ex.CASES]
    wide[1][0] = (ex.SENT, 1, context["wide"]["bytes"][3])       # rank 3 of 4 sends to rank 1: not a neighbour
    wide[1][1] = (ex.SENT, 0, 0)
    wide[2] = [row for row in wide[2] if row[:2] != (ex.FLOPS, ex.PROFILER)]       # one counter missing
    wide[3] += [(ex.FLOPS, ex.MODES, 0), (ex.FLOPS, ex.PROFILER, 1)]             # added counts: the largest holds
    outputs[3]["ledger"] = ledger_of(wide)
    outputs[0]["out"]["one_token"] = [outputs[0]["out"]["one_token"]]   # not a tensor
    cases = {c["name"]: c for c in ex.verify(args, context, outputs)["cases"]}
    assert math.isinf(cases["small"]["max_error"]) and cases["small"]["sent_ratio"][1:3] == [None, None]
    assert cases["small"]["flops_ratio"][2] is None and cases["small"]["flops_ratio"][1] is None
    assert cases["wide"]["off_ring"] == [False, False, False, True] and cases["wide"]["sent_ratio"][3] == 1.0
    assert cases["one_token"]["flops_ratio"][3] is None and cases["large_scores"]["flops_ratio"][3] == 1.0
    assert math.isinf(cases["one_token"]["max_error"])
    nan = perfect_outputs(context, 4)
    nan[0]["out"]["wide"][0, 0, 0, 0] = float("nan")
    assert math.isinf(ex.verify(args, context, nan)["cases"][1]["max_error"]), "a NaN counts as wrong"
    skips_nothing = perfect_outputs(context, 4)
    skips_nothing[0]["ledger"] = ledger_of([records(context, 4, 0, c)[:3] + [(ex.FLOPS, ex.PROFILER, 4 * context[c]["flops"][0])]
                                            for c in ex.CASES])
    assert ex.verify(args, context, skips_nothing)["cases"][0]["flops_ratio"][0] == 4.0, "the larger counter"


def test_the_profiler_counts_the_matmuls_the_dispatch_modes_miss_each_once():
    import threading

    from torch.utils.flop_counter import FlopCounterMode
    a, b = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 4, 5)
    one = 2 * 6 * 5 * 4 * 5

    def counted(work):
        with ex.profiled() as seen, FlopCounterMode(display=False) as modes:
            work()
        return modes.get_total_flops(), seen
    assert counted(lambda: a @ b) == (one, [one]), "the bmm under FlopCounterMode's own redispatch: once"
    assert counted(lambda: _hidden(a, b)) == (0, [one]), "dispatch modes switched off"

    def in_a_thread():
        worker = threading.Thread(target=lambda: a @ b)
        worker.start()
        worker.join()
    assert counted(in_a_thread) == (0, [one]), "a thread of the student's (profile_all_threads)"
    q = torch.randn(1, 2, 6, 4)
    sdpa = 2 * 2 * 6 * 6 * (4 + 4)
    assert counted(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True))[1] == [sdpa]


def _hidden(a, b):
    from torch.utils._python_dispatch import _disable_current_modes
    with _disable_current_modes():
        return a @ b


def test_a_profiler_session_the_student_stopped_or_replaced_counts_nothing():
    from torch.autograd import ProfilerActivity, ProfilerConfig, ProfilerState, _disable_profiler, _enable_profiler
    from torch.autograd import _prepare_profiler
    from torch._C._profiler import _ExperimentalConfig
    with ex.profiled() as seen:
        _disable_profiler()
    assert seen == [], "stopped: the grader's end of it finds no session of its own"
    with ex.profiled() as seen:
        _disable_profiler()
        mine = ProfilerConfig(ProfilerState.KINETO, True, False, False, False, False, _ExperimentalConfig())
        _prepare_profiler(mine, {ProfilerActivity.CPU})
        _enable_profiler(mine, {ProfilerActivity.CPU})
    assert seen == [], "replaced by the student's own session: it started after the grader's"


def test_the_grader_knows_the_job_and_par_s_ring_is_stubbed_on_its_ranks():
    assert rank_io.exercise("par.course.grading.exercise_ring_attention") is ex
    stubbed = dict.fromkeys(name for module, name in ex.EXERCISE.stubs
                            if module == "par.cp.ring_attention")
    assert {"ring_attention", "_RingAttention._forward", "flash_attention"} <= set(stubbed)
    assert not {"merge", "block_state", "finish"} & set(stubbed), "the module is given par's merge helpers"
    assert ex.EXERCISE.p2p_only and ("torch.distributed", "all_gather") in ex.EXERCISE.forbidden


def test_part_3_keeps_at_least_six_wrong_answers_aimed_at_its_checks():
    assert len(WRONG) >= 6 and len(CHEATS) >= 3
    for _, fixture, _, must_fail, _ in WRONG:
        assert set(must_fail) <= set(RING), (fixture, must_fail)
    assert {w[1] for w in WRONG if w[3] == ["check-ring-skipping"]}, "a ring that skips nothing: the skipping check only"
    assert {w[1] for w in WRONG if w[3] == ["check-ring-bytes"]}, "a ring with a pass too many: the bytes check only"


# ---- the class run ---------------------------------------------------------------------------------------------

@slow
def test_the_solution_earns_every_point_and_the_stub_fails_on_a_rank(exercise_class, course):
    graded = exercise_class(NAME)
    full = graded[f"tampered-solved__{NAME}"]
    assert full.status == "ok" and full.points == full.max_points == tg.full_marks(NAME) == 11, format_grade(full, course)
    nothing = graded[f"tampered-unsolved__{NAME}"]
    assert nothing.points == 0 and set(RING) <= set(nothing.failed_checks)
    first = next(c for c in nothing.checks if c.id == "check-ring-attention")
    assert re.search(r"NotImplementedError: your code here \(rank \d\)", first.error), first.error


@slow
@pytest.mark.parametrize("fixture, must_fail", [(w[1], w[3]) for w in WRONG] + [(c[1], c[3]) for c in CHEATS],
                         ids=[w[1] for w in WRONG] + [c[1] for c in CHEATS])
def test_a_wrong_ring_loses_exactly_the_points_of_the_checks_it_breaks(exercise_class, course, fixture, must_fail):
    cheat = fixture in {c[1] for c in CHEATS}
    if cheat and next(c for c in CHEATS if c[1] == fixture)[4] and not tc.SANDBOX:
        pytest.skip("the defence is the sandbox's view of par (needs bwrap)")
    g = exercise_class(NAME)[f"{'cheat' if cheat else 'wrong'}__{NAME}__{fixture}"]
    assert g.exercise == NAME and g.status == "failed", (g.status, g.reason)
    assert sorted(g.failed_checks) == sorted(must_fail), f"failed {g.failed_checks}, expected {must_fail}:\n" \
                                                         f"{format_grade(g, course)}"
    assert g.points == tg.full_marks(NAME) - sum(RING[c] for c in must_fail)
    for check in (c for c in g.checks if not c.passed):          # the feedback names what was compared
        assert re.search(r"SDPA|formula|blocks|matmul|output is wrong|launch|rank \d|collective|not available",
                         check.error), (check.id, check.error)
