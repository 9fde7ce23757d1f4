"""The papermill batch (`python -m par batch`) on two fixture notebooks: one records numbers, one raises.

The batch must go on past the failure, summarise both (status, first error line, recorded numbers, the
parameters it passed, every record merged), exit 1; a batch of passing notebooks exits 0 with the default
world size; a cell past the timeout fails its notebook; NCCL without GPUs stops before any notebook; a
notebook whose launches cannot work on the GPU server is not run, and the summary says why.

The course at `--world-size 1`, what a one-GPU server runs (issue 28: 5 of 10 notebooks failed there): the GPU
server's own branch of the registry and the benchmark suite (no other world size, no 4-rank checkpoint, the 3D row
skipped) emulated on gloo ranks. The whole batch on one gloo rank (11/11) is a step of `.ci/run`.
"""
import json
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import nbformat
import pytest
import torch
from tiers import slow

from par.course.batch import runner as batch, launches as course
from par.runtime.preflight import BackendError, default_world_size
from par.tp import job as tp_job

FIXTURES = Path(__file__).parent / "fixtures" / "batch"
ROOT = Path(__file__).resolve().parents[1]


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
    assert summary["records"] == {"world_size_x10": 30, "preset": "tiny"}
    assert Path(ok["output"]).is_file() and Path(failed["output"]).is_file()  # executed notebooks kept
    printed = capsys.readouterr().out
    assert "| 20_raises.ipynb | FAILED: ValueError: fixture failure on purpose (steps=7)" in printed
    assert "world_size_x10 = 30" in printed and "1/2 notebooks ok" in printed


def test_batch_of_passing_notebooks_exits_zero(tmp_path):
    shutil.copy(FIXTURES / "10_records.ipynb", tmp_path / "10_records.ipynb")
    out = tmp_path / "runs"
    assert batch.main(["--notebooks", str(tmp_path / "*.ipynb"), "--out", str(out)]) == 0
    (row,) = summary_of(out)["notebooks"]
    assert row["status"] == "ok" and row["records"]["world_size_x10"] == 10 * default_world_size()


def test_batch_without_notebooks_is_an_error(tmp_path):
    with pytest.raises(course.CourseError, match="no notebook matches"):
        batch.main(["--notebooks", str(tmp_path / "*.ipynb"), "--out", str(tmp_path / "runs")])
    assert not (tmp_path / "runs").exists()


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine can run NCCL on 2 ranks")
def test_nccl_without_gpus_stops_before_any_notebook(tmp_path):
    start = time.monotonic()
    with pytest.raises(BackendError, match="backend 'nccl' needs"):
        batch.main(["--notebooks", str(FIXTURES / "*.ipynb"), "--out", str(tmp_path / "runs"),
                    "--backend", "nccl", "--world-size", "2"])
    assert time.monotonic() - start < 5 and not (tmp_path / "runs").exists()


def test_records_of_the_same_name_merge_key_by_key():
    rows = [{"records": {"torch_api_max_diff": {"ddp": 1e-7}, "loss": 2.0}},
            {"records": {"torch_api_max_diff": {"pipelining": 3e-7}}},
            {"records": {"torch_api_max_diff": {"fsdp2": 2e-7}, "loss": 1.5}}]
    assert batch.merge_records(rows) == {"torch_api_max_diff": {"ddp": 1e-7, "pipelining": 3e-7, "fsdp2": 2e-7},
                                         "loss": 1.5}


def test_a_notebook_that_cannot_work_on_the_gpu_server_is_not_run(tmp_path, monkeypatch):
    """On NCCL the batch checks each notebook's registered launches first (here: TP 8 on a 4-head model)."""
    shutil.copy(FIXTURES / "10_records.ipynb", tmp_path / "10_records.ipynb")

    def fixture(W, backend, preset, steps):
        return [course.launch("10_records", "TP", W, tp_job.Args(), backend)]
    known = {**course.lectures(), "10_records": SimpleNamespace(NOTEBOOK="10_records", CELLS=("TP",), launches=fixture,
                                                                KEY_NUMBERS=[])}
    monkeypatch.setattr(course, "lectures", lambda extra=None: known)
    monkeypatch.setattr("par.runtime.preflight.choose_backend", lambda *a, **k: "nccl")   # as if on a GPU server
    monkeypatch.setattr(batch, "run_one", lambda *a: pytest.fail("the notebook was run"))
    summary = batch.run([tmp_path / "10_records.ipynb"], tmp_path / "runs", {"world_size": 8, "backend": "nccl",
                                                                             "preset": "tiny", "steps": 20})
    (row,) = summary["notebooks"]
    assert row["status"] == "not run" and summary["failed"] == 1
    assert "tp 8 does not divide n_head 4" in row["error"] and row["error"].startswith("10_records [TP]")
    assert "10_records.ipynb was not run:" in batch.markdown(summary)


def test_a_cell_past_the_timeout_fails_its_notebook(tmp_path):
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                           "language": "python"}})
    nb.cells = [nbformat.v4.new_code_cell("import time\ntime.sleep(60)")]
    nbformat.write(nb, tmp_path / "30_hangs.ipynb")
    start = time.monotonic()
    row = batch.run_one(tmp_path / "30_hangs.ipynb", tmp_path / "out.ipynb", {}, timeout=3)
    assert row["status"] == "FAILED" and "timed out" in row["error"], row
    assert time.monotonic() - start < 50


def test_a_failed_launch_shows_its_root_cause_in_the_notebook_and_the_summary(tmp_path):
    worker = Path(__file__).parent / "workers" / "launch_modes.py"
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                           "language": "python"}})
    nb.cells = [nbformat.v4.new_code_cell("import par.runtime.launch\nimport par.course.batch.record"),
                nbformat.v4.new_code_cell(f"par.runtime.launch.run({str(worker)!r}, nproc=2, args=['raise'], quiet=True, "
                                          f"timeout=120)"),
                nbformat.v4.new_code_cell("print('a later cell')")]
    nbformat.write(nb, tmp_path / "40_launch_fails.ipynb")
    row = batch.run_one(tmp_path / "40_launch_fails.ipynb", tmp_path / "out.ipynb", {}, timeout=300)
    cause = "rank 1 failed: ValueError: deliberate failure on rank one (marker 4417)"
    assert row["error"] == f"LaunchError: {cause}"
    (error,) = [o for c in nbformat.read(tmp_path / "out.ipynb", 4).cells for o in c.get("outputs", [])
                if o.output_type == "error"]
    shown = "\n".join(error.traceback)
    assert shown.startswith(f"LaunchError: {cause}\n") and "launch_modes.py\", line" in shown
    assert "par/runtime/launch.py" not in shown, "the launcher's own frames say nothing about the failure"


# ---------------------------------------------------------------- the course on one rank (a one-GPU server)
# Run in the notebook's kernel first: the lectures (`par.course.batch.cost.on_gpus`) and the suite (`choose_backend`)
# take their GPU branch, as on a server with one GPU; the launches keep the notebook's backend, gloo, and the
# kernel's own demos stay on the CPU.
ONE_GPU_SERVER = """\
import par.course.batch.cost as _cost, par.runtime.preflight as _preflight, par.runtime.dist as _dist
_real = _preflight.choose_backend
_cost.on_gpus = lambda backend, world_size: True
_cost.kernel_device = lambda backend, world_size: "host"
_preflight.choose_backend = _dist.choose_backend = lambda world_size, requested="auto", gpus=None, local_world_size=None: (
    "nccl" if gpus is None else _real(world_size, requested, gpus, local_world_size))
"""


@slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("stem", ["00_distributed_basics", "02_data_parallel", "06_zero", "07_putting_it_together"])
def test_the_one_gpu_server_path_runs_on_cpu_ranks(stem, tmp_path):
    """At --world-size 1 on a GPU server: 00 has no other world size to fit alpha and beta on, 02 no other loss
    curve, 06 no 4-rank job to write the checkpoint, 07's 3D row needs 8 GPUs and is skipped. (07b has no GPU
    branch: its measurement across nodes runs its own CPU ranks whatever the world size, and `.ci/run`'s
    one-rank batch executes it.)"""
    nb = nbformat.read(ROOT / "notebooks" / f"{stem}.ipynb", as_version=4)
    at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    nb.cells.insert(at + 1, nbformat.v4.new_code_cell(ONE_GPU_SERVER))
    (tmp_path / "notebooks").mkdir()
    shutil.copytree(ROOT / "configs", tmp_path / "configs")          # lecture 07 reads ../configs/3d.json
    path = tmp_path / "notebooks" / f"{stem}.ipynb"
    nbformat.write(nb, path)
    row = batch.run_one(path, tmp_path / "out.ipynb", {"world_size": 1, "backend": "gloo", "preset": "tiny",
                                                        "steps": 20}, timeout=900)
    assert row["status"] == "ok", f"{stem}: {row['error']} (executed copy: {row['output']})"
