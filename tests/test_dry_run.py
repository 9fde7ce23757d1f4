"""The course's launches as data (each lecture module's `launches`, found by `par.course.batch.launches`) and the
dry run of a GPU batch (`par.course.batch.dry_run`), without a GPU.

- each lecture's launches are a pure function of (world_size, backend, preset, steps), and every launch names a job
  that exists, with a timeout that scales with its work;
- the dry run passes for gpt3-small on 8 x 80 GB and on 4 x 40 GB, and fails with one line per problem
  for 2 x 8 GB;
- a synthetic set of lectures with the launches as the notebooks made them before issue 18 (TP degree 8 on 12
  heads, a single-process reference of the whole pipeline batch, a 1-rank baseline on the CPU, fixed
  300 s timeouts) is caught, each problem by its kind;
- the notebooks' own work in their kernel (demos, one-process references) is sized down or skipped, with the
  reason, at gpt3-small; the dry run refuses in-kernel work that does not fit the host or GPU 0, and catches
  the kernels' work as issue 28 found it (a 16 x 2048 fp32 step on GPU 0, a 64 x 2048 reference on the host);
- `python -m par batch --dry-run` prints the table, the in-kernel work and the problems, exit 0 or 2.
"""
from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from par.course.batch import cost, dry_run as checker, runner as batch, launches as course
from par.dp import job as dp_job
from par.model import preset as model_preset
from par.pp import job as pp_job
from par.tp import job as tp_job
from par.tp.layers import tp_degree

GPT3 = "gpt3-small"


@pytest.mark.parametrize("world_size, memory", [(8, 80e9), (4, 40e9)])
def test_gpt3_small_fits_real_servers(world_size, memory):
    estimates, problems = checker.dry_run(world_size, "nccl", GPT3, 200, memory)
    assert problems == []
    assert len(estimates) >= len(course.lectures())
    assert all(e.backend == "nccl" for e in estimates), "no launch may fall back to the CPU on a GPU server"
    assert all(e.launch.nproc <= world_size for e in estimates)
    assert max(e.memory for e in estimates) <= memory


def test_gpt3_small_on_one_gpu_has_no_layout_problem():
    """The GPU tier's batch (--world-size 1): every launch fits one 80 GB GPU."""
    estimates, problems = checker.dry_run(1, "nccl", GPT3, 20, 80e9)
    assert problems == [] and {e.launch.nproc for e in estimates} == {1}


def test_two_small_gpus_fail_with_one_line_per_problem():
    _, problems = checker.dry_run(2, "nccl", GPT3, 200, 8e9)
    assert problems, "gpt3-small does not fit 8 GB per GPU"
    assert {p.kind for p in problems} == {"memory"}
    for p in problems:
        line = str(p)
        assert "\n" not in line and "per GPU > 8.00 GB" in line and "[" in line   # names the notebook's cell


def test_every_lectures_launches_are_pure_and_name_real_jobs():
    for nb, lecture in course.lectures().items():
        for args in [(2, "auto", "tiny", 20), (8, "nccl", GPT3, 200)]:
            first, again = course.launches(nb, *args), course.launches(nb, *args)
            assert first == again and (first or not lecture.CELLS), nb   # 07b launches nothing
            for l in first:
                assert importlib.util.find_spec(l.module) is not None, l.module
                assert type(l.args).parse(l.args.to_argv()) == l.args
                assert l.timeout >= cost.MIN_TIMEOUT_S


def test_timeouts_scale_with_the_work():
    small = {l.name(): l.timeout for l in course.launches("02_data_parallel", 8, "nccl", GPT3, 20)}
    big = {l.name(): l.timeout for l in course.launches("02_data_parallel", 8, "nccl", GPT3, 2000)}
    assert small.keys() == big.keys() and all(big[k] > small[k] for k in small)
    found = course.launches("02_data_parallel", 8, "nccl", GPT3, 2000)
    cells: dict = {}
    for l in found:
        cells[l.cell] = cells.get(l.cell, 0) + l.timeout
    assert course.notebook_timeout(found) >= max(cells.values()), "a launch's own timeout must fire first"


def test_gpu_sensible_choices():
    """TP degree = the largest divisor of the heads <= world size; sweeps stay within the GPUs; no CPU ranks."""
    cfg = model_preset(GPT3)
    assert tp_degree(cfg, 8) == 6 and tp_degree(cfg, 4) == 4 and tp_degree(cfg, 5) == 4
    (tp,) = course.launches("04_tensor_parallel", 8, "nccl", GPT3, 200)
    assert tp.nproc == 6 and tp.args.no_reference
    sweep = course.find("02_data_parallel", "loss curves", 2, "nccl", GPT3, 200)
    assert [l.nproc for l in sweep] == [1] and sweep[0].backend == "nccl"
    gantt = course.find("03_pipelines", "gantt", 8, "nccl", GPT3, 200)
    assert not gantt[0].args.check, "no single-process reference of gpt3-small's whole batch"
    # on CPU ranks the course keeps its tiny-preset demos as they are (4 cheap pipeline ranks, the reference)
    (cpu_gantt,) = course.find("03_pipelines", "gantt", 2, "gloo", "tiny", 20)
    assert cpu_gantt.args.check and cpu_gantt.nproc == 4


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="here 'auto' means NCCL")
def test_auto_means_this_machine_in_a_notebook_and_gpus_in_the_dry_run():
    assert course.find("03_pipelines", "gantt", 2, "auto", "tiny", 20)[0].nproc == 4       # gloo here
    assert checker.dry_run(4, "auto", GPT3, 200, 40e9) == checker.dry_run(4, "nccl", GPT3, 200, 40e9)


def test_unknown_notebook_is_a_clear_error():
    with pytest.raises(course.CourseError, match="no lecture module for notebook '99_nope'"):
        course.launches("notebooks/99_nope.ipynb", 2)


# ---------------------------------------------------------------- the checker catches what issue 18 found
def synthetic(**launches) -> dict:
    """A set of lectures {notebook: module} whose `launches` are the given functions (`known=` of the dry run)."""
    return {nb: SimpleNamespace(NOTEBOOK=nb, CELLS=(), launches=fn, KEY_NUMBERS=[]) for nb, fn in launches.items()}


def legacy_registry() -> dict:
    """The launches as the notebooks made them before issue 18, written as data."""
    def nb04(W, backend, preset, steps):   # TP degree = world size, whatever the heads
        return [course.launch("04_tensor_parallel", "TP training", W, tp_job.Args(
            preset=GPT3, batch_size=8, steps=steps), backend, timeout=600)]

    def nb03(W, backend, preset, steps):   # --check: the single-process reference of the whole batch
        return [course.launch("03_pipelines", "gantt", W, pp_job.Args(
            preset=GPT3, microbatches=(16,), micro_batch_size=2, steps=3, check=True), backend, timeout=300)]

    def nb02(W, backend, preset, steps):   # the 1-rank baseline on the CPU, a fixed 300 s timeout
        return [course.launch("02_data_parallel", "loss curves", 1, dp_job.Args(
            dp=("none",), preset=GPT3, batch=32, steps=steps), "gloo", timeout=300)]
    return synthetic(**{"02_data_parallel": nb02, "03_pipelines": nb03, "04_tensor_parallel": nb04})


def test_the_work_is_what_the_arguments_say():
    """A launch's work comes from its job's arguments: here dp 2 x pp 2 on 4 ranks, the reference beside."""
    (job,) = course.find("03_pipelines", "dp x pp", 4, "gloo", "tiny", 20)
    (w,) = job.work
    assert (w.dp, w.pp, w.microbatches, w.global_batch, w.reference_batch) == (2, 2, 3, 12, 12)
    assert w.steps == job.args.steps + job.args.warmup and w.model == model_preset("tiny")
    zero = course.find("06_zero", "stages", 4, "gloo", "tiny", 20)[0]
    assert [(w.zero_stage, w.offload, w.precision) for w in zero.work] == [
        (r.stage, r.offload, r.precision or "fp32") for r in zero.args.runs]


def test_the_checker_finds_issue_18s_problems():
    _, problems = checker.dry_run(8, "nccl", GPT3, 200, 80e9, known=legacy_registry())
    by_notebook = {}
    for p in problems:
        by_notebook.setdefault(p.where.split(" ")[0], []).append(p)
    (tp,) = by_notebook["04_tensor_parallel"]
    assert tp.kind == "layout" and "tp 8 does not divide n_head 12" in tp.message
    assert [p.kind for p in by_notebook["03_pipelines"]] == ["memory"]
    assert "GB per GPU > 80.00 GB" in by_notebook["03_pipelines"][0].message
    cpu = by_notebook["02_data_parallel"]
    assert [p.kind for p in cpu] == ["time"] and "on CPU > its timeout 300 s" in cpu[0].message


def test_a_launch_needing_more_gpus_than_the_server_has():
    def nb(W, backend, preset, steps):
        return [course.launch("03_pipelines", "gantt", max(W, 4), pp_job.Args(), backend)]
    _, problems = checker.dry_run(2, "nccl", "tiny", 20, 80e9, known=synthetic(**{"03_pipelines": nb}))
    assert [str(p) for p in problems] == [
        "03_pipelines [gantt] par.pp.job on 4 ranks: needs 4 GPUs, the server has 2"]


# ---------------------------------------------------------------- the command line
def test_cli_dry_run_passes_and_fails(capsys):
    args = ["--dry-run", "--backend", "nccl", "--preset", GPT3, "--steps", "200"]
    assert batch.main([*args, "--world-size", "8", "--gpu-memory", "80e9"]) == 0
    out = capsys.readouterr().out
    assert "everything fits" in out and "04_tensor_parallel [TP training] par.tp.job on 6 ranks" in out
    assert batch.main([*args, "--world-size", "2", "--gpu-memory", "8GB"]) == 2
    out = capsys.readouterr().out
    problems = [line for line in out.splitlines() if line.startswith("problem: ")]
    _, expected = checker.dry_run(2, "nccl", GPT3, 200, 8e9)
    assert problems == [f"problem: {p}" for p in expected]


def test_cli_dry_run_needs_the_gpu_memory():
    with pytest.raises(course.CourseError, match="--gpu-memory"):
        batch.main(["--dry-run", "--backend", "nccl", "--world-size", "8"])


def test_bytes_are_read_like_a_person_writes_them():
    assert batch.parse_bytes("80e9") == 80e9 and batch.parse_bytes("40GB") == 40e9
    assert batch.parse_bytes("40 GiB") == 40 * 2 ** 30 and batch.parse_bytes("8000000000") == 8e9


# ---------------------------------------------------------------- the notebooks' own work, in their kernel
def kernel_problems(problems) -> list:
    return [p for p in problems if "in the notebook's kernel" in p.where]


def test_in_kernel_work_scales_down_or_is_skipped_at_gpu_presets():
    """Issue 28: lecture 07 trained gpt3-small's 3D reference (64 x 2048 tokens, ~290 GB) on the host, and 05 and 06
    ran an fp32 gpt3-small step on 16 x 2048 tokens (~75 GB) on GPU 0, inside the notebook's kernel."""
    for world_size in (1, 8):
        works = {k.cell: k for nb in course.lectures() for k in course.kernel_work(nb, world_size, "nccl", GPT3, 200)}
        assert set(works) == {"naive model parallel", "fp16 demos", "recomputation", "3D reference", "one process"}
        assert works["one process"].skipped, "lecture 11's one-process resume stays off the host at gpt3-small"
        for k in works.values():
            assert k.skipped or k.memory() <= course.KERNEL_MEMORY, k
        for cell in ("naive model parallel", "fp16 demos", "recomputation"):   # sized down, never skipped
            k = works[cell]
            assert not k.skipped and k.batch * k.tokens < 16 * model_preset(GPT3).block_size, k
        assert works["fp16 demos"].device == works["recomputation"].device == "gpu"
        assert works["3D reference"].skipped, "no one-process gpt3-small reference in the kernel"
    reason = course.in_kernel("07_putting_it_together", "3D reference", 8, "nccl", GPT3, 200).skipped
    assert reason.startswith("64 x 2048 tokens of gpt3-small on the host would need ") and "GB in the notebook's kernel" in reason
    assert "needs 8 GPUs and this server has 1" in course.in_kernel(
        "07_putting_it_together", "3D reference", 1, "nccl", GPT3, 20).skipped
    # the tiny course keeps its demos whole: 16 sequences of the whole context, the 3D row's own batches
    tiny = {k.cell: k for nb in course.lectures() for k in course.kernel_work(nb, 2, "gloo", "tiny", 20)}
    assert (tiny["fp16 demos"].batch, tiny["fp16 demos"].tokens) == (16, model_preset("tiny").block_size)
    assert not tiny["3D reference"].skipped and tiny["3D reference"].device == "host"


def test_dry_run_refuses_in_kernel_work_that_does_not_fit_the_host_or_the_gpu():
    _, problems = checker.dry_run(8, "nccl", GPT3, 200, 80e9, host_memory=4e9)
    (host,) = kernel_problems(problems)
    assert host.kind == "memory" and host.where == "03_pipelines [naive model parallel] in the notebook's kernel"
    assert "of host memory > 4.00 GB" in host.message and "gpt3-small on the host" in host.message
    _, problems = checker.dry_run(1, "nccl", GPT3, 20, 6e9, host_memory=512e9)
    assert [p.where for p in kernel_problems(problems)] == ["05_mixed_precision [fp16 demos] in the notebook's kernel"]
    assert "per GPU > 6.00 GB" in kernel_problems(problems)[0].message
    assert kernel_problems(checker.dry_run(8, "nccl", GPT3, 200, 80e9, host_memory=512e9)[1]) == []


def test_dry_run_catches_the_in_kernel_work_issue_28_found():
    """The kernels' work as the notebooks did it before issue 28, as data: refused on 40 GB GPUs with 128 GB of host."""
    cfg = model_preset(GPT3)

    def nb05(W, backend, preset, steps):    # an fp32 step of 16 x 2048 tokens and its fp16 copies on GPU 0
        return [course.KernelWork(notebook="05_mixed_precision", cell="fp16 demos", model=cfg, batch=16, tokens=2048,
                                  device="gpu", label=GPT3, optimizer="adam", states=20.0)]

    def nb07(W, backend, preset, steps):    # the 3D row's one-process reference: 5 steps of 64 x 2048 on the host
        return [course.KernelWork(notebook="07_putting_it_together", cell="3D reference", model=cfg, batch=64,
                                  tokens=2048, device="host", label=GPT3, optimizer="adam", steps=5)]
    known = synthetic(**{"05_mixed_precision": lambda *a: [], "07_putting_it_together": lambda *a: []})
    known["05_mixed_precision"].kernel, known["07_putting_it_together"].kernel = nb05, nb07
    _, problems = checker.dry_run(4, "nccl", GPT3, 200, 40e9, host_memory=128e9, known=known)
    found = {p.where.split(" ")[0]: p for p in kernel_problems(problems)}
    assert set(found) == {"05_mixed_precision", "07_putting_it_together"}
    assert "per GPU > 40.00 GB" in found["05_mixed_precision"].message
    assert "of host memory > 128.00 GB" in found["07_putting_it_together"].message


def test_cli_dry_run_prints_the_in_kernel_work_and_refuses_a_small_host(capsys):
    args = ["--dry-run", "--backend", "nccl", "--preset", GPT3, "--steps", "200", "--world-size", "8",
            "--gpu-memory", "80e9"]
    assert batch.main([*args, "--host-memory", "512GB"]) == 0
    out = capsys.readouterr().out
    assert "05_mixed_precision [fp16 demos] in the notebook's kernel" in out and "skipped: 64 x 2048 tokens" in out
    assert batch.main([*args, "--host-memory", "4GB"]) == 2
    problems = [line for line in capsys.readouterr().out.splitlines() if line.startswith("problem: ")]
    (line,) = problems
    assert line.startswith("problem: 03_pipelines [naive model parallel] in the notebook's kernel: predicted ")
    assert line.endswith(" GB of host memory > 4.00 GB (1 x 2048 tokens of gpt3-small on the host)")
