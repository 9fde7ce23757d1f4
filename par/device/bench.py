"""Benchmark: one device used well. par eager, par's fast path and a nanoGPT-style reference on the same shapes.

    python -m par bench mfu [--device auto] [--preset small] [--seq 128] [--tokens N] [--dtype fp32]
                            [--steps 4] [--repeats 3] [--compile auto] [--tf32 on] [--out DIR]

In one process, on the device there is (a GPU when torch sees one), for each sequence length s:

* par eager: today's par (`par.model` with attention="math", AdamW with for-each kernels, the loss read by the
  host after every step);
* par fast: `par.model.fast(cfg)` (SDPA, vocabulary padded to a multiple of 64, tied head), fused AdamW,
  `compile_blocks` (and the head and the loss compiled), the loss summed on the device and read once per run;
* reference: `par.device.nanogpt` (nanoGPT's model and choices), compiled whole.

All three run the same widths (the preset's, block size s), the same batch (tokens // s sequences), under the same
autocast (--dtype bf16: bf16 matmuls, fp32 weights) and TF32 setting (--tf32, fed to the peak). Each is warmed
up, then timed in rotating turns (a run of `--steps` steps of each, `--repeats` rounds; the device synchronised
only at each run's ends); the step time is the median of the runs, the fastest and slowest beside it, and the
process's CPU seconds per step too (on a shared machine the steadier measure of the work). The same device's achievable matmul
rate and copy bandwidth are measured first (`par.device.roofline`), unless the caller hands in the roof it measured
(`measure(args, roof=(P, B))`: lecture 10 measures one roof per run and uses it everywhere).

    MFU = flops_per_token(cfg, s) · tokens / step_s / peak          (`par.mfu`: full or causal attention)
    HFU = hardware_flops_per_token(cfg, s) · tokens / step_s / peak (the padded head's columns counted too)

On a CPU the benchmark runs one thread (--threads): the CPU seconds of a step are then its work alone, steady on
a machine others share, and the ratios are printed by CPU seconds beside the wall clock's.

The peak is the datasheet's dense peak of the exact GPU (`par.mfu.peak_flops`, the dtype's rate, TF32's for fp32
with --tf32 on); where none is known (a CPU, an unknown GPU) it is the matmul rate measured here, and the table
says so. Ratios are throughputs: par fast / reference and par fast / par eager (higher is faster).

On a CPU, compilation is off by default (--compile auto): inductor writes and builds C++ for every graph, about a
minute per model on 2 cores, longer than the whole CPU benchmark; `--compile on` includes it.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from par import mfu as flops
from par.device import nanogpt, roofline
from par.measure import sync
from par.model import build, compile_blocks, fast, lm_loss, pad_to_multiple, preset
from par.reference import make_optimizer
from par.runtime.checks import check_writable, positive_int, write_atomic

VARIANTS = ("par eager", "par fast", "reference")
CPU_COMPILE_REASON = ("torch.compile off on the CPU: inductor builds C++ for every graph, about a minute per model "
                      "on 2 cores, longer than the benchmark (--compile on includes it)")


@dataclass
class Runner:
    """One variant, ready to train: `step(x, y)` runs forward, backward and the optimizer, returns the loss tensor."""
    name: str
    cfg: object            # the par GPTConfig whose FLOPs it does (padded_vocab set where its head is padded)
    step: object
    reads_loss: bool       # the host reads the loss after every step (a synchronisation)


def _autocast(device, dtype: str):
    return torch.autocast(device.type, dtype=roofline.DTYPES[dtype]) if dtype != "fp32" else nullcontext()


def _trainer(model, loss_of, opt, device, dtype: str):
    """step(x, y): zero the gradients, the loss under autocast, backward, optimizer step; returns the loss."""
    def step(x, y):
        opt.zero_grad(set_to_none=True)
        with _autocast(device, dtype):
            loss = loss_of(model, x, y)
        loss.backward()
        opt.step()
        return loss.detach()
    return step


def par_eager(cfg, device, dtype: str, compile: bool, lr: float = 6e-4) -> Runner:
    """par as the lectures build it: explicit attention, unpadded untied tables, AdamW with for-each kernels."""
    cfg = replace(cfg, attention="math")
    model = build(cfg).to(device)
    opt = make_optimizer(model.parameters(), "adamw", lr, betas=(0.9, 0.95))
    return Runner("par eager", cfg, _trainer(model, lambda m, x, y: lm_loss(m(x), y), opt, device, dtype), True)


def par_fast(cfg, device, dtype: str, compile: bool, lr: float = 6e-4) -> Runner:
    """par's fast path: `fast(cfg)`, fused AdamW, each block, the head and the loss compiled (when `compile`)."""
    cfg = fast(cfg)
    model = build(cfg).to(device)
    loss = lm_loss
    if compile:
        compile_blocks(model, dynamic=False)        # one static graph per shape: each sequence length builds anew
        model.head.compile(dynamic=False)           # the final LayerNorm and the LM head,
        loss = torch.compile(lm_loss, dynamic=False)  # and the loss: its fp32 upcast fused into the log-softmax
    opt = make_optimizer(model.parameters(), "adamw", lr, fused=True, betas=(0.9, 0.95))
    return Runner("par fast", cfg, _trainer(model, lambda m, x, y: loss(m(x), y), opt, device, dtype), False)


def reference(cfg, device, dtype: str, compile: bool, lr: float = 6e-4) -> Runner:
    """nanoGPT's model and choices (`par.device.nanogpt`), compiled whole (when `compile`)."""
    padded = pad_to_multiple(cfg.vocab_size)
    torch.manual_seed(0)
    model = nanogpt.NanoGPT(cfg, padded).to(device)
    opt = nanogpt.optimizer(model, lr)
    run = torch.compile(model, dynamic=False) if compile else model
    cfg = replace(cfg, padded_vocab=padded, tie_embeddings=True, attention="sdpa")
    return Runner("reference", cfg, _trainer(run, lambda m, x, y: m(x, y), opt, device, dtype), False)


BUILDERS = {"par eager": par_eager, "par fast": par_fast, "reference": reference}


def timed_run(runner: Runner, batches, device, steps: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds) per step of one run of `steps` steps. The device is synchronised at the run's two
    ends only; a runner that `reads_loss` reads it after each step, as par's loops do."""
    total = torch.zeros((), device=device)
    sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(steps):
        x, y = batches[i % len(batches)]
        loss = runner.step(x, y)
        total += loss.float()
        if runner.reads_loss:
            loss.item()
    sync(device)
    wall, cpu = (time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps
    if not torch.isfinite(total):
        raise RuntimeError(f"{runner.name}: the loss is not finite ({total.item()})")
    return wall, cpu


def in_turns(runners: list, batches, device, steps: int, repeats: int, warmup: int, tick=lambda: None) -> dict:
    """Each runner warmed up (`warmup` steps: compilation happens here), then timed in rotating turns, one run of
    each per round, `repeats` rounds: a load spike on a shared machine hits every variant alike.
    Returns {name: [(wall, cpu) per step of each run]}, or {name: "out of memory"} for a runner the device
    cannot hold (par eager's T × T scores at long sequences), which is then left out."""
    runs, fits = {}, []
    for runner in runners:
        try:
            for _ in range(warmup):
                timed_run(runner, batches, device, 1)
                tick()
            fits.append(runner)
            runs[runner.name] = []
        except torch.OutOfMemoryError:
            runs[runner.name] = "out of memory"
            runner.step = None                                        # its model, gradients and state go
            torch.cuda.empty_cache()
    for _ in range(repeats):
        for runner in fits:
            runs[runner.name].append(timed_run(runner, batches, device, steps))
            tick()
    return runs


def random_batches(cfg, batch: int, seq: int, device, count: int = 2, seed: int = 0) -> list:
    """`count` batches of random tokens (inputs, next-token targets), (batch, seq) each, on `device`."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g)
        out.append((tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)))
    return out


def utilisation(cfg, seq: int, tokens: int, step_s: float, peak: float) -> dict:
    """MFU (full and causal attention) and HFU (full) of one step."""
    return {"mfu_full": flops.mfu(flops.flops_per_token(cfg, seq) * tokens, step_s, 1, peak),
            "mfu_causal": flops.mfu(flops.flops_per_token(cfg, seq, "causal") * tokens, step_s, 1, peak),
            "hfu_full": flops.mfu(flops.hardware_flops_per_token(cfg, seq) * tokens, step_s, 1, peak),
            "tflops": flops.flops_per_token(cfg, seq) * tokens / step_s / 1e12}


def peak_of_device(device, dtype: str, tf32: bool, measured: float) -> tuple[float, str]:
    """(peak FLOP/s, where it comes from): the exact GPU's datasheet, else the matmul rate measured here."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = flops.peak_flops(name, dtype, tf32)
        if peak is not None:
            return peak, f"datasheet {flops.peak_of(name)[0]}, {dtype}{' (TF32)' if dtype == 'fp32' and tf32 else ''}"
    return measured, f"measured {dtype} matmul on this device (no datasheet peak)"


def measure(args, roof: tuple[float, float] | None = None) -> dict:
    """Every variant at every sequence length (the module docstring); the result as a dict. `roof`: (matmul FLOP/s,
    copy bytes/s) already measured on this device in `args.dtype` with `args.threads` threads, used instead of
    measuring them again."""
    from tqdm.auto import tqdm
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    flops.use_tf32(args.tf32 == "on")
    compile = args.compile == "on" or (args.compile == "auto" and device.type == "cuda")
    cfg0 = preset(args.preset)
    matmul, bandwidth = roof or (roofline.matmul_flops_per_s(device, args.dtype), roofline.copy_bytes_per_s(device))
    peak, peak_source = peak_of_device(device, args.dtype, args.tf32 == "on", matmul)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    result = {"device": name, "device_type": device.type, "torch": torch.__version__, "preset": args.preset,
              "dtype": args.dtype, "tf32": args.tf32 == "on", "compile": compile, "threads": torch.get_num_threads(),
              "compile_note": "" if compile or device.type == "cuda" or args.compile == "off" else CPU_COMPILE_REASON,
              "matmul_flops_per_s": matmul, "copy_bytes_per_s": bandwidth,
              "ridge_flops_per_byte": roofline.ridge_point(matmul, bandwidth),
              "peak_flops_per_s": peak, "peak_source": peak_source, "steps": args.steps, "repeats": args.repeats,
              "rows": [], "ratios": []}
    bar = tqdm(total=len(args.seq) * len(VARIANTS) * (args.warmup + args.repeats), desc="bench mfu", unit="run")
    for seq in args.seq:
        cfg = replace(cfg0, block_size=seq)
        batch = max(1, args.tokens // seq)
        batches = random_batches(cfg, batch, seq, device)
        runners = [BUILDERS[variant](cfg, device, args.dtype, compile) for variant in VARIANTS]
        bar.set_postfix_str(f"s={seq}")
        runs = in_turns(runners, batches, device, args.steps, args.repeats, args.warmup, bar.update)
        times = {}
        for runner in runners:
            if runs[runner.name] == "out of memory":
                result["rows"].append({"variant": runner.name, "seq": seq, "batch": batch, "error": "out of memory"})
                continue
            seconds = [wall for wall, _ in runs[runner.name]]
            step_s = times[runner.name] = statistics.median(seconds)
            result["rows"].append({"variant": runner.name, "seq": seq, "batch": batch, "tokens": batch * seq,
                                   "step_s": step_s, "step_s_min": min(seconds), "step_s_max": max(seconds),
                                   "cpu_s": statistics.median(cpu for _, cpu in runs[runner.name]),
                                   "tokens_per_s": batch * seq / step_s,
                                   **utilisation(runner.cfg, seq, batch * seq, step_s, peak)})
        del runners, runs
        if device.type == "cuda":
            torch.cuda.empty_cache()
        cpu = {r["variant"]: r["cpu_s"] for r in result["rows"] if r["seq"] == seq and "cpu_s" in r}
        ratio = {k: times[k] / times["par fast"] if k in times and "par fast" in times else None
                 for k in ("reference", "par eager")}
        cpu_ratio = {k: cpu[k] / cpu["par fast"] if k in cpu and "par fast" in cpu else None
                     for k in ("reference", "par eager")}
        result["ratios"].append({"seq": seq, "fast_over_reference": ratio["reference"],
                                 "fast_over_eager": ratio["par eager"],
                                 "cpu_fast_over_reference": cpu_ratio["reference"],
                                 "cpu_fast_over_eager": cpu_ratio["par eager"]})
    bar.close()
    return result


def table(r: dict) -> str:
    """The result as the text the command prints."""
    lines = [f"bench mfu on {r['device']} (torch {r['torch']}, {r['threads']} CPU threads), preset {r['preset']}, "
             f"{r['dtype']}, "
             f"TF32 {'on' if r['tf32'] else 'off'}, compile {'on' if r['compile'] else 'off'}",
             f"measured: matmul {r['matmul_flops_per_s'] / 1e12:.3g} TFLOP/s, copy {r['copy_bytes_per_s'] / 1e9:.3g} GB/s,"
             f" ridge point {r['ridge_flops_per_byte']:.3g} FLOP/byte",
             f"peak for MFU: {r['peak_flops_per_s'] / 1e12:.4g} TFLOP/s ({r['peak_source']})"]
    if r["compile_note"]:
        lines.append(r["compile_note"])
    lines.append(f"{'variant':<10} {'seq':>5} {'batch':>5} {'ms/step (min-max)':>26} {'CPU ms':>8} {'tokens/s':>10} "
                 f"{'TFLOP/s':>8} {'MFU':>6} {'MFU causal':>10} {'HFU':>6}")
    for row in r["rows"]:
        if "error" in row:
            lines.append(f"{row['variant']:<10} {row['seq']:>5} {row['batch']:>5} {row['error']}")
            continue
        ms = f"{row['step_s'] * 1e3:.2f} ({row['step_s_min'] * 1e3:.2f}-{row['step_s_max'] * 1e3:.2f})"
        lines.append(f"{row['variant']:<10} {row['seq']:>5} {row['batch']:>5} {ms:>26} {row['cpu_s'] * 1e3:>8.2f} "
                     f"{row['tokens_per_s']:>10.0f} "
                     f"{row['tflops']:>8.3g} {row['mfu_full']:>6.1%} {row['mfu_causal']:>10.1%} {row['hfu_full']:>6.1%}")
    for q in r["ratios"]:
        x = {k: f"{v:.2f}x" if v is not None else "n/a" for k, v in q.items()}
        lines.append(f"seq {q['seq']}: par fast / reference = {x['fast_over_reference']}, par fast / par eager = "
                     f"{x['fast_over_eager']} (throughput, wall clock); by CPU seconds {x['cpu_fast_over_reference']}"
                     f" and {x['cpu_fast_over_eager']}")
    return "\n".join(lines)


def _seqs(text: str) -> list[int]:
    return [positive_int(t) for t in text.split(",") if t.strip()]


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m par bench mfu", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto", help="auto (a GPU when torch sees one), cpu, cuda or cuda:N")
    p.add_argument("--preset", default=None, help="a par.model preset (default: small on a CPU, gpt3-small on a GPU)")
    p.add_argument("--seq", type=_seqs, default=None, help="comma-separated sequence lengths (default: 64 on a "
                                                             "CPU, 1024,2048 on a GPU)")
    p.add_argument("--tokens", type=positive_int, default=None, help="tokens per step; batch = tokens // seq "
                                                                      "(default: 512 on a CPU, 16384 on a GPU)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default=None, help="autocast dtype (default: fp32 on a "
                                                                             "CPU, bf16 on a GPU)")
    p.add_argument("--steps", type=positive_int, default=None, help="steps per timed run (default 3 CPU, 10 GPU)")
    p.add_argument("--repeats", type=positive_int, default=3, help="timed runs per variant: the median, the spread")
    p.add_argument("--warmup", type=positive_int, default=2, help="untimed steps first (compilation happens here)")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="torch.compile for par fast and the reference (auto: on a GPU only)")
    p.add_argument("--tf32", choices=("on", "off"), default="on", help="fp32 matmuls on TF32 tensor cores")
    p.add_argument("--threads", type=positive_int, default=None, help="CPU threads (default: 1 on a CPU device, "
                                                                        "torch's default with a GPU)")
    p.add_argument("--out", default=None, help="a folder for mfu.json")
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: this torch ({torch.__version__}) sees no CUDA GPU; use --device cpu")
    gpu = args.device.startswith("cuda")
    args.preset = args.preset or ("gpt3-small" if gpu else "small")
    args.seq = args.seq or ([1024, 2048] if gpu else [64])
    args.tokens = args.tokens or (16384 if gpu else 512)
    args.dtype = args.dtype or ("bf16" if gpu else "fp32")
    args.steps = args.steps or (10 if gpu else 3)
    args.threads = args.threads or (None if gpu else 1)
    try:
        preset(args.preset)
    except ValueError as e:
        p.error(f"--preset: {e}")
    if max(args.seq) > 1 << 16:
        p.error(f"--seq {max(args.seq)}: use lengths up to 65536")
    if args.out:
        check_writable(args.out, directory=True)
    return args


def main(argv=None) -> int:
    args = parse(argv)
    threads = torch.get_num_threads()
    try:
        result = measure(args)
    finally:
        torch.set_num_threads(threads)                   # a caller's process keeps its own setting
    print(table(result))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        write_atomic(Path(args.out) / "mfu.json", json.dumps(result, indent=1))
        print(f"wrote {Path(args.out) / 'mfu.json'}")
    return 0
