"""The training loop's timed steps (`par.train.loop.train`, in one process): no activation meter and one host read of
the loss per step; the meter runs in the untimed warm-up step, and the run still equals the single process."""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import par.pp.pipeline
import par.runtime.dist
import par.train.loop as loop
import par.train.parallel3d as p3d
from par.model import build, preset
from par.runtime.grid import Grid
from par.train.config import parse

CONFIG = {"train_batch_size": 8, "gradient_accumulation_steps": 4, "steps": 3, "seed": 0,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "model": {"preset": "tiny", "n_layer": 2}}


def test_timed_steps_run_without_the_meter_and_read_the_loss_once(monkeypatch):
    monkeypatch.setattr(par.runtime.dist, "env", lambda: SimpleNamespace(device=torch.device("cpu")))
    step, timing = [-1], [False]
    metered, reads = [], []

    @contextlib.contextmanager
    def timed(device):
        step[0] += 1
        timing[0] = True
        with real_timed(device) as clock:
            yield clock
        timing[0] = False

    def meter(*args, **kwargs):
        metered.append((step[0], timing[0]))
        return real_meter(*args, **kwargs)

    package = str(Path(par.__file__).resolve().parent) + os.sep     # par's own files, wherever the clone is

    def item(self):       # par's reads (Adam reads its CPU step counters: no device to wait for)
        if timing[0] and str(Path(sys._getframe(1).f_code.co_filename).resolve()).startswith(package):
            reads.append(step[0])
        return real_item(self)

    real_timed, real_meter, real_item = loop.timed_step, p3d.saved_activation_bytes, torch.Tensor.item
    monkeypatch.setattr(loop, "timed_step", timed)
    monkeypatch.setattr(p3d, "saved_activation_bytes", meter)
    monkeypatch.setattr(torch.Tensor, "item", item)
    tc = parse(CONFIG, world_size=1)
    out = loop.train(tc, check=True)
    assert {s for s, _ in metered} == {0} and len(metered) == tc.grad_accum      # every micro-batch of step 0
    assert reads == [0, 1, 2]                                  # one read a step (not one a micro-batch)
    assert out["activations_peak"] > 0
    assert len(out["losses"]) == 3 and out["max_param_diff"] <= 1e-5


def test_the_pipeline_engine_switches_its_meter():
    """Parallel3D's `track_memory` is its pipeline's: on, a step measures the activations; off, it keeps the peak
    measured before and adds no hooks."""
    engine = p3d.Parallel3D(build(preset("tiny", n_layer=2), seed=0), Grid(), microbatches=2)
    x = torch.randint(0, 65, (4, 32))
    engine.track_memory = True
    engine.step(x, x)
    peak = engine.activation_peak()
    assert peak > 0 and engine.pipe.track_memory
    engine.track_memory = False
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(par.pp.pipeline, "saved_tensors_seen", lambda see: pytest.fail("meter on in a timed step"))
        engine.step(x, x)
    assert engine.activation_peak() == peak
