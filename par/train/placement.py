"""Which parallel axis crosses the node boundary: TP inside the node and DP across, or the reverse.

N nodes of K ranks, tensor parallelism of degree K and data parallelism of degree N. torchrun
numbers ranks node by node, so the groups can be placed two ways:

    tp-in-node   tp groups = the K ranks of one node            dp groups = one rank of every node
    tp-across    tp groups = one rank of every node (K = N)     dp groups = the ranks of one node

The planner (`par.train.planner.predict`) gives the bytes each rank sends per step on each axis,

    tp   4·L·m · 2(t-1)/t · b·s·d·e       (activations: 4 all-reduces per layer and micro-batch)
    dp   2(n-1)/n · e·Ψ_dev               (gradients, once per step)

and the step time = compute + Σ_axis bytes_axis / bandwidth_axis, where an axis whose groups
cross nodes gets the network's bandwidth per rank (a node's link shared by its K ranks:
link/K) and one inside a node the node's own. The bytes a node's link carries per step and
direction are K · bytes of the axis that crosses.
"""
from __future__ import annotations

from dataclasses import replace

from par.measure import parse, typed
from par.model import GPTConfig
from par.runtime.cluster import Cluster, parse_rate, PREFIX
from par.train import planner

PLACEMENTS = ("tp-in-node", "tp-across")


def groups_of(world: int, per_node: int) -> dict:
    """{'node': the ranks of each node, 'across': the ranks with the same local rank on every node}."""
    nodes = world // per_node
    return {"node": [list(range(n * per_node, (n + 1) * per_node)) for n in range(nodes)],
            "across": [list(range(k, world, per_node)) for k in range(per_node)]}


def axis_groups(placement: str) -> dict:
    """{'tp': kind, 'dp': kind} of groups ('node' or 'across') for a placement."""
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}: use one of {', '.join(PLACEMENTS)}")
    return {"tp": "node", "dp": "across"} if placement == "tp-in-node" else {"tp": "across", "dp": "node"}


def crossing(placement: str) -> str:
    """The axis whose groups cross the nodes."""
    return next(axis for axis, kind in axis_groups(placement).items() if kind == "across")


def emulated_hardware(link_bits: float, per_node: int, flops: float, bw_node: float) -> planner.Hardware:
    """A planner Hardware for nodes of `per_node` ranks joined by a link of `link_bits` bit/s per direction
    (each rank gets link/K of it), ranks computing `flops` FLOP/s, talking inside a node at `bw_node` B/s."""
    return planner.Hardware("emulated hosts", memory=1e12, flops=flops, gpus_per_node=per_node,
                            bw_node=bw_node, bw_network=link_bits / 8 / per_node, bw_host=bw_node)


def predict(w: planner.Workload, nodes: int, per_node: int, placement: str, hw: planner.Hardware) -> dict:
    """{'step_s', 'compute_s', 'tp_s', 'dp_s', 'link_bytes', 'tp_bytes', 'dp_bytes'} of one placement."""
    plan = planner.predict(w, dp=nodes, pp=1, tp=per_node, hw=replace(hw, gpus_per_node=per_node))
    if not plan.valid:
        raise ValueError(f"the planner cannot run dp{nodes}xtp{per_node}: {plan.reason}")
    across = crossing(placement)
    bw = {axis: hw.bw_network if axis == across else hw.bw_node for axis in ("tp", "dp")}
    t = {axis: plan.bytes[axis] / bw[axis] for axis in ("tp", "dp")}
    compute = plan.time["compute"]
    return {"step_s": compute + t["tp"] + t["dp"], "compute_s": compute, "tp_s": t["tp"], "dp_s": t["dp"],
            "link_bytes": per_node * plan.bytes[across], "tp_bytes": plan.bytes["tp"],
            "dp_bytes": plan.bytes["dp"]}


def node_bandwidth(tp_bytes: float, node_step_s: float, compute_s: float, back_to_back_bytes_s: float) -> float:
    """The in-node bandwidth a TP step really gets: tp_bytes / (node_step_s - compute_s), the bytes its
    all-reduces send over the time the step takes beyond the same work done dense. It pays for the waits
    at every all-reduce too, so it never exceeds what all-reduces get back to back (`back_to_back_bytes_s`),
    which is also the answer when the TP step is not measurably slower than the dense one."""
    extra = node_step_s - compute_s
    return min(tp_bytes / extra, back_to_back_bytes_s) if extra > 0 else back_to_back_bytes_s


# ---------------------------------------------------------------- the lesson's run and its comparison
JOB_DEFAULTS = {"d_model": 16, "n_head": 2, "n_layer": 2, "seq": 64, "batch": 128}
# what `par.train.placement_job` calibrated on a 2-core machine (4 ranks, all busy; medians of 8 runs): shown where
# no cluster can be built. node_bytes_s is the in-node bandwidth a TP step gets, allreduce_bytes_s the one
# all-reduces get back to back (see `par.train.placement_job.calibrate`).
RECORDED_CALIBRATION = {"compute_s": 0.046, "node_step_s": 0.099, "node_bytes_s": 38.8e6, "allreduce_bytes_s": 71.2e6}


def workload(sizes: dict | None = None) -> planner.Workload:
    """The planner's Workload of the lesson's job (fp32, Adam), for `sizes` over JOB_DEFAULTS."""
    s = {**JOB_DEFAULTS, **(sizes or {})}
    cfg = GPTConfig(vocab_size=65, block_size=s["seq"], n_layer=s["n_layer"], n_head=s["n_head"], d_model=s["d_model"])
    return planner.Workload(cfg, s["batch"], precision="fp32", optimizer="adam")


def predictions(link: str, calibration: dict, nodes: int = 2, per_node: int = 2, sizes: dict | None = None) -> dict:
    """{placement: `predict(...)`} with the planner fed this machine's measured compute and in-node bandwidth:
    FLOP/s = (step FLOPs / N) / compute_s, bw_node = node_bytes_s (the bandwidth a TP step inside a node
    really gets, waits included), the link's bandwidth from `link`."""
    w = workload(sizes)
    flops = planner.step_flops(w) / (nodes * per_node) / calibration["compute_s"]
    hw = emulated_hardware(parse_rate(link), per_node, flops, calibration["node_bytes_s"])
    return typed({p: predict(w, nodes, per_node, p, hw) for p in PLACEMENTS})


def measure(link: str = "25mbit", hosts: int = 2, per_node: int = 2, steps: int = 3, timeout: float = 240.0,
            quiet: bool = True, prefix: str | None = None, **sizes) -> dict:
    """Run `par.train.placement_job` on an emulated cluster (`par.runtime.cluster`, root only; its namespaces named
    `prefix`-...) whose links are capped at `link`; return its result (`par.train.placement_job.Result`)
    with the bytes each host's link carried (`links`)."""
    args = [f"--steps={steps}"] + [f"--{k.replace('_', '-')}={v}" for k, v in {**JOB_DEFAULTS, **sizes}.items()]
    with Cluster(hosts, rate=link, prefix=prefix or PREFIX) as cluster:
        result = cluster.run("par.train.placement_job", args, nproc_per_node=per_node, timeout=timeout, quiet=quiet)
    return parse({**result, "link": link, "steps": steps, "sizes": {**JOB_DEFAULTS, **sizes}}, "par.train.placement_job")


def compare(result) -> list:
    """Per placement, typed (`row.step_s`, `row.predicted.step_s`): measured step time (median) and link bytes
    per host and step, beside the planner's; `result` is what `measure` returns (`par.train.placement_job.Result`)."""
    per_node = result.ranks_per_node
    pred = predictions(result.link, result.calibration.to_json(), result.world_size // per_node, per_node,
                       result.sizes.to_json())
    rows = []
    for run in result.runs:
        p = run.placement
        begin, end = result.links[f"{p} begin"], result.links[f"{p} end"]
        rows.append({"placement": p, "crossing": crossing(p),
                     "step_s": sorted(run.step_s)[len(run.step_s) // 2],
                     "link_bytes": max(end[h] - begin[h] for h in end) / len(run.step_s),
                     "predicted": pred[p],
                     "counted": {"tp_bytes": run.rank(0).tp_bytes, "dp_bytes": run.rank(0).dp_bytes}})
    return typed(rows)
