"""PyTorch's own APIs beside par, equal on the same data: DTensor `parallelize_module` vs par's Megatron TP
(`par.tp.torch_api`), `all_to_all_single` vs par's hand-written all-to-all (`par.moe.torch_api`), and one
training step under `torch.profiler` saved as a Perfetto trace (`par.runtime.profile`, `par.dp.job`).
Each launch runs on 2 gloo ranks in the fast tier; more ranks in the full suite."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiers import tiered

from par.runtime import launch, profile

TOL = 1e-5


@pytest.mark.parametrize("n", tiered([2, 4]))
def test_dtensor_parallelize_module_equals_par_tp(n):
    out = launch.run("par.tp.job", nproc=n, timeout=300, quiet=True,
                     args=["--steps", "2", "--torch-api", "2", "--eps", "1e-6", "--batch-size", "4"])
    t = out["torch_api"]
    assert t["steps"] == 2 and t["max"] <= TOL, t
    assert t["grads"] <= TOL and t["params"] <= TOL and t["logits"] <= TOL


@pytest.mark.parametrize("n", tiered([2, 3]))
def test_all_to_all_single_equals_par_dispatch(n):
    out = launch.run("par.moe.job", nproc=n, timeout=300, quiet=True,
                     args=["--steps", "1", "--alphas", "0.1", "--experts", "4", "--k", "2", "--batch", "2",
                           "--torch-api"])
    t = out["torch_api"]
    assert t["dispatch"] == 0.0 and t["output"] <= TOL and t["grads"] <= TOL
    from par.moe.experts import expert_range
    owned = [b - a for a, b in (expert_range(4, n, r) for r in range(n))]   # experts per rank, as even as possible
    assert [s["send"] for s in t["split_sizes"]] == [owned] * n
    assert [s["recv"] for s in t["split_sizes"]] == [[owned[r]] * n for r in range(n)]


def test_dp_job_saves_one_perfetto_trace_per_run_and_rank(tmp_path):
    out = launch.run("par.dp.job", nproc=2, timeout=300, quiet=True,
                     args=["--dp", "bucketed,ddp", "--steps", "2", "--batch", "4", "--compare", "--bucket-kb", "64",
                           "--profile-dir", str(tmp_path)])
    traces = [t for run in out["runs"] for t in run["profile_traces"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"dp_{v}_rank{r}.json" for v in ("bucketed", "ddp") for r in range(2)) == sorted(
        t.rsplit("/", 1)[-1] for t in traces)
    names = {e.get("name", "") for e in json.loads((tmp_path / "dp_ddp_rank0.json").read_text())["traceEvents"]}
    assert any(n.startswith("aten::") for n in names)            # the step's operators are in the trace
    assert all(profile.check(t) > 0 for t in traces)
    assert out["runs"][1]["max_param_diff_vs_first"] <= TOL       # profiling changes nothing


def test_profile_step_off_writes_nothing_and_check_refuses_other_json(tmp_path):
    with profile.step(tmp_path, "x", on=False) as trace:
        torch.ones(3).sum()
    assert trace.path is None and not list(tmp_path.iterdir())
    with profile.step(tmp_path, "x") as trace:
        torch.ones(3).sum()
    assert trace.path == tmp_path / "x.json" and profile.check(trace.path) > 0
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="traceEvents"):
        profile.check(tmp_path / "bad.json")


def test_autocast_grad_scaler_equals_par_scaler():
    """torch.autocast(fp16) + torch.amp.GradScaler and par's DynamicLossScaler (hysteresis 1): the same scales,
    growth, a real fp16 overflow backed off and skipped, and the same parameters after the steps."""
    from par.data import CharDataset, global_batches
    from par.model import build, preset
    from par.precision import torch_api
    cfg = preset("tiny", n_layer=1, block_size=16)
    batches = list(global_batches(CharDataset(block_size=cfg.block_size), 2, 6, seed=0))
    r = torch_api.compare(build(cfg, seed=0), batches, window=2, blow_up=(3,))
    assert r.same_scales and r.same_skips and r.max_param_diff == 0.0
    assert r.par.skipped == [False, False, False, True, False, False]
    assert r.par.scale == [2.0 ** 16, 2.0 ** 16, 2.0 ** 17, 2.0 ** 17, 2.0 ** 16, 2.0 ** 16]


def test_batch_summary_joins_the_notebooks_traces_and_torch_diffs():
    from par.course.batch.runner import merge_records
    rows = [{"records": {"torch_api_max_diff": {"ddp": 0.0}, "profiler_traces": ["a.json"]}},
            {"records": {"torch_api_max_diff": {"dtensor_tp": 1e-7}, "profiler_traces": ["b.json"], "x": [1]}},
            {"records": {"x": [2]}}]
    assert merge_records(rows) == {"torch_api_max_diff": {"ddp": 0.0, "dtensor_tp": 1e-7},
                                   "profiler_traces": ["a.json", "b.json"], "x": [2]}


def test_the_batch_points_the_traces_at_its_run_folder_whatever_folder_a_notebook_runs_in(tmp_path, monkeypatch):
    """Notebooks run in notebooks/: a relative PAR_TRACE_DIR would put their traces there, not in the run."""
    import os
    from par.course.batch.runner import traces_into
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PAR_TRACE_DIR", raising=False)
    with traces_into(Path("runs") / "r1" / "traces"):
        assert os.environ["PAR_TRACE_DIR"] == str(tmp_path / "runs" / "r1" / "traces")
    assert "PAR_TRACE_DIR" not in os.environ
