"""3D parallelism (dp × pp × tp, 1F1B, DP or ZeRO-1) equals single-process training, on gloo as it is and
under NCCL's point-to-point semantics (PAR_NCCL_EMULATION=1: one Work per batch of sends and receives,
received data valid only after it is waited)."""
from pathlib import Path

import pytest
from tiers import slow, tiered

import par.runtime.launch
from par.runtime.grid import Layout, coords
from par.memory.accounting import param_count
from par.train.planner import stage_params
from par.model import preset

WORKER = Path(__file__).parent / "workers" / "p3d_equivalence.py"
TOL = 1e-5


def check(results, spec, world):
    r = results[spec]
    assert r["groups_ok"], spec
    assert r["param"] <= TOL, (spec, r["param"])
    assert r["loss"] <= TOL, (spec, r["loss"])
    dp, pp, tp = (int(v) for v in spec.split(",")[:3])
    # the last stage of each of the dp·tp pipelines reports 2 step losses
    assert len(r["losses"]) == 2 * dp * tp, (spec, r["losses"])
    # every rank sits where the grid's layout says
    assert [tuple(c) for c in r["coords"]] == [tuple(coords(q, Layout(dp, pp, tp)).values()) for q in range(world)]
    # tensor and pipeline parallelism shrink what one rank holds
    full = param_count(preset("tiny", n_layer=3))
    # the planner's prediction of the busiest rank's parameters is exact
    assert max(r["n_local"]) == stage_params(preset("tiny", n_layer=3), pp, tp)[0]
    if pp * tp > 1:
        assert max(r["n_local"]) < full, (spec, r["n_local"], full)
    else:
        assert set(r["n_local"]) == {full}


NCCL = pytest.mark.parametrize("env", tiered([None, {"PAR_NCCL_EMULATION": "1"}], lambda e: "nccl-semantics" if e else "gloo"))


@pytest.mark.timeout(240)
@NCCL
def test_four_ranks_three_layouts_and_zero1(env):
    specs = ["2,2,1", "1,2,2", "2,1,2", "2,2,1,1"]
    results = par.runtime.launch.run(str(WORKER), nproc=4, args=specs, timeout=220, env=env)
    for spec in specs:
        check(results, spec, 4)


@slow
@pytest.mark.timeout(300)
@NCCL
def test_eight_ranks_2x2x2_dp_and_zero1(env):
    """Every degree > 1: the layout lecture 07 records in `layouts_3d_run`."""
    specs = ["2,2,2", "2,2,2,1"]
    results = par.runtime.launch.run(str(WORKER), nproc=8, args=specs, timeout=280, env=env)
    for spec in specs:
        check(results, spec, 8)
