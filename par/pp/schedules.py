"""Pipeline schedules as data: for every rank, the ordered list of actions it runs.

An action is a forward `F` or a backward `B` of one micro-batch on one of the
rank's stages. The text form is what the lecture writes on the board:

    rank 0:  F0 F1 F2 F3 B0 B1 B2 B3        (GPipe, p = 2 stages, m = 4 micro-batches)
    rank 1:  F0 F1 F2 F3 B0 B1 B2 B3

With interleaving each rank holds v model chunks ("virtual stages"); chunk c of
rank r is global stage c*p + r, and the text names the chunk after an `@`:
`F3@1` is the forward of micro-batch 3 on this rank's chunk 1.

Generators (p ranks, m micro-batches; every m >= 1 works, also m < p):

* naive      micro-batches one after another, each through the whole model and
             back before the next starts: F0 B0 F1 B1 ... (classic model parallel)
* gpipe      all forwards, then all backwards: F0 .. F(m-1) B0 .. B(m-1)
* 1f1b       PipeDream-flush: stage s runs min(p-s-1, m) warm-up forwards, then
             alternates one forward, one backward, then drains the backwards
* interleaved  1F1B over v chunks per rank (Megatron-LM order), bubble / v

The same `Schedule` object gets its point-to-point plan from `par.pp.p2p_plan`, is checked
and simulated by `par.pp.sim` and executed by `par.pp.pipeline`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

KINDS = ("F", "B")


class ScheduleError(ValueError):
    """The schedule cannot run: incomplete, out of order, or deadlocked (one line: rank, action, reason)."""


_ACTION = re.compile(r"^([FB])(\d+)(?:@(\d+))?$")


@dataclass(frozen=True, order=True)
class Action:
    """Forward or backward (`kind`) of micro-batch `microbatch` on the rank's chunk `chunk`."""
    kind: str
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f"@{self.chunk}" if self.chunk else "")


def parse_action(word: str) -> Action:
    """'F3' -> Action('F', 3, 0); 'B2@1' -> Action('B', 2, 1)."""
    match = _ACTION.match(word.strip())
    if not match:
        raise ValueError(f"cannot read action {word!r}: write F<micro-batch> or B<micro-batch>, "
                         f"optionally @<chunk>, e.g. F3, B0, F2@1")
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

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def num_stages(self) -> int:
        """Global stages = ranks x chunks per rank."""
        return self.num_ranks * self.virtual

    def stage(self, rank: int, action: Action) -> int:
        """Global stage of `action` on `rank`: chunk c of rank r is stage c*p + r."""
        return action.chunk * self.num_ranks + rank

    def owner(self, stage: int) -> tuple[int, int]:
        """(rank, chunk) that holds global stage `stage`."""
        return stage % self.num_ranks, stage // self.num_ranks

    def text(self) -> str:
        return "\n".join(f"rank {r}: {format_actions(a)}" for r, a in enumerate(self.ranks))

    def __str__(self) -> str:
        return self.text()


def from_lists(lists, microbatches: int | None = None, virtual: int | None = None,
               name: str = "custom") -> Schedule:
    """A schedule from one action list per rank (strings like 'F0 F1 B0 B1' or lists of Actions).

    `microbatches` and `virtual` default to what the actions mention; pass them to let
    the checker notice a micro-batch (or chunk) that is missing everywhere.
    """
    ranks = tuple(tuple(parse_actions(a) if isinstance(a, str) else a) for a in lists)
    every = [a for acts in ranks for a in acts]
    m = microbatches if microbatches is not None else 1 + max((a.microbatch for a in every), default=0)
    v = virtual if virtual is not None else 1 + max((a.chunk for a in every), default=0)
    return Schedule(name, ranks, m, v)


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
    from par.comm.collectives import chunk_bounds     # the one uneven split (lecture 00's ring chunks)
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


GENERATORS = {"naive": naive, "gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved}


def make(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule called `name` for p ranks and m micro-batches (v chunks per rank for 'interleaved')."""
    key = name.lower().replace("-", "").replace("_", "")
    aliases = {"naive": "naive", "gpipe": "gpipe", "1f1b": "1f1b", "onefoneb": "1f1b",
               "pipedreamflush": "1f1b", "interleaved": "interleaved", "interleaved1f1b": "interleaved"}
    if key not in aliases:
        raise ValueError(f"unknown schedule {name!r}: use one of {', '.join(GENERATORS)}")
    if aliases[key] == "interleaved":
        return interleaved(p, m, v)
    if v != 1:
        raise ValueError(f"schedule {name!r} has one chunk per rank, got v={v}: use 'interleaved' for v > 1")
    return GENERATORS[aliases[key]](p, m)
