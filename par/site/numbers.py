"""The key numbers of each lecture, beside the formula they check: what the landing page shows.

`KEY_NUMBERS[NN]` lists, for lecture NN (its notebook's name up to the first `_`: "03", "07b"), the records
(`par.course.batch.record.record`, kept per notebook in `summary.json`) a reader should see first: (what it is, the
formula or the value expected, the record's name, and for a record that is a dict, the key inside it). A record
a run does not have (an older notebook, a notebook that failed, a GPU-only number) is left out, never shown
empty. Every record of a lecture, chosen or not, is on its own page.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Key:
    what: str
    formula: str              # plain text with Unicode (no TeX: the landing page needs no MathJax)
    record: str
    part: str | None = None   # a key inside a record that is a dict


KEY_NUMBERS: dict[str, list[Key]] = {
    "00": [Key("ring all-reduce: bytes counted / formula", "2(N−1)/N · S per rank → 1",
               "ring_bytes_counted_over_formula"),
           Key("latency per message α (s)", "T = α + β · bytes", "ring_alpha_s"),
           Key("time per byte β (s/B)", "T = α + β · bytes", "ring_beta_s_per_byte"),
           Key("α–β fit over world sizes", "≥ 3 sizes", "ring_alpha_beta_fit_world_sizes"),
           Key("where the fitted times came from", "measured, or simulated from steps", "ring_alpha_beta_source"),
           Key("hand-written ring / dist.all_reduce time", "largest message", "ring_over_torch_time_largest")],
    "01": [Key("bytes per parameter, fp32 + Adam", "4 + 4 + 8 = 16", "bytes_per_param_fp32_adam"),
           Key("bytes per parameter, mixed precision + Adam", "2 + 2 + 12 = 16", "bytes_per_param_mixed_adam"),
           Key("measured bytes per parameter, fp32 + Adam", "16", "measured_bytes_per_param_fp32_adam"),
           Key("predicted model-state bytes = measured", "equal", "predicted_equals_measured"),
           Key("block activations measured / formula", "→ 1", "block_act_measured_over_formula"),
           Key("7B model, fp32 + Adam (GB)", "16 · 7·10⁹ B", "gb_7b_fp32_adam")],
    "02": [Key("all-reduce bytes per step, counted", "2(N−1)/N · 4Ψ", "bytes_per_step_counted"),
           Key("all-reduce bytes per step, formula", "2(N−1)/N · 4Ψ", "bytes_per_step_formula"),
           Key("mean of shard gradients − big-batch gradient", "→ 0", "shard_average_max_error"),
           Key("communication overlapped with backward", "bucketed", "bucketed_overlap_fraction"),
           Key("par DP vs DistributedDataParallel (max |Δ|)", "≤ 1e-5", "torch_api_max_diff", "ddp")],
    "03": [Key("1F1B bubble measured, by micro-batches m", "(p−1)/(m+p−1)", "bubble_measured_vs_m", "1f1b"),
           Key("1F1B bubble formula, by micro-batches m", "(p−1)/(m+p−1)", "bubble_formula_vs_m", "1f1b"),
           Key("ZB-H1 bubble measured, by m (F = I = W)", "(p−1)/(3m+p−1)", "bubble_measured_vs_m", "zb_h1"),
           Key("ZB-V bubble measured, by m (F = I = W)", "(p−1)/(6m+p−1)", "bubble_measured_vs_m", "zb_v"),
           Key("largest |bubble measured − formula|", "≤ 0.05", "bubble_measured_minus_formula_max"),
           Key("simulated 1F1B bubble, p = 4, m = 6", "3/9 = 0.333", "simulated_bubble_1f1b_p4_m6"),
           Key("pipeline gradients vs one process (max |Δ|)", "≤ 1e-5", "pipeline_max_grad_diff_vs_single"),
           Key("stage-0 activation peak, GPipe (MB)", "m micro-batches held", "activation_peak_MB_stage0_gpipe"),
           Key("stage-0 activation peak, 1F1B (MB)", "≤ p micro-batches held", "activation_peak_MB_stage0_1f1b"),
           Key("par 1F1B vs torch pipelining (max |Δ|)", "≤ 1e-5", "torch_api_max_diff", "pipelining")],
    "04": [Key("TP parameters vs one process (max |Δ|)", "≤ 5e-6", "tp_max_param_diff"),
           Key("all-reduces per layer (forward + backward)", "2 + 2 = 4", "tp_allreduces_per_layer"),
           Key("TP bytes per step, measured", "4L · 2(t−1)/t · B·T·d · 4 B", "tp_bytes_per_step"),
           Key("TP / DP bytes, gpt3-small, b = 8", "activations vs gradients", "tp_over_dp_bytes_gpt3_small_b8"),
           Key("par TP vs DTensor parallelize_module (max |Δ|)", "≤ 1e-5", "torch_api_max_diff", "dtensor_tp")],
    "05": [Key("max loss difference to fp32", "small, bf16 > fp16", "max loss difference to fp32"),
           Key("steps skipped on overflow", "dynamic loss scaling", "skipped steps"),
           Key("final loss scale", "halved on overflow, doubled after a window", "final loss scale"),
           Key("model-state bytes per parameter, fp16", "2 + 2 + 12 = 16", "model-state bytes/param fp16"),
           Key("activations fp16 / fp32", "½", "activation ratio fp16/fp32"),
           Key("autocast + GradScaler vs par (max |Δ|)", "see the lecture", "torch_api_max_diff", "autocast")],
    "06": [Key("model states measured / formula, stages 0–3",
               "(2+2+K)Ψ → 2Ψ+2Ψ+KΨ/N → 2Ψ+(2+K)Ψ/N → (2+2+K)Ψ/N", "zero_memory_measured_over_formula"),
           Key("stage 3 / stage 1 bytes on the wire", "3Ψ / 2Ψ = 1.5", "zero_stage3_over_stage1_bytes"),
           Key("ZeRO losses vs plain DP (max |Δ|)", "→ 0", "zero_loss_max_diff_vs_dp"),
           Key("collectives per step, stages 0–3", "1, 2, one per unit + 1, three per unit",
               "zero_collectives_per_step"),
           Key("par ZeRO-3 vs FSDP2 fully_shard (max |Δ|)", "≤ 1e-5", "torch_api_max_diff", "fsdp2")],
    "07": [Key("3D layouts run (d, p, t)", "d · p · t = N", "layouts_3d_run"),
           Key("speed-up over one process", "benchmark table", "bench_speedup_over_single"),
           Key("bytes: counted vs formula (relative error)", "→ 0", "bench_bytes_rel_error"),
           Key("planner memory vs measured (relative error)", "→ 0", "planner_memory_rel_error")],
    "07b": [Key("best layout for 180B", "planner", "plan_180b_best"),
            Key("step time vs planner, TP inside / across nodes (rel. error)", "→ 0", "across_nodes_step_rel_error")],
    "08": [Key("online-softmax merge vs full softmax (max |Δ|)", "→ 0", "online_softmax_max_diff"),
           Key("activation bytes per rank measured / formula (max)", "→ 1", "activation_measured_over_formula_max"),
           Key("SP, CP and Ulysses parameters vs dense (max |Δ|)", "≤ 1e-5", "max_param_diff_sp_cp"),
           Key("ring and Ulysses bytes: counted = formula", "Ulysses 4(c−1)/c² · sbh·e", "attention_bytes_counted_equal_formula"),
           Key("causal work, busiest rank / mean", "balanced split → 1", "causal_work_max_over_mean"),
           Key("ring attention: exposed wait / busy", "overlap → 0", "ring_exposed_wait_fraction")],
    "09": [Key("all-to-all bytes per step, counted", "(n−1)/n · E·C·d · bytes", "alltoall_bytes_per_step"),
           Key("all-to-all bytes per step, formula", "(n−1)/n · E·C·d · bytes", "alltoall_bytes_formula"),
           Key("expert parallel vs one process (max |Δ|)", "≤ 1e-5", "ep_max_param_diff"),
           Key("EP inside DP vs one process (max |Δ|)", "≤ 1e-5", "ep_dp_max_param_diff"),
           Key("hand-written all-to-all vs all_to_all_single (max |Δ|)", "≤ 1e-5", "torch_api_max_diff",
               "all_to_all_single")],
}

MISSING = object()


def value(records: dict, key: Key):
    """The recorded value of `key`, or MISSING."""
    v = records.get(key.record, MISSING)
    if key.part is not None:
        v = v.get(key.part, MISSING) if isinstance(v, dict) else MISSING
    return v


def chosen(number: str, records: dict) -> list[Key]:
    """The keys of lecture `number` that `records` holds, in the order above."""
    return [k for k in KEY_NUMBERS.get(number, []) if value(records, k) is not MISSING]


def fmt(v, width: int = 12) -> str:
    """A recorded value as a reader wants it: 4 significant digits, 1.2e-07 for tiny ones, dicts as `k: v`."""
    if v is MISSING or v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}".replace(",", " ") if abs(v) >= 10_000 else str(v)
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        if v == 0:
            return "0"
        if v.is_integer() and abs(v) < 1e15:
            return fmt(int(v))
        return f"{v:.3g}" if abs(v) < 1e-3 or abs(v) >= 1e6 else f"{v:.4g}"
    if isinstance(v, dict):
        items = list(v.items())
        text = ", ".join(f"{k}: {fmt(x)}" for k, x in items[:width])
        return text + (f", … ({len(items) - width} more)" if len(items) > width else "")
    if isinstance(v, (list, tuple)):
        text = ", ".join(fmt(x) for x in v[:width])
        return "[" + text + (f", … ({len(v) - width} more)" if len(v) > width else "") + "]"
    return str(v)
