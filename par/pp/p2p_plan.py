"""Which sends and receives go together: the point-to-point plan of a pipeline schedule.

A schedule (`par.pp.schedules`) says which forward and backward every rank runs, and in which
order. Between two of its actions a rank sends what it computed (an activation to the next
stage, a gradient to the previous one) and receives what its next actions need. `build(schedule)`
decides, for every rank, which of those sends and receives are posted together as ONE group
(one `torch.distributed.batch_isend_irecv` call) and where each group sits between the actions.
The runtime (`par.pp.pipeline`) executes exactly this plan and the checker (`par.pp.sim`)
replays exactly this plan: one function, one plan.

NCCL's rule (gloo forgives more, so a plan that only works on gloo hangs on GPUs):

1. `batch_isend_irecv(group)` returns ONE Work for the whole group, and a received tensor holds
   its data only after that Work was waited.
2. A send completes only when the peer has posted the matching receive (NCCL buffers a small
   message, not a 12 MB activation); a receive only when the peer has posted the send.
3. Messages carry no tag: the k-th send from rank A to rank B meets B's k-th receive from A.
4. A rank's groups run one after another (one communication stream).

The runtime's discipline, which the checker replays: **one group in flight per rank**. A rank
posts a group and goes on computing; it waits for the group's Work before the first action that
reads a tensor the group receives, before it posts its next group, and at the end of the step.

How the groups are chosen. Replay the schedule with sends that never block, a forward costing 1
and a backward 2 (its halves I and W 1 each) (`earliest_times`): each action gets a start and an
end. Each message gets the time t at which its producer ends. On the sender and on the receiver
alike the message goes into the gap before the first action that starts at t or later, and
everything a rank has in one gap is one group: an activation going forward and a gradient coming
back travel together, as in Megatron-LM's `send_forward_recv_backward`. Both ranks order a pair's
messages by t, so rule 3 pairs every send with the right receive.

Why this never deadlocks. Label a group with the largest t in it. Before a group completes, its
peers must post their groups; a rank posts a group after its previous group completed and after
the actions before it, whose inputs came in groups that completed earlier still. Every action
before a gap starts before every t in that gap, so each of these waits points to a group with a
smaller label. Waits that always point to smaller labels cannot form a cycle: every group
completes, on every rank, whatever the real costs are. `par.pp.sim.check` proves it once
more, by replay, for each plan it is given.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from par.pp.schedules import Action, Schedule, ScheduleError

FORWARD_COST, BACKWARD_COST = 1.0, 2.0   # only used to order the messages
SENDS_UPSTREAM = ("B", "I")              # the actions that compute (and send) dL/d input: B whole, or its half I


# ---------------------------------------------------------------- messages
def message_in(schedule: Schedule, rank: int, a: Action):
    """(message, source rank) that action `a` must receive before it runs, or None.

    A message is (what, micro-batch, stage that produced it): the activation of micro-batch i out
    of stage s, or the gradient with respect to the input of stage s. B and I need (and make) the same
    gradient: I is the half of B that computes it; W, the weight half, needs nothing from another stage.
    """
    s, last = schedule.stage(rank, a), schedule.num_stages - 1
    if a.kind == "F" and s > 0:
        return ("activation", a.microbatch, s - 1), schedule.owner(s - 1)[0]
    if a.kind in SENDS_UPSTREAM and s < last:
        return ("gradient", a.microbatch, s + 1), schedule.owner(s + 1)[0]
    return None


def message_out(schedule: Schedule, rank: int, a: Action):
    """(message, destination rank) that action `a` sends when it is done, or None (always for W)."""
    s, last = schedule.stage(rank, a), schedule.num_stages - 1
    if a.kind == "F" and s < last:
        return ("activation", a.microbatch, s), schedule.owner(s + 1)[0]
    if a.kind in SENDS_UPSTREAM and s > 0:
        return ("gradient", a.microbatch, s), schedule.owner(s - 1)[0]
    return None


def describe(message) -> str:
    """('gradient', 0, 1) -> 'the gradient of micro-batch 0 from stage 1'."""
    what, mb, stage = message
    return f"the {what} of micro-batch {mb} from stage {stage}"


def short(message) -> str:
    """('activation', 3, 0) -> 'a3.0' (activation of micro-batch 3 out of stage 0); gradients 'g'."""
    what, mb, stage = message
    return f"{what[0]}{mb}.{stage}"


# ---------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Op:
    """One point-to-point operation: send `message` to, or receive it from, pipeline rank `peer`."""
    kind: str        # "send" or "recv"
    peer: int
    message: tuple

    def __str__(self) -> str:
        return f"{'send' if self.kind == 'send' else 'recv'} {short(self.message)} {'to' if self.kind == 'send' else 'from'} {self.peer}"


@dataclass(frozen=True)
class Group:
    """Operations posted together: one `batch_isend_irecv`, one Work to wait for."""
    ops: tuple[Op, ...]

    @property
    def sends(self) -> list[Op]:
        return [o for o in self.ops if o.kind == "send"]

    @property
    def recvs(self) -> list[Op]:
        return [o for o in self.ops if o.kind == "recv"]

    def __str__(self) -> str:
        return "[" + ", ".join(map(str, self.ops)) + "]"


@dataclass(frozen=True)
class Plan:
    """`ranks[r]`: rank r's actions (`Action`) and groups (`Group`) in the order it runs them."""
    schedule: Schedule
    ranks: tuple[tuple, ...]

    def groups(self, rank: int) -> list[Group]:
        return [x for x in self.ranks[rank] if isinstance(x, Group)]

    def text(self) -> str:
        return "\n".join(f"rank {r}: " + " ".join(map(str, items)) for r, items in enumerate(self.ranks))

    def __str__(self) -> str:
        return self.text()


def earliest_times(schedule: Schedule, forward=FORWARD_COST, backward=BACKWARD_COST) -> dict:
    """{(rank, index): (start, end)} of every action when sends never block and receives wait for the data.

    Raises ScheduleError when no order of messages can help: some rank waits for data that is
    only produced after that rank's own next actions (a deadlock in the schedule itself).
    """
    p = schedule.num_ranks
    pos, clock = [0] * p, [0.0] * p
    ready, times = {}, {}                     # message -> time it exists
    while True:
        moved = False
        for r, acts in enumerate(schedule.ranks):
            while pos[r] < len(acts):
                a, start = acts[pos[r]], clock[r]
                need = message_in(schedule, r, a)
                if need is not None:
                    if need[0] not in ready:
                        break
                    start = max(start, ready[need[0]])
                end = start + {"F": forward, "B": backward}.get(a.kind, backward / 2)
                times[(r, pos[r])] = (start, end)
                clock[r], pos[r], moved = end, pos[r] + 1, True
                out = message_out(schedule, r, a)
                if out is not None:
                    ready[out[0]] = end
        if all(pos[r] == len(acts) for r, acts in enumerate(schedule.ranks)):
            return times
        if not moved:
            raise ScheduleError("deadlock: " + "; ".join(_waiting(schedule, pos)))


def _waiting(schedule: Schedule, pos) -> list[str]:
    out = []
    for r, acts in enumerate(schedule.ranks):
        if pos[r] < len(acts):
            a = acts[pos[r]]
            message, src = message_in(schedule, r, a)
            out.append(f"rank {r} waits at action {pos[r]} ({a}) for {describe(message)} (rank {src})")
    return out


def build(schedule: Schedule) -> Plan:
    """Every rank's actions with its point-to-point groups between them (see the module docstring).

    Expects a complete schedule (`par.pp.sim.check_complete`); hand-offs between two chunks
    of the same rank stay on the rank and are not in the plan.
    """
    times = earliest_times(schedule)
    placed = defaultdict(list)                # rank -> [(t, op)]
    for r, acts in enumerate(schedule.ranks):
        for i, a in enumerate(acts):
            out = message_out(schedule, r, a)
            if out is not None and out[1] != r:
                t = times[(r, i)][1]
                placed[r].append((t, Op("send", out[1], out[0])))
                placed[out[1]].append((t, Op("recv", r, out[0])))
    ranks = []
    for r, acts in enumerate(schedule.ranks):
        ops = sorted(placed[r], key=lambda x: (x[0], x[1].kind, x[1].peer))
        items, k = [], 0
        for i, a in enumerate(acts):
            start, gap = times[(r, i)][0], []
            while k < len(ops) and ops[k][0] <= start:
                gap.append(ops[k][1])
                k += 1
            if gap:
                items.append(Group(tuple(gap)))
            items.append(a)
        if k < len(ops):
            items.append(Group(tuple(op for _, op in ops[k:])))
        ranks.append(tuple(items))
    return Plan(schedule, tuple(ranks))


def one_by_one(schedule: Schedule) -> Plan:
    """The plan one writes first, for contrast: each receive alone right before the action that reads
    it, each send alone right after the action that computed it.

    Fine where sends are buffered; under NCCL's rule 1F1B on 2 ranks deadlocks with it from m = 2
    on: rank 0 sends activation 1 while rank 1 sends gradient 0, and neither send can complete
    before the other rank posts its receive. `build` pairs them in one group instead.
    """
    ranks = []
    for r, acts in enumerate(schedule.ranks):
        items = []
        for a in acts:
            need = message_in(schedule, r, a)
            if need is not None and need[1] != r:
                items.append(Group((Op("recv", need[1], need[0]),)))
            items.append(a)
            out = message_out(schedule, r, a)
            if out is not None and out[1] != r:
                items.append(Group((Op("send", out[1], out[0]),)))
        ranks.append(tuple(items))
    return Plan(schedule, tuple(ranks))
