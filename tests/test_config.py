"""DeepSpeed-style config: batch identity, unknown keys, degrees, scheduler; the train entry follows it."""
import json
from pathlib import Path

import pytest

from par.train.config import ConfigError, load, lr_at, model_config, parse

ROOT = Path(__file__).resolve().parent.parent
BASE = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}


def test_identity_counts_data_parallel_replicas_not_gpus():
    tc = parse({**BASE, "pipeline": {"stages": 2}, "tensor_parallel": {"tp_size": 2}}, world_size=8)
    assert (tc.dp, tc.pp, tc.tp) == (2, 2, 2)
    assert tc.train_batch_size == tc.micro_batch * tc.grad_accum * tc.dp == 16


def test_wrong_identity_states_the_numbers():
    with pytest.raises(ConfigError) as e:
        parse({**BASE, "train_batch_size": 20}, world_size=2)
    msg = str(e.value)
    assert "train_batch_size 20 != micro_batch 2 × grad_accum 4 × world_size 2 = 16" in msg
    assert "dp = 2 ranks / (pp 1 × tp 1) = 2" in msg


@pytest.mark.parametrize("given,world,want", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 4, (4, 2)),       # accumulation derived
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (4, 2)),          # micro-batch derived
    ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}, 2, (3, 2)),  # batch derived
])
def test_two_of_three_derive_the_third(given, world, want):
    tc = parse(given, world)
    assert (tc.micro_batch, tc.grad_accum) == want
    assert tc.train_batch_size == tc.micro_batch * tc.grad_accum * world


def test_unknown_keys_are_errors_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"unknown key 'zero_optimisation' \(did you mean 'zero_optimization'\?\)"):
        parse({**BASE, "zero_optimisation": {"stage": 2}}, 2)
    with pytest.raises(ConfigError, match=r"unknown key 'zero_optimization.stag'"):
        parse({**BASE, "zero_optimization": {"stag": 2}}, 2)
    with pytest.raises(ConfigError, match=r"unknown key 'optimizer.params.learning_rate'"):
        parse({**BASE, "optimizer": {"type": "Adam", "params": {"learning_rate": 1}}}, 2)


def test_degrees_that_do_not_divide_the_world():
    with pytest.raises(ConfigError, match=r"world size 6 is not divisible by pipeline stages 4 × tensor degree 1 = 4"):
        parse({**BASE, "pipeline": {"stages": 4}}, 6)


@pytest.mark.parametrize("extra,world,match", [
    ({"zero_optimization": {"stage": 3}, "pipeline": {"stages": 2}}, 4, "only stages 0 and 1"),
    ({"bf16": {"enabled": True}, "tensor_parallel": {"tp_size": 2}}, 4, "bf16 with pipeline stages 1 / tensor degree 2"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, 2, "pick one"),
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}, 2, "needs stage 1, 2 or 3"),
    ({"zero_optimization": {"stage": 5}}, 2, "must be 0, 1, 2 or 3"),
    ({"optimizer": {"type": "Lamb"}}, 2, "not supported"),
    ({"scheduler": {"type": "OneCycle"}}, 2, "not supported"),
])
def test_combinations_refused_with_a_reason(extra, world, match):
    parse({**BASE, **{k: v for k, v in extra.items() if k in ("pipeline", "tensor_parallel")}}, world)  # valid alone
    with pytest.raises(ConfigError, match=match):
        parse({**BASE, **extra}, world)


def test_fp16_loss_scale_keys_and_prefetch():
    assert parse({**BASE, "fp16": {"enabled": True, "loss_scale": 128}}, 2).loss_scale == {"static": 128.0}
    tc = parse({**BASE, "fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 50}}, 2)
    assert tc.loss_scale == {"init_scale": 4096.0, "window": 50}
    from par.train.config import loss_scaler
    s = loss_scaler(tc)
    assert s.dynamic and s.scale == 4096.0
    assert parse({**BASE, "zero_optimization": {"stage": 3, "prefetch": True}}, 2).prefetch
    with pytest.raises(ConfigError, match="only stage 3"):
        parse({**BASE, "zero_optimization": {"stage": 2, "prefetch": True}}, 2)


def test_compatibility_keys_are_listed_as_ignored():
    from par.train.config import ignored_keys
    cfg = {**BASE, "steps_per_print": 10, "zero_optimization": {"stage": 3, "reduce_bucket_size": 5e8}}
    assert ignored_keys(cfg) == ["steps_per_print", "zero_optimization.reduce_bucket_size"]
    parse(cfg, 2)


def test_cli_reports_a_bad_config_before_launching(tmp_path, capsys, monkeypatch):
    from par.__main__ import main
    monkeypatch.delenv("PAR_DEBUG", raising=False)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**BASE, "train_batch_size": 20}))
    assert main(["train", "--config", str(bad), "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: batch sizes: train_batch_size 20 != micro_batch 2 × grad_accum 4 × world_size 2")
    assert len(err.strip().splitlines()) == 1
    with pytest.raises(ConfigError, match="train_batch_size 20"):       # --debug: the traceback instead
        main(["train", "--config", str(bad), "--nproc", "2", "--debug"])


@pytest.mark.parametrize("argv,says", [
    (["--config", "configs/3d.json", "--nproc", "3"], "world size 3 is not divisible by pipeline stages 2 × tensor "
                                                      "degree 2 = 4: launch a multiple of 4 ranks (e.g. --nproc 4 or 8)"),
    (["--config", "configs/nothing.json", "--nproc", "2"], "cannot read config configs/nothing.json"),
    (["--config", "{\"train_batch_size\": 8, \"zero_optimisation\": {}}", "--nproc", "2"],
     "did you mean 'zero_optimization'"),
    (["--config", "configs/ddp.json", "--nproc", "2", "--backend", "nccl"], "backend 'nccl' needs"),
])
def test_train_command_user_errors_are_one_line_exit_2_before_any_rank(argv, says):
    """`python -m par train` as a user types it: one line naming the fix, exit code 2, no traceback, fast."""
    import os
    import subprocess
    import sys
    import time
    if "nccl" in argv:
        import torch
        if torch.cuda.device_count() >= 2:
            pytest.skip("this machine has the GPUs")
    env = {k: v for k, v in os.environ.items() if k != "PAR_DEBUG"}
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "par", "train", *argv], cwd=ROOT, capture_output=True, text=True,
                       timeout=60, env=env)
    took = time.monotonic() - t0
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert p.stderr.startswith("error: ") and says in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr + p.stdout
    assert took < 30, took        # the issue asks for 5 s; a loaded test machine gets slack (torch import)
    debug = subprocess.run([sys.executable, "-m", "par", "train", *argv], cwd=ROOT, capture_output=True, text=True,
                           timeout=60, env={**env, "PAR_DEBUG": "1"})
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_warmup_log_then_constant_and_decay():
    tc = parse({**BASE, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 10}}}, 2)
    assert lr_at(tc, 0) == 0.0 and lr_at(tc, 9) == pytest.approx(0.01) and lr_at(tc, 50) == 0.01
    assert 0 < lr_at(tc, 3) < lr_at(tc, 4) < 0.01
    tc = parse({**BASE, "scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_max_lr": 0.01, "warmup_num_steps": 4, "warmup_type": "linear", "total_num_steps": 12}}}, 2)
    assert lr_at(tc, 2) == pytest.approx(0.005) and lr_at(tc, 8) == pytest.approx(0.005) and lr_at(tc, 12) == 0.0


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.json")), ids=lambda p: p.name)
def test_example_configs_parse(path):
    cfg = json.loads(path.read_text())
    pp, tp = cfg.get("pipeline", {}).get("stages", 1), cfg.get("tensor_parallel", {}).get("tp_size", 1)
    tc = load(path, world_size=2 * pp * tp)
    assert tc.dp == 2 and model_config(tc).n_layer >= 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 3])
def test_train_entry_follows_the_config_and_equals_single_process(stage):
    """2 replicas × 2 micro-batches of 2 = batch 8: the losses are those of one process on the same batches."""
    import par.runtime.launch
    from par.data import CharDataset, global_batches
    from par.model import build, lm_loss, preset
    from par.reference import train_single
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam",
           "params": {"lr": 0.001}}, "zero_optimization": {"stage": stage}, "model": {"preset": "tiny"}, "steps": 3}
    row = par.runtime.launch.run("par.train.job", nproc=2, args=["--config", json.dumps(cfg), "--check"], timeout=110)
    assert row["grad_accum"] == 2 and row["strategy"] == f"ZeRO-{stage}"
    # the job contract (par/measure.py), and the parameters of one process trained on the same batches
    assert row["world_size"] == 2 and row["backend"] == "gloo" and len(row["per_rank"]) == 2
    assert len(row["step_s"]) == 3 - row["warmup_steps"] and row["max_param_diff"] <= 1e-5, row["max_param_diff"]
    ds = CharDataset(block_size=preset("tiny").block_size)
    want = train_single(build("tiny", seed=0), global_batches(ds, 8, 3, seed=0), lm_loss, "adam", 1e-3)
    assert max(abs(a - b) for a, b in zip(row["losses"], want)) <= 1e-5, (row["losses"], want)
    assert len(row["losses"]) == 3 and row["bytes_per_step"] > 0
    # ZeRO keeps half of the Adam state per rank: the two ranks' optimizer bytes are about half of 8Ψ
    from par.memory.accounting import param_count
    assert all(r["optimizer"] < 0.6 * 8 * param_count(preset("tiny")) for r in row["per_rank"])
    # the row as the job declares it (par.train.job.Result): every key it saved, read back as attributes
    from par.measure import parse
    typed = parse(row, "par.train.job")
    assert typed.strategy == row["strategy"] and typed.rank(1).optimizer == row["per_rank"][1]["optimizer"]
    assert {k: v for k, v in typed.to_json().items() if k != "per_rank"} == {k: v for k, v in row.items()
                                                                          if k != "per_rank"}
