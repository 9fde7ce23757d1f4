"""par.measure: one timed step, the merge over ranks every job reports by (step_s, losses), and the typed
result a launch returns (`parse`: attributes, runs, ranks, the JSON back)."""
from __future__ import annotations

import copy
import json
import pickle
import time

import pytest
import torch

from par.measure import (JobResult, RankResult, RunResult, mean_over_ranks, merge_ranks, parse, plain, slowest, sync,
                         timed_step)


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


# ---------------------------------------------------------------- the typed result a launch returns
def a_result() -> dict:
    """What rank 0 of a job that runs two configurations saves (par.measure's contract)."""
    return {"world_size": 2, "backend": "gloo", "numel": 10,
            "runs": [{"label": "0", "losses": [2.0, 1.5], "step_s": [0.2, 0.1],
                      "memory": {"predicted": {"total": 160}, "by_degree": {"1": 40, "2": 20}},
                      "spans": [{"rank": 0, "name": "F0", "start": 0.0, "end": 1.0}],
                      "per_rank": [{"bytes": 7}, {"bytes": 9}]},
                     {"label": "3+offload", "losses": [2.0, 1.4], "step_s": [0.3, 0.2], "per_rank": []}]}


def test_a_result_reads_as_attributes_run_by_run_and_rank_by_rank():
    result = parse(a_result())
    assert isinstance(result, JobResult) and (result.world_size, result.backend, result.numel) == (2, "gloo", 10)
    first, offload = result.runs
    assert isinstance(first, RunResult) and first.losses == [2.0, 1.5] and first.step_s == [0.2, 0.1]
    assert result.find(label="3+offload").losses == [2.0, 1.4] and result.find(label="3+offload") == offload
    assert first.memory.predicted.total == 160
    assert first.memory.by_degree == {"1": 40, "2": 20}      # keyed by data (a degree): stays a mapping
    assert first.spans[0].name == "F0" and first.spans[0].end == 1.0
    assert [r.rank for r in first.ranks] == [0, 1] and first.rank(1).bytes == 9
    assert isinstance(first.rank(0), RankResult)
    assert first.has("memory") and not offload.has("memory")


def test_a_result_says_what_it_lacks_and_what_it_holds():
    result = parse(a_result())
    with pytest.raises(AttributeError, match="has no 'lossses'.*losses"):
        result.runs[0].lossses
    with pytest.raises(IndexError, match="rank 2: this run reported 2 ranks"):
        result.runs[0].rank(2)
    with pytest.raises(LookupError, match="0 runs"):
        result.find(label="5")
    with pytest.raises(AttributeError, match="read-only"):
        result.runs[0].losses = []
    with pytest.raises(ValueError, match="backend"):
        parse({"world_size": 2})
    assert parse(None) is None
    assert parse({"world_size": 1, "backend": "gloo", "x": {"from": 1}}).x == {"from": 1}   # a keyword: a mapping
    twice = parse({"world_size": 1, "backend": "gloo", "runs": [{"m": 1}, {"m": 1}]})
    with pytest.raises(LookupError, match="2 runs have"):
        twice.find(m=1)


def test_a_job_that_names_its_runs_reads_them_by_name():
    result = parse({"world_size": 1, "backend": "gloo", "runs": {"fp32 adam": {"losses": [1.0]}}})
    assert list(result.named()) == ["fp32 adam"] and result.named()["fp32 adam"].losses == [1.0]
    assert [r.losses for r in result.runs] == [[1.0]]


def test_a_result_gives_back_the_json_it_was_read_from():
    data = a_result()
    result = parse(data)
    assert result.to_json() == data and json.loads(json.dumps(plain(result))) == data
    assert plain({"a": [result.runs[0].memory.predicted]}) == {"a": [{"total": 160}]}
    assert repr(result.runs[0].memory.predicted) == "{'total': 160}"    # printed as the JSON it holds
    assert result.runs[0].memory.predicted == {"total": 160}
    again = pickle.loads(pickle.dumps(result))
    assert type(again) is JobResult and again == result and copy.deepcopy(result.runs[0].rank(1)).bytes == 9


def test_record_keeps_a_typed_value_as_its_json(monkeypatch):
    import IPython.display
    from par.course.batch.record import RECORD_MIME, record
    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj, raw: shown.append(obj))
    result = parse(a_result())
    record("memory", [result.runs[0].memory.predicted])
    assert shown == [{RECORD_MIME: {"memory": [{"total": 160}]}, "text/plain": "memory = [{'total': 160}]"}]
    assert type(shown[0][RECORD_MIME]["memory"][0]) is dict       # what the batch's summary.json gets
