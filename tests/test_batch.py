"""The papermill batch (`python -m par batch`) on two fixture notebooks: one records numbers, one raises.

The batch must go on past the failure, summarise both (status, first error line, recorded numbers, the
parameters it passed), exit 1; a batch of passing notebooks exits 0; a cell past the timeout fails its notebook.
"""
import json
import shutil
import time
from pathlib import Path

import nbformat

from par import batch

FIXTURES = Path(__file__).parent / "fixtures" / "batch"


def summary_of(out: Path) -> dict:
    (folder,) = out.iterdir()  # one timestamped run folder
    assert (folder / "summary.md").is_file()
    return json.loads((folder / "summary.json").read_text())


def test_batch_goes_on_past_a_failure_and_exits_nonzero(tmp_path, capsys):
    out = tmp_path / "runs"
    code = batch.main(["--notebooks", str(FIXTURES / "*.ipynb"), "--out", str(out),
                       "--world-size", "3", "--steps", "7", "--timeout", "120"])
    assert code == 1
    summary = summary_of(out)
    rows = {r["notebook"]: r for r in summary["notebooks"]}
    assert list(rows) == ["10_records.ipynb", "20_raises.ipynb"]  # sorted, the failing one still ran
    ok, failed = rows["10_records.ipynb"], rows["20_raises.ipynb"]
    assert ok["status"] == "ok" and ok["error"] is None
    assert ok["records"] == {"world_size_x10": 30, "preset": "tiny"}  # parameters reached the notebook
    assert failed["status"] == "FAILED"
    assert failed["error"] == "ValueError: fixture failure on purpose (steps=7)"
    assert summary["failed"] == 1 and summary["parameters"]["world_size"] == 3
    assert Path(ok["output"]).is_file() and Path(failed["output"]).is_file()  # executed notebooks kept
    printed = capsys.readouterr().out
    assert "| 20_raises.ipynb | FAILED: ValueError: fixture failure on purpose (steps=7)" in printed
    assert "world_size_x10 = 30" in printed and "1/2 notebooks ok" in printed


def test_batch_of_passing_notebooks_exits_zero(tmp_path):
    shutil.copy(FIXTURES / "10_records.ipynb", tmp_path / "10_records.ipynb")
    out = tmp_path / "runs"
    assert batch.main(["--notebooks", str(tmp_path / "*.ipynb"), "--out", str(out)]) == 0
    (row,) = summary_of(out)["notebooks"]
    assert row["status"] == "ok" and row["records"]["world_size_x10"] == 20  # the batch's default world_size=2


def test_batch_without_notebooks_is_an_error(tmp_path, capsys):
    assert batch.main(["--notebooks", str(tmp_path / "*.ipynb"), "--out", str(tmp_path / "runs")]) == 1
    assert "no notebook matches" in capsys.readouterr().out
    assert not (tmp_path / "runs").exists()


def test_a_cell_past_the_timeout_fails_its_notebook(tmp_path):
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                           "language": "python"}})
    nb.cells = [nbformat.v4.new_code_cell("import time\ntime.sleep(60)")]
    nbformat.write(nb, tmp_path / "30_hangs.ipynb")
    start = time.monotonic()
    row = batch.run_one(tmp_path / "30_hangs.ipynb", tmp_path / "out.ipynb", {}, timeout=3)
    assert row["status"] == "FAILED" and "timed out" in row["error"], row
    assert time.monotonic() - start < 50
