"""Exercise 11's save and load of a ZeRO run's training state, on real ranks (`par.course.grading.exercise_resume`).

- The grader's own trajectory is what `torch.optim.Adam` leaves, in one process, on the gradient averaged over the
  ranks, with the noise torch's default generator draws after `torch.manual_seed` (the ranks' stream).
- verify() on raw outputs: nothing (or forged types) earns nothing; honest ranks pass; a resumed run starting at
  the wrong step, a resumed loss off at the first step after the resume or only later, a run that never stopped
  off the grader's trajectory, a final state off by Adam's step count are each named.
- par's own resume and sharded checkpoint are refused on the ranks and stubbed in the sandbox's par.
- The class run (11's `exercise_class`, tests/classroom.py, graded once and shared with tests/test_grading.py):
  the solution earns every point, the untouched exercise none, every wrong answer of
  tests/fixtures/wrong_answers/11_when_things_break fails exactly the checks its file names (and loses exactly their
  points), every cheat of tests/fixtures/cheats/11_when_things_break loses exactly the points of what it dodges.
"""
import re

import pytest
import torch
from tiers import slow

from classroom import fixture_files, full_marks, points_of
from par.course.grading import exercise_resume as resume, sandbox

NAME = "11_when_things_break"
RESUME_CHECKS = ("check-resume-losses", "check-resume-state")
WRONG_ANSWERS = {f[1]: f for f in fixture_files("wrong_answers") if f[0] == NAME}
CHEATS = {f[1]: f for f in fixture_files("cheats") if f[0] == NAME}
FULL = full_marks(NAME)


# ---- the grader's own numbers -----------------------------------------------------------------------------------

def test_the_trajectory_is_what_torch_adam_leaves_with_the_default_generators_noise():
    n = 2
    inputs, context = resume.make_inputs(resume.Args(), n, seed=5)
    mine = inputs[0]
    params = [p.clone().requires_grad_() for p in mine["params"]]
    adam = torch.optim.Adam(params, lr=resume.LR)
    torch.manual_seed(mine["seed"])
    for step, (x, y) in enumerate(zip(mine["x"], mine["y"])):
        noise = torch.randn(x.shape)                # the default generator, as on the ranks
        adam.zero_grad()
        losses = []
        for r in range(n):
            h, target = resume.rank_rows(x, y, noise, r, n)
            for k in range(0, len(params), 2):
                h = torch.nn.functional.linear(h, params[k], params[k + 1])
                h = h if k + 2 == len(params) else torch.tanh(h)
            losses.append(torch.nn.functional.mse_loss(h, target))
        sum(losses).div(n).backward()
        adam.step()
        got = torch.stack([v.detach() for v in losses])
        assert torch.allclose(got, context["losses"][step], atol=1e-6), (step, got, context["losses"][step])
    assert context["losses"].shape == (resume.STEPS, n) and 0 < resume.SAVE_AT < resume.STEPS


# ---- verify, on raw outputs -------------------------------------------------------------------------------------

def honest(context: dict, n: int) -> list[dict]:
    """What n correct ranks report: the grader's losses, resumed at SAVE_AT with the same losses and final state."""
    state = {"params": [torch.arange(6.0), torch.ones(3)], "m": [torch.zeros(6), torch.zeros(3)],
             "v": [torch.ones(6), torch.ones(3)], "step": [torch.tensor(8.0), torch.tensor(8.0)]}
    out = []
    for r in range(n):
        losses = [v.clone() for v in context["losses"][:, r]]
        out.append({"losses": losses, "start": resume.SAVE_AT, "resumed": [v.clone() for v in losses[resume.SAVE_AT:]],
                    "final": {k: [t.clone() for t in v] for k, v in state.items()},
                    "again": {k: [t.clone() for t in v] for k, v in state.items()}})
    return out


def test_verify_passes_honest_ranks_and_names_what_is_off():
    n = 2
    _, context = resume.make_inputs(resume.Args(), n, seed=3)
    good = resume.verify(resume.Args(), context, honest(context, n))
    assert good["losses"]["ok"] and good["state"]["ok"], good

    nothing = resume.verify(resume.Args(), context, [None] * n)
    assert not nothing["losses"]["ok"] and not nothing["state"]["ok"]
    forged = [{"losses": "all right", "start": 4.0, "resumed": [1.0], "final": {}, "again": "same"}] * n
    result = resume.verify(resume.Args(), context, forged)
    assert not result["losses"]["ok"] and not result["state"]["ok"]

    restart = honest(context, n)
    restart[1].update(start=0, resumed=[v.clone() for v in restart[1]["losses"]])
    assert "rank 1: load returned 0" in resume.verify(resume.Args(), context, restart)["losses"]["problem"]
    first = honest(context, n)
    first[0]["resumed"][0] = first[0]["resumed"][0] * (1 + 1e-6)
    assert "step 5 differs" in resume.verify(resume.Args(), context, first)["losses"]["problem"]
    assert "the batch or its noise" in resume.verify(resume.Args(), context, first)["losses"]["problem"]
    later = honest(context, n)
    later[1]["resumed"][2] = later[1]["resumed"][2] * 1.01
    assert "step 7 differs" in resume.verify(resume.Args(), context, later)["losses"]["problem"]
    assert "Adam's state" in resume.verify(resume.Args(), context, later)["losses"]["problem"]
    drifted = honest(context, n)
    drifted[0]["losses"][1] = drifted[0]["losses"][1] + 1e-3
    problem = resume.verify(resume.Args(), context, drifted)["losses"]["problem"]
    assert "left the grader's trajectory at step 2" in problem
    count = honest(context, n)
    count[1]["again"]["step"][0] = torch.tensor(4.0)
    problem = resume.verify(resume.Args(), context, count)["state"]["problem"]
    assert problem.startswith("rank 1, unit 0") and "Adam's step count t differs" in problem
    assert "(t = 4, against 8; bit-equal expected)" in problem
    shard = honest(context, n)
    shard[0]["again"]["params"][1] = shard[0]["again"]["params"][1][:-1]
    assert resume.verify(resume.Args(), context, shard)["state"]["problem"].startswith("rank 0, unit 1")


def test_pars_resume_and_checkpoint_are_refused_on_the_ranks_and_stubbed_in_the_sandbox():
    for name in (("par.resilience.resume", "save"), ("par.resilience.resume", "load"),
                 ("par.zero.checkpoint", "save"), ("par.zero.checkpoint", "load")):
        assert name in resume.EXERCISE.forbidden and name in resume.EXERCISE.stubs


# ---- the class run (11's `exercise_class`, tests/classroom.py, shared with tests/test_grading.py) ---------------

def test_the_fixtures_cover_every_part():
    assert points_of(NAME, RESUME_CHECKS) == 5 and FULL == 7
    on_ranks = [f for f in WRONG_ANSWERS.values() if f[2] == "resume-ranks"]
    assert len(on_ranks) >= 6 and len(WRONG_ANSWERS) > len(on_ranks) and len(CHEATS) >= 3


@slow
def test_the_solution_earns_every_point_and_the_exercise_none(exercise_class):
    solved = exercise_class(NAME)[f"tampered-solved__{NAME}"]
    stub = exercise_class(NAME)[f"tampered-unsolved__{NAME}"]
    print(f"the solution graded in {solved.seconds:.1f} s")
    assert solved.status == "ok" and solved.points == solved.max_points == FULL, (solved.reason, solved.notes)
    assert stub.points == 0 and set(stub.failed_checks) >= set(RESUME_CHECKS)
    first = next(c for c in stub.checks if c.id == RESUME_CHECKS[0])
    assert re.search(r"NotImplementedError: your code here \(rank \d\)", first.error), first.error


@slow
@pytest.mark.parametrize("name", sorted(WRONG_ANSWERS))
def test_every_wrong_answer_loses_exactly_the_points_of_what_it_breaks(exercise_class, name):
    must_fail = set(WRONG_ANSWERS[name][3])
    g = exercise_class(NAME)[f"wrong__{NAME}__{name}"]
    assert g.status == "failed" and set(g.failed_checks) == must_fail, (g.failed_checks, g.reason)
    assert g.points == FULL - points_of(NAME, must_fail)
    for check in g.checks:      # the feedback names what was compared, never a NameError of a broken check
        assert not re.match(r"(NameError|SyntaxError|ImportError|KeyError|TypeError)", check.error), \
            (check.id, check.error)
    if WRONG_ANSWERS[name][2] == "resume-ranks":     # the run went through and a comparison failed
        losses = next(c.error for c in g.checks if c.id == RESUME_CHECKS[0])
        assert re.search(r"rank \d: (load returned|the resumed run's loss at step \d differs)", losses), losses


@slow
@pytest.mark.parametrize("name", sorted(CHEATS))
def test_cheats_lose_the_points_of_what_they_dodge(exercise_class, name):
    if CHEATS[name][4] and not sandbox.available():
        pytest.skip("the defence is the sandbox's view of par (needs bwrap)")
    must_fail = set(CHEATS[name][3])
    g = exercise_class(NAME)[f"cheat__{NAME}__{name}"]
    assert set(g.failed_checks) == must_fail, (g.failed_checks, g.reason)
    assert g.points == FULL - points_of(NAME, must_fail)
    if name.startswith("uses_par_"):        # refused on the ranks, or stubbed in the sandbox's par
        error = next(c.error for c in g.checks if c.id == RESUME_CHECKS[0])
        assert re.search(r"par\.(resilience\.resume|zero\.checkpoint)\.(save|load)", error), error
