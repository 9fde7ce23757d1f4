"""Expert parallelism equals the single-process MoE with the ranks' batches as routing groups.

In-process: the expert ranges and the bytes formula. Multi-process: one launch per world size (2, 3, 4)
runs every case of tests/workers/ep_check.py: the layer with E = 5 experts (uneven over the ranks), k = 1
and 2, tokens dropped, p2p and torch all-to-all; and a MoE GPT-lite trained 3 Adam steps with EP (ep = N)
and EP inside DP (ep = 2 on 4 ranks). The 3-rank launch also runs with NCCL's point-to-point
semantics emulated on gloo (`p2p_env`).
"""
from __future__ import annotations

from pathlib import Path

import pytest
from tiers import tiered

from par.moe import experts as ep
from par.runtime import launch, nccl_emulation
from par.moe.router import MoEError

WORKER = Path(__file__).parent / "workers" / "ep_check.py"
TOL = 1e-5
_CACHE: dict = {}
# one launch per world size; the 3-rank one also under NCCL's point-to-point rules (each launch costs ~30 s)
LAUNCHES = pytest.mark.parametrize("n, env", tiered([(2, {}), (3, {}), (3, {nccl_emulation.ENV: "1"}), (4, {})],
                                                    lambda c: ("nccl-emulation-" if c[1] else "gloo-") + str(c[0])))


def run_worker(n: int, env: dict) -> dict:
    key = (n, tuple(env.items()))
    if key not in _CACHE:
        out = launch.run(str(WORKER), nproc=n, timeout=240, quiet=True, env=env)
        assert out["world_size"] == n and out["nccl_emulation"] == bool(env)
        _CACHE[key] = out
    return _CACHE[key]


def test_experts_split_unevenly_and_bytes_match_the_formula():
    assert [ep.expert_range(5, 3, r) for r in range(3)] == [(0, 2), (2, 4), (4, 5)]
    assert [ep.expert_range(8, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    for r in range(4):                       # n divides E: both all-to-alls are (n-1)/n · E·C·d·4
        assert ep.alltoall_bytes(8, 3, 16, 4, r) == (ep.alltoall_formula_bytes(8, 3, 16, 4),) * 2
    assert ep.alltoall_bytes(5, 2, 4, 3, 2) == ((5 - 1) * 2 * 4 * 4, 2 * 1 * 2 * 4 * 4)
    with pytest.raises(MoEError, match="ep degree <= 3"):
        ep.expert_range(3, 4, 0)


@pytest.mark.timeout(300)
@LAUNCHES
def test_layer_equals_the_single_process_moe(n, env):
    out = run_worker(n, env)
    for case, got in out["layers"].items():
        assert got["same_routing"], f"{case}: routing or dropped tokens differ from the single process"
        assert got["dropped"] > 0, f"{case}: the case should drop tokens"
        for key in ("forward", "input_grad", "aux"):
            assert got[key] <= TOL, (case, key, got[key])
        assert max(got["grads"].values()) <= TOL, (case, got["grads"])
        assert got["bytes_ok"], f"{case}: all-to-all bytes {got['bytes']} != formula {got['formula']}"


@pytest.mark.timeout(300)
@LAUNCHES
def test_training_with_ep_inside_dp_equals_the_single_process(n, env):
    out = run_worker(n, env)
    assert set(out["train"]) == ({f"ep{n}", "ep2"} if n % 2 == 0 else {f"ep{n}"}) | {"shared+z"}
    for case, got in out["train"].items():
        assert got["ep"] * got["dp"] == n
        assert got["loss"] <= TOL and got["weights"] <= TOL, (case, got["loss"], got["weights"])
        assert got["key_bias"] <= 3 * 1e-2, (case, got["key_bias"])    # 3 Adam steps of lr 1e-2: ep_check.weight_gaps


@pytest.mark.slow
def test_the_moe_job_compares_the_weights_after_several_steps_and_after_the_last():
    """par.moe.job --check (lecture 09's launch): every step's loss, the weights after SEVERAL_STEPS steps (the
    course's target) and after the last one, against the single process."""
    from par.moe import job as moe_job
    result = launch.run("par.moe.job", nproc=2, timeout=300, quiet=True, args=moe_job.Args(
        preset="tiny", steps=7, batch=2, experts=4, k=2, check=True, alphas=(0.0,)).to_argv())
    (run,) = result["runs"]
    assert run["several_steps"] == moe_job.SEVERAL_STEPS == 5 and len(run["losses"]) == 7
    assert run["max_loss_diff"] <= TOL and run["max_param_diff_after_several"] <= TOL
    assert run["max_param_diff"] >= run["max_param_diff_after_several"] > 0   # measured, not a placeholder
