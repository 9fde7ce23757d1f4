"""Lecture 11's own pieces: the pure helpers its notebook uses (the differences, the slope, the resume length), Daly's
exact optimum and the restart term of the first-order time lost, the job's `--mistakes` (its arguments, its
refusal, its work), DiLoCo's outer step and its refusal, and, in the full suite, the mistakes, the straggler and
DiLoCo against DP on 2 real gloo ranks (the elastic restart: tests/test_elastic.py).
"""
from __future__ import annotations

import math

import pytest
from tiers import slow

import par.runtime.launch
from par.course.lectures import l11_when_things_break as l11
import torch

from par.resilience import diloco_job, interval, job, straggler_job

C, M, R = 60.0, 11135.0, 300.0


# ---------------------------------------------------------------- the checkpoint interval
def test_restart_cost_adds_a_constant_and_leaves_the_optimum():
    tau = interval.young_daly_interval(C, M)
    for t in (tau / 3, tau, 3 * tau):
        assert interval.lost_fraction(t, C, M, R) == pytest.approx(C / t + (t / 2 + R) / M)
        assert interval.lost_fraction(t, C, M, R) - interval.lost_fraction(t, C, M) == pytest.approx(R / M)
    best = min((tau * 2 ** (k / 64) for k in range(-64, 65)), key=lambda t: interval.lost_fraction(t, C, M, R))
    assert best == pytest.approx(tau, rel=0.02)


def test_exact_optimum_is_dalys_series_and_ignores_the_restart():
    """The golden-section minimum of 1 − τ/E[segment] equals Daly's √(2CM)(1 + ⅓√(C/2M) + C/18M) − C within 0.1 %
    (the series' next term is O((C/M)^1.5)), is the same for any R, and is a minimum."""
    tau = interval.young_daly_interval(C, M)
    series = tau * (1 + math.sqrt(C / (2 * M)) / 3 + C / (18 * M)) - C
    best = interval.exact_optimum(C, M, R)
    assert best == pytest.approx(series, rel=1e-3)
    assert best < tau
    assert interval.exact_optimum(C, M, 0.0) == pytest.approx(best, rel=1e-6)
    f = lambda t: interval.exact_lost_fraction(t, C, M, R)     # noqa: E731
    assert f(best) < min(f(best * 0.98), f(best * 1.02))


# ---------------------------------------------------------------- the notebook's helpers
def test_max_diff_and_slope():
    assert l11.max_diff([1.0, 2.0, 3.0], [1.0, 2.5, 2.0]) == 1.0
    assert l11.max_diff([], []) == 0.0
    with pytest.raises(ValueError, match="equally long"):
        l11.max_diff([1.0], [1.0, 2.0])
    assert l11.slope([0, 1, 2, 3], [5, 7, 9, 11]) == pytest.approx(2.0)
    assert l11.slope([0.0, 0.05, 0.1, 0.2], [0.02, 0.071, 0.12, 0.222]) == pytest.approx(1.0, abs=0.02)
    for xs, ys in (([1.0], [2.0]), ([1.0, 1.0], [2.0, 3.0])):
        with pytest.raises(ValueError):
            l11.slope(xs, ys)


def test_resume_steps_save_halfway_within_4_to_12():
    assert l11.resume_steps(20) == (12, 6)
    assert l11.resume_steps(3) == (4, 2)
    assert l11.resume_steps(9) == (9, 4)
    for s in range(1, 50):
        n, save = l11.resume_steps(s)
        assert 1 <= save < n


def test_the_lecture_launches_one_resume_with_every_mistake_and_a_straggler_on_two_ranks():
    found = l11.launches(2, "gloo", "tiny", 20)
    assert [l.cell for l in found] == ["resume", "elastic", "elastic", "stragglers", "diloco"]
    resume, strag = found[0], found[3]
    assert resume.args.mistakes == l11.MISTAKES and resume.args.dcp and resume.args.resume_stages == (1, 3)
    assert [w.label for w in resume.work] == ["uninterrupted", "resumed on ZeRO-1", "resumed on ZeRO-3",
                                              *[f"resumed forgetting {m}" for m in l11.MISTAKES], "resumed on TP"]
    assert resume.args.resume_tp and not l11.launches(3, "gloo", "tiny", 20)[0].args.resume_tp    # 4 heads: TP 2
    assert strag.module == "par.resilience.straggler_job" and len(strag.work) == len(strag.args.delays_ms)
    assert [l.cell for l in l11.launches(1, "gloo", "tiny", 20)] == ["resume", "elastic", "elastic"]   # a straggler
    # and DiLoCo need two ranks; one rank can be killed and restarted


# ---------------------------------------------------------------- the job's --mistakes
def test_mistakes_parse_and_are_refused_without_a_stage_to_resume_on(tmp_path, capsys):
    args = job.Args.parse(["--dir", str(tmp_path), "--mistakes", "data,rng,optimizer"])
    assert args.mistakes == ("data", "rng", "optimizer") and "--mistakes" in args.to_argv()
    with pytest.raises(SystemExit) as refused:
        job.main(["--dir", str(tmp_path), "--resume-stages", "", "--mistakes", "data"])
    assert "error: --mistakes" in str(refused.value)
    with pytest.raises(SystemExit) as bad:
        job.Args.parse(["--dir", str(tmp_path), "--mistakes", "weights"])
    assert bad.value.code == 2 and "not one of data, rng, optimizer" in capsys.readouterr().err


def test_a_negative_delay_is_refused():
    with pytest.raises(SystemExit, match="error: --delays-ms"):
        straggler_job.main(["--delays-ms", "0,-5"])


@slow
def test_the_mistakes_drift_and_the_right_resumes_do_not(tmp_path):
    """One launch on 2 ranks: the right resumes on ZeRO-3 and ZeRO-1 equal the uninterrupted run bit for bit; each
    mistake moves its resumed losses 10x beyond the tolerance."""
    res = par.runtime.launch.run("par.resilience.job", nproc=2, timeout=600, quiet=True,
                                 args=["--dir", str(tmp_path), "--steps", 6, "--save-step", 3,
                                       "--mistakes", "data,rng,optimizer"])
    runs = {r["label"]: r for r in res["runs"]}
    assert list(runs) == ["3", "3>1", "3>3", "3>1 forget data", "3>1 forget rng", "3>1 forget optimizer"]
    whole = runs["3"]["losses"][3:]
    assert runs["3>1"]["losses"] == whole and runs["3>3"]["losses"] == whole
    assert runs["3>1 forget data"]["start_step"] == 0 and len(runs["3>1 forget data"]["losses"]) == 6
    for m in ("data", "rng", "optimizer"):
        assert l11.max_diff(runs[f"3>1 forget {m}"]["losses"][:3], whole) > 1e-4, m


@slow
def test_a_straggler_makes_every_rank_wait(tmp_path):
    """On 2 ranks, rank 1 sleeps 200 ms after backward: the slowest rank's step takes at least those 200 ms, and
    rank 0 spends at least half of them waiting inside the all-reduce (it computed as fast as without the delay)."""
    res = par.runtime.launch.run("par.resilience.straggler_job", nproc=2, timeout=600, quiet=True,
                                 args=["--delays-ms", "0,200", "--steps", 4])
    none, slow_ = res["runs"]
    assert [r["delay_ms"] for r in res["runs"]] == [0.0, 200.0]
    assert slow_["step_s"] >= 0.2 and slow_["per_rank"][1]["compute_s"] >= 0.2
    assert slow_["per_rank"][0]["allreduce_s"] >= 0.1 + none["per_rank"][0]["allreduce_s"] / 2


# ---------------------------------------------------------------- DiLoCo
def test_the_outer_step_is_torchs_nesterov_sgd():
    """`nesterov_step` on a flat θ with gradient Δ equals torch.optim.SGD(nesterov=True) over three steps."""
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(10, generator=gen)
    ref = torch.nn.Parameter(theta.clone())
    opt = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    buf = torch.zeros_like(theta)
    for _ in range(3):
        delta = torch.randn(10, generator=gen)
        diloco_job.nesterov_step(theta, delta, buf, 0.7, 0.9)
        ref.grad = delta.clone()
        opt.step()
    assert torch.allclose(theta, ref.detach(), atol=1e-6)


def test_an_h_that_does_not_divide_the_steps_is_refused():
    with pytest.raises(SystemExit, match="error: --h 5 does not divide --steps 48"):
        diloco_job.main(["--h", "4,5", "--steps", "48"])


def test_diloco_is_launched_with_the_lectures_h():
    [dil] = [l for l in l11.launches(2, "gloo", "tiny", 20) if l.cell == "diloco"]
    assert dil.args.h == l11.DILOCO_H and all(l11.DILOCO_STEPS % h == 0 for h in l11.DILOCO_H)
    assert [w.label for w in dil.work] == ["dp", *[f"diloco H={h}" for h in l11.DILOCO_H]]


@slow
def test_diloco_sends_h_times_fewer_bytes_than_dp(tmp_path):
    """On 2 ranks, 8 steps: DP all-reduces 4Ψ·2(N−1)/N bytes at every step, DiLoCo (H = 4) once per 4 steps: 4× fewer
    bytes, 2 all-reduces; both start from the same loss; DiLoCo's held-out loss is measured at its 2 outer steps."""
    from par.comm.collectives import all_reduce_formula_bytes
    res = par.runtime.launch.run("par.resilience.diloco_job", nproc=2, timeout=600, quiet=True,
                                 args=["--h", "4", "--steps", 8])
    dp, dil = res["runs"]
    assert (dp["label"], dil["label"]) == ("dp", "diloco H=4")
    assert dp["bytes_sent"] == 8 * all_reduce_formula_bytes(4 * res["psi"], 2) and dp["all_reduces"] == 8
    assert dp["bytes_sent"] == 4 * dil["bytes_sent"] and dil["all_reduces"] == 2
    assert dp["losses"][0] == dil["losses"][0] and dp["losses"][1] != dil["losses"][1]
    assert dil["eval_steps"] == [4, 8] and dp["eval_steps"] == [4, 8]
    assert all(math.isfinite(x) for x in dil["eval_losses"] + dp["eval_losses"])
