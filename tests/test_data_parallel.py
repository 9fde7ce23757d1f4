"""Data parallelism: equal to single-process training (and to torch's DDP), identical replicas, bytes as the
ring formula. One launch per world size (2, 3, 4), and the 3-rank one again with NCCL's point-to-point
semantics emulated on gloo (`PAR_NCCL_EMULATION=1`)."""
from __future__ import annotations

import functools
from pathlib import Path

import pytest
from tiers import tiered
import torch
import torch.nn.functional as F

from par.comm import collectives
from par.dp import compression
from par.dp.async_gossip import (gossip_sgd, latency_steps, max_stable_lr, ring_mixing_matrix, rounds_to_spread,
                                 stale_sgd)
from par.dp.batch_size import BatchSizeError, check_batch_identity, resolve_batch
from par.data import CharDataset, global_batches
from par.dp.wrap import overlap_fraction, split_micro, train_step
from par.dp.bucketed import BucketedDP, assign_buckets
from par.dp.naive import NaiveDP
from par.runtime.launch import run
from par.model import TinyMLP, build, lm_loss, preset
from par.reference import make_optimizer, max_abs_diff, train_single

WORKER = Path(__file__).parent / "workers" / "dp_equivalence.py"
EXACT = ["naive-ring", "naive-torch", "naive-ring-accum2", "bucketed-ring-1", "bucketed-ring-2",
         "bucketed-ring-several", "bucketed-torch-several", "bucketed-ring-several-accum2",
         "bucketed-torch-2-accum4", "gated-bucketed", "gated-naive", "gpt-tied-bucketed", "gpt-tied-naive-accum2",
         "topk-all", "randomk-all"]
LOSSY = ["topk-bucketed", "topk-naive-torch", "randomk-bucketed", "randomk-naive-torch", "int8-bucketed",
         "int8-naive-torch"]


LAUNCHES = [(2, False), (3, False), (4, False), (3, True)]   # (ranks, NCCL emulation)


def launch_id(case) -> str:
    return f"{case[0]}ranks" + ("-nccl-emulation" if case[1] else "")


@functools.lru_cache(maxsize=None)
def results(n: int, nccl: bool = False) -> dict:
    out = run(str(WORKER), nproc=n, timeout=240, quiet=True, env={"PAR_NCCL_EMULATION": "1"} if nccl else None)
    assert out.pop("nccl_emulation") == nccl, "the NCCL emulation was (not) active in the ranks"
    return out


# ---------------------------------------------------------------- multi-process (one launch per world size)
@pytest.mark.parametrize("n,nccl", tiered(LAUNCHES, launch_id))
def test_dp_equals_single_process(n, nccl):
    r = results(n, nccl)
    for name in EXACT:
        assert r[name]["diff"] <= 1e-5, f"{name} on {n} ranks: max |DP − reference| = {r[name]['diff']:.3g}"
    assert [r[f"bucketed-ring-{b}"]["n_buckets"] for b in ("1", "2")] == [1, 2]
    assert r["bucketed-ring-several"]["n_buckets"] >= 3


@pytest.mark.parametrize("n,nccl", tiered(LAUNCHES, launch_id))
def test_replicas_identical(n, nccl):
    for name, case in results(n, nccl).items():
        if isinstance(case, dict):
            assert len(set(case["hashes"])) == 1 and len(case["hashes"]) == n, f"{name}: replicas differ {case}"


@pytest.mark.parametrize("n,nccl", tiered(LAUNCHES, launch_id))
def test_bytes_per_step_match_ring_formula(n, nccl):
    for name, case in results(n, nccl).items():
        if not isinstance(case, dict):
            continue
        assert case["sent"] == [case["exact"]] * len(case["sent"]), f"{name}: counted {case['sent']} != {case['exact']}"
        if name in EXACT[:-3]:  # uncompressed: 2(N−1)/N × gradient bytes, up to uneven chunks (≤ 2 floats each)
            ops = case["n_buckets"] or 20
            assert abs(case["exact"] - case["formula"]) <= 8 * ops, name


@pytest.mark.parametrize("n,nccl", tiered(LAUNCHES, launch_id))
def test_lossy_compression_sends_less_and_differs(n, nccl):
    r = results(n, nccl)
    for name in LOSSY:
        assert r[name]["exact"] < r[name]["formula"], f"{name} sends {r[name]['exact']} >= {r[name]['formula']}"
        assert r[name]["diff"] > 1e-4, f"{name} trained exactly like the reference: was anything compressed?"


@pytest.mark.parametrize("n,nccl", tiered(LAUNCHES, launch_id))
def test_bucket_launched_during_backward_and_unused_params_covered(n, nccl):
    r = results(n, nccl)
    for name in ("bucketed-ring-2", "bucketed-ring-several", "bucketed-torch-several", "gpt-tied-bucketed"):
        assert r[name]["first_launch_before_backward_end"], f"{name}: no bucket started before backward ended"
    coverage = r["gated-coverage"]  # ranks that used the gated branch, per step
    assert all(c >= 1 for c in coverage), "a step where no rank used the branch makes Adam differ (test data)"
    assert any(c < n for c in coverage), f"the gated branch was used on every rank in every step: {coverage}"


# ---------------------------------------------------------------- single process (world size 1, no launch)
def _mlp_batches(steps=4, b=6):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(b, 10, generator=g), torch.randn(b, 5, generator=g)) for _ in range(steps)]


@pytest.mark.parametrize("wrapper", ["naive", "bucketed"])
@pytest.mark.parametrize("accum", [1, 3])
def test_wrappers_in_one_process_equal_plain_training(wrapper, accum):
    batches = _mlp_batches()
    ref = TinyMLP(seed=4)
    train_single(ref, batches, F.mse_loss, "adam", 1e-2)
    model = TinyMLP(seed=4)
    dp = NaiveDP(model) if wrapper == "naive" else BucketedDP(model, bucket_bytes=300)
    opt = make_optimizer(model.parameters(), "adam", 1e-2)
    for x, y in batches:
        train_step(dp, opt, split_micro(x, y, accum), F.mse_loss)
    assert max_abs_diff(model, ref) <= 1e-6


def test_bucketed_gpt_with_tied_embeddings_in_one_process():
    cfg = preset("tiny", n_layer=1, d_model=16, n_head=2, block_size=8, tie_embeddings=True)
    data = CharDataset(block_size=8)
    batches = list(global_batches(data, 4, 3, seed=1))
    ref = build(cfg, seed=2)
    train_single(ref, batches, lm_loss, "adam", 1e-3)
    model = build(cfg, seed=2)
    dp = BucketedDP(model, bucket_bytes=2000)
    assert len(dp.buckets) > 2 and sum(len(b.params) for b in dp.buckets) == len(list(model.parameters()))
    opt = make_optimizer(model.parameters(), "adam", 1e-3)
    for x, y in batches:
        train_step(dp, opt, [(x, y)], lm_loss)
    assert max_abs_diff(model, ref) <= 1e-6


def test_no_sync_leaves_gradients_local():
    model = TinyMLP(seed=0)
    dp = BucketedDP(model, bucket_bytes=100)
    x, y = _mlp_batches(1)[0]
    with dp.no_sync():
        F.mse_loss(dp(x), y).backward()
    assert all(b.pending is None for b in dp.buckets) and not dp._in_backward


# ---------------------------------------------------------------- bucket assignment
def test_assign_buckets_reverse_order_and_cap():
    assert assign_buckets([4, 4, 4], 8) == [[2, 1], [0]]
    assert assign_buckets([4, 4, 4], 12) == [[2, 1, 0]]
    assert assign_buckets([4, 100, 4], 8) == [[2], [1], [0]]   # too big for any bucket: alone
    assert assign_buckets([4, 4, 4], 1) == [[2], [1], [0]]
    sizes = [40, 12, 8, 100, 4, 4, 36]
    for cap in (1, 16, 50, 120, 1000):
        plan = assign_buckets(sizes, cap)
        assert [i for b in plan for i in b] == list(reversed(range(len(sizes))))
        assert all(len(b) == 1 or sum(sizes[i] for i in b) <= cap for b in plan)
        # greedy: the next parameter would not have fitted in the previous bucket
        assert all(sum(sizes[i] for i in a) + sizes[b[0]] > cap for a, b in zip(plan, plan[1:]))
    with pytest.raises(ValueError, match="positive"):
        assign_buckets([4], 0)


def test_bad_variant_and_uneven_micro_batches_are_clear_errors():
    from par.dp.wrap import wrap
    with pytest.raises(ValueError, match="unknown data-parallel variant 'zero9'"):
        wrap(TinyMLP(), "zero9")
    with pytest.raises(ValueError, match="per-rank batch 6 is not divisible by grad_accum 4"):
        split_micro(torch.zeros(6, 10), torch.zeros(6, 5), 4)


def test_bucketed_dp_rejects_mixed_dtypes():
    model = TinyMLP(seed=0)
    model.net[0].double()
    with pytest.raises(ValueError, match="one gradient dtype"):
        BucketedDP(model)


# ---------------------------------------------------------------- batch identity
def test_batch_identity():
    assert check_batch_identity(64, 4, 2, 8).per_rank == 8
    with pytest.raises(BatchSizeError) as e:
        check_batch_identity(64, 4, 2, 4)
    msg = str(e.value)
    assert "64" in msg and "micro_batch 4" in msg and "grad_accum 2" in msg and "world_size 4" in msg and "32" in msg
    with pytest.raises(BatchSizeError, match="positive"):
        check_batch_identity(64, 0, 2, 4)
    assert resolve_batch(4, train_batch_size=64) == check_batch_identity(64, 16, 1, 4)
    assert resolve_batch(4, train_batch_size=64, grad_accum=2).micro_batch == 8
    assert resolve_batch(4, train_batch_size=64, micro_batch=2).grad_accum == 8
    assert resolve_batch(3, micro_batch=5, grad_accum=2).train_batch_size == 30
    with pytest.raises(BatchSizeError, match="not divisible"):
        resolve_batch(3, train_batch_size=64)
    with pytest.raises(BatchSizeError, match="not divisible"):
        resolve_batch(4, train_batch_size=64, micro_batch=5)


# ---------------------------------------------------------------- compression (pure pieces, one process)
def test_topk_and_quantization():
    x = torch.tensor([0.1, -5.0, 0.3, 2.0, -0.2])
    values, idx = compression.topk_select(x, 2)
    assert sorted(idx.tolist()) == [1, 3]
    assert torch.equal(compression.scatter(values, idx, 5), torch.tensor([0, -5.0, 0, 2.0, 0]))
    assert compression.num_kept(1000, 0.01) == 10 and compression.num_kept(5, 1e-9) == 1
    y = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    q, scale = compression.quantize_int8(y)
    assert q.dtype == torch.int8 and q.abs().max() == 127
    assert (compression.dequantize_int8(q, scale) - y).abs().max() <= scale.item() / 2 + 1e-7
    assert torch.equal(compression.randomk_indices(100, 7, 5), compression.randomk_indices(100, 7, 5))
    assert compression.shared_seed(1, "bucket", 3) == compression.shared_seed(1, "bucket", 3)
    assert compression.shared_seed(1, 0, 3) != compression.shared_seed(1, 0, 4)


def test_randomk_draws_its_indices_on_the_gradient_device(monkeypatch):
    """No CPU permutation and copy every step: randperm runs on the gradient's device, with its generator."""
    calls = []
    real = torch.randperm

    def spy(*args, **kwargs):
        calls.append((kwargs.get("device"), kwargs["generator"].device))
        return real(*args, **kwargs)
    monkeypatch.setattr(torch, "randperm", spy)
    x = torch.randn(100)
    payload = compression.RandomK(0.1, seed=3).encode(x, key="b0", step=0)
    assert calls == [(x.device, x.device)] and payload[1].device == x.device and payload[1].dtype == torch.int32
    idx = compression.randomk_indices(100, 10, seed=5, device="cpu")
    assert len(set(idx.tolist())) == 10 and torch.equal(idx, compression.randomk_indices(100, 10, 5, "cpu"))


def test_error_feedback_keeps_what_was_not_sent():
    g = torch.Generator().manual_seed(1)
    residual = torch.zeros(50)
    total_grad, total_sent = torch.zeros(50), torch.zeros(50)
    top3 = lambda v: compression.scatter(*compression.topk_select(v, 3), 50)  # noqa: E731
    for _ in range(40):
        grad = torch.randn(50, generator=g)
        sent, new_residual = compression.error_feedback_step(grad, residual, top3)
        assert torch.allclose(sent + new_residual, grad + residual)
        assert (sent != 0).sum() == 3
        residual = new_residual
        total_grad += grad
        total_sent += sent
    # everything not sent yet is in the residual: Σ sent = Σ grad − residual
    assert torch.allclose(total_sent, total_grad - residual, atol=1e-4)


@pytest.mark.parametrize("name", ["topk", "randomk", "int8"])
def test_compressor_in_one_process_matches_its_decode(name):
    comp = compression.make(name, ratio=0.2)
    x = torch.randn(30, generator=torch.Generator().manual_seed(2))
    out = comp.average(x.clone(), key=0)
    assert torch.allclose(out + comp.residuals[0], x, atol=1e-6)   # sent + residual = gradient
    assert comp.bytes_formula(30, 1) == 0 and comp.bytes_formula(1000, 4) < collectives.all_reduce_formula_bytes(
        4000, 4)
    with pytest.raises(ValueError, match="unknown compression"):
        compression.make("zip")


# ---------------------------------------------------------------- timeline overlap, async and gossip
def test_overlap_fraction():
    spans = [dict(rank=0, name="B", lane="compute", start=0.0, end=10.0),
             dict(rank=0, name="AR0", lane="comm", start=4.0, end=8.0),
             dict(rank=0, name="AR1", lane="comm", start=9.0, end=13.0),
             dict(rank=1, name="AR0", lane="comm", start=20.0, end=30.0)]
    assert overlap_fraction(spans, 0) == pytest.approx(5 / 8)
    assert overlap_fraction(spans, 1) == 0.0


@pytest.mark.parametrize("wrapper", [NaiveDP, functools.partial(BucketedDP, bucket_bytes=1024)])
def test_on_a_gpu_every_span_is_timed_by_cuda_events(wrapper):
    """A one-process step with a recorder on "cuda:0" (fake events, tests/test_timeline.py): every span lies
    between two of its marks, none on the CPU clock, which on a GPU would time the launches, not the work."""
    from test_timeline import FakeCudaRecorder, GpuClock
    rec = FakeCudaRecorder(GpuClock())
    dp = wrapper(TinyMLP(), recorder=rec)
    F.mse_loss(dp(torch.randn(4, 10)), torch.zeros(4, 5)).backward()
    dp.sync_gradients()
    names = {e.name for e in rec._entries}
    assert "B" in names and names & {"all-reduce", "AR0"}
    assert all(type(e).__name__ == "_EventSpan" for e in rec._entries), "a span on the CPU clock"


def test_stale_updates_and_stability_limit():
    centers = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    assert stale_sgd(centers, 0.5, 60, 0)[-1] < 1e-6
    for tau in (0, 1, 4):
        limit = max_stable_lr(tau)
        assert stale_sgd(centers, 0.95 * limit, 600, tau)[-1] < 1e-2
        assert stale_sgd(centers, 1.05 * limit, 600, tau)[-1] > 10
    assert max_stable_lr(0) == pytest.approx(2.0) and max_stable_lr(1) == pytest.approx(1.0)


def test_ring_gossip():
    m = ring_mixing_matrix(6)
    assert torch.allclose(m.sum(0), torch.ones(6)) and torch.allclose(m.sum(1), torch.ones(6))
    centers = torch.randn(8, 2, generator=torch.Generator().manual_seed(1))
    out = gossip_sgd(centers, 0.1, 300)
    assert out["error"][-1] < 1e-5                 # the average model reaches the joint optimum
    assert out["disagreement"][-1] > 1e-2          # but replicas still disagree (no exact consensus)
    # no gradient: gossip keeps the mean and contracts to consensus
    w0 = torch.randn(8, 2, generator=torch.Generator().manual_seed(2))
    still = gossip_sgd(torch.zeros(8, 2), 0.0, 400, w0=w0)
    assert torch.allclose(still["final"].mean(0), w0.mean(0), atol=1e-5) and still["disagreement"][-1] < 1e-4
    assert latency_steps(8, "allreduce") == 14 and latency_steps(8, "gossip") == 1 and rounds_to_spread(8) == 4
    with pytest.raises(ValueError):
        ring_mixing_matrix(2)


# ---------------------------------------------------------------- the training job
def test_train_dp_job_reports_consistent_runs():
    out = run("par.dp.job", nproc=2, timeout=240, quiet=True,
              args=["--dp", "naive,bucketed", "--compression", "none,int8", "--steps", "3", "--batch", "8",
                    "--accum", "2", "--bucket-kb", "16", "--tie-embeddings", "--lr", "1e-3", "--compare"])
    runs = {(r["dp"], r["compression"]): r for r in out["runs"]}
    assert len(runs) == 4 and out["world_size"] == 2 and out["backend"] == "gloo"
    exact_naive, exact_bucketed = runs["naive", "none"], runs["bucketed", "none"]
    assert max(abs(a - b) for a, b in zip(exact_naive["losses"], exact_bucketed["losses"])) <= 1e-5
    assert exact_bucketed["losses"] != runs["bucketed", "int8"]["losses"]
    assert exact_naive["max_param_diff_vs_first"] == 0.0 and exact_bucketed["max_param_diff_vs_first"] <= 1e-5
    assert runs["bucketed", "int8"]["max_param_diff_vs_first"] > 1e-5   # lossy: really different weights
    for r in runs.values():
        assert r["replicas_identical"], (r["dp"], r["compression"])
        assert r["bytes_sent_per_step"] == [r["bytes_expected"]["exact"]] * 3, (r["dp"], r["compression"])
        assert r["batch"] == {"train_batch_size": 8, "micro_batch": 2, "grad_accum": 2, "world_size": 2,
                              "per_rank": 4}
        assert r["memory"]["measured"] == r["memory"]["predicted"]
        lanes = {(s["rank"], s["lane"]) for s in r["timeline"]}
        assert lanes == {(0, "compute"), (0, "comm"), (1, "compute"), (1, "comm")}
        # the job contract: the same keys for the same quantities
        assert len(r["losses"]) == len(r["step_s"]) == 3 and len(r["per_rank"]) == 2
        assert r["step_s"] == [max(p["step_s"][i] for p in r["per_rank"]) for i in range(3)]
        assert r["losses"] == [sum(p["losses"][i] for p in r["per_rank"]) / 2 for i in range(3)]
    assert exact_bucketed["memory"]["wrapper_buffers"] == exact_bucketed["bytes_expected"]["grad_bytes"]
    assert exact_bucketed["n_buckets"] > 2
    spans = [s for s in exact_bucketed["timeline"] if s["rank"] == 0]
    backward = next(s for s in spans if s["name"] == "B")
    assert all(0 <= s["start"] <= s["end"] for s in spans)           # recorder times, not perf_counter
    assert [s["name"] for s in spans if s["lane"] == "comm"] == [f"AR{i}" for i in range(exact_bucketed["n_buckets"])]
    # overlap, as a fact of the schedule and not of timing (under load the comm thread may start late):
    # every bucket but the last is handed to the comm thread from a gradient hook, while backward runs
    assert exact_bucketed["launched_in_backward"] >= exact_bucketed["n_buckets"] - 1, "no bucket sent during backward"
    assert runs["naive", "none"]["launched_in_backward"] is None


def test_train_dp_derives_accumulation_from_the_micro_batch():
    """`--micro-batch` alone: the single process takes the global batch in micro-batches (as a GPU must)."""
    from par.dp.job import Args
    args = Args.parse(["--batch", "32", "--micro-batch", "8"])
    sizes = resolve_batch(1, args.batch, args.micro_batch, args.accum)
    assert (sizes.micro_batch, sizes.grad_accum) == (8, 4)
    assert Args().accum is None and resolve_batch(2, 32, None, Args().accum).grad_accum == 1


def test_ddp_beside_par_bucketed_dp():
    """torch's DistributedDataParallel and par's bucketed DP: same model, data and buckets, same weights."""
    out = run("par.dp.job", nproc=2, timeout=240, quiet=True,
              args=["--dp", "bucketed,ddp", "--impl", "torch", "--steps", "4", "--batch", "8", "--bucket-kb", "16",
                    "--compare"])
    bucketed, ddp = out["runs"]
    assert ddp["dp"] == "ddp" and ddp["bytes_expected"] is None
    assert ddp["max_param_diff_vs_first"] <= 1e-5
    assert max(abs(a - b) for a, b in zip(bucketed["losses"], ddp["losses"])) <= 1e-5


def test_step_parts_read_each_part_of_a_recorded_step_on_both_clocks():
    """`par.dp.wrap.step_parts`: forward, backward and optimizer from their spans; the wait after backward is naive
    DP's "all-reduce" span and bucketed DP's "sync" span; steady = wall less the span's run-queue seconds."""
    from par.dp.wrap import step_parts
    spans = [dict(rank=0, name="F", lane="compute", start=0.0, end=2.0, cpu=2.0, ready=0.0),
             dict(rank=0, name="B", lane="compute", start=2.0, end=6.0, cpu=3.0, ready=1.0),
             dict(rank=0, name="sync", lane="compute", start=6.0, end=7.0, cpu=0.0, ready=0.5),
             dict(rank=0, name="AR0", lane="comm", start=3.0, end=7.0, cpu=0.0, ready=0.0),
             dict(rank=0, name="step", lane="compute", start=7.0, end=8.0, cpu=1.0, ready=0.0),
             dict(rank=1, name="F", lane="compute", start=0.0, end=9.0, cpu=9.0, ready=0.0)]
    parts = step_parts(spans, 0, "bucketed")
    assert parts["forward"] == {"wall": 2.0, "steady": 2.0} and parts["backward"] == {"wall": 4.0, "steady": 3.0}
    assert parts["wait"] == {"wall": 1.0, "steady": 0.5} and parts["optimizer"]["wall"] == 1.0
    assert "wait" not in step_parts(spans, 0, "ddp")
    naive = [dict(s, name="all-reduce", lane="comm") if s["name"] == "sync" else s for s in spans]
    assert step_parts(naive, 0, "naive")["wait"] == {"wall": 1.0, "steady": 0.5}
