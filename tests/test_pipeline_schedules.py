"""Schedules as data: text form, generators, the p2p plan, the NCCL-rule checker, the simulator, partitioning.

All in-process, pure Python. The checker tests are exhaustive over every schedule par can execute.
"""
from __future__ import annotations

import itertools
import random
from collections import defaultdict

import pytest

from par.pp import p2p_plan, partition, sim as sim, schedules
from par.model import build
from par.pp.p2p_plan import Group, Op, Plan
from par.pp.schedules import Action, from_lists, parse_actions

SIZES = [(p, m) for p in (1, 2, 3, 4, 5) for m in (1, 2, max(1, p - 1), p, p + 1, 2 * p + 1, 3 * p)]


# ---------------------------------------------------------------- text form
def test_text_round_trip():
    acts = parse_actions("F0 F1 B0 F2@1 B12@3")
    assert acts == [Action("F", 0), Action("F", 1), Action("B", 0), Action("F", 2, 1), Action("B", 12, 3)]
    assert schedules.format_actions(acts) == "F0 F1 B0 F2@1 B12@3"
    s = schedules.one_f_one_b(3, 5)
    again = from_lists([line.split(":", 1)[1] for line in s.text().splitlines()])
    assert again.ranks == s.ranks and again.microbatches == 5
    with pytest.raises(ValueError, match="cannot read action 'X3'"):
        parse_actions("F0 X3")


def test_generators_write_the_lecture_schedules():
    assert schedules.gpipe(2, 3).text() == "rank 0: F0 F1 F2 B0 B1 B2\nrank 1: F0 F1 F2 B0 B1 B2"
    assert schedules.naive(2, 2).text() == "rank 0: F0 B0 F1 B1\nrank 1: F0 B0 F1 B1"
    assert [schedules.format_actions(a) for a in schedules.one_f_one_b(4, 5).ranks] == [
        "F0 F1 F2 F3 B0 F4 B1 B2 B3 B4",
        "F0 F1 F2 B0 F3 B1 F4 B2 B3 B4",
        "F0 F1 B0 F2 B1 F3 B2 F4 B3 B4",
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4"]
    # fewer micro-batches than stages: warm-up stops at m
    assert schedules.format_actions(schedules.one_f_one_b(4, 2).ranks[0]) == "F0 F1 B0 B1"
    il = schedules.interleaved(2, 4, 2)
    assert il.virtual == 2 and il.num_stages == 4
    assert schedules.format_actions(il.ranks[0]) == "F0 F1 F0@1 F1@1 F2 B0@1 F3 B1@1 F2@1 B0 F3@1 B1 B2@1 B3@1 B2 B3"


def test_make_names_and_errors():
    assert schedules.make("1F1B", 2, 3).ranks == schedules.one_f_one_b(2, 3).ranks
    assert schedules.make("interleaved", 2, 4, 1).name == "1f1b"   # v = 1 is plain 1F1B
    with pytest.raises(ValueError, match="unknown schedule 'zigzag': use one of naive, gpipe, 1f1b, interleaved"):
        schedules.make("zigzag", 2, 2)
    with pytest.raises(ValueError, match="micro-batches m must be a positive integer, got 0"):
        schedules.gpipe(2, 0)
    with pytest.raises(ValueError, match="use 'interleaved' for v > 1"):
        schedules.make("gpipe", 2, 2, v=2)


def test_microbatch_groups_are_at_least_p():
    assert [list(g) for g in schedules.microbatch_groups(2, 7)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [list(g) for g in schedules.microbatch_groups(4, 3)] == [[0, 1, 2]]
    for p, m in SIZES:
        groups = schedules.microbatch_groups(p, m)
        assert [i for g in groups for i in g] == list(range(m))
        assert all(len(g) >= min(p, m) for g in groups)


# ---------------------------------------------------------------- the checker rejects broken schedules
def test_backward_before_forward_is_rejected():
    bad = from_lists(["B0 F0 F1 B1", "F0 B0 F1 B1"])
    with pytest.raises(sim.ScheduleError, match=r"rank 0, action 0: backward B0 comes before its forward F0 \(action 1\)"):
        sim.check(bad)


def test_missing_microbatch_is_rejected():
    bad = from_lists(["F0 F1 B0 B1", "F0 B0 F1"], microbatches=2)
    with pytest.raises(sim.ScheduleError, match=r"incomplete: rank 1 never runs B1 \(stage 1, micro-batch 1\)"):
        sim.check(bad)
    everywhere = from_lists(["F0 B0", "F0 B0"], microbatches=2)  # micro-batch 1 missing on every rank
    with pytest.raises(sim.ScheduleError, match="never runs F1"):
        sim.check(everywhere)


def test_duplicates_and_out_of_range_are_rejected():
    with pytest.raises(sim.ScheduleError, match="rank 0 runs F0 twice"):
        sim.check(from_lists(["F0 F0 B0", "F0 B0"], microbatches=1))
    with pytest.raises(sim.ScheduleError, match=r"micro-batch 3 is not in 0\.\.1"):
        sim.check(from_lists(["F0 F1 F3 B0 B1", "F0 F1 B0 B1"], microbatches=2))


def test_deadlock_is_found_and_named():
    # rank 0 waits for the gradient of micro-batch 0 before it sends micro-batch 1's activation,
    # rank 1 wants micro-batch 1's activation before it runs B0: each waits for the other
    bad = from_lists(["F0 B0 F1 B1", "F0 F1 B0 B1"])
    with pytest.raises(sim.ScheduleError) as err:
        sim.check(bad)
    msg = str(err.value)
    assert msg.startswith("deadlock: ")
    assert "rank 0 waits at action 1 (B0) for the gradient of micro-batch 0 from stage 1 (rank 1)" in msg
    assert "rank 1 waits at action 1 (F1) for the activation of micro-batch 1 from stage 0 (rank 0)" in msg
    assert "\n" not in msg


def test_receive_order_differs_from_send_order_without_deadlock():
    # stage 1 runs micro-batch 1 before 0: it reads micro-batch 0's activation first and keeps it
    ok = from_lists(["F0 F1 B0 B1", "F1 F0 B1 B0"])
    t = sim.simulate(ok)
    start = {(x["rank"], x["name"]): x["start"] for x in t.spans}
    assert start[(1, "F1")] == 2.0 and start[(1, "F0")] == 3.0   # F1 waits for rank 0's second forward
    assert start[(0, "B0")] == 8.0 and t.makespan == 12.0         # B0 on rank 1 runs last there (6..8)


@pytest.mark.parametrize("p,m", SIZES)
def test_every_generated_schedule_passes(p, m):
    """Accepted, and its replay keeps the dependencies: F on stage s+1 after F on s, B on s after B on s+1."""
    generated = [schedules.make(name, p, m) for name in ("naive", "gpipe", "1f1b")]
    generated += [schedules.interleaved(p, m, v) for v in (2, 3)]
    for sched in generated:
        sim.check(sched)
        t = sim.simulate(sched, forward=[1 + s % 3 for s in range(sched.num_stages)], backward=2.5, latency=0.25)
        when = {(x["name"][0], x["microbatch"], x["stage"]): (x["start"], x["end"]) for x in t.spans}
        assert len(when) == 2 * m * sched.num_stages
        wire = 0.25 if p > 1 else 0.0       # one rank hands its chunks' tensors over in memory
        for (kind, mb, s), (start, end) in when.items():
            assert start < end
            if kind == "F" and s > 0:
                assert start >= when[("F", mb, s - 1)][1] + wire
            if kind == "B" and s < sched.num_stages - 1:
                assert start >= when[("B", mb, s + 1)][1] + wire
            if kind == "B":
                assert start >= when[("F", mb, s)][1]


def test_random_orders_are_checked_not_trusted():
    """Shuffle a valid schedule's rank lists; whatever the checker accepts must replay to the end."""
    rng = random.Random(0)
    accepted = rejected = 0
    for _ in range(300):
        p, m = rng.randint(2, 4), rng.randint(1, 4)
        lists = [list(a) for a in schedules.gpipe(p, m).ranks]
        for acts in lists:
            rng.shuffle(acts)
        s = schedules.Schedule("random", tuple(map(tuple, lists)), m)
        try:
            t = sim.simulate(s)
        except sim.ScheduleError:
            rejected += 1
            continue
        accepted += 1
        assert len(t.spans) == 2 * p * m
    assert accepted > 0 and rejected > 0


# ---------------------------------------------------------------- the p2p plan under NCCL's rule
EXECUTABLE = [(name, p, m, 1) for name in ("naive", "gpipe", "1f1b") for p in range(2, 9) for m in range(1, 17)]
EXECUTABLE += [("interleaved", p, m, v) for v in (2, 3) for p in range(2, 9) for m in range(1, 17)]


def test_every_executable_schedule_passes_the_nccl_checker():
    """naive, GPipe, 1F1B, interleaved (v = 2, 3), p = 2..8, m = 1..16: the plan terminates under NCCL's rule,
    pairs every send with the receive of the same message, and runs the schedule's actions in order."""
    for name, p, m, v in EXECUTABLE:
        sched = schedules.make(name, p, m, v)
        plan = sim.verified_plan(sched)
        sends = [op for r in range(p) for g in plan.groups(r) for op in g.sends]
        remote = sum(1 for r, acts in enumerate(sched.ranks) for a in acts
                     if (out := p2p_plan.message_out(sched, r, a)) is not None and out[1] != r)
        assert len(sends) == remote == len({op.message for op in sends}), (name, p, m, v)
        assert all(len(g.ops) > 0 for r in range(p) for g in plan.groups(r))
        for r, items in enumerate(plan.ranks):   # at most one group between two actions
            assert not any(isinstance(a, Group) and isinstance(b, Group) for a, b in zip(items, items[1:]))


def old_grouping(sched) -> Plan:
    """par's grouping before the plan: the sends still pending plus the receives the next action needs
    (a source's messages in its send order, up to the one needed) posted as one group."""
    incoming = [defaultdict(list) for _ in range(sched.num_ranks)]
    for src, acts in enumerate(sched.ranks):
        for a in acts:
            out = p2p_plan.message_out(sched, src, a)
            if out is not None and out[1] != src:
                incoming[out[1]][src].append(out[0])
    ranks = []
    for r, acts in enumerate(sched.ranks):
        cursor, have, pending, items = defaultdict(int), set(), [], []
        for a in acts:
            need, recvs = p2p_plan.message_in(sched, r, a), []
            if need is not None and need[1] != r and need[0] not in have:
                while True:
                    early = incoming[r][need[1]][cursor[need[1]]]
                    cursor[need[1]] += 1
                    have.add(early)
                    recvs.append(Op("recv", need[1], early))
                    if early == need[0]:
                        break
            if pending or recvs:
                items.append(Group(tuple(pending + recvs)))
            pending = []
            items.append(a)
            out = p2p_plan.message_out(sched, r, a)
            if out is not None and out[1] != r:
                pending.append(Op("send", out[1], out[0]))
        if pending:
            items.append(Group(tuple(pending)))
        ranks.append(tuple(items))
    return Plan(sched, tuple(ranks))


def test_the_old_grouping_deadlocks_under_nccl_rule():
    """Interleaved p=2, m=4, v=2: with sends that block until matched, par's old groups wait on each other."""
    sched = schedules.interleaved(2, 4, 2)
    with pytest.raises(sim.ScheduleError) as err:
        sim.replay(old_grouping(sched))
    msg = str(err.value)
    assert msg.startswith("deadlock under NCCL's rule: rank 0 waits") and "rank 1 waits" in msg
    assert "has not posted the receive of" in msg and "\n" not in msg
    sim.replay(p2p_plan.build(sched))                       # the plan runs the same schedule to the end
    # the smallest such case (issue 18 counts 147 of the 336 interleaved (p, m, v) with v = 2..4, p = 2..8)
    assert [m for m in range(1, 5) if _deadlocks(old_grouping(schedules.interleaved(2, m, 2)))] == [4]


def _deadlocks(plan) -> bool:
    try:
        sim.replay(plan)
    except sim.ScheduleError:
        return True
    return False


def test_1f1b_plan_pairs_forward_sends_with_backward_receives():
    """Megatron-LM's send_forward_recv_backward / send_backward_recv_forward, found by the plan."""
    plan = p2p_plan.build(schedules.one_f_one_b(2, 4))
    assert plan.text().splitlines() == [
        "rank 0: F0 [send a0.0 to 1] F1 [send a1.0 to 1, recv g0.1 from 1] B0 F2 [recv g1.1 from 1, send a2.0 to 1] "
        "B1 F3 [recv g2.1 from 1, send a3.0 to 1] B2 [recv g3.1 from 1] B3",
        "rank 1: [recv a0.0 from 0] F0 [recv a1.0 from 0] B0 [send g0.1 to 0] F1 B1 [recv a2.0 from 0, "
        "send g1.1 to 0] F2 B2 [recv a3.0 from 0, send g2.1 to 0] F3 B3 [send g3.1 to 0]"]


def test_plan_of_one_rank_has_no_messages():
    plan = sim.verified_plan(schedules.interleaved(1, 3, 3))
    assert plan.groups(0) == [] and list(plan.ranks[0]) == list(schedules.interleaved(1, 3, 3).ranks[0])


def _swap(plan, rank, i, j):
    items = list(plan.ranks[rank])
    items[i], items[j] = items[j], items[i]
    return Plan(plan.schedule, tuple(tuple(items) if r == rank else x for r, x in enumerate(plan.ranks)))


def _replace(plan, rank, i, item):
    items = list(plan.ranks[rank])
    items[i] = item
    return Plan(plan.schedule, tuple(tuple(items) if r == rank else x for r, x in enumerate(plan.ranks)))


def test_replay_rejects_broken_plans():
    sched = schedules.gpipe(2, 2)
    plan = p2p_plan.build(sched)
    assert plan.text().splitlines() == [
        "rank 0: F0 [send a0.0 to 1] F1 [send a1.0 to 1, recv g0.1 from 1] B0 [recv g1.1 from 1] B1",
        "rank 1: [recv a0.0 from 0] F0 [recv a1.0 from 0] F1 B0 [send g0.1 to 0] B1 [send g1.1 to 0]"]
    r0, r1 = plan.ranks
    F0, F1, B0, B1 = (Action(k, i) for k in "FB" for i in (0, 1))
    a0, a1, g0, g1 = ("activation", 0, 0), ("activation", 1, 0), ("gradient", 0, 1), ("gradient", 1, 1)

    def rank0(*items):
        return Plan(sched, (tuple(items), r1))

    # the two activations sent in the other order: NCCL has no tags, so rank 1 would read them swapped
    with pytest.raises(sim.ScheduleError, match=r"rank 0's 1st send to rank 1 is the activation of micro-batch 1 "
                                                r"from stage 0 but the recv it meets on rank 1 expects the "
                                                r"activation of micro-batch 0 from stage 0"):
        sim.replay(rank0(F0, F1, Group((Op("send", 1, a1), Op("send", 1, a0))), Group((Op("recv", 1, g0),)), B0,
                         Group((Op("recv", 1, g1),)), B1))
    # a send posted before the action that computes it
    with pytest.raises(sim.ScheduleError, match="rank 0 sends the activation of micro-batch 0 from stage 0 before "
                                                "it has computed it"):
        sim.replay(rank0(Group((Op("send", 1, a0),)), *r0[:1], *r0[2:]))
    # a receive posted after the action that reads it: rank 0 would read a buffer nobody wrote yet
    with pytest.raises(sim.ScheduleError, match="rank 0 runs B1 before it receives the gradient of micro-batch 1"):
        sim.replay(rank0(*r0[:-2], B1, r0[-2]))
    # a send nobody receives
    with pytest.raises(sim.ScheduleError, match=r"rank 1's 2nd send to rank 0 \(the gradient of micro-batch 1 from "
                                                r"stage 1\) is never matched: rank 0 posts only 1 recvs from rank 1"):
        sim.replay(rank0(F0, F1, Group((Op("send", 1, a0), Op("send", 1, a1), Op("recv", 1, g0))), B0, B1))
    # an action out of the schedule's order
    with pytest.raises(sim.ScheduleError, match="the plan of rank 1 does not run the schedule's actions"):
        sim.replay(Plan(sched, (r0, tuple(reversed(r1)))))
    # a peer that is not another rank
    with pytest.raises(sim.ScheduleError, match=r"rank 0: send a0.0 to 0 names rank 0: a peer must be another"):
        sim.replay(rank0(F0, Group((Op("send", 0, a0),)), *r0[2:]))


def test_groups_that_wait_on_each_other_deadlock():
    """Rank 0 waits to receive the gradient before it sends the activation rank 1 waits for."""
    sched = schedules.from_lists(["F0 B0", "F0 B0"])
    a, g = ("activation", 0, 0), ("gradient", 0, 1)
    ok = p2p_plan.build(sched)
    sim.replay(ok)
    bad = Plan(sched, ((Action("F", 0), Group((Op("send", 1, a),)), Group((Op("recv", 1, g),)), Action("B", 0)),
                       (Group((Op("recv", 0, a),)), Action("F", 0), Action("B", 0), Group((Op("send", 0, g),)))))
    sim.replay(bad)                                          # in this order it completes
    crossed = Plan(sched, ((Action("F", 0), Group((Op("recv", 1, g),)), Group((Op("send", 1, a),)), Action("B", 0)),
                           bad.ranks[1]))
    with pytest.raises(sim.ScheduleError, match=r"deadlock under NCCL's rule: rank 0 waits before \[send a0.0 to 1\] for its "
                                                r"group \[recv g0.1 from 1\] \(rank 1 has not posted the send of g0.1\); "
                                                r"rank 1 waits before F0 for its group \[recv a0.0 from 0\] \(rank 0 has "
                                                r"not posted the send of a0.0\)$"):
        sim.replay(crossed)


# ---------------------------------------------------------------- the simulator
@pytest.mark.parametrize("p,m", SIZES)
def test_bubble_equals_formula(p, m):
    for name in ("gpipe", "1f1b"):
        t = sim.simulate(schedules.make(name, p, m), forward=1.0, backward=2.0)
        assert t.bubble_fraction == pytest.approx(sim.bubble_formula(p, m), abs=1e-12)
        assert t.makespan == pytest.approx((m + p - 1) * 3.0)
    naive = sim.simulate(schedules.naive(p, m), forward=1.0, backward=2.0)
    assert naive.bubble_fraction == pytest.approx((p - 1) / p)


@pytest.mark.parametrize("p,m", SIZES)
def test_in_flight_peaks(p, m):
    for s in range(p):
        assert sim.peak_in_flight(schedules.gpipe(p, m))[s] == m
        assert sim.peak_in_flight(schedules.one_f_one_b(p, m))[s] == min(p - s, m)
        assert sim.peak_in_flight(schedules.naive(p, m))[s] == 1
        for name in ("gpipe", "1f1b", "naive"):
            assert sim.peak_in_flight(schedules.make(name, p, m))[s] == sim.peak_in_flight_formula(name, p, m, s)


@pytest.mark.parametrize("p,m,v", [(p, k * p, v) for p in (2, 3, 4) for k in (1, 2, 3) for v in (2, 3, 4)])
def test_interleaved_bubble_formula(p, m, v):
    """Each chunk does 1/v of a stage's work: idle time = (p-1)/(v·m) of the ideal time m(f+b)."""
    t = sim.simulate(schedules.interleaved(p, m, v), forward=1.0 / v, backward=2.0 / v)
    assert t.bubble_ratio == pytest.approx(sim.interleaved_bubble_ratio(p, m, v), abs=1e-9)
    assert t.bubble_fraction == pytest.approx(sim.interleaved_bubble_formula(p, m, v), abs=1e-9)    # idle / step
    plain = sim.simulate(schedules.one_f_one_b(p, m))
    assert plain.bubble_ratio == pytest.approx((p - 1) / m)
    if p > 1:
        assert t.makespan < plain.makespan


def test_unequal_costs_and_latency():
    s = schedules.one_f_one_b(2, 2)
    t = sim.simulate(s, forward=[1.0, 3.0], backward=[2.0, 6.0], latency=0.5)
    spans = {(x["rank"], x["name"]): (x["start"], x["end"]) for x in t.spans}
    assert spans[(0, "F0")] == (0.0, 1.0)
    assert spans[(1, "F0")] == (1.5, 4.5)            # waits for F0 plus the wire
    assert spans[(1, "B0")] == (4.5, 10.5)
    assert spans[(0, "F1")] == (1.0, 2.0)
    assert spans[(0, "B0")] == (11.0, 13.0)          # gradient leaves rank 1 at 10.5, arrives at 11
    with pytest.raises(ValueError, match="need one per stage"):
        sim.simulate(s, forward=[1.0])


def test_bubble_of_spans_matches_the_definition():
    spans = [{"rank": 0, "lane": "compute", "start": 0.0, "end": 1.0, "name": "F0"},
             {"rank": 1, "lane": "compute", "start": 1.0, "end": 4.0, "name": "F0"}]
    assert sim.step_time(spans) == 4.0
    assert sim.bubble_fraction(spans) == pytest.approx(((1 - 1 / 4) + (1 - 3 / 4)) / 2)
    assert sim.bubble_ratio(spans) == pytest.approx((2 * 4 - 4) / 4)


def test_a_step_rebuilt_from_its_own_spans_is_the_step():
    """`as_executed` replays the plan with each action's own cost and the time after it: fed a simulated step's
    spans it gives that step back, on every clock; a rank that spends time between its actions delays the other."""
    s = schedules.make("zb_h1", 3, 5)
    t = sim.simulate(s, forward=[1.0, 1.2, 0.9], backward_input=[1.1, 1.0, 1.3], backward_weight=[0.7, 0.8, 0.6])
    spans = [dict(x, cpu=x["end"] - x["start"], cpu_s=x["end"] - x["start"], ready=0.0) for x in t.spans]
    for clock in ("wall", "steady", "cpu"):
        again = sim.as_executed(spans, s, clock=clock)
        assert again.bubble_fraction == pytest.approx(t.bubble_fraction) and again.makespan == pytest.approx(t.makespan)
    busy = [dict(x, cpu_s=2 * (x["end"] - x["start"])) for x in spans]             # every action twice as costly
    assert sim.as_executed(busy, s).makespan == pytest.approx(2 * t.makespan)
    late = [dict(x, after_s={"cpu": 0.5 if x["rank"] == 0 else 0.0}) for x in spans]   # rank 0 idles 0.5 after each
    slow = sim.as_executed(late, s)
    assert slow.makespan > t.makespan and slow.bubble_fraction > t.bubble_fraction
    with pytest.raises(ValueError, match="unknown clock"):
        sim.as_executed(spans, s, clock="cuda")


def test_replay_takes_each_actions_own_cost():
    s = schedules.one_f_one_b(2, 3)
    plan = p2p_plan.build(s)
    same = sim.replay(plan, cost_of=lambda r, a: 1.0 if a.kind == "F" else 2.0)
    assert same.makespan == pytest.approx(sim.simulate(s).makespan)
    def cost(slow):
        return lambda r, a: (3.0 if (r, str(a)) == slow else 1.0) if a.kind == "F" else 2.0
    assert sim.replay(plan, cost_of=cost((0, "F0"))).makespan == pytest.approx(same.makespan + 2.0)  # all wait for it
    assert sim.replay(plan, cost_of=cost((0, "F1"))).makespan == pytest.approx(same.makespan)   # 1F1B's slack takes it


# ---------------------------------------------------------------- partitioning
def test_partition_uniform_and_by_parameters():
    layers = build("tiny").to_layers()             # embedding, 4 blocks, head
    counts = partition.param_counts(layers)
    assert counts[1] == counts[2] and counts[0] < counts[1] and counts[-1] < counts[1]
    assert partition.uniform(6, 4) == [(0, 2), (2, 4), (4, 5), (5, 6)]
    by_params = partition.bounds_for(layers, 4, "parameters")
    heaviest = max(sum(counts[a:b]) for a, b in by_params)
    assert heaviest == counts[0] + counts[1]      # a block can never share, so best = block + the embedding
    assert max(sum(counts[a:b]) for a, b in partition.uniform(6, 4)) > heaviest
    with pytest.raises(ValueError, match="cannot cut 6 layers into 8 stages: .* use at most 6 stages"):
        partition.split(layers, 8)
    with pytest.raises(ValueError, match="unknown partition method 'flops'"):
        partition.split(layers, 2, "flops")


def test_balanced_partition_is_optimal():
    rng = random.Random(1)
    for _ in range(200):
        n = rng.randint(1, 8)
        k = rng.randint(1, n)
        w = [rng.randint(0, 30) for _ in range(n)]
        bounds = partition.balanced(w, k)
        assert bounds[0][0] == 0 and bounds[-1][1] == n and all(b > a for a, b in bounds)
        assert all(bounds[i][1] == bounds[i + 1][0] for i in range(k - 1))
        best = min(max(sum(w[a:b]) for a, b in zip((0,) + cuts, cuts + (n,)))
                   for cuts in itertools.combinations(range(1, n), k - 1))
        assert max(sum(w[a:b]) for a, b in bounds) == best


def test_one_send_per_group_deadlocks_1f1b():
    """The plan one writes first (every send and receive alone) hangs 1F1B on 2 ranks under NCCL's rule."""
    assert not _deadlocks(p2p_plan.one_by_one(schedules.one_f_one_b(2, 1)))
    with pytest.raises(sim.ScheduleError, match=r"rank 0 waits before \[recv g0.1 from 1\] for its group "
                                                r"\[send a1.0 to 1\] \(rank 1 has not posted the receive of a1.0\)"):
        sim.replay(p2p_plan.one_by_one(schedules.one_f_one_b(2, 2)))


def test_fixed_batch_step_time_formula_and_its_optimum():
    p, work, overhead = 2, 40.0, 2.0
    times = [sim.step_time_formula(p, m, work, overhead) for m in (1, 2, 4, 8, 16)]
    assert times[0] == 2 * (40 + 2) and times[-1] == 17 * (2.5 + 2)
    assert sim.fit_step_time(p, (1, 2, 4, 8, 16), times) == pytest.approx((work, overhead))
    best = sim.best_microbatches(p, work, overhead)
    assert best == pytest.approx(20 ** 0.5)
    grid = [best * f for f in (0.5, 0.9, 1.0, 1.1, 2.0)]
    assert min(grid, key=lambda m: sim.step_time_formula(p, m, work, overhead)) == best
    with pytest.raises(ValueError, match="needs step times at two or more different m"):
        sim.fit_step_time(p, (4,), (1.0,))
    assert sim.p2p_bytes_formula(4, 3, 0, 100) == 300 and sim.p2p_bytes_formula(4, 3, 1, 100) == 600
    assert sim.p2p_bytes_formula(4, 3, 3, 100) == 300 and sim.p2p_bytes_formula(1, 3, 0, 100) == 0
