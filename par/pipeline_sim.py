"""Check a pipeline schedule, and simulate it to get its timeline, bubble and memory.

`check(schedule)` proves a schedule can run, the way `par.pipeline` runs it:

1. complete: every micro-batch gets exactly one F and one B on every stage;
2. on each stage, B(i) comes after F(i) (backward needs the forward's saved activations);
3. it terminates. Each rank runs its list in order. An F on stage s > 0 first *receives*
   the activation from stage s-1; a B on stage s < S-1 first receives the gradient from
   stage s+1; a receive blocks until the matching send was posted. Sends never block
   (they are posted and waited for at the end of the step). Between two ranks messages
   are read in the order they were sent (NCCL has no tags); one that comes before it is
   needed is kept until its action runs, so reading in order never waits longer than the
   message itself. If no rank can move, the schedule deadlocks, and the error names
   what every stuck rank waits for. Dependencies across stages (F on stage s after F on
   s-1, B on s after B on s+1) hold because of these receives.

`simulate(schedule, forward, backward)` runs the same replay with costs and returns
the timeline. With equal costs f, b on every stage, GPipe and 1F1B both idle

    bubble = (p-1)/(m+p-1)      of the step (p stages, m micro-batches),

interleaving with v chunks per rank idles (p-1)/(v·m) of the ideal time m(f+b), and
the peak number of micro-batches in flight (forward done, backward not yet) on stage s
is m for GPipe but min(p-s, m) for 1F1B: activation memory ∝ that peak.
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field

from par.schedules import Action, Schedule


class ScheduleError(ValueError):
    """The schedule cannot run: incomplete, out of order, or deadlocked."""


# ---------------------------------------------------------------- formulas
def bubble_formula(p: int, m: int) -> float:
    """Idle fraction of a GPipe or 1F1B step with equal stage costs: (p-1)/(m+p-1)."""
    return (p - 1) / (m + p - 1)


def interleaved_bubble_ratio(p: int, m: int, v: int) -> float:
    """Idle time of interleaved 1F1B over the ideal (bubble-free) time: (p-1)/(v·m)."""
    return (p - 1) / (v * m)


def peak_in_flight_formula(name: str, p: int, m: int, stage: int) -> int:
    """Micro-batches whose activations stage `stage` holds at once: GPipe m, 1F1B min(p-s, m), naive 1."""
    if name == "gpipe":
        return m
    if name == "1f1b":
        return min(p - stage, m)
    if name == "naive":
        return 1
    raise ValueError(f"no in-flight formula for schedule {name!r}: use gpipe, 1f1b or naive")


# ---------------------------------------------------------------- messages
def message_in(schedule: Schedule, rank: int, a: Action):
    """(what, source rank) this action must receive before it runs, or None."""
    s, last = schedule.stage(rank, a), schedule.num_stages - 1
    if a.kind == "F" and s > 0:
        return ("activation", a.microbatch, s - 1), schedule.owner(s - 1)[0]
    if a.kind == "B" and s < last:
        return ("gradient", a.microbatch, s + 1), schedule.owner(s + 1)[0]
    return None


def message_out(schedule: Schedule, rank: int, a: Action):
    """(what, destination rank) this action sends when it is done, or None."""
    s, last = schedule.stage(rank, a), schedule.num_stages - 1
    if a.kind == "F" and s < last:
        return ("activation", a.microbatch, s), schedule.owner(s + 1)[0]
    if a.kind == "B" and s > 0:
        return ("gradient", a.microbatch, s), schedule.owner(s - 1)[0]
    return None


def _describe(message) -> str:
    what, mb, stage = message
    return f"the {what} of micro-batch {mb} from stage {stage}"


# ---------------------------------------------------------------- structure
def check_complete(schedule: Schedule) -> None:
    """Every (F|B, micro-batch, stage) exactly once, each B after its F on the same rank."""
    p, m, v = schedule.num_ranks, schedule.microbatches, schedule.virtual
    for r, acts in enumerate(schedule.ranks):
        seen = {}
        for i, a in enumerate(acts):
            if a.kind not in ("F", "B"):
                raise ScheduleError(f"rank {r}, action {i}: unknown kind {a.kind!r} (use F or B)")
            if not 0 <= a.microbatch < m:
                raise ScheduleError(f"rank {r}, action {i} ({a}): micro-batch {a.microbatch} is not in 0..{m - 1}")
            if not 0 <= a.chunk < v:
                raise ScheduleError(f"rank {r}, action {i} ({a}): chunk {a.chunk} is not in 0..{v - 1}")
            if a in seen:
                raise ScheduleError(f"rank {r} runs {a} twice (actions {seen[a]} and {i})")
            seen[a] = i
            if a.kind == "B" and Action("F", a.microbatch, a.chunk) not in seen:
                where = seen_later(acts, Action("F", a.microbatch, a.chunk), i)
                raise ScheduleError(f"rank {r}, action {i}: backward {a} comes before its forward "
                                    f"{Action('F', a.microbatch, a.chunk)}{where}")
        for c in range(v):
            for mb in range(m):
                for kind in ("F", "B"):
                    if Action(kind, mb, c) not in seen:
                        raise ScheduleError(f"incomplete: rank {r} never runs {Action(kind, mb, c)} "
                                            f"(stage {schedule.stage(r, Action(kind, mb, c))}, micro-batch {mb})")


def seen_later(acts, action, after: int) -> str:
    for j in range(after + 1, len(acts)):
        if acts[j] == action:
            return f" (action {j})"
    return " (which is missing)"


def peak_in_flight(schedule: Schedule) -> list[int]:
    """For each global stage, the most micro-batches with F done and B not yet done at once."""
    peaks = [0] * schedule.num_stages
    for r, acts in enumerate(schedule.ranks):
        live = defaultdict(int)
        for a in acts:
            s = schedule.stage(r, a)
            live[s] += 1 if a.kind == "F" else -1
            peaks[s] = max(peaks[s], live[s])
    return peaks


def peak_in_flight_per_rank(schedule: Schedule) -> list[int]:
    """For each rank, the most micro-batch activations held at once over all its chunks."""
    peaks = []
    for acts in schedule.ranks:
        live = peak = 0
        for a in acts:
            live += 1 if a.kind == "F" else -1
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


# ---------------------------------------------------------------- replay
@dataclass
class Timeline:
    """A simulated step: spans like `par.timeline.Recorder.gather()` returns, plus the sums."""
    spans: list[dict]
    num_ranks: int
    peak_in_flight: list[int] = field(default_factory=list)

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


def simulate(schedule: Schedule, forward=1.0, backward=2.0, latency: float = 0.0) -> Timeline:
    """Replay the schedule with per-stage `forward`/`backward` costs (numbers or lists, one per stage).

    A message arrives `latency` after the action that sends it ends. Raises ScheduleError if
    the schedule is incomplete, out of order or deadlocks (see the module docstring).
    """
    check_complete(schedule)
    p, S = schedule.num_ranks, schedule.num_stages
    cost = {"F": _costs(forward, S, "forward"), "B": _costs(backward, S, "backward")}
    pos, clock = [0] * p, [0.0] * p
    sent = defaultdict(dict)          # (src, dst) -> {message: arrival time}
    spans = []
    while True:
        moved = False
        for r, acts in enumerate(schedule.ranks):
            while pos[r] < len(acts):
                a = acts[pos[r]]
                start = clock[r]
                need = message_in(schedule, r, a)
                if need is not None:
                    arrival = _take(sent, need, r)
                    if arrival is None:
                        break
                    start = max(start, arrival)
                s = schedule.stage(r, a)
                end = start + cost[a.kind][s]
                spans.append({"rank": r, "name": str(a), "lane": "compute", "start": start, "end": end,
                              "stage": s, "microbatch": a.microbatch})
                clock[r], pos[r], moved = end, pos[r] + 1, True
                out = message_out(schedule, r, a)
                if out is not None:
                    sent[(r, out[1])][out[0]] = end + latency
        if all(pos[r] == len(acts) for r, acts in enumerate(schedule.ranks)):
            return Timeline(spans, p, peak_in_flight(schedule))
        if not moved:
            raise ScheduleError("deadlock: " + "; ".join(_waiting(schedule, pos)))


def _take(sent, need, rank):
    """Arrival time of the message `need` = (message, src) on `rank`; None while it is not sent yet."""
    message, src = need
    return sent[(src, rank)].get(message)


def _waiting(schedule: Schedule, pos) -> list[str]:
    out = []
    for r, acts in enumerate(schedule.ranks):
        if pos[r] < len(acts):
            a = acts[pos[r]]
            message, src = message_in(schedule, r, a)
            out.append(f"rank {r} waits at action {pos[r]} ({a}) for {_describe(message)} (rank {src})")
    return out


def check(schedule: Schedule) -> Schedule:
    """Raise ScheduleError (one line: the rank, the action, the reason) unless the schedule can run."""
    simulate(schedule)
    return schedule


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


def stage_costs(spans: list[dict], schedule: Schedule) -> tuple[list[float], list[float]]:
    """Median duration of the F and of the B actions of every stage in a recorded timeline.

    Feed them to `simulate` to get the timeline the schedule would have with those costs and
    nothing else (no waiting for messages, no noise): simulated next to executed.
    """
    from par.schedules import parse_action
    sums = {"F": defaultdict(list), "B": defaultdict(list)}
    for x in spans:
        if x["lane"] == "compute":
            a = parse_action(x["name"])
            sums[a.kind][schedule.stage(x["rank"], a)].append(x["end"] - x["start"])
    def median(xs):  # robust to an action that was descheduled half-way
        return statistics.median(xs) if xs else 0.0
    return ([median(sums["F"][s]) for s in range(schedule.num_stages)],
            [median(sums["B"][s]) for s in range(schedule.num_stages)])
