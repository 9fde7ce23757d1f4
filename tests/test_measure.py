"""par.measure: one timed step, and the merge over ranks every job reports by (step_s, losses)."""
from __future__ import annotations

import time

import torch

from par.measure import mean_over_ranks, merge_ranks, slowest, sync, timed_step


def test_a_step_lasts_as_long_as_its_slowest_rank_and_the_loss_is_the_mean():
    per_rank = [{"loss": [4.0, 3.0], "time": [0.1, 0.4]}, {"loss": [2.0, 1.0], "time": [0.3, 0.2]}]
    assert slowest(r["time"] for r in per_rank) == [0.3, 0.4]
    assert mean_over_ranks(r["loss"] for r in per_rank) == [3.0, 2.0]
    assert merge_ranks(per_rank, losses="loss", step_s="time") == {"losses": [3.0, 2.0], "step_s": [0.3, 0.4]}
    assert merge_ranks([{"losses": [1.5], "step_s": [0.2]}]) == {"losses": [1.5], "step_s": [0.2]}


def test_timed_step_counts_the_wall_clock_of_the_block():
    sync(torch.device("cpu"))                      # nothing queued on a CPU: returns at once
    with timed_step(torch.device("cpu"), barrier=True) as clock:   # no process group: no barrier
        time.sleep(0.05)
    assert 0.05 <= clock.seconds < 5 and 0 <= clock.cpu_s < clock.seconds
