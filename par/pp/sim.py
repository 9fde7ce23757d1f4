"""Check a pipeline schedule, and simulate it to get its timeline, bubble and memory.

`check(schedule)` proves a schedule can run the way `par.pp.pipeline` runs it:

1. complete: every micro-batch gets exactly one F on every stage, and one backward: either B, or its
   two halves I (input gradient) and W (weight gradient), never both;
2. on each stage, B(i) and I(i) come after F(i) (backward needs the forward's saved activations), and
   W(i) after I(i) (the weight gradient needs the gradient at each layer's output, which I computes);
3. it terminates under NCCL's rule. `par.pp.p2p_plan.build` turns the schedule into each rank's
   communication plan (its actions, and between them the groups of sends and receives posted
   together), and `replay` runs that plan the way NCCL would: a group completes only when every
   peer has posted its matching operations (sends block until matched; the k-th send from A to
   B meets B's k-th receive from A, so both must name the same message); a rank keeps one group
   in flight and waits for it before reading what it receives, before its next group and at the
   end. The replay also checks the plan itself: every action in the schedule's order, every
   message sent after it was computed and received before it is read. If no rank can move, the
   error names what every stuck rank waits for.

`simulate(schedule, forward, backward)` is the same replay with costs and returns the timeline
(`backward_input`, `backward_weight`: the costs of I and W, by default half of `backward` each).
`as_executed(spans, schedule)` replays an executed step with each action's own recorded cost and the time its
rank spent between actions: the step on the load-proof clock.
With equal costs f, b on every stage, GPipe and 1F1B both idle

    bubble = (p-1)/(m+p-1)      of the step (p stages, m micro-batches),

interleaving with v chunks per rank (p-1)/(v·m+p-1) of the step (`interleaved_bubble_formula`; (p-1)/(v·m)
of the ideal time m(f+b), `interleaved_bubble_ratio`), ZB-H1 idles
(p-1)(f+i-w) per rank instead of 1F1B's (p-1)(f+i+w) (`zb_h1_bubble_formula`), and the peak
number of micro-batches in flight (forward done, backward not yet) on stage s is m for GPipe
but min(p-s, m) for 1F1B: activation memory ∝ that peak. A split backward holds its micro-batch
until W: `par.pp.pipeline` keeps the autograd graph from F to W.
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field

from par.clock import load_proof
from par.pp import p2p_plan
from par.pp.p2p_plan import describe, Group, message_in, message_out, Plan
from par.pp.schedules import Action, KINDS, parse_action, Schedule, ScheduleError

__all__ = ["ScheduleError", "check", "check_complete", "verified_plan", "replay", "simulate", "Timeline",
           "bubble_formula", "interleaved_bubble_formula", "interleaved_bubble_ratio", "zb_h1_bubble_formula",
           "zb_v_bubble_formula",
           "action_costs", "step_time_formula", "best_microbatches", "fit_step_time", "p2p_bytes_formula",
           "peak_in_flight_formula", "peak_in_flight", "peak_in_flight_per_rank", "peak_bytes_per_rank",
           "step_time", "busy_times", "bubble_fraction", "bubble_ratio", "stage_costs", "as_executed"]


# ---------------------------------------------------------------- formulas
def bubble_formula(p: int, m: int) -> float:
    """Idle fraction of a GPipe or 1F1B step with equal stage costs: (p-1)/(m+p-1)."""
    return (p - 1) / (m + p - 1)


def interleaved_bubble_formula(p: int, m: int, v: int) -> float:
    """Idle fraction of an interleaved 1F1B step (v chunks per rank, m a multiple of p, equal costs):
    the fill and drain last (p-1)(f+b)/v, so  bubble = (p-1)/(v·m + p-1)."""
    return (p - 1) / (v * m + p - 1)


def interleaved_bubble_ratio(p: int, m: int, v: int) -> float:
    """Idle time of interleaved 1F1B over the ideal (bubble-free) time: (p-1)/(v·m)."""
    return (p - 1) / (v * m)


def zb_h1_bubble_formula(p: int, m: int, f: float = 1.0, i: float = 1.0, w: float = 1.0) -> float:
    """Idle fraction of a ZB-H1 step: every rank idles (p-1)(f+i-w) of

        T = m(f+i+w) + (p-1)(f+i-w),   so   bubble = (p-1)(f+i-w) / (m(f+i+w) + (p-1)(f+i-w)).

    Why: 1F1B idles (p-1)(f+b) = (p-1)(f+i+w) per rank (`bubble_formula`'s time). ZB-H1 keeps
    1F1B's order of F and I, so the gradients travel up as fast; but rank r postpones its first r
    weight halves W to the end of the step, where 1F1B's rank r idles (the last rank longest): every
    rank's wait shrinks by (p-1)·2w. With f = i = w: (p-1)·f, a third of 1F1B's (p-1)·3f, and
    bubble = (p-1)/(3m+p-1).

    Exact (the simulator agrees) when w = f, whatever i. With w != f it is exact only in special cases
    (m <= p; p = 2 with w < f): in general the steady state itself stalls (rank r runs F I W while its
    neighbours' slots are shifted by one action, so a W of one rank faces an F of the next) and the
    idle time grows with m: there the simulator, fed with the measured costs, is the answer.
    """
    return (p - 1) * (f + i - w) / (m * (f + i + w) + (p - 1) * (f + i - w))


def zb_v_bubble_formula(p: int, m: int) -> float:
    """Idle fraction of a ZB-V step when every chunk's F, I and W cost the same f (m >= 2p-1):

        bubble = (p-1)f / (2m·3f + (p-1)f) = (p-1)/(6m+p-1).

    Rank p-1 runs the turn of the V, so its first activation arrives after p-1 chunk forwards: (p-1)f
    idle that no schedule avoids. ZB-V fills every other gap with W, so that is all: half of ZB-H1's
    (p-1)·2f (a stage is two chunks), a sixth of 1F1B's (p-1)·6f.
    """
    return (p - 1) / (6 * m + p - 1)


def bubble_formula_of(kind: str, p: int, m: int, f: float = 1.0, i: float = 1.0, w: float = 1.0) -> float | None:
    """The formula a schedule's measured bubble is compared with (None where it has none):
    GPipe, 1F1B: (p-1)/(m+p-1); ZB-H1: `zb_h1_bubble_formula` with the costs f, i, w; ZB-V and DualPipeV:
    (p-1)/(6m+p-1), from m >= 2p-1 (2p for DualPipeV)."""
    if kind in ("gpipe", "1f1b", "naive"):
        return bubble_formula(p, m) if kind != "naive" else None
    if kind == "zb_h1":
        return zb_h1_bubble_formula(p, m, f, i, w)
    if kind in ("zb_v", "dualpipe_v"):
        return zb_v_bubble_formula(p, m) if m >= 2 * p - (1 if kind == "zb_v" else 0) else None
    return None


def step_time_formula(p: int, m: int, work: float, overhead: float) -> float:
    """1F1B step time at a fixed batch: (m+p-1)·(work/m + overhead).

    `work` is one stage's forward and backward of the whole batch, so a micro-batch costs work/m
    plus a fixed `overhead` (Python and kernel launches per action, one message each way); the
    step lasts m+p-1 micro-batch slots. Fewer, larger micro-batches waste bubble; more, smaller
    ones pay the overhead more often.
    """
    return (m + p - 1) * (work / m + overhead)


def best_microbatches(p: int, work: float, overhead: float) -> float:
    """The m that minimises `step_time_formula`: d/dm = 0 gives m* = sqrt((p-1)·work/overhead)."""
    return ((p - 1) * work / overhead) ** 0.5 if overhead > 0 else float("inf")


def fit_step_time(p: int, ms, times) -> tuple[float, float]:
    """(work, overhead) that fit measured step times best (least squares; the formula is linear in both):
    time(m) = work·(m+p-1)/m + overhead·(m+p-1)."""
    rows = [((m + p - 1) / m, float(m + p - 1)) for m in ms]
    saa = sum(a * a for a, _ in rows)
    sab = sum(a * b for a, b in rows)
    sbb = sum(b * b for _, b in rows)
    sat = sum(a * t for (a, _), t in zip(rows, times))
    sbt = sum(b * t for (_, b), t in zip(rows, times))
    det = saa * sbb - sab * sab
    if len(rows) < 2 or det == 0:
        raise ValueError("fitting work and overhead needs step times at two or more different m")
    return (sat * sbb - sbt * sab) / det, (saa * sbt - sab * sat) / det


def p2p_bytes_formula(p: int, m: int, stage: int, activation_bytes: float) -> float:
    """Bytes stage `stage` of a p-stage pipeline sends per step: m activations forward (unless it is
    the last stage) and m gradients backward (unless it is the first), each `activation_bytes`."""
    return m * activation_bytes * ((stage < p - 1) + (stage > 0))


def peak_in_flight_formula(name: str, p: int, m: int, stage: int) -> int:
    """Micro-batches whose activations stage `stage` holds at once: GPipe m, 1F1B min(p-s, m), naive 1."""
    if name == "gpipe":
        return m
    if name == "1f1b":
        return min(p - stage, m)
    if name == "naive":
        return 1
    raise ValueError(f"no in-flight formula for schedule {name!r}: use gpipe, 1f1b or naive")


# ---------------------------------------------------------------- structure
NEEDS = {"B": "F", "I": "F", "W": "I"}    # an action and the one that must come before it (same micro-batch, chunk)


def check_complete(schedule: Schedule) -> None:
    """Every (F, micro-batch, stage) exactly once and one backward: B, or I then W (never both);
    B and I after their F, W after its I, on the same rank."""
    m, v = schedule.microbatches, schedule.virtual
    for r, acts in enumerate(schedule.ranks):
        seen = {}
        for i, a in enumerate(acts):
            if a.kind not in KINDS:
                raise ScheduleError(f"rank {r}, action {i}: unknown kind {a.kind!r} (use F, B, I or W)")
            if not 0 <= a.microbatch < m:
                raise ScheduleError(f"rank {r}, action {i} ({a}): micro-batch {a.microbatch} is not in 0..{m - 1}")
            if not 0 <= a.chunk < v:
                raise ScheduleError(f"rank {r}, action {i} ({a}): chunk {a.chunk} is not in 0..{v - 1}")
            if a in seen:
                raise ScheduleError(f"rank {r} runs {a} twice (actions {seen[a]} and {i})")
            seen[a] = i
            before = Action(NEEDS[a.kind], a.microbatch, a.chunk) if a.kind in NEEDS else None
            if before is not None and before not in seen:
                what = {"B": "backward", "I": "input gradient", "W": "weight gradient"}[a.kind]
                whose = "forward" if before.kind == "F" else "input gradient"
                raise ScheduleError(f"rank {r}, action {i}: {what} {a} comes before its {whose} "
                                    f"{before}{seen_later(acts, before, i)}")
        for c in range(v):
            for mb in range(m):
                whole, half = Action("B", mb, c) in seen, Action("I", mb, c) in seen
                if whole and (half or Action("W", mb, c) in seen):
                    raise ScheduleError(f"rank {r} runs both {Action('B', mb, c)} and its halves I/W: run the "
                                        f"backward whole (B) or split (I then W), not both")
                for kind in ("F",) + (("I", "W") if half else ("B",)):
                    if Action(kind, mb, c) not in seen:
                        raise ScheduleError(f"incomplete: rank {r} never runs {Action(kind, mb, c)} "
                                            f"(stage {schedule.stage(r, Action(kind, mb, c))}, micro-batch {mb})")


def seen_later(acts, action, after: int) -> str:
    for j in range(after + 1, len(acts)):
        if acts[j] == action:
            return f" (action {j})"
    return " (which is missing)"


HOLDS = {"F": 1, "B": -1, "I": 0, "W": -1}   # micro-batches whose activations an action takes or releases


def peak_in_flight(schedule: Schedule) -> list[int]:
    """For each global stage, the most micro-batches held at once: F done, and B (or W, when the
    backward is split: the runtime keeps the graph until W) not yet done."""
    peaks = [0] * schedule.num_stages
    for r, acts in enumerate(schedule.ranks):
        live = defaultdict(int)
        for a in acts:
            s = schedule.stage(r, a)
            live[s] += HOLDS[a.kind]
            peaks[s] = max(peaks[s], live[s])
    return peaks


def peak_in_flight_per_rank(schedule: Schedule) -> list[int]:
    """For each rank, the most micro-batch activations held at once over all its chunks (F to B or W)."""
    peaks = []
    for acts in schedule.ranks:
        live = peak = 0
        for a in acts:
            live += HOLDS[a.kind]
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def peak_bytes_per_rank(schedule: Schedule, activations, kept_for_w=0.0) -> list[float]:
    """For each rank, the most bytes it holds at once when F(i) on stage s keeps `activations[s]` until its
    B or W, and I(i) adds `kept_for_w[s]` (the dL/dy_l its W needs) until that W (numbers or per-stage lists)."""
    act = _costs(activations, schedule.num_stages, "activations")
    kept = _costs(kept_for_w, schedule.num_stages, "kept_for_w")
    peaks = []
    for r, acts in enumerate(schedule.ranks):
        held, peak, mine = 0.0, 0.0, {}
        for a in acts:
            s, key = schedule.stage(r, a), (a.microbatch, a.chunk)
            if a.kind in "FI":
                mine[key] = mine.get(key, 0.0) + (act[s] if a.kind == "F" else kept[s])
                held += act[s] if a.kind == "F" else kept[s]
            else:
                held -= mine.pop(key)
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


# ---------------------------------------------------------------- replay
@dataclass
class Timeline:
    """A simulated step: spans like `par.timeline.Recorder.gather()` returns, plus the sums."""
    spans: list[dict]
    num_ranks: int
    peak_in_flight: list[int] = field(default_factory=list)
    plan: Plan | None = None

    @property
    def makespan(self) -> float:
        return step_time(self.spans)

    @property
    def bubble_fraction(self) -> float:
        return bubble_fraction(self.spans)

    @property
    def bubble_ratio(self) -> float:
        return bubble_ratio(self.spans)


def _costs(value, n: int, label: str) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)] * n
    value = [float(x) for x in value]
    if len(value) != n:
        raise ValueError(f"{label} costs: need one per stage ({n}), got {len(value)}")
    return value


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _partners(plan: Plan) -> dict:
    """{(rank, item index of a group): [(peer, item index of the peer's group that matches each op)]}.

    The k-th send from A to B meets B's k-th receive from A (NCCL has no tags), so both must name
    the same message; raises ScheduleError for an op that is never matched or meets the wrong one.
    """
    p = plan.schedule.num_ranks
    posted = defaultdict(list)           # (kind, rank, peer) -> [(item index, message)] in posting order
    for r, items in enumerate(plan.ranks):
        for i, x in enumerate(items):
            for op in x.ops if isinstance(x, Group) else ():
                if not (0 <= op.peer < p) or op.peer == r:
                    raise ScheduleError(f"rank {r}: {op} names rank {op.peer}: a peer must be another of the {p} ranks")
                posted[(op.kind, r, op.peer)].append((i, op.message))
    partners = {}
    for r, items in enumerate(plan.ranks):
        count = defaultdict(int)
        for i, x in enumerate(items):
            if not isinstance(x, Group):
                continue
            partners[(r, i)] = []
            for op in x.ops:
                n = count[(op.kind, op.peer)]
                count[(op.kind, op.peer)] += 1
                other = "recv" if op.kind == "send" else "send"
                theirs = posted[(other, op.peer, r)]
                what = f"rank {r}'s {_ordinal(n + 1)} {op.kind} {'to' if op.kind == 'send' else 'from'} rank {op.peer}"
                if n >= len(theirs):
                    raise ScheduleError(f"{what} ({describe(op.message)}) is never matched: rank {op.peer} posts "
                                        f"only {len(theirs)} {other}s {'from' if other == 'recv' else 'to'} rank {r}")
                j, message = theirs[n]
                if message != op.message:
                    raise ScheduleError(f"{what} is {describe(op.message)} but the {other} it meets on rank {op.peer} "
                                        f"expects {describe(message)}: NCCL pairs the messages of two ranks in order, "
                                        f"so both must list them in the same order")
                partners[(r, i)].append((op.peer, j))
    return partners


def replay(plan: Plan, forward=1.0, backward=2.0, latency: float = 0.0, backward_input=None,
           backward_weight=None, cost_of=None, after_of=None) -> Timeline:
    """Run `plan` under NCCL's rule with per-stage `forward`/`backward` costs (numbers or lists, one per stage);
    `backward_input`/`backward_weight`, the costs of I and W, default to half of `backward` each.
    `cost_of(rank, action)`, where given, is each action's own cost instead, and `after_of(rank, action)` the
    seconds its rank spends after it before its next item, outside the span (`as_executed`).

    A group completes `latency` after the last of its peers posted the matching operations.
    Raises ScheduleError if the plan deadlocks, pairs messages wrongly, sends what was not
    computed yet or reads what was not received (one line, every stuck rank named).
    """
    schedule = plan.schedule
    p, S = schedule.num_ranks, schedule.num_stages
    cost = {"F": _costs(forward, S, "forward"), "B": _costs(backward, S, "backward")}
    half = [b / 2 for b in cost["B"]]
    cost["I"] = half if backward_input is None else _costs(backward_input, S, "backward_input")
    cost["W"] = half if backward_weight is None else _costs(backward_weight, S, "backward_weight")
    for r, items in enumerate(plan.ranks):
        if [x for x in items if isinstance(x, Action)] != list(schedule.ranks[r]):
            raise ScheduleError(f"the plan of rank {r} does not run the schedule's actions in their order")
    partners = _partners(plan)
    brings = {k: {op.message for op in plan.ranks[k[0]][k[1]].recvs} for k in partners}   # what each group receives
    pos, clock, pending = [0] * p, [0.0] * p, [None] * p     # pending: item index of the group in flight
    posted = {}                                              # (rank, item index) -> time it was posted
    have = [set() for _ in range(p)]                         # messages a rank computed, or received and waited for
    spans = []

    def wait(r) -> bool:
        """Wait for rank r's group in flight; False while a peer has not posted its part."""
        g = pending[r]
        if g is None:
            return True
        if any(q not in posted for q in partners[(r, g)]):
            return False
        done = max([posted[(r, g)]] + [posted[q] for q in partners[(r, g)]])
        clock[r] = max(clock[r], done + (latency if partners[(r, g)] else 0.0))
        have[r].update(brings[(r, g)])
        pending[r] = None
        return True

    while True:
        moved = False
        for r, items in enumerate(plan.ranks):
            while pos[r] < len(items) or pending[r] is not None:
                if pos[r] == len(items):          # the end of the step: wait for the last group
                    moved |= wait(r)
                    break
                x = items[pos[r]]
                if isinstance(x, Group):
                    if not wait(r):
                        break
                    for op in x.sends:
                        if op.message not in have[r]:
                            raise ScheduleError(f"rank {r} sends {describe(op.message)} before it has computed it")
                    posted[(r, pos[r])], pending[r] = clock[r], pos[r]
                else:
                    need = message_in(schedule, r, x)
                    if need is not None and need[0] not in have[r]:
                        g = pending[r]
                        if g is None or need[0] not in brings[(r, g)]:
                            raise ScheduleError(f"rank {r} runs {x} before it receives {describe(need[0])}")
                        if not wait(r):
                            break
                    s = schedule.stage(r, x)
                    end = clock[r] + (cost_of(r, x) if cost_of is not None else cost[x.kind][s])
                    spans.append({"rank": r, "name": str(x), "lane": "compute", "start": clock[r], "end": end,
                                  "stage": s, "microbatch": x.microbatch})
                    clock[r] = end + (after_of(r, x) if after_of is not None else 0.0)
                    out = message_out(schedule, r, x)
                    if out is not None:
                        have[r].add(out[0])
                pos[r] += 1
                moved = True
        if all(pos[r] == len(items) and pending[r] is None for r, items in enumerate(plan.ranks)):
            return Timeline(spans, p, peak_in_flight(schedule), plan)
        if not moved:
            raise ScheduleError("deadlock under NCCL's rule: " + "; ".join(_stuck(plan, pos, pending, partners, posted)))


def _stuck(plan: Plan, pos, pending, partners, posted) -> list[str]:
    out = []
    for r, items in enumerate(plan.ranks):
        g = pending[r]
        if g is None:
            continue
        where = f"before {items[pos[r]]}" if pos[r] < len(items) else "at the end of the step"
        missing = [f"rank {op.peer} has not posted the {'receive' if op.kind == 'send' else 'send'} of "
                   f"{p2p_plan.short(op.message)}" for op, q in zip(items[g].ops, partners[(r, g)]) if q not in posted]
        out.append(f"rank {r} waits {where} for its group {items[g]} ({', '.join(missing)})")
    return out


def verified_plan(schedule: Schedule) -> Plan:
    """The communication plan of `schedule` (`par.pp.p2p_plan.build`), after proving it runs to the end."""
    check_complete(schedule)
    plan = p2p_plan.build(schedule)
    replay(plan)
    return plan


def check(schedule: Schedule) -> Schedule:
    """Raise ScheduleError (one line: the rank, the action, the reason) unless the schedule can run."""
    verified_plan(schedule)
    return schedule


def simulate(schedule: Schedule, forward=1.0, backward=2.0, latency: float = 0.0, backward_input=None,
             backward_weight=None) -> Timeline:
    """The timeline of `schedule` with per-stage costs (numbers or lists, one per stage) of F, B and of B's
    halves I (`backward_input`) and W (`backward_weight`), by default half of `backward` each: its
    communication plan replayed under NCCL's rule (`replay`). Raises ScheduleError like `check`."""
    check_complete(schedule)
    return replay(p2p_plan.build(schedule), forward, backward, latency, backward_input, backward_weight)


def _steady(span: dict) -> float:
    """A recorded span's steady seconds: wall less its run-queue wait, never below its CPU seconds (`par.clock`)."""
    return load_proof(span["end"] - span["start"], span.get("cpu", 0.0), span.get("ready", 0.0))


def as_executed(spans: list[dict], schedule: Schedule, clock: str = "cpu") -> Timeline:
    """An executed step (the spans `par.pp.job` gathers) rebuilt from what each rank spent itself: every action
    at its own seconds on `clock`, and after it what its rank spent before its next action without waiting for
    another rank (the span's `after_s[clock]`, recorded by `par.pp.pipeline.Pipeline.step`; 0 where a span has
    none); the waits for the other ranks are the plan's, replayed under NCCL's rule (`replay`), each message
    arriving the moment its group completes (no latency).

    clock  "wall"    each span's start to end: rebuilds the recorded timeline itself (how close it comes checks
                     that the waits were the plan's and the messages' own time small)
           "steady"  each span less its run-queue wait (`par.clock`)
           "cpu"     each action's own cost (`cpu_s`, `par.pp.pipeline.ActionCosts`): its thread's CPU time, on
                     a GPU the time between CUDA events around it

    On a busy CPU, "cpu" is the load-proof one: a rank kept from its core loses no CPU time, whether it waited in
    the run queue (what "steady" takes out) or elsewhere (a span neither computing nor queued: wall − ready − cpu
    > 0, which "steady" keeps), and the waits it caused on the other ranks are replayed from the others' own
    times. Its `bubble_fraction` is the step's bubble on that clock."""
    if clock not in ("wall", "steady", "cpu"):
        raise ValueError(f"unknown clock {clock!r}: use 'wall', 'steady' or 'cpu'")
    cost, after = {}, {}
    for x in spans:
        if x["lane"] == "compute":
            key = (x["rank"], x["name"])
            cost[key] = x["cpu_s"] if clock == "cpu" else x["end"] - x["start"] if clock == "wall" else _steady(x)
            after[key] = (x.get("after_s") or {}).get(clock, 0.0)
    check_complete(schedule)
    return replay(p2p_plan.build(schedule), cost_of=lambda r, a: cost[(r, str(a))],
                  after_of=lambda r, a: after[(r, str(a))])


# ---------------------------------------------------------------- measures (simulated or recorded spans)
def step_time(spans: list[dict], lane: str = "compute") -> float:
    """From the first span's start to the last span's end."""
    s = [x for x in spans if x["lane"] == lane]
    return max(x["end"] for x in s) - min(x["start"] for x in s)


def busy_times(spans: list[dict], lane: str = "compute") -> dict[int, float]:
    """Time each rank spent computing."""
    busy = defaultdict(float)
    for x in spans:
        if x["lane"] == lane:
            busy[x["rank"]] += x["end"] - x["start"]
    return dict(sorted(busy.items()))


def bubble_fraction(spans: list[dict], lane: str = "compute") -> float:
    """Mean over ranks of idle / step time: 1 - busy_r / T. Works on simulated and executed timelines."""
    total, busy = step_time(spans, lane), busy_times(spans, lane)
    return sum(1 - b / total for b in busy.values()) / len(busy)


def bubble_ratio(spans: list[dict], lane: str = "compute") -> float:
    """Idle time over busy time, summed over ranks: (p·T - Σ busy_r) / Σ busy_r."""
    total, busy = step_time(spans, lane), busy_times(spans, lane)
    work = sum(busy.values())
    return (len(busy) * total - work) / work


def stage_costs(spans: list[dict], schedule: Schedule, clock: str = "wall") -> tuple[list[float], list[float]]:
    """Median duration of the F and of the B actions of every stage in a recorded timeline (`action_costs`).

    `clock="wall"` uses each span's start and end; `clock="cpu"` the action's own cost (`cpu_s`, recorded
    by `par.pp.pipeline.ActionCosts`): on the CPU the time the rank's thread spent in it
    (`time.thread_time()`), which does not count the time a rank waited for a core when ranks share
    cores; on a GPU the time between CUDA events around it; `clock="steady"` the span less its run-queue
    wait (`par.clock`: what it took on a core of its own; the span's duration on a GPU). Feed them to
    `simulate` to get the timeline the schedule would have with those costs and nothing else
    (no waiting for messages, no noise): simulated next to executed.
    """
    costs = action_costs(spans, schedule, clock)
    return costs["F"], costs["B"]


def action_costs(spans: list[dict], schedule: Schedule, clock: str = "wall") -> dict[str, list[float]]:
    """{kind: median duration of that kind's actions on every stage} for F, B, I, W (0.0 where none ran):
    `simulate(forward=c["F"], backward=c["B"], backward_input=c["I"], backward_weight=c["W"])` replays
    the schedule with the measured costs. `clock` as in `stage_costs`."""
    if clock not in ("wall", "cpu", "steady"):
        raise ValueError(f"unknown clock {clock!r}: use 'wall', 'cpu' or 'steady'")
    sums = {k: defaultdict(list) for k in KINDS}
    for x in spans:
        if x["lane"] == "compute":
            a = parse_action(x["name"])
            sums[a.kind][schedule.stage(x["rank"], a)].append(
                x["cpu_s"] if clock == "cpu" else _steady(x) if clock == "steady" else x["end"] - x["start"])

    def median(xs):  # robust to an action that was descheduled half-way
        return statistics.median(xs) if xs else 0.0
    return {k: [median(sums[k][s]) for s in range(schedule.num_stages)] for k in KINDS}
