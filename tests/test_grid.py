"""The process grid: rank layout, groups, errors (pure, no process group); its groups made and all-reduced over
on real gloo ranks (`python -m par.runtime.grid`, what exercise 07's part 1 runs)."""
import itertools
import json
import re

import pytest
from tiers import slow, tiered

from par.runtime import launch
from par.runtime.grid import AXES, GridError, Layout, check_layout, coords, describe, group_ranks, groups_in_node, \
    my_group, node_of, parse_groups, rank_of, stride, tp_stays_on_node


def test_layout_2x2x2_groups_match_the_docstring():
    lay = check_layout(8, 2, 2, 2)
    assert group_ranks("tp", lay) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert group_ranks("dp", lay) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert group_ranks("pp", lay) == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("dp,pp,tp", [(1, 1, 1), (3, 2, 2), (2, 3, 1), (1, 4, 2), (5, 1, 3), (2, 2, 4)])
def test_groups_partition_the_world_and_coords_invert_rank_of(dp, pp, tp):
    lay = Layout(dp, pp, tp)
    for axis, size in (("dp", dp), ("pp", pp), ("tp", tp)):
        groups = group_ranks(axis, lay)
        assert len(groups) == lay.size // size and all(len(g) == size for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(lay.size))
    for r in range(lay.size):
        c = coords(r, lay)
        assert rank_of(c["dp"], c["pp"], c["tp"], lay) == r
        # the groups of one rank meet only in that rank
        assert set(my_group("dp", r, lay)) & set(my_group("pp", r, lay)) & set(my_group("tp", r, lay)) == {r}
        # a tp group is consecutive ranks (TP innermost)
        tpg = my_group("tp", r, lay)
        assert tpg == list(range(tpg[0], tpg[0] + tp))


def test_tp_stays_on_a_node():
    assert tp_stays_on_node(Layout(4, 2, 8), gpus_per_node=8)
    assert not tp_stays_on_node(Layout(1, 1, 16), gpus_per_node=8)


def test_groups_in_node_from_the_strides_equals_looking_at_every_group():
    """The planner's test (no group lists) agrees with the groups themselves, for every small layout and node size."""
    for dp, pp, tp in itertools.product(range(1, 6), repeat=3):
        lay = Layout(dp, pp, tp)
        for axis in AXES:
            groups = group_ranks(axis, lay)
            assert all(b - a == stride(axis, lay) for g in groups for a, b in zip(g, g[1:]))
            for gpus in (1, 2, 3, 4, 8):
                assert groups_in_node(axis, lay, gpus) == \
                    all(len({node_of(r, gpus) for r in g}) == 1 for g in groups), (lay, axis, gpus)
    with pytest.raises(GridError, match="unknown axis"):
        stride("cp", Layout(1, 1, 1))


def test_group_lists_must_split_the_world_before_any_group_is_made():
    good = {a: group_ranks(a, Layout(2, 1, 2)) for a in AXES}
    assert parse_groups(json.dumps(good), 4) == good
    for groups, match in (({**good, "tp": [[0, 1], [1, 2], [3]]}, r"the tp groups .* listed twice \[1\]$"),
                          ({**good, "dp": [[0, 2], [1, 4]]}, r"missing \[3\]; outside the world \[4\]"),
                          ({"tp": good["tp"], "pp": good["pp"]}, "exactly the axes"),
                          ({**good, "pp": [[0], [1], [2], ["3"]]}, "lists of ranks")):
        with pytest.raises(GridError, match=match):
            parse_groups(json.dumps(groups), 4)


@pytest.mark.parametrize("nproc, dp, pp, tp", tiered([(2, 1, 1, 2), (4, 2, 1, 2), (8, 2, 2, 2)],
                                                     id=lambda c: "x".join(map(str, c[1:]))))
def test_grid_groups_on_real_ranks_all_reduce_over_exactly_their_members(nproc, dp, pp, tp):
    lay = check_layout(nproc, dp, pp, tp)
    groups = {a: group_ranks(a, lay) for a in AXES}
    result = launch.run("par.runtime.grid", nproc=nproc, args=["--groups", json.dumps(groups)], backend="gloo",
                        timeout=120, quiet=True)
    assert [r["rank"] for r in result["per_rank"]] == list(range(nproc))
    for r, got in enumerate(result["per_rank"]):
        for axis in AXES:
            want = my_group(axis, r, lay)
            assert got[axis]["sum"] == [q + 1 if q in want else 0 for q in range(nproc)], (r, axis, got[axis])
            assert got[axis]["members"] == want
            assert (got[axis]["index"], got[axis]["size"]) == (want.index(r), len(want))


@slow
def test_grid_job_refuses_groups_that_do_not_split_the_ranks_on_every_rank():
    groups = {"tp": [[0, 1]], "pp": [[0], [0]], "dp": [[0], [1]]}
    with pytest.raises(launch.LaunchError) as info:
        launch.run("par.runtime.grid", nproc=2, args=["--groups", json.dumps(groups)], backend="gloo",
                   timeout=60, quiet=True)
    assert re.fullmatch(r"rank \d: error: the pp groups .* listed twice \[0\]; missing \[1\]", info.value.root_cause)
    assert "Traceback" not in str(info.value)      # one line per rank, no GridError traceback


def test_wrong_product_is_one_error_naming_the_numbers():
    with pytest.raises(GridError, match=r"dp 2 × pp 2 × tp 3 = 12 but the world has 8 ranks"):
        check_layout(8, 2, 2, 3)
    with pytest.raises(GridError, match="dp=2 with pp=2, tp=2"):
        check_layout(8, 4, 2, 2)
    with pytest.raises(GridError, match="positive"):
        check_layout(8, 0, 2, 4)
    with pytest.raises(GridError, match="outside"):
        coords(8, Layout(2, 2, 2))


def test_describe_lists_every_rank():
    text = describe(Layout(2, 2, 2))
    assert len(text.splitlines()) == 2 + 8
    assert "[0, 2]" in text and "[0, 4]" in text and "[0, 1]" in text


def test_grid_single_process():
    from par.runtime.grid import Grid
    g = Grid()
    assert (g.dp_rank, g.stage, g.tp_rank) == (0, 0, 0) and g.tp_group is None and g.pp_ranks == [0]
    with pytest.raises(GridError, match="world has 1 ranks"):
        Grid(2, 1, 1)


def test_one_spelling_of_a_layout_for_grid_config_and_planner():
    from par.train.config import parse
    from par.runtime.grid import layout_label
    from par.model import preset
    from par.train.planner import Workload, predict
    assert layout_label(2, 2, 2) == str(Layout(2, 2, 2)) == "dp2xpp2xtp2"
    tc = parse({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "pipeline": {"stages": 2},
                "tensor_parallel": {"tp_size": 2}}, 8)
    assert tc.layout == "dp2xpp2xtp2" and tc.strategy == "3D dp2xpp2xtp2"
    assert predict(Workload(preset("tiny"), 16), 2, 2, 2).layout == "dp2xpp2xtp2"
    # "3D" only when every degree is > 1
    assert Layout(2, 2, 2).is_3d and not Layout(1, 2, 2).is_3d and not Layout(2, 1, 2).is_3d
    two = parse({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "pipeline": {"stages": 2},
                 "tensor_parallel": {"tp_size": 2}}, 4)
    assert two.strategy == "2D dp1xpp2xtp2"
