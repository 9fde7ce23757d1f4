"""One training step under `torch.profiler`, saved as a Chrome / Perfetto trace-event JSON.

    with profile.step(args.profile_dir, f"dp_{variant}_rank{rank}", on=step == 1) as trace:
        train_step(...)                  # the ops of this step, on every thread the profiler sees
    trace.path                           # <profile_dir>/dp_bucketed_rank0.json (None when off)

Open the file in https://ui.perfetto.dev (or chrome://tracing): one row per thread, a slice per op
(aten::mm, autograd's backward nodes, gloo's all-reduce, par's own `record_function` spans), CUDA kernels too
on a GPU. `check(path)` reads a trace back and says how many events it holds (a trace-event JSON is an object
with a "traceEvents" list). `trace_dir(name)` is a fresh folder for a notebook's traces under the repository's
runs/traces/ (git-ignored), or under $PAR_TRACE_DIR (the batch sets it to its run folder's traces/).
"""
from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from par.runtime.paths import ROOT

import torch


@dataclass
class Trace:
    path: Path | None = None      # where the trace was written (None: not profiled)


@contextmanager
def step(directory: str | os.PathLike | None, name: str, on: bool = True):
    """Profile the block (one step) when `on` and `directory` are set; write <directory>/<name>.json."""
    trace = Trace()
    if not (on and directory):
        yield trace
        return
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        yield trace
    path = Path(directory) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    trace.path = path


def check(path: str | os.PathLike) -> int:
    """The number of events of a Chrome / Perfetto trace-event JSON; ValueError when it is not one."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ValueError(f"{path} is not a trace-event JSON (no 'traceEvents' list)")
    return len(data["traceEvents"])


def trace_dir(name: str) -> Path:
    """A new folder for `name`'s traces: $PAR_TRACE_DIR/<name>-<time>, else <repo>/runs/traces/<name>-<time>."""
    root = Path(os.environ.get("PAR_TRACE_DIR") or ROOT / "runs" / "traces")
    path = root / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    suffix = 1
    while path.exists():
        path = path.with_name(f"{name}-{time.strftime('%Y%m%d-%H%M%S')}_{suffix}")
        suffix += 1
    path.mkdir(parents=True)
    return path
