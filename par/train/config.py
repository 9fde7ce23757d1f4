"""A DeepSpeed-style JSON training configuration, checked before anything starts.

    {
      "train_batch_size": 16,                  # samples per optimizer step, all replicas together
      "train_micro_batch_size_per_gpu": 2,     # samples one replica pushes through at a time
      "gradient_accumulation_steps": 4,        # micro-batches per step (= pipeline micro-batches)
      "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8}},
      "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3,
                                                   "warmup_num_steps": 10}},
      "fp16": {"enabled": false}, "bf16": {"enabled": false},
      "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
      "pipeline": {"stages": 2, "schedule": "1f1b"},
      "tensor_parallel": {"tp_size": 2},
      "model": {"preset": "tiny", "n_layer": 4},  "steps": 20, "seed": 0
    }

The batch identity (DeepSpeed's, `par.dp.batch_size`) counts data-parallel replicas, not GPUs:

    train_batch_size = micro_batch × gradient_accumulation_steps × dp,   dp = world_size / (pp · tp)

Give any two of the three batch numbers and the third is derived; give three that disagree and
the error states the numbers. A key this file does not know is an error (with the closest known
key), never silently ignored: a typo such as "zero_optimisation" would otherwise train without ZeRO.
`pipeline` and `tensor_parallel` are par's (DeepSpeed takes the stages from PipelineModule);
`model`, `steps` and `seed` say what to train.

fp16's `loss_scale` (0 = dynamic), `initial_scale_power` (S = 2^power), `loss_scale_window`,
`hysteresis` and `min_loss_scale` configure `par.precision.loss_scaler`; `zero_optimization.prefetch`
turns on stage-3 prefetching. Accepted for DeepSpeed compatibility but without effect in par
(`IGNORED`, listed by `ignored_keys`): `steps_per_print`, `wall_clock_breakdown`, the ZeRO bucket
sizes, `overlap_comm`, `contiguous_gradients`, `offload_optimizer.pin_memory`.
"""
from __future__ import annotations

import difflib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from par.dp.batch_size import BatchSizeError, resolve_batch
from par.runtime.grid import layout_label

TOP_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer",
            "scheduler", "fp16", "bf16", "zero_optimization", "pipeline", "tensor_parallel", "gradient_clipping",
            "model", "steps", "seed", "steps_per_print", "wall_clock_breakdown"}
SECTION_KEYS = {
    "optimizer": {"type", "params"},
    "optimizer.params": {"lr", "betas", "eps", "weight_decay", "momentum"},
    "scheduler": {"type", "params"},
    "scheduler.params": {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps"},
    "fp16": {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"},
    "bf16": {"enabled"},
    "zero_optimization": {"stage", "offload_optimizer", "reduce_bucket_size", "allgather_bucket_size",
                          "overlap_comm", "contiguous_gradients", "prefetch"},
    "zero_optimization.offload_optimizer": {"device", "pin_memory"},
    "pipeline": {"stages", "schedule", "partition_method"},
    "tensor_parallel": {"tp_size"},
    "model": {"preset", "vocab_size", "block_size", "n_layer", "n_head", "d_model", "d_ff"},
}
IGNORED = {"steps_per_print", "wall_clock_breakdown", "zero_optimization.reduce_bucket_size",
           "zero_optimization.allgather_bucket_size", "zero_optimization.overlap_comm",
           "zero_optimization.contiguous_gradients", "zero_optimization.offload_optimizer.pin_memory"}
OPTIMIZERS = {"adam": "adam", "adamw": "adamw", "sgd": "sgd", "momentum": "momentum"}
SCHEDULERS = ("WarmupLR", "WarmupDecayLR")


class ConfigError(ValueError):
    """A configuration that cannot run: one message naming the key, the numbers and the fix."""


@dataclass(frozen=True)
class TrainConfig:
    world_size: int
    dp: int
    pp: int
    tp: int
    train_batch_size: int
    micro_batch: int
    grad_accum: int
    optimizer: str = "adam"
    lr: float = 1e-3
    optimizer_params: dict = field(default_factory=dict)   # betas, eps, weight_decay, momentum
    warmup_steps: int = 0
    warmup_min_lr: float = 0.0
    warmup_type: str = "log"                               # DeepSpeed's default; or "linear"
    decay_steps: int | None = None                         # WarmupDecayLR: linear decay to 0 at this step
    precision: str = "fp32"                                # fp32 | fp16 | bf16
    zero_stage: int = 0
    offload: bool = False
    schedule: str = "1f1b"
    partition_method: str = "parameters"
    gradient_clipping: float | None = None
    loss_scale: dict = field(default_factory=dict)         # fp16: {"static": S} or DynamicLossScaler arguments
    prefetch: bool = False                                 # ZeRO-3: gather the next unit ahead
    model: dict = field(default_factory=lambda: {"preset": "tiny"})
    steps: int = 10
    seed: int = 0

    @property
    def layout(self) -> str:
        """'dp2xpp2xtp2' (`par.runtime.grid.layout_label`)."""
        return layout_label(self.dp, self.pp, self.tp)

    @property
    def strategy(self) -> str:
        """A short name: 'single', 'DDP', 'ZeRO-2 + offload', 'pipeline (2 stages)', 'tensor parallel (2)',
        '2D dp2xpp2xtp1', '3D dp2xpp2xtp2 + ZeRO-1', ... ('3D' only when every degree is > 1)."""
        if self.pp == 1 and self.tp == 1:
            name = "single" if self.dp == 1 and self.zero_stage == 0 else (
                "DDP" if self.zero_stage == 0 else f"ZeRO-{self.zero_stage}")
            if self.offload:
                name += " + offload"
        elif self.dp == 1 and self.tp == 1:
            name = f"pipeline ({self.pp} stages)"
        elif self.dp == 1 and self.pp == 1:
            name = f"tensor parallel ({self.tp})"
        else:
            name = f"{sum(n > 1 for n in (self.dp, self.pp, self.tp))}D {self.layout}"
        if self.zero_stage and (self.pp > 1 or self.tp > 1):
            name += f" + ZeRO-{self.zero_stage}"
        return name + ("" if self.precision == "fp32" else f" {self.precision}")

    def to_dict(self) -> dict:
        return asdict(self)


def _unknown(section: str, given: dict, known: set) -> list[str]:
    msgs = []
    for key in sorted(set(given) - known):
        near = difflib.get_close_matches(key, sorted(known), n=1)
        where = f"{section}." if section else ""
        msgs.append(f"unknown key '{where}{key}'" + (f" (did you mean '{near[0]}'?)" if near else "")
                    + f"; known keys{' in ' + section if section else ''}: {', '.join(sorted(known))}")
    return msgs


def check_keys(cfg: dict) -> None:
    """Raise `ConfigError` listing every key this file does not know, at every level."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"a config is a JSON object, got {type(cfg).__name__}")
    msgs = _unknown("", cfg, TOP_KEYS)
    for section, known in SECTION_KEYS.items():
        node = cfg
        for part in section.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            msgs += _unknown(section, node, known)
        elif node is not None:
            msgs.append(f"'{section}' must be a JSON object, got {node!r}")
    if msgs:
        raise ConfigError("; ".join(msgs))


def _int(cfg: dict, key: str, default=None):
    v = cfg.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v or v < 1:
        raise ConfigError(f"{key} must be a positive integer, got {v!r}")
    return int(v)


def degrees(world_size: int, pp: int, tp: int) -> int:
    """dp = world_size / (pp · tp); an error naming the numbers when it is not a whole number."""
    if world_size % (pp * tp):
        n = pp * tp
        raise ConfigError(f"world size {world_size} is not divisible by pipeline stages {pp} × tensor degree "
                          f"{tp} = {n}: launch a multiple of {n} ranks (e.g. --nproc {n} or {2 * n}) or change "
                          f"pipeline.stages / tensor_parallel.tp_size")
    return world_size // (pp * tp)


def parse(cfg: dict, world_size: int) -> TrainConfig:
    """Check a config dict for `world_size` ranks and resolve it into a `TrainConfig`."""
    try:
        return _parse(cfg, world_size)
    except ConfigError:
        raise
    except (TypeError, ValueError, AttributeError) as e:   # a value of the wrong kind, e.g. "lr": "fast"
        raise ConfigError(f"a value in the config has the wrong type: {e}") from None


def _parse(cfg: dict, world_size: int) -> TrainConfig:
    check_keys(cfg)
    pp = _int(cfg.get("pipeline", {}), "stages", 1)
    tp = _int(cfg.get("tensor_parallel", {}), "tp_size", 1)
    dp = degrees(world_size, pp, tp)
    try:
        b = resolve_batch(dp, _int(cfg, "train_batch_size"), _int(cfg, "train_micro_batch_size_per_gpu"),
                          _int(cfg, "gradient_accumulation_steps"))
    except BatchSizeError as e:
        raise ConfigError(f"batch sizes: {e} [world_size here is the data-parallel degree dp = {world_size} ranks "
                          f"/ (pp {pp} × tp {tp}) = {dp}]") from None
    opt = cfg.get("optimizer", {"type": "Adam"})
    kind = str(opt.get("type", "Adam")).lower()
    if kind not in OPTIMIZERS:
        raise ConfigError(f"optimizer.type {opt.get('type')!r} is not supported: use Adam, AdamW, SGD or Momentum")
    oparams = dict(opt.get("params", {}))
    if kind == "momentum" and "momentum" in oparams:
        raise ConfigError("optimizer.type Momentum fixes momentum = 0.9: for another value use type SGD "
                          "with params.momentum")
    if kind in ("sgd", "momentum") and ("betas" in oparams or "eps" in oparams):
        raise ConfigError(f"optimizer.params betas/eps belong to Adam, not {opt.get('type')}")
    lr = float(oparams.pop("lr", 1e-3))
    if "betas" in oparams:
        oparams["betas"] = tuple(oparams["betas"])
    warmup, min_lr, decay, wtype = 0, 0.0, None, "log"
    if "scheduler" in cfg:
        sch = cfg["scheduler"]
        if sch.get("type") not in SCHEDULERS:
            raise ConfigError(f"scheduler.type {sch.get('type')!r} is not supported: use {' or '.join(SCHEDULERS)}")
        sp = sch.get("params", {})
        warmup = int(sp.get("warmup_num_steps", 0))
        min_lr = float(sp.get("warmup_min_lr", 0.0))
        lr = float(sp.get("warmup_max_lr", lr))
        wtype = sp.get("warmup_type", "log")
        if wtype not in ("log", "linear"):
            raise ConfigError(f"scheduler.params.warmup_type {wtype!r}: use 'log' or 'linear'")
        if sch["type"] == "WarmupDecayLR":
            if "total_num_steps" not in sp:
                raise ConfigError("scheduler WarmupDecayLR needs params.total_num_steps")
            decay = int(sp["total_num_steps"])
    fp16, bf16 = cfg.get("fp16", {}).get("enabled", False), cfg.get("bf16", {}).get("enabled", False)
    if fp16 and bf16:
        raise ConfigError("fp16.enabled and bf16.enabled are both true: pick one")
    precision = "fp16" if fp16 else "bf16" if bf16 else "fp32"
    zero = cfg.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    offload = (zero.get("offload_optimizer") or {}).get("device", "none") == "cpu"
    if offload and stage == 0:
        raise ConfigError("zero_optimization.offload_optimizer needs stage 1, 2 or 3 (stage 0 is plain DP)")
    if (pp > 1 or tp > 1) and stage > 1:
        raise ConfigError(f"ZeRO stage {stage} with pipeline stages {pp} / tensor degree {tp}: only stages 0 and 1 "
                          f"combine with pipeline or tensor parallelism (as in DeepSpeed); use stage 1")
    if (pp > 1 or tp > 1) and (precision != "fp32" or offload):
        raise ConfigError(f"{precision if precision != 'fp32' else 'offload'} with pipeline stages {pp} / tensor "
                          f"degree {tp} is not implemented in par: use fp32 without offload, or pp = tp = 1")
    scale = _loss_scale(cfg.get("fp16", {}))
    prefetch = bool(zero.get("prefetch", False))
    if prefetch and stage != 3:
        raise ConfigError(f"zero_optimization.prefetch gathers parameters ahead, which only stage 3 does (stage {stage})")
    pipe = cfg.get("pipeline", {})
    steps = _int(cfg, "steps", 10)
    tc = TrainConfig(world_size, dp, pp, tp, b.train_batch_size, b.micro_batch, b.grad_accum,
                       optimizer=OPTIMIZERS[kind], lr=lr, optimizer_params=oparams, warmup_steps=warmup,
                       warmup_min_lr=min_lr, warmup_type=wtype, decay_steps=decay, precision=precision, zero_stage=stage,
                       offload=offload, schedule=pipe.get("schedule", "1f1b"),
                       partition_method=pipe.get("partition_method", "parameters"),
                       gradient_clipping=cfg.get("gradient_clipping"), loss_scale=scale, prefetch=prefetch, model=dict(cfg.get("model", {"preset": "tiny"})),
                       steps=steps, seed=int(cfg.get("seed", 0)))
    check_model(tc)
    return tc


def check_model(tc: TrainConfig) -> None:
    """Raise `ConfigError` when the `model` section names no preset, or its model cannot be cut into the
    pipeline's stages (a layer each) or split over the tensor-parallel ranks (whole heads, d_model, the FFN):
    found here, before any rank starts, by the checks the ranks would fail (imports torch: the model's)."""
    from par.pp.partition import uniform
    from par.tp.layers import check_tp_degree
    try:
        model = model_config(tc)
    except ValueError as e:
        raise ConfigError(f"model.preset: {e}") from None
    for key, check in (("pipeline.stages", lambda: uniform(model.n_layer, tc.pp)),
                       ("tensor_parallel.tp_size", lambda: check_tp_degree(model, tc.tp))):
        try:
            check()
        except ValueError as e:
            raise ConfigError(f"{key}: {e}") from None


def _loss_scale(fp16: dict) -> dict:
    """DeepSpeed's fp16 keys as `par.precision.loss_scaler` arguments: loss_scale > 0 is a static scale S; 0 (the
    default) a dynamic one starting at 2^initial_scale_power, raised after loss_scale_window clean steps."""
    if fp16.get("loss_scale", 0):
        return {"static": float(fp16["loss_scale"])}
    keys = {"initial_scale_power": "init_scale", "loss_scale_window": "window", "hysteresis": "hysteresis",
            "min_loss_scale": "min_scale"}
    out = {keys[k]: v for k, v in fp16.items() if k in keys}
    if "init_scale" in out:
        out["init_scale"] = 2.0 ** out["init_scale"]
    return out


def ignored_keys(cfg: dict) -> list[str]:
    """The keys of `cfg` that par accepts for compatibility but that change nothing here."""
    found = []
    for key in sorted(IGNORED):
        node = cfg
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            found.append(key)
    return found


def _short(text: str, n: int = 60) -> str:
    return text if len(text) <= n else text[:n] + "..."


def read(source) -> dict:
    """The config as a dict: from a JSON file (path), a JSON object given as text, or a dict."""
    if isinstance(source, dict):
        return source
    text = str(source)
    try:
        return json.loads(text if text.lstrip().startswith("{") else Path(source).read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{_short(text)}: not valid JSON ({e})") from None
    except OSError as e:
        raise ConfigError(f"cannot read config {text}: {e.strerror}; pass a JSON file (e.g. configs/ddp.json) "
                          f"or a JSON object") from None


def load(source, world_size: int) -> TrainConfig:
    """`parse` a JSON file (path), a JSON object given as text, or an already loaded dict."""
    return parse(read(source), world_size)


def lr_at(cfg: TrainConfig, step: int) -> float:
    """DeepSpeed's WarmupLR: for step < warmup, min + (max - min)·f with f = log(step + 1)/log(warmup)
    ("log", the default) or f = step/warmup ("linear"); then max. WarmupDecayLR then decays
    linearly to 0 at `decay_steps`."""
    if step < cfg.warmup_steps:
        if cfg.warmup_type == "linear":
            frac = step / cfg.warmup_steps
        else:
            frac = math.log(step + 1) / math.log(cfg.warmup_steps) if cfg.warmup_steps > 1 else 1.0
        return cfg.warmup_min_lr + (cfg.lr - cfg.warmup_min_lr) * frac
    if cfg.decay_steps:
        return cfg.lr * max(0.0, (cfg.decay_steps - step) / max(1, cfg.decay_steps - cfg.warmup_steps))
    return cfg.lr


def loss_scaler(cfg: TrainConfig):
    """The fp16 loss scaler the config asks for (`par.precision.loss_scaler`): StaticLossScaler(S) for loss_scale S > 0,
    DynamicLossScaler(...) for the dynamic keys; None means par.zero.engine's default for the precision."""
    if cfg.precision != "fp16" or not cfg.loss_scale:
        return None
    from par.precision.loss_scaler import DynamicLossScaler, StaticLossScaler
    if "static" in cfg.loss_scale:
        return StaticLossScaler(cfg.loss_scale["static"])
    return DynamicLossScaler(**cfg.loss_scale)


def model_config(cfg: TrainConfig):
    """The GPTConfig the `model` section names: a preset plus overrides."""
    from par.model import preset
    m = dict(cfg.model)
    return preset(m.pop("preset", "tiny"), **m)
