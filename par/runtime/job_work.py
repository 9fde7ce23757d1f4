"""What a job computes, in the planner's terms: the data each job's `work(args, nproc)` returns (beside its
`Args`, in the job's own module) and the course's dry run costs (`par.course.batch.cost`).

    Training      a training run: model, global batch, layout (dp × pp × tp, ZeRO stage, offload),
                  micro-batches, precision, optimizer, steps; `reference_batch` > 0: every rank also
                  trains the single-process model on that many sequences (a correctness check) beside it
    Collectives   collectives timed on tensors of `numels` float32 elements, `rounds` times each
"""
from __future__ import annotations

from dataclasses import dataclass

from par.runtime.grid import layout_label


@dataclass(frozen=True, kw_only=True)
class Training:
    """A training run in the planner's terms (`par.train.planner.predict` takes these fields)."""
    model: object                    # par.model.GPTConfig
    global_batch: int
    dp: int = 1
    pp: int = 1
    tp: int = 1
    zero_stage: int = 0
    offload: bool = False
    microbatches: int = 1
    precision: str = "fp32"          # fp32 | fp16 | bf16
    optimizer: str = "adam"
    steps: int = 1
    reference_batch: int = 0
    label: str = ""

    def describe(self) -> str:
        layout = layout_label(self.dp, self.pp, self.tp) + (f" ZeRO-{self.zero_stage}" if self.zero_stage else "")
        return f"{self.label or 'training'} ({layout}, {self.precision}, batch {self.global_batch})"


@dataclass(frozen=True)
class Collectives:
    """Collectives timed on tensors of `numels` float32 elements, `rounds` times each (ring and torch)."""
    numels: tuple
    rounds: int
    label: str = "collectives"

    def describe(self) -> str:
        return self.label
