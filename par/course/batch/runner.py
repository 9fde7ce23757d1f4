"""Run the whole course: every lecture notebook, executed with papermill, summarised.

    python -m par batch                                   # CPU: min(4, cores) gloo ranks, tiny model
    python -m par batch --backend nccl --world-size 8 --preset gpt3-small --steps 200   # a GPU server
    python -m par batch --dry-run --backend nccl --world-size 8 --preset gpt3-small --steps 200 --gpu-memory 80e9

Before anything runs, the backend is checked against this machine (`par.runtime.preflight`): NCCL
without a GPU per rank stops at once (`BackendError`, exit 2). On a GPU server the batch also
checks each notebook's launches (`par.course.batch.launches`) and does not run a notebook it knows will fail
(a layout its degrees cannot split, a launch that needs more GPUs or more memory than there are); on any
machine it does not run one whose in-kernel work (`par.course.batch.launches.kernel_work`) needs more memory than
GPU 0 or the host has. Its row says "not run" and why.

Each `notebooks/*.ipynb` (sorted) runs top to bottom in a fresh kernel "python3" of
this interpreter, with its `parameters` cell overridden by world_size, backend,
preset and steps, and is saved executed into `runs/<YYYYmmdd-HHMMSS>/`. A failing
notebook is reported and the batch goes on. A cell may run for `--timeout` seconds; by
default a notebook's cell timeout scales with its launches (`par.course.batch.launches.notebook_timeout`).
The folder gets `summary.json` and `summary.md`: per notebook its status (ok, FAILED with
the error's first line, or not run), its duration, and the key numbers it left with
`par.course.batch.record.record`, and the verdict of each of its lecture's targets (`par.course.batch.claims.verdicts`:
met, or missed with the value; `summary.md` lists every missed one, and a missed target does not fail the batch);
`summary.json` also merges every notebook's numbers under `records` and counts `targets_missed`.
`summary.json`'s `provenance` says where the run came from (date, machine, CPU, GPUs, backend chosen,
world size, preset, steps, torch, commit): `python -m par site` shows it on every page.
The exit code is 1 when any notebook failed or was not run.

`--dry-run` runs nothing: it checks every launch of every notebook for a server of
`--world-size` GPUs with `--gpu-memory` bytes each (`par.course.batch.dry_run`), and the work each
notebook does in its own kernel (demos, single-process references) against GPU 0 and `--host-memory`
(default: this machine's); it prints the predicted memory and time per launch, the in-kernel work, then
one line per problem; exit 0 when everything fits, else 2.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import time
from dataclasses import replace
from datetime import datetime
from pathlib import Path

from tqdm.auto import tqdm

from par.course.batch.cost import CELL_TIMEOUT_S   # a notebook's cell timeout when no lecture module knows it
from par.course.batch.kernel_poll import sliced
from par.course.batch.record import records
from par.runtime import preflight
from par.runtime.checks import check_writable, positive_float, positive_int, write_atomic
from par.runtime.lifeline import STOPPING


def first_line(error: BaseException) -> str:
    """`Name: message` of an error, first line only (papermill's carries the cell's exception)."""
    name = getattr(error, "ename", None) or type(error).__name__
    text = str(getattr(error, "evalue", None) or error).strip()
    return f"{name}: {text.splitlines()[0] if text else ''}".strip().rstrip(":")


def kernel_warning() -> str | None:
    """A warning when the kernel "python3" would not run this interpreter (so notebooks could miss `par`)."""
    import shutil
    import sys

    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
    try:
        program = KernelSpecManager().get_kernel_spec("python3").argv[0]
    except NoSuchKernel:
        return "no Jupyter kernel named python3: pip install ipykernel"
    if program in ("python", "python3", f"python{sys.version_info[0]}.{sys.version_info[1]}"):
        return None  # jupyter_client runs sys.executable for these
    if Path(shutil.which(program) or program).resolve() != Path(sys.executable).resolve():
        return (f"the Jupyter kernel python3 runs {program}, not this interpreter ({sys.executable}); "
                f"fix: {sys.executable} -m ipykernel install --user --name python3")
    return None


KERNEL_ARGUMENTS = ["--IPKernelApp.log_level=CRITICAL"]   # the kernel's own log (its TCP-transport warning, its
                                                          # complaints while it is shut down mid-cell) stays quiet
NOISY_LOGGERS = ("papermill", "traitlets", "asyncio")      # what speaks while a stopped batch's kernel goes down


class _AfterStop(logging.Filter):
    """Drops every record once the batch was stopped (`par.runtime.lifeline.STOPPING`): the stop's one line is
    what the user reads, not a dead kernel's messages."""

    def filter(self, record) -> bool:
        return not STOPPING.is_set()


@contextlib.contextmanager
def quiet_after_stop():
    """Inside the block, the first Ctrl-C marks the batch stopped as SIGTERM and SIGHUP do (then raises
    KeyboardInterrupt; later ones are ignored), and the NOISY_LOGGERS say nothing after a stop; the filter stays after a stop, for the messages of exit."""
    import signal
    import threading

    STOPPING.clear()                      # a new batch in a process an earlier one was stopped in
    gate = _AfterStop()
    for name in NOISY_LOGGERS:
        for old in [f for f in logging.getLogger(name).filters if isinstance(f, _AfterStop)]:
            logging.getLogger(name).removeFilter(old)
        logging.getLogger(name).addFilter(gate)
    main = threading.current_thread() is threading.main_thread()

    def interrupted(signum, frame):       # the first Ctrl-C stops the batch; a second one cannot cut its teardown
        if not STOPPING.is_set():
            STOPPING.set()
            raise KeyboardInterrupt
    previous = signal.signal(signal.SIGINT, interrupted) if main else None
    try:
        yield
    finally:
        if main:
            signal.signal(signal.SIGINT, previous)
        if not STOPPING.is_set():
            for name in NOISY_LOGGERS:
                logging.getLogger(name).removeFilter(gate)


def run_one(notebook: Path, output: Path, parameters: dict, timeout: float) -> dict:
    """Execute one notebook with papermill into `output`; return its summary row (never raises).

    papermill saves into a temporary file beside `output`, renamed to `output` once it reads back as a notebook:
    a write that failed (a full disk) leaves no truncated notebook, only the row's error."""
    import nbformat
    import papermill

    start = time.perf_counter()
    error, found = None, {}
    partial = output.with_name(f".{output.stem}.tmp{output.suffix}")
    try:
        with sliced():  # a lost wake-up must not stall a cell for its whole timeout
            papermill.execute_notebook(str(notebook), str(partial), parameters=parameters, kernel_name="python3",
                                       cwd=str(notebook.parent), execution_timeout=timeout,
                                       progress_bar=False, log_output=False, extra_arguments=KERNEL_ARGUMENTS)
    except Exception as e:  # the batch reports every failure and goes on
        error = first_line(e)
    except BaseException:   # stopped (Ctrl-C, SIGTERM): what ran is kept as the notebook, whole, then the stop goes on
        keep(partial, output)
        raise
    try:
        if partial.exists():
            found = records(nbformat.read(partial, as_version=4))
            os.replace(partial, output)
    except Exception as e:   # truncated (the disk filled up), or not renamed: no half-written notebook is kept
        error = error or f"the executed notebook could not be saved: {first_line(e)}"
        with contextlib.suppress(OSError):
            partial.unlink()
    from par.course.batch.claims import verdicts   # defers torch (the lectures' keys) to a notebook's end
    return {"notebook": notebook.name, "status": "FAILED" if error else "ok", "error": error,
            "duration_s": round(time.perf_counter() - start, 1), "records": found,
            "verdicts": verdicts(notebook.stem, found), "output": str(output) if output.exists() else None}


def keep(partial: Path, output: Path) -> None:
    """`partial` renamed to `output` when it reads back as a notebook, else removed."""
    import nbformat
    try:
        nbformat.read(partial, as_version=4)
        os.replace(partial, output)
    except Exception:
        with contextlib.suppress(OSError):
            partial.unlink()


CONCATENATED = ("profiler_traces",)   # records whose lists add up over the notebooks (02 and 03 save traces)


def merge_records(rows: list[dict]) -> dict:
    """Every notebook's records in one dict, in notebook order. Records of the same name that are dicts
    are merged key by key (02, 03, 04, 05, 06 and 09 each add their part of `torch_api_max_diff`), the lists
    of a name in CONCATENATED are joined; otherwise the later notebook's value wins."""
    merged: dict = {}
    for row in rows:
        for name, value in row["records"].items():
            if isinstance(value, dict) and isinstance(merged.get(name), dict):
                merged[name] = {**merged[name], **value}
            elif name in CONCATENATED and isinstance(value, list) and isinstance(merged.get(name), list):
                merged[name] = merged[name] + value
            else:
                merged[name] = value
    return merged


def not_run(notebook: Path, output: Path, problems: list) -> dict:
    """The summary row of a notebook the batch did not run, because its launches cannot work here."""
    return {"notebook": notebook.name, "status": "not run", "error": f"{problems[0]}" + (
        f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""),
            "problems": [str(p) for p in problems], "duration_s": 0.0, "records": {}, "verdicts": [], "output": None}


def gpu_memory_here() -> float | None:
    """Bytes of memory of GPU 0 of this machine (None without one)."""
    if not preflight.visible_gpus():
        return None
    import torch
    return float(torch.cuda.get_device_properties(0).total_memory)


def known_failures(notebook: Path, parameters: dict) -> tuple[list, float | None]:
    """(problems that make this notebook fail here, its automatic cell timeout); ([], None) when the
    course registry does not know the notebook. Its in-kernel work (`par.course.batch.launches.kernel_work`) that
    needs more memory than GPU 0 or this machine's host memory has; the layouts that cannot split (checked as the
    dry run does, for the backend the batch runs); on a GPU server (backend NCCL) also the launches that need
    more GPUs or more memory than there are."""
    from par.course.batch import dry_run as checker, launches as course   # defers torch (the launches' configs)
    if notebook.stem not in course.lectures():
        return [], None
    p = parameters
    try:
        found = course.launches(notebook.stem, p["world_size"], p["backend"], p["preset"], p["steps"])
    except Exception as e:  # the registry's own bug must not stop the course: run the notebook, say so
        print(f"warning: par.course.batch.launches could not list {notebook.stem}'s launches ({type(e).__name__}: {e}); "
              f"running it unchecked", flush=True)
        return [], None
    timeout = course.notebook_timeout(found)
    memory = gpu_memory_here() or float("inf")
    kernel = [problem for k in course.kernel_work(notebook.stem, p["world_size"], p["backend"], p["preset"], p["steps"])
              for problem in checker.check_kernel(k, memory, checker.host_memory_here())]
    gloo = preflight.choose_backend(p["world_size"], p["backend"]) == "gloo"   # then every launch runs gloo here
    problems = [problem for l in found for problem in checker.check(replace(l, backend="gloo") if gloo else l,
                                                                   p["world_size"], memory, timeout)[1]
                if problem.kind in ("layout", "memory")]
    return problems + kernel, timeout


def provenance(parameters: dict) -> dict:
    """Where a run comes from, for whoever reads its numbers later: when, on what machine, with which backend
    (the one `auto` chose here), ranks, preset and steps, torch and the course's commit. Never raises."""
    import os
    import platform
    import subprocess
    from importlib.metadata import version

    def attempt(fn, default=None):
        try:
            return fn()
        except Exception:
            return default
    cpu = attempt(lambda: next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                               if line.startswith("model name")), platform.processor() or platform.machine())
    gpus = attempt(lambda: [__import__("torch").cuda.get_device_name(i) for i in range(preflight.visible_gpus())], [])
    commit = attempt(lambda: subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                            timeout=10, cwd=Path(__file__).parent).stdout.strip() or None)
    backend = attempt(lambda: preflight.choose_backend(parameters["world_size"], parameters["backend"]),
                      parameters["backend"])
    machine = f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs ({cpu})" + (
        f", {len(gpus)} x {gpus[0]}" if gpus else ", no GPU")
    return {"date": datetime.now().astimezone().isoformat(timespec="seconds"), "machine": machine,
            "gpus": gpus, "backend": backend, "world_size": parameters["world_size"],
            "preset": parameters["preset"], "steps": parameters["steps"], "python": platform.python_version(),
            "torch": attempt(lambda: version("torch")), "commit": commit}


def matching(pattern: str) -> list[Path]:
    """The notebooks `--notebooks` names: a glob, or a folder (its *.ipynb); only .ipynb files, sorted. None:
    CourseError saying where it looked and, for a name close to a notebook's, which one was meant."""
    import difflib
    path = Path(pattern)
    if path.is_dir():
        path = path / "*.ipynb"
    found = sorted(Path().glob(str(path))) if not path.is_absolute() else sorted(path.parent.glob(path.name))
    found = [p for p in found if p.suffix == ".ipynb" and p.is_file()]
    if found:
        return found
    known = sorted(Path("notebooks").glob("*.ipynb")) if Path("notebooks").is_dir() else []
    close = difflib.get_close_matches(Path(pattern).name, [p.name for p in known], n=1, cutoff=0.6)
    hint = f"; did you mean notebooks/{close[0]}?" if close else \
        ": run from the repository root, or pass --notebooks 'notebooks/NN_*.ipynb'"
    from par.course.batch.launches import CourseError   # defers torch to a name that matches no notebook
    raise CourseError(f"no notebook matches {pattern!r} in {Path.cwd()}{hint}")


def run(notebooks, out_root: Path, parameters: dict, timeout: float | None = None) -> dict:
    """Execute `notebooks` in order into a new timestamped folder under `out_root`; return the summary.

    `timeout`: seconds a cell may run (None: per notebook, `par.course.batch.launches.notebook_timeout`, else 600)."""
    logging.getLogger("papermill").setLevel(logging.WARNING)
    folder = Path(out_root) / datetime.now().strftime("%Y%m%d-%H%M%S")
    suffix = 1
    while folder.exists():  # two batches in the same second
        folder = folder.with_name(f"{folder.name.split('_')[0]}_{suffix}")
        suffix += 1
    folder.mkdir(parents=True)
    origin = provenance(parameters)

    def save(rows: list[dict]) -> dict:
        """summary.json and summary.md of the rows so far, each replaced atomically after every notebook: a batch
        stopped by a full disk keeps the summary of every notebook done before."""
        summary = {"folder": str(folder), "parameters": parameters, "provenance": origin, "timeout_s": timeout,
                   "notebooks": rows, "failed": sum(r["status"] != "ok" for r in rows),
                   "duration_s": round(sum(r["duration_s"] for r in rows), 1), "records": merge_records(rows),
                   "targets_missed": sum(v["verdict"] == "missed" for r in rows for v in r.get("verdicts", []))}
        write_atomic(folder / "summary.json", json.dumps(summary, indent=2) + "\n")
        write_atomic(folder / "summary.md", markdown(summary))
        return summary
    with traces_into(folder / "traces"), quiet_home(folder), quiet_after_stop():
        warning = kernel_warning()         # inside quiet_home: reading the kernel spec asks IPython for its folder
        if warning:
            print(f"warning: {warning}", flush=True)
        rows = run_all(notebooks, folder, parameters, timeout, save)
    return save(rows)


@contextlib.contextmanager
def quiet_home(folder: Path):
    """With HOME unwritable, the kernels' IPython and matplotlib settings folders go into a folder of the run that
    is removed afterwards (otherwise each kernel leaves a tmp* folder in /tmp)."""
    import shutil
    import tempfile
    home = Path(os.environ.get("HOME") or "~").expanduser()
    if os.access(home, os.W_OK):
        yield
        return
    scratch = Path(tempfile.mkdtemp(prefix=".settings-", dir=folder))
    saved = {k: os.environ.get(k) for k in ("IPYTHONDIR", "MPLCONFIGDIR")}
    os.environ.update({k: str(scratch / k.lower()) for k in saved if saved[k] is None})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
        shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def traces_into(folder: Path):
    """The profiler traces the notebooks save (`par.runtime.profile.trace_dir`) go into the run's own folder."""
    previous = os.environ.get("PAR_TRACE_DIR")
    os.environ["PAR_TRACE_DIR"] = str(folder.resolve())   # the notebooks run in their own folder
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("PAR_TRACE_DIR", None)
        else:
            os.environ["PAR_TRACE_DIR"] = previous


def run_all(notebooks, folder: Path, parameters: dict, timeout: float | None, save=None) -> list[dict]:
    """Each notebook in order into `folder`: its summary row (a failure is reported and the batch goes on);
    `save(rows)` after each one."""
    rows = []
    bar = tqdm(list(notebooks), desc="notebooks", unit="nb")
    for notebook in bar:
        bar.set_postfix_str(notebook.name)
        problems, auto_timeout = known_failures(notebook, parameters)
        if problems:
            row = not_run(notebook, folder / notebook.name, problems)
        else:
            cell_timeout = timeout or auto_timeout or CELL_TIMEOUT_S
            row = run_one(notebook, folder / notebook.name, parameters, cell_timeout)
            row["timeout_s"] = cell_timeout
        rows.append(row)
        if row["error"]:
            bar.write(f"{row['status'].upper()} {notebook.name}: {row['error']}")
        if save is not None:
            save(rows)
    bar.close()
    return rows


def short(value) -> str:
    """A recorded value for the table: floats to 4 significant digits (whole ones as integers), containers element by element."""
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else f"{value:.4g}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {short(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(short(v) for v in value) + "]"
    return str(value)


def markdown(summary: dict) -> str:
    """The human summary: one table row per notebook (summary.json keeps the numbers in full)."""
    p = summary["parameters"]
    cell = f"{summary['timeout_s']:g} s" if summary["timeout_s"] else "scaled with each notebook's launches"
    lines = [f"# Batch run {Path(summary['folder']).name}", "",
             "Parameters: " + ", ".join(f"{k}={v}" for k, v in p.items()) + f"; cell timeout {cell}",
             "", "| notebook | status | duration (s) | key numbers |", "|---|---|---:|---|"]
    for r in summary["notebooks"]:
        status = r["status"] + (f": {r['error']}" if r["error"] else "")
        numbers = ", ".join(f"{k} = {short(v)}" for k, v in r["records"].items())
        lines.append(f"| {r['notebook']} | {status.replace('|', '/')} | {r['duration_s']:.1f} | {numbers} |")
    ok = len(summary["notebooks"]) - summary["failed"]
    lines += ["", f"{ok}/{len(summary['notebooks'])} notebooks ok in {summary['duration_s']:.1f} s."]
    lines += targets_markdown(summary["notebooks"])
    for r in summary["notebooks"]:
        if r.get("problems"):
            lines += ["", f"{r['notebook']} was not run:", *[f"- {p}" for p in r["problems"]]]
    return "\n".join(lines) + "\n"


def targets_markdown(rows: list[dict]) -> list[str]:
    """The lectures' targets judged on this run: how many were met, and every missed one on a line of its own
    (a missed target does not fail the batch: the reader sees it)."""
    judged = [(r["notebook"], v) for r in rows for v in r.get("verdicts", [])]
    if not judged:
        return []
    missed = [(nb, v) for nb, v in judged if v["verdict"] == "missed"]
    lines = ["", f"Targets: {len(judged) - len(missed)}/{len(judged)} met" + (", missed:" if missed else ".")]
    lines += [f"- ✗ {nb}: {v['what']} = {short(v['value'])}, target {v['target']} ({v['reason']})"
              for nb, v in missed]
    return lines


def parse_bytes(text: str) -> float:
    """'80e9', '80GB', '40 GiB', '8000000000' -> bytes (> 0: argparse.ArgumentTypeError otherwise)."""
    t = text.strip().replace(" ", "").replace("_", "").lower()
    for unit, size in (("gib", 2 ** 30), ("gb", 1e9), ("mib", 2 ** 20), ("mb", 1e6), ("g", 1e9)):
        if t.endswith(unit):
            return positive_float(t[:-len(unit)]) * size
    return positive_float(t)


def dry_run(args) -> int:
    """`--dry-run`: the course's launches checked for the imagined server; exit 0 if all fit, else 2."""
    from par.course.batch import dry_run as checker   # defers torch (the launches' configs) to a dry run
    preflight.choose_backend(args.world_size, args.backend, gpus=args.world_size)   # a backend name that exists
    if args.gpu_memory is None and args.backend != "gloo":
        raise checker.CourseError("--dry-run imagines a GPU server: give its memory per GPU, e.g. --gpu-memory 80e9")
    host = checker.host_memory_here() if args.host_memory is None else args.host_memory
    estimates, problems = checker.dry_run(args.world_size, args.backend, args.preset, args.steps,
                                          args.gpu_memory or float("inf"), args.timeout, gpu_flops=args.gpu_flops,
                                          host_memory=host)
    memory = f"{args.gpu_memory / 1e9:g} GB" if args.gpu_memory else "CPU"
    print(f"dry run: {args.world_size} x {memory}, backend {args.backend}, preset {args.preset}, "
          f"{args.steps} steps; host memory {host / 1e9:g} GB\n")
    print(checker.format_estimates(estimates) + "\n")
    backend = "nccl" if args.backend == "auto" else args.backend
    kernel = checker.every_kernel_work(args.world_size, backend, args.preset, args.steps)
    print(checker.format_kernel(kernel) + "\n")
    for problem in problems:
        print(f"problem: {problem}")
    print(f"{len(estimates)} launches checked: " + (f"{len(problems)} problem(s)" if problems else "everything fits"))
    return 2 if problems else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m par batch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=positive_int, default=preflight.default_world_size(),
                        help=f"ranks per launched job; GPUs on a GPU server (default min(4, cores) = "
                             f"{preflight.default_world_size()})")
    parser.add_argument("--backend", default="auto", help="auto | gloo | nccl (default auto)")
    parser.add_argument("--preset", default="tiny", help="GPT-lite preset: tiny | small | gpt3-small | tiny-long")
    parser.add_argument("--steps", type=positive_int, default=20, help="training steps where a notebook trains")
    parser.add_argument("--out", type=Path, default=Path("runs"), help="runs/<time>/ goes here")
    parser.add_argument("--notebooks", default="notebooks/*.ipynb", help="glob of notebooks to run")
    parser.add_argument("--timeout", type=positive_float, default=None,
                        help="seconds any one cell may run before the notebook is failed (papermill execution_timeout; "
                             "default: scaled with the notebook's launches, at least 600)")
    parser.add_argument("--dry-run", action="store_true",
                        help="run nothing: check every launch for a server of --world-size GPUs of --gpu-memory bytes")
    parser.add_argument("--gpu-memory", type=parse_bytes, default=None, help="bytes per GPU for --dry-run: 80e9, 40GB")
    parser.add_argument("--host-memory", type=parse_bytes, default=None,
                        help="the server's host memory for --dry-run (the notebooks' own work on the CPU): 512GB "
                             "(default: this machine's)")
    parser.add_argument("--gpu-flops", type=positive_float, default=None,
                        help="achieved FLOP/s of one GPU for --dry-run (default: an A100's, fp32 without TF32)")
    args = parser.parse_args(argv)
    from par.model import PRESETS   # defers torch (par.model) past the arguments: a bad one is refused at once
    if args.preset not in PRESETS:
        parser.error(f"unknown --preset {args.preset!r}: use one of {', '.join(PRESETS)}")
    if args.dry_run:
        return dry_run(args)
    preflight.choose_backend(args.world_size, args.backend)   # preflight: BackendError before any notebook starts
    check_writable(args.out, directory=True)
    notebooks = matching(args.notebooks)
    parameters = {"world_size": args.world_size, "backend": args.backend, "preset": args.preset, "steps": args.steps}
    summary = run(notebooks, args.out, parameters, args.timeout)
    print("\n" + markdown(summary) + f"\nexecuted notebooks and summary: {summary['folder']}")
    return 1 if summary["failed"] else 0
