"""`python -m par gpu-check --minutes 8`: a GPU server checked and its course run recorded, in one command.

Four stages, each a command of its own with a share of the time budget as its timeout, in this order:

    gpu tier   python -m pytest -m gpu -s                      what only a GPU shows (tests/test_gpu.py)
    bench mfu  python -m par bench mfu --device cuda            one device's MFU, beside a nanoGPT-style reference
    dry run    python -m par batch --dry-run --backend nccl     every launch at the server's size and GPU memory
    batch      python -m par batch --world-size 1 --backend nccl --steps S

The batch gets what the budget leaves after the others, and its steps are scaled to it: S = 20 · (its seconds /
240), between 5 and 200 (the CPU batch at 20 steps takes about 240 s of training on one rank). A stage that is
not available on this checkout (no `mfu` benchmark) is recorded as skipped with the reason.

Everything goes to one run folder (`--out`, default runs/gpu-check-<time>/): `provenance.json` (GPU SKU and
memory, driver, CUDA, torch and NCCL versions, par's commit), each stage's log, `gpu-check.json` (each stage's
command, status, seconds), and the batch's own run folder under `batch/`. On a machine without a CUDA GPU the
command says so in one line and exits 2 before it starts anything.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from par.bench import BENCHMARKS
from par.runtime.checks import check_writable, CheckError, positive_float
from par.runtime.paths import ROOT

SHARES = {"gpu tier": 0.30, "bench mfu": 0.15, "dry run": 0.05}   # of the budget; the batch gets the rest
CPU_BATCH_TRAINING_S = 240.0                                       # the one-rank batch's training at 20 steps, CPU


@dataclass(frozen=True)
class Stage:
    name: str
    command: tuple[str, ...]
    timeout_s: float
    skipped: str = ""            # why the stage does not run here ("" when it runs)


def batch_steps(seconds: float) -> int:
    """The batch's --steps for `seconds` of budget: 20 · seconds / 240, clamped to [5, 200]."""
    return max(5, min(200, round(20 * seconds / CPU_BATCH_TRAINING_S)))


def has_benchmark(name: str) -> bool:
    return name in BENCHMARKS


def stages(minutes: float, gpus: int, gpu_memory: float, out: Path) -> list[Stage]:
    """The four stages for a budget of `minutes` on a server of `gpus` GPUs of `gpu_memory` bytes each."""
    budget = minutes * 60.0
    py = sys.executable
    mfu_skip = "" if has_benchmark("mfu") else "this checkout has no `python -m par bench mfu`"
    batch_s = budget * (1.0 - sum(SHARES.values()))
    return [
        Stage("gpu tier", (py, "-m", "pytest", "-m", "gpu", "-s", "-q", "-p", "no:cacheprovider",
                           f"--junitxml={out / 'gpu-tier.xml'}"), budget * SHARES["gpu tier"]),
        Stage("bench mfu", (py, "-m", "par", "bench", "mfu", "--device", "cuda"), budget * SHARES["bench mfu"],
              mfu_skip),
        Stage("dry run", (py, "-m", "par", "batch", "--dry-run", "--backend", "nccl", "--world-size", str(gpus),
                          "--preset", "gpt3-small", "--steps", "200", "--gpu-memory", f"{gpu_memory:.3g}"),
              budget * SHARES["dry run"]),
        Stage("batch", (py, "-m", "par", "batch", "--world-size", "1", "--backend", "nccl",
                        "--steps", str(batch_steps(batch_s)), "--out", str(out / "batch")), batch_s),
    ]


def provenance() -> dict:
    """What ran this check: the GPU (SKU, memory, count), the driver, CUDA, torch, NCCL, Python, par's commit."""
    import torch
    props = torch.cuda.get_device_properties(0)
    smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30) if shutil.which("nvidia-smi") else None
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    nccl = torch.cuda.nccl.version() if torch.distributed.is_nccl_available() else None
    return {"gpu": props.name, "gpu_memory_bytes": props.total_memory, "gpus": torch.cuda.device_count(),
            "driver": (smi.stdout.strip().splitlines() or [None])[0] if smi and smi.returncode == 0 else None,
            "cuda": torch.version.cuda, "torch": torch.__version__,
            "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
            "python": sys.version.split()[0], "par_commit": commit.stdout.strip() or None,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def require_gpu() -> None:
    import torch
    if not torch.cuda.is_available():
        raise CheckError("no CUDA GPU here (torch.cuda.is_available() is False): run gpu-check on the GPU server; "
                         "the CPU course is `python -m par batch`")


def run_stage(stage: Stage, out: Path) -> dict:
    """Run one stage with its timeout, its output to <out>/<name>.log; its record for gpu-check.json."""
    record = {**asdict(stage), "command": " ".join(stage.command)}
    if stage.skipped:
        return {**record, "status": "skipped", "seconds": 0.0}
    log = out / f"{stage.name.replace(' ', '-')}.log"
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            done = subprocess.run(stage.command, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, timeout=stage.timeout_s, start_new_session=True)
            status = "ok" if done.returncode == 0 else f"failed (exit {done.returncode})"
        except subprocess.TimeoutExpired:
            status = f"timed out after {stage.timeout_s:.0f} s"
    return {**record, "status": status, "seconds": round(time.perf_counter() - t0, 1), "log": log.name}


def write_json(path: Path, data: dict) -> None:
    """`data` to `path` atomically (a reader never sees half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m par gpu-check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=positive_float, default=8.0, help="the time budget (default 8)")
    parser.add_argument("--out", type=Path, default=None, help="the run folder (default runs/gpu-check-<time>)")
    args = parser.parse_args(argv)
    out = args.out or ROOT / "runs" / f"gpu-check-{time.strftime('%Y%m%d-%H%M%S')}"
    require_gpu()
    check_writable(out, directory=True, parents=True)
    out.mkdir(parents=True, exist_ok=True)
    facts = provenance()
    write_json(out / "provenance.json", facts)
    print(f"gpu-check: {facts['gpus']} x {facts['gpu']}, torch {facts['torch']}, CUDA {facts['cuda']}, "
          f"NCCL {facts['nccl']}, driver {facts['driver']}; budget {args.minutes:g} min; writing {out}")
    from tqdm.auto import tqdm
    records = []
    for stage in tqdm(stages(args.minutes, facts["gpus"], facts["gpu_memory_bytes"], out), desc="gpu-check",
                      unit="stage"):
        records.append(run_stage(stage, out))
        write_json(out / "gpu-check.json", {"provenance": facts, "stages": records})
        print(f"  {stage.name:<10} {records[-1]['status']} ({records[-1]['seconds']:.0f} s)")
    return 0 if all(r["status"] in ("ok", "skipped") for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
