"""The process grid of 3D parallelism: a world of dp × pp × tp ranks, and the groups each strategy needs.

Every rank has three coordinates: its data-parallel replica d, its pipeline stage s and its
tensor-parallel slot t. The layout follows DeepSpeed's topology (axes pipe, data, model) and
Megatron-LM: tensor parallel innermost, then data, pipeline outermost:

    rank = t + tp · (d + dp · s)          0 <= t < tp,  0 <= d < dp,  0 <= s < pp

Why this order: the tp ranks of one layer talk most (4 all-reduces of B·T·d per layer and
step), so they are consecutive ranks, i.e. GPUs of one node joined by NVLink when tp <= GPUs
per node. Data parallelism talks once per step (the gradients), pipeline stages only send one
activation per micro-batch to a neighbour: those groups can cross the slower network.

Groups (each is a list of global ranks; every rank belongs to exactly one group per axis):

    tp group   same (d, s), t = 0 .. tp-1   shards one layer's matrices        (par.tp.layers)
    pp group   same (d, t), s = 0 .. pp-1   the stages of one pipeline         (par.pp.pipeline)
    dp group   same (s, t), d = 0 .. dp-1   replicas of the same shard: average gradients (DP / ZeRO)

Example, dp = pp = tp = 2 on 8 ranks: tp groups [0,1] [2,3] [4,5] [6,7]; dp groups [0,2] [1,3]
[4,6] [5,7]; pp groups [0,4] [1,5] [2,6] [3,7].

The pure functions (`coords`, `rank_of`, `group_ranks`) need no process group; `Grid`
builds the torch.distributed groups once (every rank creates every group, in the same order,
as `dist.new_group` requires) and hands each strategy its own.

Run as a job, the module makes the groups from given rank lists and all-reduces over each (exercise 07, part 1):

    par.runtime.launch.run("par.runtime.grid", nproc=8, args=["--groups", json.dumps(groups)])

`groups` is {"tp": [[0, 1], [2, 3], ...], "pp": [...], "dp": [...]} (what `group_ranks` gives for each axis, or
lists someone wrote by hand). Every rank checks that each axis's lists split the world's ranks (every rank in
exactly one group; anything else is one `error:` line on every rank, before any group exists), creates every group of
every axis with `dist.new_group`, in the same order, and all-reduces (sum) over its group of each axis a vector
of world size holding rank + 1 at its own position and 0 elsewhere: afterwards position q holds q + 1 exactly
when rank q is in the group, i.e. the members the collective really joined, whatever the lists said. Rank 0
saves {"world_size", "backend", "per_rank": [{"rank", "tp", "pp", "dp"}]}, each axis {"members", "sum",
"index": dist.get_rank(group), "size": dist.get_world_size(group)}. The job runs par's code only; whoever
launches it judges the result (exercise 07's grader compares it with `group_ranks`).
"""
from __future__ import annotations

from dataclasses import dataclass

from par.runtime.job_args import arg, JobArgs

PRELOAD = ("torch",)    # what par.runtime.agent imports before it forks the ranks: no optimizer step, no dispatch
#                         mode here, so the ranks never import torch._dynamo

AXES = ("dp", "pp", "tp")


class GridError(ValueError):
    """A layout that does not fit the world: one line naming the numbers."""


def layout_label(dp: int, pp: int, tp: int) -> str:
    """'dp2xpp2xtp2': the one spelling of a layout, used by the config, the planner, the benchmark
    table and the notebooks' records (a plain 'x', so it can be typed and searched for)."""
    return f"dp{dp}xpp{pp}xtp{tp}"


@dataclass(frozen=True)
class Layout:
    dp: int
    pp: int
    tp: int

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def is_3d(self) -> bool:
        """True when all three degrees are > 1: only then is a run 3D parallel."""
        return min(self.dp, self.pp, self.tp) > 1

    def __str__(self) -> str:
        return layout_label(self.dp, self.pp, self.tp)


def check_layout(world_size: int, dp: int, pp: int, tp: int) -> Layout:
    """Raise `GridError` unless dp, pp, tp are positive integers with dp · pp · tp = world_size."""
    for name, v in (("dp", dp), ("pp", pp), ("tp", tp), ("world_size", world_size)):
        if int(v) != v or v < 1:
            raise GridError(f"{name} must be a positive integer, got {v!r}")
    if dp * pp * tp != world_size:
        hint = ""
        if world_size % (pp * tp) == 0:
            hint = f" (e.g. dp={world_size // (pp * tp)} with pp={pp}, tp={tp})"
        raise GridError(f"dp {dp} × pp {pp} × tp {tp} = {dp * pp * tp} but the world has {world_size} ranks: "
                        f"choose degrees whose product is {world_size}{hint}")
    return Layout(int(dp), int(pp), int(tp))


def rank_of(d: int, s: int, t: int, layout: Layout) -> int:
    """Global rank of replica d, stage s, tensor slot t: t + tp · (d + dp · s)."""
    return t + layout.tp * (d + layout.dp * s)


def coords(rank: int, layout: Layout) -> dict:
    """{'dp': d, 'pp': s, 'tp': t} of a global rank (the inverse of `rank_of`)."""
    if not 0 <= rank < layout.size:
        raise GridError(f"rank {rank} is outside a grid of {layout.size} ranks ({layout})")
    t, rest = rank % layout.tp, rank // layout.tp
    return {"dp": rest % layout.dp, "pp": rest // layout.dp, "tp": t}


def group_ranks(axis: str, layout: Layout) -> list[list[int]]:
    """Every group along `axis` ('dp', 'pp' or 'tp'): the ranks that differ only in that coordinate."""
    if axis not in AXES:
        raise GridError(f"unknown axis {axis!r}: use one of {', '.join(AXES)}")
    sizes = {"dp": layout.dp, "pp": layout.pp, "tp": layout.tp}
    others = [a for a in AXES if a != axis]
    groups = []
    for i in range(sizes[others[0]]):
        for j in range(sizes[others[1]]):
            fixed = {others[0]: i, others[1]: j}
            groups.append([rank_of(**_dst(fixed, axis, k), layout=layout) for k in range(sizes[axis])])
    return sorted(groups)


def _dst(fixed: dict, axis: str, k: int) -> dict:
    c = {**fixed, axis: k}
    return {"d": c["dp"], "s": c["pp"], "t": c["tp"]}


def my_group(axis: str, rank: int, layout: Layout) -> list[int]:
    """The ranks of `rank`'s group along `axis`."""
    return next(g for g in group_ranks(axis, layout) if rank in g)


def node_of(rank: int, gpus_per_node: int) -> int:
    return rank // gpus_per_node


def stride(axis: str, layout: Layout) -> int:
    """How far apart two neighbours of a group along `axis` are: the factor in front of the axis's coordinate
    in t + tp · (d + dp · s), i.e. 1 for tp, tp for dp, tp · dp for pp."""
    if axis not in AXES:
        raise GridError(f"unknown axis {axis!r}: use one of {', '.join(AXES)}")
    return {"tp": 1, "dp": layout.tp, "pp": layout.tp * layout.dp}[axis]


def groups_in_node(axis: str, layout: Layout, gpus_per_node: int) -> bool:
    """True when every group along `axis` lies inside one node (ranks numbered node by node). A group's ranks
    grow with its coordinate, so its first and last rank decide; the first ranks of the groups are the ranks
    whose coordinate along `axis` is 0. (From the strides alone: the planner's bandwidth model needs no group
    list, and the process-grid exercise's graded kernel has none: `par.course.grading.stubs`.)"""
    step, n = stride(axis, layout), getattr(layout, axis)
    firsts = (r for r in range(layout.size) if (r // step) % n == 0)
    return all(node_of(r, gpus_per_node) == node_of(r + step * (n - 1), gpus_per_node) for r in firsts)


def tp_stays_on_node(layout: Layout, gpus_per_node: int) -> bool:
    """True when every tp group lies inside one node (ranks numbered node by node)."""
    return groups_in_node("tp", layout, gpus_per_node)


def describe(layout: Layout) -> str:
    """A text table: one line per rank with its (d, s, t) coordinates and groups."""
    lines = [f"{layout}: rank = t + {layout.tp}·(d + {layout.dp}·s)",
             f"{'rank':>4} {'d':>3} {'s':>3} {'t':>3}   dp group      pp group      tp group"]
    for r in range(layout.size):
        c = coords(r, layout)
        groups = "".join(f"{str(my_group(a, r, layout)):<14}" for a in AXES)
        lines.append(f"{r:>4} {c['dp']:>3} {c['pp']:>3} {c['tp']:>3}   {groups}")
    return "\n".join(lines)


class Grid:
    """This process's place in a dp × pp × tp grid, and the process groups of its three axes.

        grid = Grid(dp=2, pp=2, tp=2)        # inside a job of 8 ranks (after par.runtime.dist.init())
        grid.tp_group, grid.pp_ranks, grid.dp_rank, grid.stage, ...

    Without a running process group (a plain single process) only the 1×1×1 grid exists and
    every group is None (which the strategies read as "just me").
    """

    def __init__(self, dp: int = 1, pp: int = 1, tp: int = 1):
        import torch.distributed as dist
        running = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if running else 1
        self.layout = check_layout(world, dp, pp, tp)
        self.dp, self.pp, self.tp = self.layout.dp, self.layout.pp, self.layout.tp
        self.rank = dist.get_rank() if running else 0
        c = coords(self.rank, self.layout)
        self.dp_rank, self.stage, self.tp_rank = c["dp"], c["pp"], c["tp"]
        self.groups, self.ranks = {}, {}
        for axis in AXES:
            for ranks in group_ranks(axis, self.layout):
                handle = dist.new_group(ranks) if running else None   # every rank creates every group
                if self.rank in ranks:
                    self.groups[axis], self.ranks[axis] = handle, ranks

    @property
    def dp_group(self):
        return self.groups["dp"]

    @property
    def pp_group(self):
        return self.groups["pp"]

    @property
    def tp_group(self):
        return self.groups["tp"]

    @property
    def dp_ranks(self) -> list[int]:
        return self.ranks["dp"]

    @property
    def pp_ranks(self) -> list[int]:
        return self.ranks["pp"]

    @property
    def tp_ranks(self) -> list[int]:
        return self.ranks["tp"]

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pp - 1

    def __repr__(self) -> str:
        return (f"Grid({self.layout}, rank {self.rank}: d={self.dp_rank} s={self.stage} t={self.tp_rank}, "
                f"dp {self.dp_ranks}, pp {self.pp_ranks}, tp {self.tp_ranks})")


# ---------------------------------------------------------------- the groups on real ranks (the job)
@dataclass(frozen=True)
class Args(JobArgs):
    groups: str = arg(help='JSON {"tp": [[ranks], ...], "pp": [...], "dp": [...]}: the groups of every axis')


def parse_groups(text: str, world_size: int) -> dict[str, list[list[int]]]:
    """The groups `text` gives, each axis's lists a partition of range(world_size); else one `GridError`."""
    import json
    try:
        groups = json.loads(text)
    except ValueError as e:
        raise GridError(f"--groups is not JSON: {e}") from None
    if not isinstance(groups, dict) or set(groups) != set(AXES):
        raise GridError(f"--groups must name exactly the axes {', '.join(AXES)}")
    for axis in AXES:
        lists = groups[axis]
        if not (isinstance(lists, list) and all(isinstance(g, list) and g and all(type(r) is int for r in g)
                                                for g in lists)):
            raise GridError(f"{axis}: a list of non-empty lists of ranks (ints) is needed")
        seen = [r for g in lists for r in g]
        if sorted(seen) != list(range(world_size)):
            twice = sorted({r for r in seen if seen.count(r) > 1})
            missing = sorted(set(range(world_size)) - set(seen))
            outside = sorted({r for r in seen if not 0 <= r < world_size})
            raise GridError(f"the {axis} groups {lists} do not split the {world_size} ranks into groups: "
                            + "; ".join(s for s in (f"listed twice {twice}" if twice else "",
                                                    f"missing {missing}" if missing else "",
                                                    f"outside the world {outside}" if outside else "") if s))
    return groups


def run_groups(groups: dict[str, list[list[int]]], rank: int, world_size: int) -> dict:
    """This rank's view of every axis: the groups made (all of them, by every rank), then one all-reduce each."""
    import torch
    import torch.distributed as dist
    mine = {}
    for axis in AXES:
        for ranks in groups[axis]:
            handle = dist.new_group(ranks)          # every rank creates every group, in the same order
            if rank in ranks:
                mine[axis] = handle
    out = {"rank": rank}
    for axis in AXES:
        group = mine[axis]
        value = torch.zeros(world_size, dtype=torch.int64)
        value[rank] = rank + 1
        dist.all_reduce(value, group=group)
        out[axis] = {"members": [q for q in range(world_size) if value[q].item() == q + 1],
                     "sum": value.tolist(), "index": dist.get_rank(group), "size": dist.get_world_size(group)}
    return out


def main(argv=None) -> None:
    """Bad --groups: one `error:` line on every rank, before any process group exists (torchrun's WORLD_SIZE)."""
    import os

    args = Args.parse(argv)
    try:
        groups = parse_groups(args.groups, int(os.environ.get("WORLD_SIZE", "1")))
    except GridError as e:
        raise SystemExit(f"error: {e}") from None
    import par.runtime.dist   # defers torch to the job: the layout helpers are read by torch-free tools
    env = par.runtime.dist.init()
    per_rank = par.runtime.dist.gather_object(run_groups(groups, env.rank, env.world_size))
    par.runtime.dist.save_result({"world_size": env.world_size, "backend": env.backend, "per_rank": per_rank})
    par.runtime.dist.teardown()


if __name__ == "__main__":
    main()
