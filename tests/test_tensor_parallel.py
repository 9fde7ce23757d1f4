"""Tensor parallelism equals the dense layers it was cut from.

In-process: shard arithmetic, the QKV re-layout, errors, formulas, the TP degree rule, and the size-1
group (every operator a no-op). Multi-process: one launch per world size (2, 3, 4; par's ring
all-reduce, and the whole model once more with torch's) runs every case in tests/workers/tp_check.py
and returns the numbers asserted here; the 3-rank launch runs again with NCCL's point-to-point
semantics emulated on gloo (`PAR_NCCL_EMULATION=1`).
"""
from __future__ import annotations

from pathlib import Path

import pytest
from tiers import tiered
import torch

from par.runtime import launch
from par.tp import layers as tp, ops as tp_ops
from par.comm.collectives import all_reduce_formula_bytes
from par.memory.accounting import gpt_param_count
from par.model import GPTConfig, build, preset

WORKER = Path(__file__).parent / "workers" / "tp_check.py"
TOL = 5e-6
_CACHE: dict = {}


LAUNCHES = [(2, False), (3, False), (4, False), (3, True)]   # (ranks, NCCL emulation)


def launch_id(case) -> str:
    return f"{case[0]}ranks" + ("-nccl-emulation" if case[1] else "")


def run_worker(n: int, nccl: bool = False) -> list[dict]:
    if (n, nccl) not in _CACHE:
        out = launch.run(str(WORKER), nproc=n, args=["ring"], timeout=240, quiet=True,
                         env={"PAR_NCCL_EMULATION": "1"} if nccl else None)
        assert out["world_size"] == n and out["impl"] == "ring" and out["nccl_emulation"] == nccl
        _CACHE[n, nccl] = out["ranks"]
    return _CACHE[n, nccl]


# ---------------------------------------------------------------- in-process
def test_operators_are_no_ops_without_a_group():
    x = torch.randn(3, 4, requires_grad=True)
    for op in (tp_ops.copy_to_region, tp_ops.reduce_from_region, tp_ops.scatter_to_region, tp_ops.gather_from_region):
        assert op(x) is x


def test_size_one_model_is_the_dense_model():
    dense = build("tiny", seed=0)
    model = tp.TensorParallelGPT.from_dense(dense)
    idx = torch.randint(0, 65, (2, 32))
    assert torch.equal(model(idx), dense(idx))
    assert tp.param_bytes(model) == tp.param_bytes(dense) == 4 * tp.tp_param_count(dense.cfg, 1)


def test_qkv_relayout_hands_each_rank_whole_heads():
    d, n = 12, 3
    w = torch.arange(3 * d, dtype=torch.float32).unsqueeze(1)  # row i holds the number i
    relaid = tp.qkv_for_column_split(w, n)
    for r in range(n):
        mine = tp.column_shard(relaid, n, r).flatten().tolist()
        k = d // n
        assert mine == [j * d + r * k + i for j in range(3) for i in range(k)]  # Q_r, then K_r, then V_r
    # a plain split of the un-relaid weight would give rank 0 only queries: the re-layout matters
    assert tp.column_shard(w, n, 0).flatten().tolist() == list(range(d))


def test_shards_tile_the_dense_weight():
    w = torch.randn(8, 6)
    assert torch.equal(torch.cat([tp.column_shard(w, 2, r) for r in range(2)]), w)
    assert torch.equal(torch.cat([tp.row_shard(w, 3, r) for r in range(3)], dim=1), w)


def test_row_split_needs_the_sum_and_column_split_does_not():
    x, w = torch.randn(5, 6), torch.randn(4, 6)
    n = 3
    partials = [x[:, r * 2:(r + 1) * 2] @ tp.row_shard(w, n, r).T for r in range(n)]
    assert torch.allclose(sum(partials), x @ w.T, atol=1e-6)
    assert not torch.allclose(partials[0], x @ w.T, atol=1e-3)
    cols = [x @ tp.column_shard(w, 2, r).T for r in range(2)]
    assert torch.allclose(torch.cat(cols, dim=1), x @ w.T, atol=1e-6)


@pytest.mark.parametrize("cfg,n,words", [
    (preset("tiny"), 3, ["n_head 4", "degree 3", "(1, 2, 4)"]),
    (GPTConfig(n_head=6, d_model=48, d_ff=100), 4, ["n_head 6", "degree 4"]),
    (GPTConfig(n_head=4, d_model=32, d_ff=130), 4, ["ffn size 130", "degree 4", "multiple of 4"]),
])
def test_indivisible_sizes_name_the_numbers(cfg, n, words):
    with pytest.raises(ValueError) as e:
        tp.check_tp_degree(cfg, n)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


@pytest.mark.parametrize("cfg,world,degree", [
    (preset("gpt3-small"), 8, 6),      # 12 heads on 8 GPUs: 6, not a failure at setup
    (preset("gpt3-small"), 12, 12), (preset("gpt3-small"), 16, 12), (preset("gpt3-small"), 5, 4),
    (preset("tiny"), 2, 2), (preset("tiny"), 3, 2), (preset("tiny"), 8, 4), (preset("tiny"), 1, 1),
    (GPTConfig(n_head=6, d_model=48, d_ff=100), 4, 2),   # 3 divides the heads but not the FFN size
])
def test_tp_degree_is_the_largest_divisor_of_the_heads(cfg, world, degree):
    assert tp.tp_degree(cfg, world) == degree
    tp.check_tp_degree(cfg, degree)   # and it really splits
    with pytest.raises(ValueError, match="at least 1"):
        tp.tp_degree(cfg, 0)


def test_formulas():
    cfg = GPTConfig(n_layer=3, d_model=32, n_head=4)
    assert tp.allreduces_per_step(3) == {"forward": 6, "backward": 6}
    assert tp.tp_bytes_per_step(cfg, 2, 8, 4) == 12 * all_reduce_formula_bytes(2 * 8 * 32 * 4, 4)
    assert tp.tp_bytes_per_step(cfg, 2, 8, 1) == 0
    dense = sum(p.numel() for p in build(cfg).parameters())
    assert tp.tp_param_count(cfg, 1) == dense == gpt_param_count(cfg)
    assert tp.tp_param_count(cfg, 2) < tp.tp_param_count(cfg, 1)
    tied = GPTConfig(n_layer=1, tie_embeddings=True)
    assert tp.tp_param_count(tied, 1) == sum(p.numel() for p in build(tied).parameters())


# ---------------------------------------------------------------- multi-process
CASES = ["column gather=False", "column gather=True", "row input_parallel=True", "row input_parallel=False",
         "mlp", "attention", "block", "model", "model impl=torch"]


@pytest.mark.parametrize("n,nccl", tiered(LAUNCHES, launch_id))
def test_tp_equals_dense(n, nccl):
    ranks = run_worker(n, nccl)
    assert len(ranks) == n
    for r, res in enumerate(ranks):
        for case in CASES:
            c = res[case]
            assert c["shard"] == 0.0, (r, case)                      # exact slices of the dense weights
            for key in ("forward", "input_grad", "weight_grad"):
                if key in c:
                    assert c[key] <= TOL, (r, case, key, c[key])
        assert res["column shard is W[r]"] == 0.0 and res["row shard is W[:, r]"] == 0.0
        assert res["attention"]["qkv shard is whole heads"] == 0.0
        assert res["attention"]["local heads"] == 12 // n
        assert res["adam"]["params"] <= TOL and res["adam"]["loss"] <= TOL, res["adam"]
        assert res["model impl=torch"]["impls"] == ["torch"] and res["model"]["events_fwd"] > 0


@pytest.mark.parametrize("n,nccl", tiered(LAUNCHES, launch_id))
def test_four_all_reduces_per_layer_and_bytes_match_the_formula(n, nccl):
    ranks = run_worker(n, nccl)
    for res in ranks:
        m = res["model"]
        assert m["kinds"] == ["all_reduce"]
        assert m["fwd_all_reduces"] == 2 * 2 and m["bwd_all_reduces"] == 2 * 2   # 2 layers
        assert m["events_fwd"] == 4 and m["events_bwd"] == 4
        assert m["per_layer"] == [4, 4]
        assert m["bytes"] == m["bytes_exact"] == m["bytes_formula"] == m["bytes_function"]
        assert m["param_bytes"] == m["param_bytes_formula"]
        # the MLP and attention each: one all-reduce forward, one backward
        for case in ("mlp", "attention"):
            assert res[case]["events_fwd"] == 1 and res[case]["events_bwd"] == 1 and res[case]["all_reduces"] == 2
        assert res["block"]["all_reduces"] == 4
        # column without gather: nothing forward, the f all-reduce backward; with gather: + an all-gather
        assert (res["column gather=False"]["events_fwd"], res["column gather=False"]["events_bwd"]) == (0, 1)
        assert (res["column gather=True"]["events_fwd"], res["column gather=True"]["events_bwd"]) == (1, 1)
        assert (res["row input_parallel=True"]["events_fwd"], res["row input_parallel=True"]["events_bwd"]) == (1, 0)
    m0 = ranks[0]["model"]
    assert m0["replicated_grads_spread"] == 0.0 and m0["replicated_numel"] > 0   # identical without communication


@pytest.mark.parametrize("n", tiered([2, 3, 4]))
def test_indivisible_model_fails_with_one_line(n):
    errors = run_worker(n)[0]["errors"]
    assert errors["n_head"].startswith("n_head ") and f"degree {n}" in errors["n_head"], errors
    assert errors["ffn size"].startswith("ffn size 193") and f"degree {n}" in errors["ffn size"], errors


def test_tp_group_inside_a_larger_world():
    for r, res in enumerate(run_worker(4)):
        c = res["subgroup mlp"]
        assert c["shard"] == 0.0 and max(c["forward"], c["input_grad"], c["weight_grad"]) <= TOL, (r, c)
        assert c["group_sizes"] == [2]


# ---------------------------------------------------------------- the training job and the benchmark run
def test_training_job_matches_dense_and_counts():
    out = launch.run("par.tp.job", nproc=2, args=["--steps", "3", "--lr", "1e-3"], timeout=240, quiet=True)
    assert len(out["losses"]) == len(out["dense_losses"]) == len(out["step_s"]) == 3
    assert max(abs(a - b) for a, b in zip(out["losses"], out["dense_losses"])) <= TOL
    assert out["max_param_diff"] <= 1e-5 and out["max_param_diff_name"] in out["per_rank"][0]["max_param_diff_name"] \
        + out["per_rank"][1]["max_param_diff_name"]
    assert out["world_size"] == 2 and out["backend"] == "gloo" and len(out["per_rank"]) == 2
    assert out["step_s"] == [max(r["step_s"][i] for r in out["per_rank"]) for i in range(3)]
    comm = out["comm"]
    assert all((row["forward"], row["backward"]) == (2, 2) for row in comm["per_layer"])
    assert len(comm["per_layer"]) == out["config"]["n_layer"]
    assert comm["tp_bytes_per_step_measured"] == comm["tp_bytes_per_step_formula"] > 0
    mem = out["memory"]
    assert mem["param_bytes_per_rank"] == [mem["param_bytes_formula"]] * 2
    assert mem["by_degree_measured"] == {k: v for k, v in mem["by_degree_formula"].items()}
    assert mem["by_degree_measured"]["1"] == mem["dense_param_bytes"] > mem["by_degree_measured"]["2"]
    assert mem["model_states_measured"] == mem["model_states_formula"]          # Adam fp32: 4 + 4 + 8 bytes
    assert mem["model_states_measured"]["params"] == mem["param_bytes_formula"]


def test_benchmark_runs_and_matches_torch_tp_memory():
    from par.tp import bench as bench
    out = bench.run(nproc=2, preset="tiny", batch_size=2, steps=1, warmup=0, rounds=1, timeout=240)
    assert {(r["module"], r["impl"]) for r in out["rows"]} == \
        {(m, i) for m in bench.KINDS for i in ("par ring", "par torch-allreduce", "torch TP")}
    for kind in bench.KINDS:
        rows = {r["impl"]: r for r in out["rows"] if r["module"] == kind}
        assert rows["par ring"]["param_bytes"] == rows["torch TP"]["param_bytes"] > 0
        assert all(r["max_err"] <= TOL and r["step_s"] > 0 for r in rows.values()), rows
    assert "vs torch" in bench.table(out)
