"""Lecture 08, sequence and context parallelism: one job measures activation memory (DP, TP, TP+SP, CP), trains
TP+SP and CP beside the dense model, records the ring-attention timeline and times both causal layouts in turns
(work counted, time on the steady clock); its key numbers."""
from __future__ import annotations

from par.course.batch import cost
from par.course.batch.launches import launch
from par.cp import job as cp_job
from par.model import preset as model_preset
from par.site.numbers import Key, at_most, equal
from par.tp.layers import tp_degree

NOTEBOOK = "08_sequence_context_parallel"
CELLS = ("memory, training, timeline",)


def launches(W, backend, preset, steps):
    """One launch on the TP degree's ranks (`par.cp.job`)."""
    cfg = model_preset(preset)
    return [launch(NOTEBOOK, "memory, training, timeline", tp_degree(cfg, W), cp_job.Args(
        preset=preset, steps=max(2, min(steps, 5)), batch_size=cost.per_rank_batch(cfg, 4)), backend)]


KEY_NUMBERS = [
    Key("online-softmax merge vs full softmax (max |Δ|)", "→ 0", "online_softmax_max_diff"),
    Key("activation bytes per rank measured / formula (max)", "→ 1", "activation_measured_over_formula_max"),
    Key("SP, CP and Ulysses parameters vs dense (max |Δ|)", "≤ 1e-5", "max_param_diff_sp_cp", target=at_most(1e-5)),
    Key("ring and Ulysses bytes: counted = formula", "Ulysses 4(c−1)/c² · sbh·e",
        "attention_bytes_counted_equal_formula", target=equal(True)),
    Key("causal work (FLOPs), balanced: busiest rank / mean", "balanced split → 1", "causal_work_max_over_mean",
        part="balanced", target=at_most(1.01)),
    Key("causal work (FLOPs), naive: busiest rank / mean", "2N/(N+1)", "causal_work_max_over_mean", part="naive"),
    Key("causal work (FLOPs), busiest rank: balanced / naive", "(1 + (N−1)/2)/N: 3/4 at N = 2",
        "causal_work_busiest_balanced_over_naive"),
    Key("causal attention time, busiest rank: balanced / naive (steady, fastest forward)", "≈ the work's ratio",
        "causal_time_busiest_balanced_over_naive", target=at_most(0.9)),
    Key("ring attention: exposed wait / busy (worst rank, steady)", "overlap → 0", "ring_exposed_wait_fraction",
        target=at_most(0.1)),
]
