"""The GPU tier: `pytest -m gpu` on a machine with one CUDA GPU (skipped, with the reason, without one).

What only a GPU can show, on one GPU:
- par's NCCL bootstrap with one rank (NCCL, cuda:0, a collective);
- every strategy's job with one rank on CUDA under NCCL, finite losses;
- the CUDA allocator's bytes of model states (params, grads, Adam) within 5 % of `par.memory.accounting`;
- fp16 with dynamic loss scaling and bf16 on real kernels (bf16 only where the GPU has it natively);
- CUDA-event timelines (`par.timeline`): a span measures the GPU's work, not the launch;
- a pipeline step (1F1B, ZB-H1, ZB-V) with the memory meter on leaves CUDA memory as it found it;
- the batch with `--backend nccl --world-size 1 --preset gpt3-small` writing its report;
- lecture 10: `python -m par bench mfu` on gpt3-small, par's fast path at >= 45 % MFU beside a nanoGPT-style reference;
- tokens/s and MFU of gpt3-small printed (`par.mfu`: (6·N + 12·L·s·d)·tokens, N without the embeddings,
  over the peak of the SKU `par.mfu.PEAK` names).

Run: `.venv/bin/python -m pytest -m gpu -s` (-s shows the printed numbers).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gpu_checks import finite_losses, sixteen_bit_tracks_fp32, tokens_per_second
from par.runtime import launch
from par.memory import accounting as memory
from par.train import planner
from par.mfu import mfu, peak_flops
from par.model import build, lm_loss, preset

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]
WORKER = str(ROOT / "tests" / "workers" / "launch_modes.py")


def test_nccl_bootstrap_with_one_rank():
    result = launch.run(WORKER, nproc=1, args=["ok"], backend="nccl", timeout=300, quiet=True)
    (rank,) = result["ranks"]
    assert rank["backend"] == "nccl" and rank["device"] == "cuda:0" and rank["world_size"] == 1


# every strategy's job on one rank; the arguments keep each one short
JOBS = {
    "collectives": ("par.comm.job", ["--parts", "bytes,timing", "--sizes", "65536", "--reps", "3"]),
    "memory": ("par.memory.job", ["--preset", "small", "--precisions", "fp32,bf16", "--steps", "2"]),
    "data parallel": ("par.dp.job", ["--dp", "naive,bucketed", "--preset", "small", "--steps", "5",
                                            "--batch", "8"]),
    "pipeline": ("par.pp.job", ["--schedules", "gpipe,1f1b", "--microbatches", "4", "--preset", "small",
                                       "--steps", "2", "--check"]),
    "tensor parallel": ("par.tp.job", ["--preset", "small", "--steps", "5"]),
    "mixed precision": ("par.precision.job", ["--dtype", "fp32,fp16", "--preset", "small", "--steps", "5",
                                              "--batch", "8"]),
    "zero": ("par.zero.job", ["--runs", "0,1,2,3,3+offload", "--preset", "small", "--steps", "3",
                                     "--batch", "4", "--timeline-runs", "3"]),
    "config": ("par.train.job", ["--config", json.dumps({
        "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
        "model": {"preset": "small"}, "steps": 3})]),
}   # (Parallel3D needs pp or tp > 1: two GPUs at least; on one it is the ZeRO engine)


@pytest.mark.parametrize("name", list(JOBS))
def test_every_strategy_runs_on_one_gpu(name):
    module, args = JOBS[name]
    result = launch.run(module, nproc=1, args=args, backend="nccl", timeout=600, quiet=True)
    assert result is not None
    assert json.dumps(result).count('"gloo"') == 0, "a job fell back to gloo"
    if name == "memory":
        assert all(run["cuda_peak"] for run in result["runs"].values()), "the CUDA allocator was read"
    elif name != "collectives":
        finite_losses(result)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cuda_bytes_of_model_states_match_the_formula(precision):
    """params + grads + Adam state, read from the CUDA allocator, within 5 % of par.memory.accounting's count."""
    if precision == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip("bf16 needs compute capability >= 8.0")
    device = torch.device("cuda", 0)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device)
    cfg = preset("gpt3-small", block_size=128)
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    model = build(cfg).to(device, dtype)
    params = list(model.parameters())
    masters = params if precision == "fp32" else [p.detach().float().requires_grad_() for p in params]
    opt = torch.optim.Adam(masters, lr=1e-4)
    x = torch.randint(cfg.vocab_size, (1, cfg.block_size), device=device)
    lm_loss(model(x).float(), x).backward()
    if masters is not params:
        for m, p in zip(masters, params):
            m.grad = p.grad.float()
    opt.step()
    if masters is not params:
        for m in masters:
            m.grad = None          # mixed precision keeps 16-bit grads only (the fp32 ones were transient)
    torch.cuda.synchronize(device)
    measured = torch.cuda.memory_allocated(device) - before
    numel = sum(p.numel() for p in params)
    predicted = memory.model_state_bytes(numel, precision=precision, optimizer="adam").total
    print(f"\n{precision}: CUDA allocator {measured / 1e9:.3f} GB, par.memory.accounting {predicted / 1e9:.3f} GB "
          f"({measured / predicted - 1:+.2%})")
    assert abs(measured / predicted - 1) <= 0.05
    del model, opt, masters, params
    torch.cuda.empty_cache()


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_16_bit_training_on_real_kernels(dtype):
    if dtype == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip("bf16 needs compute capability >= 8.0 (older GPUs only emulate it)")
    result = launch.run("par.precision.job", nproc=1, backend="nccl", timeout=600, quiet=True, args=[
        "--dtype", f"fp32,{dtype}", "--preset", "small", "--steps", "30", "--batch", "16", "--init-scale", 2 ** 16])
    print("\n" + sixteen_bit_tracks_fp32(result, dtype))


def test_timeline_spans_are_gpu_time():
    from par.timeline import Recorder
    device = torch.device("cuda", 0)
    rec = Recorder(device=device, sync=False)
    a = torch.randn(4096, 4096, device=device)
    torch.cuda.synchronize(device)
    cpu_start = time.perf_counter()
    with rec.span("matmuls"):
        for _ in range(20):
            a = a @ a / 4096 ** 0.5
    launched = time.perf_counter() - cpu_start            # the CPU only queued the kernels
    torch.cuda.synchronize(device)
    ran = time.perf_counter() - cpu_start
    (span,) = rec.gather()
    print(f"\n20 matmuls of 4096²: CPU left the block after {launched * 1e3:.2f} ms; GPU span "
          f"{(span['end'] - span['start']) * 1e3:.2f} ms; wall time to synchronize {ran * 1e3:.2f} ms")
    assert span["end"] - span["start"] > 2 * launched and span["end"] - span["start"] <= ran * 1.05


@pytest.mark.parametrize("name", ["1f1b", "zb_h1", "zb_v"])
def test_a_pipeline_step_with_the_memory_meter_leaves_cuda_memory_as_it_found_it(name):
    """One rank, 8 square layers of 4096 on 8 micro-batches of 2048 rows, `track_memory` on: after each step only
    the weights, their .grad and the batch stay allocated (the step's CUDA peak and the meter's count printed).
    With a pack hook that handed autograd the tensor itself, I and W kept every graph: +2 GiB a step on an H200."""
    import torch.nn.functional as F
    from par.model import SquareStack, square_batches
    from par.pp import schedules
    from par.pp.pipeline import Pipeline
    device = torch.device("cuda", 0)
    torch.cuda.empty_cache()
    x, y = (t.to(device) for t in next(square_batches(4096, 2048 * 8, 1, seed=2)))
    model = SquareStack(4096, 8, seed=1)
    pipe = Pipeline(model.to_layers(), schedules.make(name, 1, 8), F.mse_loss, method="uniform", device=device,
                    track_memory=True)
    pipe.step(x, y)                                # creates every .grad
    torch.cuda.synchronize(device)
    alive = torch.cuda.memory_allocated(device)
    for step in range(3):
        torch.cuda.reset_peak_memory_stats(device)
        pipe.step(x, y)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - alive
        print(f"\n{name} step {step + 1}: {(torch.cuda.memory_allocated(device) - alive) / 2**20:+.0f} MiB left, "
              f"peak {peak / 2**20:.0f} MiB above what stays, meter {pipe.memory['peak_bytes'] / 2**20:.0f} MiB")
        assert torch.cuda.memory_allocated(device) == alive
    del pipe, model, x, y
    torch.cuda.empty_cache()


def test_batch_writes_its_report_on_one_gpu(tmp_path):
    out = subprocess.run([sys.executable, "-m", "par", "batch", "--backend", "nccl", "--world-size", "1",
                          "--preset", "gpt3-small", "--steps", "20", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=3600)
    print(out.stdout[-4000:], out.stderr[-2000:])
    (folder,) = tmp_path.iterdir()
    summary = json.loads((folder / "summary.json").read_text())
    lectures = sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert (folder / "summary.md").is_file() and len(summary["notebooks"]) == len(lectures)
    failed = [(r["notebook"], r["status"], r.get("error")) for r in summary["notebooks"] if r["status"] != "ok"]
    assert not failed and summary["failed"] == 0 and out.returncode == 0, failed


def test_gpt3_small_tokens_per_second_and_mfu():
    device = torch.device("cuda", 0)
    bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
    precision = "bf16" if bf16 else "fp16"
    cfg = preset("gpt3-small")
    batch, steps = 8, 6
    config = {"train_batch_size": batch, "train_micro_batch_size_per_gpu": batch, "steps": steps,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-4}}, "model": {"preset": "gpt3-small"},
              precision: {"enabled": True}}
    row = launch.run("par.train.job", nproc=1, backend="nccl", timeout=900, quiet=True,
                     args=["--config", json.dumps(config)])
    step_s, tokens_per_s = tokens_per_second(row, batch, cfg.block_size)
    flops = planner.step_flops(planner.Workload(cfg, batch))
    name = torch.cuda.get_device_name(device)
    peak = peak_flops(name, precision)
    used = mfu(flops, step_s, 1, peak) if peak else float("nan")
    print(f"\ngpt3-small on {name}, {precision}, batch {batch} x {cfg.block_size}: {step_s * 1e3:.0f} ms/step, "
          f"{tokens_per_s:,.0f} tokens/s, {flops / step_s / 1e12:.1f} TFLOP/s, MFU {used:.1%} "
          f"(peak {peak / 1e12 if peak else float('nan'):.0f} TFLOP/s)")
    assert tokens_per_s > 0 and (peak is None or 0 < used < 1)


GPU_MFU_COMMAND = ["-m", "par", "bench", "mfu", "--device", "cuda", "--preset", "gpt3-small", "--seq", "1024,2048",
                   "--dtype", "bf16", "--tokens", "16384"]


def test_one_gpu_used_well_gpt3_small_reaches_45_percent_mfu(tmp_path):
    """Lecture 10's target (issue 36): gpt3-small at s = 1024 and 2048 in bf16, par's fast path at >= 45 % MFU
    (full-attention FLOPs over the exact SKU's dense bf16 peak) and >= 0.9x the nanoGPT-style reference in the
    same process; where the reference itself stays under 45 %, par fast >= 0.95x the reference."""
    out = subprocess.run([sys.executable, *GPU_MFU_COMMAND, "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=1800)
    print(out.stdout[-4000:], out.stderr[-2000:])
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads((tmp_path / "mfu.json").read_text())
    assert result["peak_source"].startswith("datasheet"), f"no datasheet peak for {result['device']}"
    for seq in (1024, 2048):
        row = {r["variant"]: r for r in result["rows"] if r["seq"] == seq}
        ratio = next(q for q in result["ratios"] if q["seq"] == seq)["fast_over_reference"]
        fast, ref = row["par fast"]["mfu_full"], row["reference"]["mfu_full"]
        assert (fast >= 0.45 and ratio >= 0.9) or (ref < 0.45 and ratio >= 0.95), (seq, fast, ref, ratio)
