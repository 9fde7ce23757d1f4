"""Lecture 07b, at scale: the planner for models no course server holds, and TP inside a node or across nodes.

It launches nothing through the batch: its planner cells are pure, and its measurement across nodes
(`par.train.placement.measure`) starts its own 2 hosts x 2 gloo ranks in network namespaces (root only, on the
CPU), which no GPU server's dry run has to check."""
from __future__ import annotations

from par.site.numbers import Key, at_least

NOTEBOOK = "07b_at_scale"
CELLS = ()


def launches(W, backend, preset, steps):
    return []


KEY_NUMBERS = [
    Key("best layout for 180B", "planner", "plan_180b_best"),
    Key("step time vs planner, TP inside / across nodes (rel. error)", "→ 0", "across_nodes_step_rel_error"),
    Key("measured step, TP across nodes / TP inside", "the link is the step: ≫ 1", "across_nodes_tp_across_over_in_node",
        target=at_least(2)),
]
