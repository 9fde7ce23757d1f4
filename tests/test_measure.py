"""par.measure: one timed step, the merge over ranks every job reports by (step_s, losses), and the typed
result a launch returns (`parse`: attributes, runs, ranks, the JSON back)."""
from __future__ import annotations

import copy
import json
import pickle
import time
from dataclasses import dataclass

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


@dataclass(frozen=True, kw_only=True)
class ARank(RankResult):
    bytes: int


@dataclass(frozen=True, kw_only=True)
class ARun(RunResult):
    Rank = ARank
    label: str
    losses: list
    step_s: list
    memory: dict | None = None
    spans: list | None = None


@dataclass(frozen=True, kw_only=True)
class Result(JobResult):
    """The job of `a_result`, declared as a job module declares its own (`par.dp.job.Result`)."""
    Run = ARun
    numel: int
    runs: tuple | dict


def parsed(data: dict) -> Result:
    return parse(data, __name__)           # this module declares the job's Result


def test_a_result_reads_as_attributes_run_by_run_and_rank_by_rank():
    result = parsed(a_result())
    assert isinstance(result, Result) and (result.world_size, result.backend, result.numel) == (2, "gloo", 10)
    first, offload = result.runs
    assert isinstance(first, ARun) and first.losses == [2.0, 1.5] and first.step_s == [0.2, 0.1]
    assert result.find(label="3+offload").losses == [2.0, 1.4] and result.find(label="3+offload") == offload
    assert first.memory.predicted.total == 160
    assert first.memory.by_degree == {"1": 40, "2": 20}      # keyed by data (a degree): stays a mapping
    assert first.spans[0].name == "F0" and first.spans[0].end == 1.0
    assert [r.rank for r in first.ranks] == [0, 1] and first.rank(1).bytes == 9
    assert isinstance(first.rank(0), ARank)
    assert first.has("memory") and not offload.has("memory")


def test_a_result_is_no_mapping_and_says_what_it_declares():
    result = parsed(a_result())
    run = result.runs[0]
    with pytest.raises(AttributeError, match="has no 'lossses'.*declares: .*losses"):
        run.lossses
    with pytest.raises(AttributeError, match="has no 'memory'.*declares: rank, bytes"):
        run.rank(0).memory
    with pytest.raises(TypeError):
        run["losses"]
    with pytest.raises(TypeError):
        run.rank(0)["bytes"]
    with pytest.raises(IndexError, match="rank 2: this run reported 2 ranks"):
        run.rank(2)
    with pytest.raises(LookupError, match="0 runs"):
        result.find(label="5")
    with pytest.raises(AttributeError, match="losses"):
        run.losses = []
    twice = parsed({"world_size": 1, "backend": "gloo", "numel": 1, "runs": [{"label": "a", "losses": [], "step_s": []}] * 2})
    with pytest.raises(LookupError, match="2 runs have"):
        twice.find(label="a")
    assert parse(None, __name__) is None


def test_a_result_unlike_its_declaration_stops_the_parse():
    with pytest.raises(ValueError, match="Result lacks backend"):
        parsed({"world_size": 2, "numel": 1, "runs": []})
    with pytest.raises(ValueError, match="ARun declares no bubble"):
        parsed({**a_result(), "runs": [{"label": "0", "losses": [], "step_s": [], "bubble": 0.1}]})
    with pytest.raises(ValueError, match="ARank declares no memory and lacks bytes"):
        parsed({**a_result(), "runs": [{"label": "0", "losses": [], "step_s": [], "per_rank": [{"memory": 1}]}]})
    with pytest.raises(TypeError, match="par.measure declares no Result"):
        parse(a_result(), "par.measure")


def test_a_job_that_names_its_runs_reads_them_by_name():
    result = parsed({"world_size": 1, "backend": "gloo", "numel": 1,
                     "runs": {"fp32 adam": {"label": "a", "losses": [1.0], "step_s": [0.1]}}})
    assert list(result.named()) == ["fp32 adam"] and result.named()["fp32 adam"].losses == [1.0]
    assert result.find(label="a").losses == [1.0]


def test_every_job_declares_its_result_beside_its_args():
    import importlib
    for job in ("par.comm.job", "par.memory.job", "par.dp.job", "par.pp.job", "par.pp.vs_torch_job", "par.tp.job",
                "par.precision.job", "par.zero.job", "par.zero.activations_job", "par.train.job",
                "par.train.placement_job", "par.cp.job", "par.moe.job"):
        module = importlib.import_module(job)
        assert issubclass(module.Result, JobResult) and hasattr(module, "Args"), job
        assert {"world_size", "backend"} <= set(module.Result.names()), job


def test_a_result_gives_back_the_json_it_was_read_from():
    data = a_result()
    result = parsed(data)
    data["runs"][0]["per_rank"] = [{"rank": 0, "bytes": 7}, {"rank": 1, "bytes": 9}]    # each rank names itself
    assert result.to_json() == data and json.loads(json.dumps(plain(result))) == data
    assert plain({"a": [result.runs[0].memory.predicted]}) == {"a": [{"total": 160}]}
    assert repr(result.runs[0].memory.predicted) == "{'total': 160}"    # printed as the JSON it holds
    assert result.runs[0].memory.predicted == {"total": 160}
    again = pickle.loads(pickle.dumps(result))
    assert type(again) is Result and again == result and copy.deepcopy(result.runs[0].rank(1)).bytes == 9


def test_record_keeps_a_typed_value_as_its_json(monkeypatch):
    import IPython.display
    from par.course.batch.record import RECORD_MIME, record
    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj, raw: shown.append(obj))
    result = parsed(a_result())
    record("memory", [result.runs[0].memory.predicted])
    assert shown == [{RECORD_MIME: {"memory": [{"total": 160}]}, "text/plain": "memory = [{'total': 160}]"}]
    assert type(shown[0][RECORD_MIME]["memory"][0]) is dict       # what the batch's summary.json gets
    record("run", result.runs[1])
    assert shown[1][RECORD_MIME]["run"] == a_result()["runs"][1]   # a whole run: its JSON, from its type
