"""Lecture 09, mixture of experts: a MoE GPT-lite with expert parallelism, with and without the balancing loss,
then EP inside DP; its key numbers."""
from __future__ import annotations

from par.course.batch import cost
from par.course.batch.launches import launch
from par.model import preset as model_preset
from par.moe import job as moe_job
from par.site.numbers import Key, at_least, at_most

NOTEBOOK = "09_mixture_of_experts"
CELLS = ("EP training", "EP inside DP")


def launches(W, backend, preset, steps):
    """ep = W (at least one expert per rank); then EP inside DP (4 ranks, ep = 2) on CPU ranks or a server with 4
    GPUs. The single-process reference beside only where it is small."""
    cfg = model_preset(preset)
    b = cost.per_rank_batch(cfg, 4)
    check = cfg.block_size <= 256
    out = [launch(NOTEBOOK, "EP training", W, moe_job.Args(
        preset=preset, steps=steps, batch=b, experts=max(4, W), k=2, check=check, alphas=(0.0, 0.1), torch_api=True),
                  backend)]
    if 4 in cost.sweep_sizes({4}, W, backend):
        out.append(launch(NOTEBOOK, "EP inside DP", 4, moe_job.Args(
            preset=preset, steps=max(1, min(steps, 3)), batch=b, experts=4, k=2, ep=2, alphas=(0.1,), check=check),
                          backend))
    return out


KEY_NUMBERS = [
    Key("all-to-all bytes per step, counted", "(n−1)/n · E·C·d · bytes", "alltoall_bytes_per_step"),
    Key("all-to-all bytes per step, formula", "(n−1)/n · E·C·d · bytes", "alltoall_bytes_formula"),
    Key("expert parallel vs one process after several Adam steps (max |Δ|)", "≤ 1e-5", "ep_max_param_diff",
        target=at_most(1e-5)),
    Key("EP inside DP vs one process after several Adam steps (max |Δ|)", "≤ 1e-5", "ep_dp_max_param_diff",
        target=at_most(1e-5)),
    Key("hand-written all-to-all vs all_to_all_single (max |Δ|)", "≤ 1e-5", "torch_api_max_diff",
        "all_to_all_single", target=at_most(1e-5)),
    Key("router √z without z-loss, peak / first step", "logits grow (lr 3e-2, 40 steps)",
        "moe_router_rms_lse_growth_without_zloss", target=at_least(1.5)),
    Key("router √z at the end, with z-loss / without", "β·z holds the logits down",
        "moe_router_rms_lse_zloss_over_plain", target=at_most(0.5)),
]
