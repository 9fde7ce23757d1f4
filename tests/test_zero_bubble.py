"""Zero-bubble schedules: I and W as data, checked, compared with torch's own, simulated, executed.

In-process: the text form, the checker's rules for I and W, the V placement, every generated ZB-H1 /
ZB-V / DualPipeV schedule under NCCL's rule, the rank lists against torch's classes of the same name
and torch's lowering + simulator, the bubble formulas, and I + W = B on one process.
Launched (this file is also the worker, `python tests/test_zero_bubble.py SCHEDULES`): the same
GPT-lite trained under 1F1B and the zero-bubble schedules on 2, 3, 4 gloo ranks (and NCCL's p2p
semantics emulated) gives 1F1B's gradients; torch's ScheduleZBVZeroBubble beside par's ZB-V.
"""
from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from par.data import CharDataset, global_batches
from par.model import SquareStack, build, lm_loss, preset, square_batches
from par.pp import p2p_plan, schedules, sim
from par.pp.pipeline import Pipeline
from par.pp.schedules import Action, ScheduleError, from_lists, parse_actions

sys.path.insert(0, str(Path(__file__).parent))
from tiers import tiered_one  # noqa: E402

ZB = ("zb_h1", "zb_v", "dualpipe_v")
TORCH_CLASS = {"zb_h1": "ScheduleInterleavedZeroBubble", "zb_v": "ScheduleZBVZeroBubble",
               "dualpipe_v": "ScheduleDualPipeV"}


def sizes(name, ps=range(1, 6), ms=range(1, 17)):
    """(p, m) the generator accepts: ZB-V m >= p, DualPipeV m >= 2p."""
    least = {"zb_h1": lambda p: 1, "zb_v": lambda p: p, "dualpipe_v": lambda p: 2 * p}[name]
    return [(p, m) for p in ps for m in ms if m >= least(p)]


# ---------------------------------------------------------------- text form, placement, checker
def test_text_form_of_split_backwards():
    acts = parse_actions("F0 I0 W0 F1@1 I1@1 W1@1 B2")
    assert acts[1] == Action("I", 0) and acts[5] == Action("W", 1, 1)
    assert schedules.format_actions(acts) == "F0 I0 W0 F1@1 I1@1 W1@1 B2"
    with pytest.raises(ValueError, match=r"cannot read action 'X3': write F, B, I or W"):
        parse_actions("X3")


def test_v_placement_puts_the_last_stage_on_rank_0():
    v = schedules.make("zb_v", 4, 4)
    assert v.placement == "v" and v.virtual == 2
    assert [[v.stage_of(r, c) for c in (0, 1)] for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert all(v.owner(v.stage_of(r, c)) == (r, c) for r in range(4) for c in (0, 1))
    loop = schedules.interleaved(4, 4, 2)
    assert [[loop.stage_of(r, c) for c in (0, 1)] for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(ValueError, match="unknown placement 'w': use one of loop, v"):
        schedules.Schedule("x", ((),), 1, 1, "w")


def test_checker_rules_for_i_and_w():
    with pytest.raises(ScheduleError, match=r"rank 0, action 0: input gradient I0 comes before its forward F0"):
        sim.check(from_lists(["I0 F0 W0", "F0 I0 W0"]))
    with pytest.raises(ScheduleError, match=r"rank 1, action 1: weight gradient W0 comes before its input "
                                            r"gradient I0 \(action 2\)"):
        sim.check(from_lists(["F0 I0 W0", "F0 W0 I0"]))
    with pytest.raises(ScheduleError, match="rank 0 runs both B0 and its halves I/W: run the backward whole"):
        sim.check(from_lists(["F0 I0 B0 W0", "F0 B0"]))
    with pytest.raises(ScheduleError, match=r"incomplete: rank 1 never runs W0 \(stage 1, micro-batch 0\)"):
        sim.check(from_lists(["F0 I0 W0", "F0 I0"]))
    sim.check(from_lists(["F0 F1 I0 B1 W0", "F0 I0 F1 B1 W0"]))          # split and whole may mix


def test_i_sends_upstream_like_b_and_w_sends_nothing():
    s = from_lists(["F0 I0 W0", "F0 I0 W0"])
    assert p2p_plan.message_out(s, 1, Action("I", 0)) == (("gradient", 0, 1), 0)
    assert p2p_plan.message_in(s, 0, Action("I", 0)) == (("gradient", 0, 1), 1)
    assert p2p_plan.message_out(s, 0, Action("W", 0)) is None and p2p_plan.message_in(s, 1, Action("W", 0)) is None
    assert p2p_plan.build(s).text().splitlines() == [
        "rank 0: F0 [send a0.0 to 1, recv g0.1 from 1] I0 W0",
        "rank 1: [recv a0.0 from 0] F0 I0 [send g0.1 to 0] W0"]


def test_generators_write_the_papers_schedules():
    assert schedules.make("zb_h1", 3, 4).text().splitlines() == [
        "rank 0: F0 F1 F2 I0 W0 F3 I1 W1 I2 W2 I3 W3",
        "rank 1: F0 F1 I0 F2 I1 W0 F3 I2 W1 I3 W2 W3",
        "rank 2: F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3"]
    assert schedules.make("zb_v", 2, 4).text().splitlines()[1] == (
        "rank 1: F0 F0@1 F1 F1@1 I0@1 W0@1 F2 I0 W0 F2@1 I1@1 W1@1 F3 I1 W1 F3@1 I2@1 W2@1 I2 I3@1 I3 W2 W3@1 W3")
    assert schedules.make("dualpipe-v", 2, 4).text().splitlines()[0] == (
        "rank 0: F0 F1 F2 F0@1 I0@1 W0@1 F1@1 B1@1 F3 B0 F2@1 B2@1 B1 F3@1 B3@1 I2 W2 I3 W3")
    with pytest.raises(ScheduleError, match=r"ZB-V needs at least as many micro-batches as ranks, got m=3 < p=4: "
                                            r"use m >= 4"):
        schedules.zb_v(4, 3)
    with pytest.raises(ScheduleError, match=r"DualPipeV needs at least 2p = 8 micro-batches .* use m >= 8"):
        schedules.make("dualpipe_v", 4, 4)
    with pytest.raises(ValueError, match="leave v out"):
        schedules.make("zb_h1", 2, 4, v=2)
    with pytest.raises(ValueError, match="unknown schedule 'zigzag': use one of .* zb_h1, zb_v, dualpipe_v"):
        schedules.make("zigzag", 2, 2)


def test_every_zero_bubble_schedule_passes_the_nccl_checker():
    """ZB-H1, ZB-V, DualPipeV for p = 1..5 and every m they accept up to 16: complete, I before W, and a
    plan that terminates under NCCL's rule, every send paired with the receive of the same message."""
    for name in ZB:
        for p, m in sizes(name):
            sched = schedules.make(name, p, m)
            plan = sim.verified_plan(sched)
            assert sum(a.kind in "BI" for acts in sched.ranks for a in acts) == m * sched.num_stages
            sends = [op for r in range(p) for g in plan.groups(r) for op in g.sends]
            assert len(sends) == len({op.message for op in sends}), (name, p, m)
            if name != "dualpipe_v":       # DualPipeV runs most backwards whole (B): only its drain splits
                assert not any(a.kind == "B" for acts in sched.ranks for a in acts)


# ---------------------------------------------------------------- torch's classes and lowering
def _torch_order(name: str, p: int, m: int) -> dict:
    """pipeline_order of torch's class of the same name, built on stand-in stages (no process group)."""
    from torch.distributed.pipelining import schedules as ts
    local = 1 if name == "zb_h1" else 2
    stages = [types.SimpleNamespace(group_size=p, group_rank=0, num_stages=p * local, submod=None, stage_index=i,
                                    stage_index_to_group_rank=None) for i in range(local)]
    return getattr(ts, TORCH_CLASS[name])(stages, n_microbatches=m, loss_fn=None).pipeline_order


def _flat(order_of_rank) -> list[tuple]:
    """torch's actions as (kind, micro-batch, stage); an OVERLAP_F_B pair (F, B) becomes its B then its F,
    as par runs it; idle slots go."""
    return [(x.computation_type.value, x.microbatch_index, x.stage_index)
            for a in order_of_rank if a is not None for x in (a.sub_actions[::-1] if a.sub_actions else (a,))]


@pytest.mark.parametrize("name", ZB)
def test_rank_lists_equal_torchs_class_of_the_same_name(name):
    """Action for action, with two explained differences: torch pads a rank's list with idle slots (None)
    that par's replay finds by itself, and DualPipeV's overlapped pair is one torch action (OVERLAP_F_B with
    sub-actions F, B) but two consecutive par actions, the B first (`schedules.dualpipe_v_actions` says
    why; `test_dualpipe_v_runs_the_backward_of_a_pair_first` measures it). ZB-H1 is torch's
    ScheduleInterleavedZeroBubble with one stage per rank (the paper's ZB-H1 = its ZB1P with v = 1);
    torch refuses m that are not a multiple of max(1, m // p) there, par has no such limit."""
    for p, m in sizes(name, ps=(2, 3, 4), ms=(2, 3, 4, 6, 8, 12)):
        if name == "zb_h1" and m % max(1, m // p):
            continue
        order, ours = _torch_order(name, p, m), schedules.make(name, p, m)
        for r in range(p):
            assert _flat(order[r]) == [(a.kind, a.microbatch, ours.stage(r, a)) for a in ours.ranks[r]], (name, p, m, r)


def test_dualpipe_v_runs_the_backward_of_a_pair_first():
    """One action at a time, an overlapped pair runs its B first: with F = I = W = 1 per chunk DualPipeV then
    idles only the V's unavoidable start, (p-1)/(6m+p-1) like ZB-V; torch's order (F first) lets the waits add
    up under NCCL's rule, the more the larger m."""
    for p, m in ((3, 6), (4, 8), (4, 32)):
        ours = schedules.make("dualpipe_v", p, m)
        assert sim.simulate(ours).bubble_fraction == pytest.approx(sim.zb_v_bubble_formula(p, m))
        order = _torch_order("dualpipe_v", p, m)
        forward_first = [[Action(k, mb, ours.owner(s)[1]) for k, mb, s in
                          ((x.computation_type.value, x.microbatch_index, x.stage_index)
                           for a in order[r] if a is not None for x in (a.sub_actions or (a,)))] for r in range(p)]
        theirs = sim.simulate(from_lists(forward_first, m, 2, placement="v"))
        assert theirs.makespan > sim.simulate(ours).makespan
    assert (theirs.makespan, sim.simulate(ours).makespan) == (247.0, 195.0)


def _to_torch(sched):
    from torch.distributed.pipelining.schedules import _Action, _ComputationType
    return {r: [_Action(sched.stage(r, a), _ComputationType(a.kind), a.microbatch) for a in acts]
            for r, acts in enumerate(sched.ranks)}


@pytest.mark.parametrize("name", ZB)
def test_torch_lowering_and_simulator_accept_pars_schedules(name):
    """torch's `_validate_schedule`, `_add_send_recv` (adds SEND/RECV, fails on a schedule whose messages
    cannot be ordered) and `_simulate_comms_compute` (fails on a deadlock) take par's schedules as they are,
    for p in {2, 4}, m in {4, 8}. DualPipeV at p = 4, m = 4 is refused by par and torch alike (m < 2p)."""
    from torch.distributed.pipelining.schedules import (_add_send_recv, _simulate_comms_compute,
                                                        _validate_schedule)
    for p in (2, 4):
        for m in (4, 8):
            if name == "dualpipe_v" and m < 2 * p:
                with pytest.raises(ScheduleError, match="use m >= 8"):
                    schedules.make(name, p, m)
                continue
            sched = schedules.make(name, p, m)
            stage_of = {sched.stage(r, a): r for r, acts in enumerate(sched.ranks) for a in acts}
            assert _validate_schedule(_to_torch(sched), p, sched.num_stages, m) == stage_of
            lowered = _add_send_recv(_to_torch(sched), stage_to_rank=stage_of.__getitem__,
                                     num_stages=sched.num_stages)
            done = _simulate_comms_compute(lowered, stage_to_rank=stage_of.__getitem__, num_stages=sched.num_stages)
            assert sum(a is not None and a.computation_type.value in "FBIW" for acts in done.values()
                       for a in acts) == sum(len(acts) for acts in sched.ranks)


# ---------------------------------------------------------------- the simulator and the formulas
@pytest.mark.parametrize("p,m", [(p, m) for p in (2, 3, 4) for m in (p, 2 * p, 4 * p)])
def test_zb_h1_bubble_matches_its_formula_and_beats_1f1b(p, m):
    """F = I = W = 1: ZB-H1 idles (p-1)(f+i-w) = p-1 per rank, a third of 1F1B's 3(p-1)."""
    zb = sim.simulate(schedules.make("zb_h1", p, m), forward=1.0, backward_input=1.0, backward_weight=1.0)
    ofob = sim.simulate(schedules.one_f_one_b(p, m), forward=1.0, backward=2.0)
    assert zb.bubble_fraction == pytest.approx(sim.zb_h1_bubble_formula(p, m), abs=1e-12)
    assert zb.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1))
    assert ofob.bubble_fraction == pytest.approx(sim.bubble_formula(p, m))
    assert zb.bubble_fraction < ofob.bubble_fraction
    assert p * zb.makespan - 3 * m * p == pytest.approx((p * ofob.makespan - 3 * m * p) / 3)   # idle time: a third
    # unequal costs: idle (p-1)(f+i-w) per rank holds for w = f whatever i (and if m <= p) ...
    for f, i, w in ((1.0, 1.5, 1.0), (1.0, 2.0, 1.0), (2.0, 1.0, 0.5)):
        if w != f and m > p:
            continue
        zb = sim.simulate(schedules.make("zb_h1", p, m), forward=f, backward_input=i, backward_weight=w)
        assert zb.bubble_fraction == pytest.approx(sim.zb_h1_bubble_formula(p, m, f, i, w), abs=1e-12)
    # ... with w != f, p >= 3 and m > p the steady state stalls too: more idle than the formula says
    if m > p > 2:
        zb = sim.simulate(schedules.make("zb_h1", p, m), forward=2.0, backward_input=1.0, backward_weight=0.5)
        assert zb.bubble_fraction > sim.zb_h1_bubble_formula(p, m, 2.0, 1.0, 0.5)


def test_v_schedules_idle_less_and_hold_more():
    """Each chunk of a V is half a stage (costs halved): ZB-V idles less than ZB-H1, which idles less than
    1F1B; the price is in flight: 2p chunk-micro-batches on every rank (p stages' worth, 1F1B's peak on rank 0,
    but on every rank), ZB-H1 p on every rank, 1F1B p-r on rank r."""
    p, m = 4, 8
    one = sim.simulate(schedules.one_f_one_b(p, m), forward=1.0, backward=2.0).bubble_fraction
    h1 = sim.simulate(schedules.make("zb_h1", p, m), forward=1.0, backward=2.0).bubble_fraction
    zbv = sim.simulate(schedules.make("zb_v", p, m), forward=0.5, backward=1.0).bubble_fraction
    dpv = sim.simulate(schedules.make("dualpipe_v", p, m), forward=0.5, backward=1.0).bubble_fraction
    assert zbv < h1 < one and dpv < one
    assert sim.peak_in_flight_per_rank(schedules.one_f_one_b(p, m)) == [4, 3, 2, 1]
    assert sim.peak_in_flight_per_rank(schedules.make("zb_h1", p, m)) == [4, 4, 4, 4]
    assert sim.peak_in_flight_per_rank(schedules.make("zb_v", p, m)) == [8, 8, 8, 8]
    with pytest.raises(ValueError, match=r"backward_weight costs: need one per stage \(8\), got 2"):
        sim.simulate(schedules.make("zb_v", p, m), backward_weight=[1.0, 1.0])


def test_action_costs_read_i_and_w_from_spans():
    s = schedules.make("zb_h1", 2, 2)
    t = sim.simulate(s, forward=[1.0, 2.0], backward_input=[3.0, 4.0], backward_weight=[5.0, 6.0])
    costs = sim.action_costs(t.spans, s)
    assert costs == {"F": [1.0, 2.0], "B": [0.0, 0.0], "I": [3.0, 4.0], "W": [5.0, 6.0]}
    again = sim.simulate(s, forward=costs["F"], backward_input=costs["I"], backward_weight=costs["W"])
    assert again.spans == t.spans


def test_peak_bytes_follow_the_schedule():
    """F takes a micro-batch's activations, I adds what W keeps, B or W gives both back."""
    s = from_lists(["F0 F1 I0 B1 W0"])
    assert sim.peak_bytes_per_rank(s, 10.0, 3.0) == [23.0]        # F0 F1 (20), I0 (+3), B1 (-10), W0 (-13)
    assert sim.peak_bytes_per_rank(schedules.one_f_one_b(4, 8), 1.0) == [4.0, 3.0, 2.0, 1.0]
    zb = schedules.make("zb_h1", 4, 8)
    assert sim.peak_bytes_per_rank(zb, 1.0) == [float(x) for x in sim.peak_in_flight_per_rank(zb)]
    assert sim.peak_bytes_per_rank(zb, 1.0, 0.5) == [4.5, 5.0, 5.5, 6.0]   # p micro-batches, r + 1 of them past I


def test_costs_measured_on_one_rank():
    """pipeline.measure_costs: every chunk's F, B, I, W timed on one rank; merged(2) = stages of two chunks;
    uniform = medians."""
    from par.pp.pipeline import measure_costs
    cfg = preset("tiny", n_layer=2)
    x, y = next(global_batches(CharDataset(block_size=cfg.block_size), 4, 1, seed=4))
    c = measure_costs(build(cfg, seed=3).to_layers(), 4, x, y, lm_loss, m=4, whole=1)
    assert len(c.forward) == len(c.kept_for_w) == 4 and all(t > 0 for t in c.forward + c.backward_weight)
    assert all(a > 0 and k > 0 for a, k in zip(c.activations, c.kept_for_w))
    two = c.merged(2)
    assert two.forward == [c.forward[0] + c.forward[1], c.forward[2] + c.forward[3]]
    assert len(set(c.uniform().backward_input)) == 1
    assert sim.simulate(schedules.make("zb_v", 2, 4), **c.simulator()).makespan > 0
    with pytest.raises(ValueError, match="use 0 < whole < m - 1"):
        measure_costs(build(cfg).to_layers(), 4, x, y, lm_loss, m=4, whole=3)


# ---------------------------------------------------------------- I + W = B, in one process
def test_split_backward_equals_the_whole_one_in_one_process():
    """p = 1: every schedule's I then W gives the whole backward's gradients; the meter sees the price:
    the activations held until W, plus the dL/dy_l W needs (`bytes_kept_for_w`)."""
    cfg = preset("tiny")
    x, y = next(global_batches(CharDataset(block_size=cfg.block_size), 4, 1, seed=4))
    ref = build(cfg, seed=3)
    lm_loss(ref(x), y).backward()
    memory = {}
    for name in ("1f1b",) + ZB:
        model = build(cfg, seed=3)
        pipe = Pipeline(model.to_layers(), schedules.make(name, 1, 4), lm_loss, method="uniform", track_memory=True)
        pipe.step(x, y)
        assert max((a.grad - b.grad).abs().max().item() for a, b in zip(model.parameters(), ref.parameters())) < 1e-6
        memory[name] = pipe.memory
    assert memory["1f1b"]["bytes_kept_for_w"] == 0 < memory["zb_h1"]["bytes_kept_for_w"]
    zb = memory["zb_h1"]
    assert zb["peak_bytes"] == zb["bytes_per_microbatch"] + zb["bytes_kept_for_w"]


def test_w_of_a_linear_adds_g_transposed_x_in_place():
    """W of an nn.Linear: A.grad += gᵀx and b.grad += Σ g over every leading dimension, into the same
    .grad tensors (no new weight-sized tensor), equal to autograd's; other dtypes are left to autograd."""
    import torch
    from par.pp.pipeline import linear_weight_gradients
    torch.manual_seed(0)
    layer = torch.nn.Linear(5, 3)
    x, g = torch.randn(2, 4, 5), torch.randn(2, 4, 3)
    ref = torch.autograd.grad(layer(x), [layer.weight, layer.bias], g)
    assert linear_weight_gradients(layer, x, g)
    assert torch.allclose(layer.weight.grad, ref[0], atol=1e-6) and torch.allclose(layer.bias.grad, ref[1], atol=1e-6)
    grad = layer.weight.grad
    assert linear_weight_gradients(layer, x, g)
    assert layer.weight.grad is grad and torch.allclose(grad, 2 * ref[0], atol=1e-6)
    assert torch.allclose(layer.bias.grad, 2 * ref[1], atol=1e-6)
    assert not linear_weight_gradients(layer, x.double(), g.double())     # autocast-like: autograd's path
    assert not linear_weight_gradients(torch.nn.LayerNorm(3), g, g)
    assert not linear_weight_gradients(layer, None, g)


def test_the_memory_meter_frees_every_activation_after_w():
    """track_memory's saved-tensor hooks must not keep a graph alive: a pack hook that returns an op's own output
    (ReLU saves its result) makes tensor -> node -> tensor, a cycle only the garbage collector breaks, and I and W
    retain the graph, so each micro-batch's activations outlived its W. With the collector off, a step must leave
    exactly as many tensors alive as it found."""
    import gc

    import torch
    import torch.nn.functional as F
    x, y = next(square_batches(16, 8, 1, seed=2))
    for name in ("1f1b", "zb_h1", "zb_v"):
        model = SquareStack(16, 4, seed=1)
        pipe = Pipeline(model.to_layers(), schedules.make(name, 1, 4), F.mse_loss, method="uniform", track_memory=True)
        pipe.step(x, y)                          # the first step creates every .grad
        gc.collect()
        gc.disable()
        try:
            before = sum(issubclass(type(o), torch.Tensor) for o in gc.get_objects())
            pipe.step(x, y)
            after = sum(issubclass(type(o), torch.Tensor) for o in gc.get_objects())
        finally:
            gc.enable()
        assert after == before, f"{name}: {after - before} tensors left alive by one step"
        assert pipe.memory["peak_bytes"] > 0


def test_square_stack_trains_equal_with_its_input_gradient_asked_for():
    """The timing model of the executed bubbles: a batch that asks for its gradient makes stage 0 compute
    dL/dx in B and in I (each micro-batch a leaf of its own, the batch itself untouched), and every schedule
    still gives the single process's gradients."""
    import torch.nn.functional as F
    x, y = next(square_batches(16, 8, 1, seed=2))
    ref = SquareStack(16, 4, seed=1)
    F.mse_loss(ref(x), y).backward()
    for name in ("1f1b",) + ZB:
        model = SquareStack(16, 4, seed=1)
        pipe = Pipeline(model.to_layers(), schedules.make(name, 1, 4), F.mse_loss, method="uniform")
        xg = x.clone().requires_grad_(True)
        pipe.step(xg, y)
        assert xg.grad is None
        assert max((a.grad - b.grad).abs().max().item() for a, b in zip(model.parameters(), ref.parameters())) < 1e-6


@pytest.mark.slow
def test_the_square_timing_model_trains_equal_to_the_single_process_under_every_schedule():
    """`par.pp.job --model square --check` (the zero-bubble timing launch's model) on 2 ranks: 1F1B, ZB-H1 and
    ZB-V reach the single process's gradients and weights after 3 Adam steps, on a depth that does not
    split evenly into 4 chunks."""
    import par.runtime.launch
    res = par.runtime.launch.run("par.pp.job", nproc=2, timeout=300, quiet=True, args=[
        "--model", "square", "--schedules", "1f1b,zb_h1,zb_v", "--microbatches", "4", "--micro-batch-size", "3",
        "--n-layer", "7", "--d-model", "24", "--check", "--steps", "3"])
    assert res["model"] == "square" and res["config"] == {"d_model": 24, "n_layer": 7}
    assert [r["schedule"] for r in res["runs"]] == ["1f1b", "zb_h1", "zb_v"]
    for r in res["runs"]:
        assert r["max_grad_diff"] <= 1e-6 and r["max_diff"] <= 1e-5 and r["max_loss_diff"] <= 1e-6, r["schedule"]
        assert r["bubble_formula"] is not None and 0 <= r["bubble"] < 1
        assert 0 <= r["bubble_load_proof"] < 1 and 0 <= r["bubble_simulated"] < 1
        assert len(r["bubble_load_proof_steps"]) == 3
        assert all(set(s["after_s"]) == {"wall", "steady", "cpu"} for s in r["spans"] if s["lane"] == "compute")


# ---------------------------------------------------------------- launched: equal to 1F1B on 2, 3, 4 ranks
CASES = [(2, False, ("zb_v",))] + [(p, emulate, ZB + (("torch_zb_v",) if p == 2 and not emulate else ()))
                                   for emulate in (False, True) for p in (2, 3, 4)]
_RESULTS: dict = {}


@pytest.fixture(params=tiered_one(CASES, lambda c: f"p{c[0]}-{'+'.join(c[2])}" + ("-nccl-emulation" if c[1] else "")))
def launched(request):
    import par.runtime.launch
    if request.param not in _RESULTS:
        p, emulate, names = request.param
        _RESULTS[request.param] = par.runtime.launch.run(
            __file__, nproc=p, timeout=300, quiet=True, args=[",".join(names)],
            env={"PAR_NCCL_EMULATION": "1"} if emulate else None)
    return request.param, _RESULTS[request.param]


def test_zero_bubble_training_equals_1f1b(launched):
    """Gradients of one step (the whole model's, gathered by name) and the loss equal 1F1B's (≤ 1e-6);
    each rank posted exactly the checked plan; the measured in-flight peak is the schedule's."""
    (p, _, names), res = launched
    m = 2 * p
    assert set(res) == {"1f1b", *names}
    for name in names:
        r = res[name]
        assert r["grad_diff"] <= 1e-6 and r["loss_diff"] <= 1e-6, (name, r["grad_diff"], r["loss_diff"])
        if name.startswith("torch"):
            continue
        sched = schedules.make(name, p, m)
        plan = sim.verified_plan(sched)
        for rank, groups in enumerate(r["executed"]):
            posted = [[(kind, peer, tuple(message)) for kind, peer, message in g] for g in groups]
            assert posted == [[(o.kind, o.peer, o.message) for o in g.sends + g.recvs] for g in plan.groups(rank)]
        assert [x["peak_in_flight"] for x in r["memory"]] == sim.peak_in_flight_per_rank(sched)
        # the bytes too: each stage's measured activations and dL/dy_l, replayed in the schedule's order
        stage = {int(k): v for x in r["memory"] for k, v in x["per_stage"].items()}
        predicted = sim.peak_bytes_per_rank(sched, [stage[k]["activations"] for k in range(sched.num_stages)],
                                            [stage[k]["kept_for_w"] for k in range(sched.num_stages)])
        assert [x["peak_bytes"] for x in r["memory"]] == pytest.approx(predicted, rel=0.02)


def _worker(names: list[str]) -> None:
    """Every rank: one step of GPT-lite under 1F1B and each of `names` (and torch's ZB-V for 'torch_zb_v'),
    m = 2p; rank 0 saves {schedule: grad_diff and loss_diff against 1F1B, executed groups, memory}."""
    import par.runtime.dist
    env = par.runtime.dist.init()
    p, m = env.world_size, 2 * env.world_size
    cfg = preset("tiny", n_layer=max(4, 2 * p - 2))            # 2p stages for the V schedules
    x, y = next(global_batches(CharDataset(block_size=cfg.block_size), 2 * m, 1, seed=5))
    runs = {}
    for name in ["1f1b", *names]:
        if name == "torch_zb_v":
            from par.pp.torch_api import TorchVPipeline
            ours = Pipeline(build(cfg, seed=1).to_layers(), schedules.make("zb_v", p, m), lm_loss)
            pipe = TorchVPipeline(build(cfg, seed=1).to_layers(), ours.bounds, lm_loss, m, "zb_v", env.rank, p)
            # the same chunks from the same boundaries: par's names, in par's order, for torch's parameters
            named = list(zip([n for n, _ in ours.named_parameters()], [q for _, q in pipe.named_parameters()]))
            loss, mine = pipe.step(x, y), {"executed": [], "memory": {}}
        else:
            pipe = Pipeline(build(cfg, seed=1).to_layers(), schedules.make(name, p, m), lm_loss, track_memory=True)
            loss = pipe.step(x, y)
            named, mine = list(pipe.named_parameters()), {"executed": pipe.executed, "memory": pipe.memory}
        parts = par.runtime.dist.gather_object({"grads": {n: q.grad for n, q in named}, "loss": loss, **mine})
        if parts is not None:
            runs[name] = {"grads": {n: g for part in parts for n, g in part["grads"].items()},
                          "loss": next(q["loss"] for q in parts if q["loss"] is not None),
                          "executed": [q["executed"] for q in parts], "memory": [q["memory"] for q in parts]}
    if env.rank == 0:
        base = runs["1f1b"]
        out = {}
        for name, r in runs.items():
            assert r["grads"].keys() == base["grads"].keys(), name
            out[name] = {"grad_diff": max((r["grads"][n] - g).abs().max().item() for n, g in base["grads"].items()),
                         "loss_diff": abs(r["loss"] - base["loss"]), "executed": r["executed"], "memory": r["memory"]}
        par.runtime.dist.save_result(out)
    par.runtime.dist.teardown()


if __name__ == "__main__":
    _worker(sys.argv[1].split(","))
