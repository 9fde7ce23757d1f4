"""Pipeline schedules as data: for every rank, the ordered list of actions it runs.

An action is a forward `F` or a backward `B` of one micro-batch on one of the
rank's stages. A backward can also run in two halves (the zero-bubble schedules at the end of
this file): `I`, the gradient with respect to the stage's input (the stage before waits for it),
and `W`, the gradient with respect to the stage's weights (nobody waits for it). B = I + W.
The text form is what the lecture writes on the board:

    rank 0:  F0 F1 F2 F3 B0 B1 B2 B3        (GPipe, p = 2 stages, m = 4 micro-batches)
    rank 1:  F0 F1 F2 F3 B0 B1 B2 B3

With interleaving each rank holds v model chunks ("virtual stages") and the text names
the chunk after an `@`: `F3@1` is the forward of micro-batch 3 on this rank's chunk 1.
Which global stage a chunk is, is the schedule's `placement`:

    "loop"  chunk c of rank r is stage c*p + r        (interleaved: 0 1 2 3 | 4 5 6 7 over ranks 0 1 2 3 | 0 1 2 3)
    "v"     even chunks go down, odd chunks come back  (ZB-V, DualPipeV: ranks 0 1 2 3 | 3 2 1 0):
            chunk c of rank r is stage c*p + r for even c, c*p + p-1-r for odd c; the last stage is on rank 0

Generators (p ranks, m micro-batches; every m >= 1 works, also m < p, but ZB-V needs m >= p and DualPipeV m >= 2p):

* naive      micro-batches one after another, each through the whole model and
             back before the next starts: F0 B0 F1 B1 ... (classic model parallel)
* gpipe      all forwards, then all backwards: F0 .. F(m-1) B0 .. B(m-1)
* 1f1b       PipeDream-flush: stage s runs min(p-s-1, m) warm-up forwards, then
             alternates one forward, one backward, then drains the backwards
* interleaved  1F1B over v chunks per rank (Megatron-LM order), bubble / v
* zb_h1, zb_v, dualpipe_v   zero-bubble schedules: every backward split into I and W, W filling
             the bubble (the section "zero-bubble generators" below)

The same `Schedule` object gets its point-to-point plan from `par.pp.p2p_plan`, is checked
and simulated by `par.pp.sim` and executed by `par.pp.pipeline`.
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

KINDS = ("F", "B", "I", "W")     # forward, whole backward, input-gradient half, weight-gradient half
PLACEMENTS = ("loop", "v")


class ScheduleError(ValueError):
    """The schedule cannot run: incomplete, out of order, or deadlocked (one line: rank, action, reason)."""


_ACTION = re.compile(r"^([FBIW])(\d+)(?:@(\d+))?$")


@dataclass(frozen=True, order=True)
class Action:
    """`kind` F (forward), B (backward), I (input gradient) or W (weight gradient) of micro-batch
    `microbatch` on the rank's chunk `chunk`."""
    kind: str
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f"@{self.chunk}" if self.chunk else "")


def parse_action(word: str) -> Action:
    """'F3' -> Action('F', 3, 0); 'B2@1' -> Action('B', 2, 1); 'I3', 'W3@1' likewise."""
    match = _ACTION.match(word.strip())
    if not match:
        raise ValueError(f"cannot read action {word!r}: write F, B, I or W then the micro-batch, "
                         f"optionally @<chunk>, e.g. F3, B0, F2@1, I3, W3@1")
    kind, mb, chunk = match.groups()
    return Action(kind, int(mb), int(chunk or 0))


def parse_actions(text: str) -> list[Action]:
    """'F0 F1 B0 B1' -> [Action('F', 0), Action('F', 1), Action('B', 0), Action('B', 1)]."""
    return [parse_action(w) for w in text.replace(",", " ").split()]


def format_actions(actions) -> str:
    """The inverse of `parse_actions`."""
    return " ".join(map(str, actions))


@dataclass(frozen=True)
class Schedule:
    """What every rank runs in one training step: `ranks[r]` is rank r's action list."""
    name: str
    ranks: tuple[tuple[Action, ...], ...]
    microbatches: int
    virtual: int = 1  # chunks (virtual stages) per rank
    placement: str = "loop"  # which stage a chunk is: "loop" or "v" (module docstring)

    def __post_init__(self):
        if self.placement not in PLACEMENTS:
            raise ValueError(f"unknown placement {self.placement!r}: use one of {', '.join(PLACEMENTS)}")

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def num_stages(self) -> int:
        """Global stages = ranks x chunks per rank."""
        return self.num_ranks * self.virtual

    def stage_of(self, rank: int, chunk: int) -> int:
        """Global stage of `rank`'s chunk `chunk`: c*p + r ("loop"; "v": c*p + p-1-r for odd c)."""
        p = self.num_ranks
        return chunk * p + (p - 1 - rank if self.placement == "v" and chunk % 2 else rank)

    def stage(self, rank: int, action: Action) -> int:
        """Global stage of `action` on `rank`."""
        return self.stage_of(rank, action.chunk)

    def owner(self, stage: int) -> tuple[int, int]:
        """(rank, chunk) that holds global stage `stage` (the inverse of `stage_of`)."""
        chunk, i = divmod(stage, self.num_ranks)
        return (self.num_ranks - 1 - i if self.placement == "v" and chunk % 2 else i), chunk

    def text(self) -> str:
        return "\n".join(f"rank {r}: {format_actions(a)}" for r, a in enumerate(self.ranks))

    def __str__(self) -> str:
        return self.text()


def from_lists(lists, microbatches: int | None = None, virtual: int | None = None,
               name: str = "custom", placement: str = "loop") -> Schedule:
    """A schedule from one action list per rank (strings like 'F0 F1 B0 B1' or lists of Actions).

    `microbatches` and `virtual` default to what the actions mention; pass them to let
    the checker notice a micro-batch (or chunk) that is missing everywhere.
    """
    ranks = tuple(tuple(parse_actions(a) if isinstance(a, str) else a) for a in lists)
    every = [a for acts in ranks for a in acts]
    m = microbatches if microbatches is not None else 1 + max((a.microbatch for a in every), default=0)
    v = virtual if virtual is not None else 1 + max((a.chunk for a in every), default=0)
    return Schedule(name, ranks, m, v, placement)


def _check_sizes(p: int, m: int, v: int = 1) -> None:
    for label, value in (("ranks (stages) p", p), ("micro-batches m", m), ("chunks per rank v", v)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be a positive integer, got {value!r}")


# ---------------------------------------------------------------- generators
def naive(p: int, m: int = 1) -> Schedule:
    """Classic model parallel: each micro-batch goes all the way forward and back before the next.

    Every rank: F0 B0 F1 B1 ... Only one rank computes at any time: bubble (p-1)/p, whatever m.
    """
    _check_sizes(p, m)
    acts = tuple(a for i in range(m) for a in (Action("F", i), Action("B", i)))
    return Schedule("naive", (acts,) * p, m)


def gpipe(p: int, m: int) -> Schedule:
    """GPipe: F0 F1 .. F(m-1) then B0 B1 .. B(m-1) on every rank; m micro-batches in flight."""
    _check_sizes(p, m)
    acts = tuple([Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)])
    return Schedule("gpipe", (acts,) * p, m)


def one_f_one_b_actions(rank: int, p: int, m: int) -> list[Action]:
    """1F1B on stage `rank` of p: warm-up w = min(p-rank-1, m) forwards, m-w pairs (F, B), w backwards.

    At most w+1 = min(p-rank, m) micro-batches are ever in flight on this stage.
    """
    warmup = min(p - rank - 1, m)
    acts = [Action("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        acts += [Action("F", warmup + i), Action("B", i)]
    acts += [Action("B", i) for i in range(m - warmup, m)]
    return acts


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-flush): the same bubble as GPipe, but at most p-s micro-batches in flight on stage s."""
    _check_sizes(p, m)
    return Schedule("1f1b", tuple(tuple(one_f_one_b_actions(r, p, m)) for r in range(p)), m)


def microbatch_groups(p: int, m: int) -> list[range]:
    """Micro-batches in consecutive groups of at least p (all of them if m < p), larger groups first.

    m = 7, p = 2 -> [0, 1, 2], [3, 4], [5, 6]. A group smaller than p would come back to rank 0
    for its next chunk before the last rank had finished with it.
    """
    from par.comm.collectives import chunk_bounds   # one uneven split; defers torch: schedules are data
    return [range(a, b) for a, b in chunk_bounds(m, max(1, m // p))]


def interleaved_order(p: int, m: int, v: int, backward: bool = False) -> list[tuple[int, int]]:
    """(micro-batch, chunk) in the order every rank runs them (Megatron-LM interleaving).

    Each group of micro-batches passes through chunk 0, then chunk 1, ... (backwards:
    chunk v-1 first) before the next group starts.
    """
    order = []
    for group in microbatch_groups(p, m):
        chunks = range(v - 1, -1, -1) if backward else range(v)
        order += [(mb, c) for c in chunks for mb in group]
    return order


def interleaved_actions(rank: int, p: int, m: int, v: int) -> list[Action]:
    """Interleaved 1F1B on `rank`: warm-up forwards, then one forward / one backward, then the drain.

    Warm-up = 2(p-rank-1) + (v-1)·g forwards, g the size of the first micro-batch group,
    capped at the m·v forwards the rank has to run.
    """
    fwd, bwd = interleaved_order(p, m, v), interleaved_order(p, m, v, backward=True)
    total = m * v
    warmup = min(total, 2 * (p - rank - 1) + (v - 1) * len(microbatch_groups(p, m)[0]))
    acts = [Action("F", mb, c) for mb, c in fwd[:warmup]]
    for i in range(total - warmup):
        acts += [Action("F", *fwd[warmup + i]), Action("B", *bwd[i])]
    acts += [Action("B", *x) for x in bwd[total - warmup:]]
    return acts


def interleaved(p: int, m: int, v: int = 2) -> Schedule:
    """Interleaved 1F1B with v chunks per rank: the bubble shrinks to (p-1)/(v·m) of the ideal time."""
    _check_sizes(p, m, v)
    if v == 1:
        return one_f_one_b(p, m)
    return Schedule("interleaved", tuple(tuple(interleaved_actions(r, p, m, v)) for r in range(p)), m, v)


# ---------------------------------------------------------------- zero-bubble generators
# Zero-bubble pipeline schedules: split every backward into I and W, and fill the bubble with W.
#
# A stage's backward does two jobs. I, the gradient with respect to the stage's input, dL/dx, is what
# the stage before waits for: it is on the critical path. W, the gradient with respect to the stage's
# weights, dL/dθ, is needed only by the optimizer at the end of the step: nobody waits for it. So W can
# wait, and a schedule can run it where 1F1B would idle (Qi et al., "Zero Bubble Pipeline Parallelism",
# 2023). The runtime (`par.pp.pipeline`) runs I and W as two actions; here they are only data:
#
# * zb_h1       1F1B with the backward split (p ranks, one stage each). Rank r postpones its first r
#               W's to the end of the step, where 1F1B's rank r idles: bubble (p-1)(F+I-W) per rank
#               instead of (p-1)(F+I+W), a third with F = I = W (`par.pp.sim.zb_h1_bubble_formula`).
#               In flight: at most p micro-batches on every rank (1F1B: p-r on rank r).
# * zb_v        two chunks per rank placed in a V (rank r holds stages r and 2p-1-r, the last stage
#               back on rank 0): the down leg, the turn on rank p-1, the up leg. With F = I = W only
#               the V's start idles: bubble (p-1)/(6m+p-1) (`par.pp.sim.zb_v_bubble_formula`), at
#               most 2p micro-batch-chunks in flight (the paper's ZB-V).
# * dualpipe_v  DeepSeek's DualPipeV (DeepSeek-V3 report, 2024): the same V, steady state
#               "F on one chunk with B on the other" (the pairs DeepSeek overlaps, compute beside
#               communication, are two consecutive actions here, the B first), I/W only in the
#               warm-up and drain.
#
# Rank lists follow torch's `ScheduleInterleavedZeroBubble` (with one stage per rank: ZB-H1),
# `ScheduleZBVZeroBubble` and `ScheduleDualPipeV` action for action (tests/test_zero_bubble.py
# compares them); par checks them under NCCL's rule, simulates, executes and plots them like any
# other schedule.


def zb_h1_actions(rank: int, p: int, m: int) -> list[Action]:
    """ZB-H1 on stage `rank` of p: 1F1B's warm-up w = min(p-rank-1, m) forwards, then for i = 0..m-1:
    the next forward (while any is left), I(i), and W(i - rank) once i >= rank; the rank's last
    `rank` W's fill the end of the step."""
    warmup = min(p - rank - 1, m)
    acts = [Action("F", i) for i in range(warmup)]
    for i in range(m):
        if warmup + i < m:
            acts.append(Action("F", warmup + i))
        acts.append(Action("I", i))
        if i >= rank:
            acts.append(Action("W", i - rank))
    return acts + [Action("W", i) for i in range(max(0, m - rank), m)]


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1: 1F1B's order with every backward split into I then W, rank r's first r W's postponed."""
    _check_sizes(p, m)
    return Schedule("zb_h1", tuple(tuple(zb_h1_actions(r, p, m)) for r in range(p)), m)


class _Counter:
    """Appends actions with the next micro-batch of each (kind, chunk): I and B share one count (the
    backward's), W has its own; `pending` holds the W's owed by the I's so far, oldest first.
    ZB-V takes its W's by chunk (`w`), DualPipeV the oldest owed on any chunk (`w_pending`)."""

    def __init__(self):
        self.acts, self.next, self.pending = [], defaultdict(int), []

    def add(self, kind: str, chunk: int) -> None:
        key = ("B" if kind in "BI" else kind, chunk)
        mb = self.next[key]
        self.next[key] += 1
        self.acts.append(Action(kind, mb, chunk))
        if kind == "I":
            self.pending.append(Action("W", mb, chunk))

    def w(self, chunk: int) -> None:
        """The weight half of this chunk's oldest micro-batch whose W has not run (by W's own count)."""
        self.add("W", chunk)

    def w_pending(self) -> None:
        """The oldest W owed on any chunk, if one is owed."""
        if self.pending:
            self.acts.append(self.pending.pop(0))


def zb_v_actions(rank: int, p: int, m: int) -> list[Action]:
    """ZB-V on `rank` (chunk 0 = stage r going down, chunk 1 = stage 2p-1-r coming back up):

    warm-up  2(p-r)-1 forwards on chunk 0; r times F@1 F@0; p-r times F@1 I@1 W@1 (the turn)
    steady   F@0 (while any is left) I@0 W@0 F@1 I@1 W@1, until chunk 1 caught up with chunk 0
    drain    r times I@0 I@1, p-r times I@0 W@0, then the W's still owed (chunk 1, then chunk 0)

    The V needs 2p-1 micro-batches to fill; with fewer the same order is built for 2p-1 and the
    missing ones' actions are left out (what torch does).
    """
    n, c = max(2 * p - 1, m), _Counter()
    for _ in range(2 * (p - rank) - 1):
        c.add("F", 0)
    for _ in range(rank):
        c.add("F", 1), c.add("F", 0)
    for _ in range(p - rank):
        c.add("F", 1), c.add("I", 1), c.w(1)
    while c.next["F", 1] < c.next["F", 0] or c.next["F", 0] < n:
        if c.next["F", 0] < n:
            c.add("F", 0)
        c.add("I", 0), c.w(0), c.add("F", 1), c.add("I", 1), c.w(1)
    for _ in range(rank):
        c.add("I", 0), c.add("I", 1)
    for _ in range(p - rank):
        c.add("I", 0), c.w(0)
    for chunk in (1, 0):
        while c.next["W", chunk] < c.next["B", chunk]:
            c.w(chunk)
    return [a for a in c.acts if a.microbatch < m]


def zb_v(p: int, m: int) -> Schedule:
    """ZB-V: two chunks per rank in a V, every backward split, W filling the bubbles (m >= p)."""
    _check_sizes(p, m)
    if m < p:
        raise ScheduleError(f"ZB-V needs at least as many micro-batches as ranks, got m={m} < p={p}: use m >= {p}")
    return Schedule("zb_v", tuple(tuple(zb_v_actions(r, p, m)) for r in range(p)), m, 2, "v")


def dualpipe_v_actions(rank: int, p: int, m: int) -> list[Action]:
    """DualPipeV on `rank` (chunk 0 = stage r, chunk 1 = stage 2p-1-r), DeepSeek's eight steps:

    1  2(p-r-1) times F@0                       5  p-r-1 times B@1, (F@1 with B@0)
    2  r+1 times F@0 F@1                        6  r+1 times a backward on chunk 1 then on chunk 0, whole
    3  p-r-1 times I@1, a W owed, F@1              (B) for the first half, split (I) for the second
    4  m-2p+r+1 times (F@0 with B@1),           7  p-r-1 times a W owed, a backward on chunk 0
       (F@1 with B@0)                           8  r+1 times a W owed

    "F with B" is the pair DeepSeek overlaps (one micro-batch's forward computing while the other's
    backward communicates; torch: one OVERLAP_F_B action, F listed first). par's runtime runs one action
    at a time, so the pair becomes two actions, and the backward goes first: its gradient is what the
    rank below waits for. Forward first, the waits add up under NCCL's rule (par keeps one group of
    sends and receives in flight): with F = I = W = 1 per chunk, p = 4, m = 32 the step takes 247
    instead of 195 (ideal 192). The one pair DeepSeek does not overlap (step 4's first on the last rank)
    stays as written, F then B.
    """
    c = _Counter()
    for _ in range(2 * (p - rank - 1)):
        c.add("F", 0)
    for _ in range(rank + 1):
        c.add("F", 0), c.add("F", 1)
    for _ in range(p - rank - 1):
        c.add("I", 1), c.w_pending(), c.add("F", 1)
    for i in range(m - 2 * p + rank + 1):
        if i == 0 and rank == p - 1:
            c.add("F", 0), c.add("B", 1)
        else:
            c.add("B", 1), c.add("F", 0)
        c.add("B", 0), c.add("F", 1)
    for _ in range(p - rank - 1):
        c.add("B", 1), c.add("B", 0), c.add("F", 1)
    split = False
    for i in range(rank + 1):
        split |= i == (rank + 1) // 2 and rank % 2 == 1
        c.add("I" if split else "B", 1)
        split |= i == (rank + 1) // 2 and rank % 2 == 0
        c.add("I" if split else "B", 0)
    for _ in range(p - rank - 1):
        c.w_pending(), c.add("I" if split else "B", 0)
    for _ in range(rank + 1):
        c.w_pending()
    return c.acts


def dualpipe_v(p: int, m: int) -> Schedule:
    """DualPipeV: DeepSeek's V schedule, two chunks per rank, m >= 2p micro-batches."""
    _check_sizes(p, m)
    if m < 2 * p:
        raise ScheduleError(f"DualPipeV needs at least 2p = {2 * p} micro-batches (its V fills with 2p), "
                            f"got m={m}: use m >= {2 * p}")
    return Schedule("dualpipe_v", tuple(tuple(dualpipe_v_actions(r, p, m)) for r in range(p)), m, 2, "v")


GENERATORS = {"naive": naive, "gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved,
              "zb_h1": zb_h1, "zb_v": zb_v, "dualpipe_v": dualpipe_v}
ZERO_BUBBLE = ("zb_h1", "zb_v", "dualpipe_v")
V_SCHEDULES = ("zb_v", "dualpipe_v")   # two chunks per rank in a V


def make(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule called `name` for p ranks and m micro-batches (v chunks per rank for 'interleaved';
    'zb_v' and 'dualpipe_v' have their 2 chunks)."""
    key = name.lower().replace("-", "").replace("_", "")
    aliases = {"naive": "naive", "gpipe": "gpipe", "1f1b": "1f1b", "onefoneb": "1f1b",
               "pipedreamflush": "1f1b", "interleaved": "interleaved", "interleaved1f1b": "interleaved",
               "zbh1": "zb_h1", "zbv": "zb_v", "dualpipev": "dualpipe_v"}
    if key not in aliases:
        raise ValueError(f"unknown schedule {name!r}: use one of {', '.join(GENERATORS)}")
    if aliases[key] == "interleaved":
        return interleaved(p, m, v)
    if aliases[key] in ZERO_BUBBLE:
        if v not in (1, 2) or (v == 2 and aliases[key] not in V_SCHEDULES):
            raise ValueError(f"schedule {name!r} fixes its chunks per rank (zb_h1 1, zb_v and dualpipe_v 2), "
                             f"got v={v}: leave v out")
        return GENERATORS[aliases[key]](p, m)
    if v != 1:
        raise ValueError(f"schedule {name!r} has one chunk per rank, got v={v}: use 'interleaved' for v > 1")
    return GENERATORS[aliases[key]](p, m)
