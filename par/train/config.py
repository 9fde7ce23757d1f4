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

Every value is checked here, before any rank starts, into the typed `TrainConfig` (no schema library: each
section's reader states its field's type and range, `_number` / `_bool` / `_choice`): numbers finite and in
range (lr > 0, betas in [0, 1), sizes whole and >= 1, NaN and Infinity refused), true/false never taken for a
number (`"stage": true`), enumerations named in the error, the model's heads dividing its width. A config file is
read as a regular UTF-8 file of at most 1 MiB (`read_file`: a FIFO is refused without blocking).
`gradient_clipping` 0 means off, as in DeepSpeed.

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
import os
import stat
from dataclasses import asdict, dataclass, field

from par.data import ALPHABET, corpus_length
from par.dp.batch_size import BatchSizeError, resolve_batch
from par.model import preset, PRESETS
from par.pp.partition import uniform
from par.pp.schedules import GENERATORS
from par.precision.loss_scaler import DynamicLossScaler, StaticLossScaler
from par.runtime.grid import layout_label
from par.tp.layers import check_tp_degree

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


def _number(node: dict, path: str, default=None, *, integer: bool = False, minimum=None, above=None, below=None):
    """The number at `path` ("section.key") of the config, checked: JSON true/false is not a number, nor is a
    string; NaN and Infinity are refused, and so is a value outside [minimum, ∞) ∩ (above, below); None if absent
    and no default."""
    v = node.get(path.rsplit(".", 1)[-1], default)
    if v is None:
        return None
    kind = "a whole number" if integer else "a number"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{path} must be {kind}, got {json.dumps(v)}")
    try:
        finite = math.isfinite(v)
    except OverflowError:            # an integer beyond any float: 1e400 written out
        finite = False
    if not finite:
        raise ConfigError(f"{path} must be a finite number, got {str(v)[:20]}")
    if integer and v != int(v):
        raise ConfigError(f"{path} must be {kind}, got {v!r}")
    for bad, rule in ((minimum is not None and v < minimum, f">= {minimum}"), (above is not None and not v > above,
                      f"> {above}"), (below is not None and not v < below, f"< {below}")):
        if bad:
            raise ConfigError(f"{path} must be {rule}, got {v!r}")
    return int(v) if integer else float(v)


def _int(cfg: dict, key: str, default=None, section: str = ""):
    """A whole number >= 1 (sizes, degrees, steps)."""
    return _number(cfg, f"{section}.{key}" if section else key, default, integer=True, minimum=1)


def _bool(node: dict, path: str, default: bool = False) -> bool:
    """true or false, nothing else (1 and "yes" are refused: a typo must not switch a feature on or off)."""
    v = node.get(path.rsplit(".", 1)[-1], default)
    if not isinstance(v, bool):
        raise ConfigError(f"{path} must be true or false, got {json.dumps(v)}")
    return v


def _choice(node: dict, path: str, default, choices) -> str:
    """One of `choices` (strings), named in the error."""
    v = node.get(path.rsplit(".", 1)[-1], default)
    if v not in choices or not isinstance(v, str):
        raise ConfigError(f"{path} {json.dumps(v)} is not supported: use one of {', '.join(map(str, choices))}")
    return v


def _section(cfg: dict, path: str) -> dict:
    """The JSON object at `path` ({} when absent; `check_keys` has refused one that is not an object)."""
    node = cfg
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else {}


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
    pp = _int(_section(cfg, "pipeline"), "stages", 1, "pipeline")
    tp = _int(_section(cfg, "tensor_parallel"), "tp_size", 1, "tensor_parallel")
    dp = degrees(world_size, pp, tp)
    try:
        b = resolve_batch(dp, _int(cfg, "train_batch_size"), _int(cfg, "train_micro_batch_size_per_gpu"),
                          _int(cfg, "gradient_accumulation_steps"))
    except BatchSizeError as e:
        raise ConfigError(f"batch sizes: {e} [world_size here is the data-parallel degree dp = {world_size} ranks "
                          f"/ (pp {pp} × tp {tp}) = {dp}]") from None
    kind, lr, oparams = optimizer(cfg)
    warmup, min_lr, lr, wtype, decay = scheduler(cfg, lr)
    fp16 = _bool(_section(cfg, "fp16"), "fp16.enabled")
    bf16 = _bool(_section(cfg, "bf16"), "bf16.enabled")
    if fp16 and bf16:
        raise ConfigError("fp16.enabled and bf16.enabled are both true: pick one")
    precision = "fp16" if fp16 else "bf16" if bf16 else "fp32"
    zero = _section(cfg, "zero_optimization")
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {json.dumps(stage)}")
    offload = _choice(_section(cfg, "zero_optimization.offload_optimizer"), "zero_optimization.offload_optimizer.device",
                      "none", ("cpu", "none")) == "cpu"
    if offload and stage == 0:
        raise ConfigError("zero_optimization.offload_optimizer needs stage 1, 2 or 3 (stage 0 is plain DP)")
    if (pp > 1 or tp > 1) and stage > 1:
        raise ConfigError(f"ZeRO stage {stage} with pipeline stages {pp} / tensor degree {tp}: only stages 0 and 1 "
                          f"combine with pipeline or tensor parallelism (as in DeepSpeed); use stage 1")
    if (pp > 1 or tp > 1) and (precision != "fp32" or offload):
        raise ConfigError(f"{precision if precision != 'fp32' else 'offload'} with pipeline stages {pp} / tensor "
                          f"degree {tp} is not implemented in par: use fp32 without offload, or pp = tp = 1")
    scale = _loss_scale(_section(cfg, "fp16"))
    prefetch = _bool(zero, "zero_optimization.prefetch")
    if prefetch and stage != 3:
        raise ConfigError(f"zero_optimization.prefetch gathers parameters ahead, which only stage 3 does (stage {stage})")
    pipe = _section(cfg, "pipeline")
    clip = _number(cfg, "gradient_clipping", minimum=0)
    tc = TrainConfig(world_size, dp, pp, tp, b.train_batch_size, b.micro_batch, b.grad_accum,
                     optimizer=OPTIMIZERS[kind], lr=lr, optimizer_params=oparams, warmup_steps=warmup,
                     warmup_min_lr=min_lr, warmup_type=wtype, decay_steps=decay, precision=precision, zero_stage=stage,
                     offload=offload, schedule=_choice(pipe, "pipeline.schedule", "1f1b", sorted(GENERATORS)),
                     partition_method=_choice(pipe, "pipeline.partition_method", "parameters", PARTITION_METHODS),
                     gradient_clipping=clip or None, loss_scale=scale, prefetch=prefetch, model=model_section(cfg),
                     steps=_int(cfg, "steps", 10), seed=_number(cfg, "seed", 0, integer=True, minimum=0, below=2 ** 63))
    check_model(tc)
    return tc


PARTITION_METHODS = ("parameters", "uniform")   # par.pp.partition.METHODS (that module imports torch)


def optimizer(cfg: dict) -> tuple[str, float, dict]:
    """(kind, lr, the other params) of the `optimizer` section: lr > 0, betas two numbers in [0, 1), eps > 0,
    weight_decay >= 0, momentum in [0, 1)."""
    opt = cfg.get("optimizer", {"type": "Adam"})
    name = opt.get("type", "Adam")
    kind = name.lower() if isinstance(name, str) else name
    if kind not in OPTIMIZERS:
        raise ConfigError(f"optimizer.type {json.dumps(name)} is not supported: use Adam, AdamW, SGD or Momentum")
    params = _section(cfg, "optimizer.params")
    if kind == "momentum" and "momentum" in params:
        raise ConfigError("optimizer.type Momentum fixes momentum = 0.9: for another value use type SGD "
                          "with params.momentum")
    if kind in ("sgd", "momentum") and ("betas" in params or "eps" in params):
        raise ConfigError(f"optimizer.params betas/eps belong to Adam, not {name}")
    lr = _number(params, "optimizer.params.lr", 1e-3, above=0)
    out = {}
    for key, rule in (("eps", {"above": 0}), ("weight_decay", {"minimum": 0}), ("momentum", {"minimum": 0, "below": 1})):
        if key in params:
            out[key] = _number(params, f"optimizer.params.{key}", **rule)
    if "betas" in params:
        betas = params["betas"]
        if not isinstance(betas, list) or len(betas) != 2:
            raise ConfigError(f"optimizer.params.betas must be two numbers [beta1, beta2], got {json.dumps(betas)}")
        out["betas"] = tuple(_number({"betas": b}, "optimizer.params.betas", minimum=0, below=1) for b in betas)
    return kind, lr, out


def scheduler(cfg: dict, lr: float) -> tuple[int, float, float, str, int | None]:
    """(warmup steps, min lr, max lr, warmup type, decay end) of the `scheduler` section: lrs >= 0 with
    max > 0 and min <= max, step counts whole, total_num_steps after the warm-up."""
    if "scheduler" not in cfg:
        return 0, 0.0, lr, "log", None
    kind = _choice(cfg["scheduler"], "scheduler.type", None, SCHEDULERS)
    sp = _section(cfg, "scheduler.params")
    warmup = _number(sp, "scheduler.params.warmup_num_steps", 0, integer=True, minimum=0)
    min_lr = _number(sp, "scheduler.params.warmup_min_lr", 0.0, minimum=0)
    max_lr = _number(sp, "scheduler.params.warmup_max_lr", lr, above=0)
    if min_lr > max_lr:
        raise ConfigError(f"scheduler.params.warmup_min_lr {min_lr:g} is above warmup_max_lr {max_lr:g}: the warm-up "
                          f"climbs from min to max; swap them")
    wtype = _choice(sp, "scheduler.params.warmup_type", "log", ("log", "linear"))
    decay = None
    if kind == "WarmupDecayLR":
        if "total_num_steps" not in sp:
            raise ConfigError("scheduler WarmupDecayLR needs params.total_num_steps")
        decay = _number(sp, "scheduler.params.total_num_steps", integer=True, minimum=max(1, warmup))
    return warmup, min_lr, max_lr, wtype, decay


MODEL_SIZES = ("vocab_size", "block_size", "n_layer", "n_head", "d_model")


def model_section(cfg: dict) -> dict:
    """The `model` section checked: a preset's name, sizes whole numbers >= 1 (d_ff may be null), and
    n_head dividing d_model (each head gets d_model / n_head features)."""
    m = dict(_section(cfg, "model") or {"preset": "tiny"})
    name = m.get("preset", "tiny")
    if not isinstance(name, str) or name not in PRESETS:
        raise ConfigError(f"model.preset: unknown preset {name!r}: use one of {', '.join(PRESETS)}")
    for key in MODEL_SIZES + ("d_ff",):
        if key in m:
            m[key] = _int(m, key, section="model")
    base = PRESETS[m.get("preset", "tiny")]
    heads, width = m.get("n_head", base.n_head), m.get("d_model", base.d_model)
    if width % heads:
        raise ConfigError(f"model.n_head {heads} does not divide model.d_model {width}: each head gets d_model / "
                          f"n_head features; pick n_head among the divisors of {width}")
    fed_by_the_data(m.get("vocab_size", base.vocab_size), m.get("block_size", base.block_size))
    return m


def fed_by_the_data(vocab_size: int, block_size: int) -> None:
    """ConfigError unless the training data (`par.data.CharDataset`'s default corpus) can feed the model: its
    characters need vocab_size >= len(ALPHABET) rows of the embedding, a window of block_size + 1 characters
    needs a corpus longer than that."""
    if vocab_size < len(ALPHABET):
        raise ConfigError(f"model.vocab_size {vocab_size} is smaller than the data's {len(ALPHABET)} characters: the "
                          f"embedding cannot hold them; use model.vocab_size {len(ALPHABET)} or more")
    if block_size >= corpus_length():
        raise ConfigError(f"model.block_size {block_size} is longer than the data ({corpus_length():,} characters): "
                          f"use a block_size below that (the presets use 64 to 2048)")


def check_model(tc: TrainConfig) -> None:
    """Raise `ConfigError` when the `model` section names no preset, or its model cannot be cut into the
    pipeline's stages (a layer each) or split over the tensor-parallel ranks (whole heads, d_model, the FFN):
    found here, before any rank starts, by the checks the ranks would fail (imports torch: the model's)."""
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
    default) a dynamic one starting at 2^initial_scale_power (a power in [0, 127], finite in fp32), raised after
    loss_scale_window clean steps."""
    static = _number(fp16, "fp16.loss_scale", 0, minimum=0)
    if static:
        return {"static": static}
    out = {}
    for key, name, rule in (("initial_scale_power", "init_scale", {"integer": True, "minimum": 0}),
                            ("loss_scale_window", "window", {"integer": True, "minimum": 1}),
                            ("hysteresis", "hysteresis", {"integer": True, "minimum": 1}),
                            ("min_loss_scale", "min_scale", {"above": 0})):
        if key in fp16:
            out[name] = _number(fp16, f"fp16.{key}", **rule)
    if out.get("init_scale", 0) > 127:
        raise ConfigError(f"fp16.initial_scale_power must be <= 127 (2^128 overflows fp32), got {out['init_scale']}")
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


MAX_CONFIG_BYTES = 1 << 20   # a config is a few hundred bytes; a bigger file is the wrong file


def read_file(path) -> str:
    """The text of a config file: a regular file (a FIFO, a device or a folder is refused without blocking: opened
    with O_NONBLOCK, checked with fstat), at most MAX_CONFIG_BYTES, UTF-8."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror}; pass a JSON file (e.g. configs/ddp.json) "
                          f"or a JSON object") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = "a folder" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode) else "not a file"
        raise ConfigError(f"config {path} is {kind}, not a regular file: pass a JSON file such as configs/ddp.json")
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config {path} is over {MAX_CONFIG_BYTES} bytes: a config is a small JSON file; "
                          f"is it the right file?")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config {path} is not UTF-8 text (byte {e.start}: {data[e.start:e.start + 1]!r}): "
                          f"save it as UTF-8") from None


def read(source) -> dict:
    """The config as a dict: from a JSON file (path, `read_file`), a JSON object given as text, or a dict."""
    if isinstance(source, dict):
        return source
    text = str(source)
    try:
        return json.loads(text if text.lstrip().startswith("{") else read_file(source))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{_short(text)}: not valid JSON ({e})") from None
    except RecursionError:
        raise ConfigError(f"{_short(text)}: JSON nested too deeply to be a config") from None


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
    if "static" in cfg.loss_scale:
        return StaticLossScaler(cfg.loss_scale["static"])
    return DynamicLossScaler(**cfg.loss_scale)


def model_config(cfg: TrainConfig):
    """The GPTConfig the `model` section names: a preset plus overrides."""
    m = dict(cfg.model)
    return preset(m.pop("preset", "tiny"), **m)
