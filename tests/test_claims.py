"""A lecture's claim checked on the page (`par.course.batch.claims`) and its verdicts in the batch's summary."""
import pytest

from par.course.batch import claims
from par.course.batch.launches import CourseError
from par.course.batch.runner import markdown

GAP = "gpipe_over_1f1b_measured"   # lecture 03: GPipe's bubble over 1F1B's, target 0.8 to 1.25


def test_a_met_target_prints_a_tick_and_the_target(capsys):
    v = claims.check("03_pipelines", GAP, 1.031)
    out = capsys.readouterr().out
    assert v.met and v.verdict == "met" and "✓" in out and "1.031" in out and "0.8 to 1.25" in out
    assert v.word("inside", "outside") == "inside"


def test_a_missed_target_prints_the_value_and_the_side_it_fell_on(capsys):
    v = claims.check("03_pipelines", GAP, 1.3)
    out = capsys.readouterr().out
    assert not v.met and v.verdict == "missed" and "✗" in out and "1.3 > 1.25" in out
    assert v.word("inside", "outside") == "outside"


def test_a_claim_not_declared_in_the_lecture_module_is_refused():
    with pytest.raises(CourseError, match="KEY_NUMBERS"):
        claims.check("03_pipelines", "a_number_no_key_reads", 1.0)


def test_verdicts_are_json_for_the_summary_and_empty_without_a_lecture():
    found = claims.verdicts("03_pipelines", {GAP: float("nan")})
    assert [v["verdict"] for v in found] == ["missed"] and found[0]["reason"] == "not a number"
    assert claims.verdicts("99_not_a_lecture", {GAP: 1.0}) == []


def test_summary_md_lists_every_missed_target_and_counts_the_met_ones():
    rows = [{"notebook": "03_pipelines.ipynb", "status": "ok", "error": None, "duration_s": 1.0,
             "records": {GAP: 0.7}, "verdicts": claims.verdicts("03_pipelines", {GAP: 0.7})},
            {"notebook": "00_x.ipynb", "status": "ok", "error": None, "duration_s": 1.0, "records": {},
             "verdicts": []}]
    text = markdown({"folder": "/tmp/x", "parameters": {"world_size": 2}, "timeout_s": None, "notebooks": rows,
                     "failed": 0, "duration_s": 2.0})
    assert "Targets: 0/1 met, missed:" in text and "✗ 03_pipelines.ipynb" in text and "0.7 < 0.8" in text
