"""Run the whole course: every lecture notebook, executed with papermill, summarised.

    python -m par batch                                   # CPU: 2 gloo ranks, tiny model
    python -m par batch --backend nccl --world-size 8 --preset gpt3-small --steps 200   # a GPU server

Each `notebooks/*.ipynb` (sorted) runs top to bottom in a fresh kernel "python3" of
this interpreter, with its `parameters` cell overridden by world_size, backend,
preset and steps, and is saved executed into `runs/<YYYYmmdd-HHMMSS>/`. A failing
notebook is reported and the batch goes on. The folder gets `summary.json` and
`summary.md`: per notebook its status (ok, or FAILED with the error's first line),
its duration, and the key numbers it left with `par.notebook.record`. The exit
code is 1 when any notebook failed.
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from datetime import datetime
from pathlib import Path

from tqdm.auto import tqdm


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


def run_one(notebook: Path, output: Path, parameters: dict, timeout: float) -> dict:
    """Execute one notebook with papermill into `output`; return its summary row (never raises)."""
    import nbformat
    import papermill

    from par.notebook import records

    start = time.perf_counter()
    error = None
    try:
        papermill.execute_notebook(str(notebook), str(output), parameters=parameters, kernel_name="python3",
                                   cwd=str(notebook.parent), execution_timeout=timeout,
                                   progress_bar=False, log_output=False)
    except Exception as e:  # the batch reports every failure and goes on
        error = first_line(e)
    found = records(nbformat.read(output, as_version=4)) if output.exists() else {}
    return {"notebook": notebook.name, "status": "FAILED" if error else "ok", "error": error,
            "duration_s": round(time.perf_counter() - start, 1), "records": found, "output": str(output)}


def run(notebooks, out_root: Path, parameters: dict, timeout: float) -> dict:
    """Execute `notebooks` in order into a new timestamped folder under `out_root`; return the summary."""
    logging.getLogger("papermill").setLevel(logging.WARNING)
    warning = kernel_warning()
    if warning:
        print(f"warning: {warning}", flush=True)
    folder = Path(out_root) / datetime.now().strftime("%Y%m%d-%H%M%S")
    suffix = 1
    while folder.exists():  # two batches in the same second
        folder = folder.with_name(f"{folder.name.split('_')[0]}_{suffix}")
        suffix += 1
    folder.mkdir(parents=True)
    rows = []
    bar = tqdm(list(notebooks), desc="notebooks", unit="nb")
    for notebook in bar:
        bar.set_postfix_str(notebook.name)
        row = run_one(notebook, folder / notebook.name, parameters, timeout)
        rows.append(row)
        if row["error"]:
            bar.write(f"FAILED {notebook.name}: {row['error']}")
    bar.close()
    summary = {"folder": str(folder), "parameters": parameters, "timeout_s": timeout, "notebooks": rows,
               "failed": sum(r["status"] != "ok" for r in rows),
               "duration_s": round(sum(r["duration_s"] for r in rows), 1)}
    (folder / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (folder / "summary.md").write_text(markdown(summary))
    return summary


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
    lines = [f"# Batch run {Path(summary['folder']).name}", "",
             "Parameters: " + ", ".join(f"{k}={v}" for k, v in p.items()) + f"; cell timeout {summary['timeout_s']:g} s",
             "", "| notebook | status | duration (s) | key numbers |", "|---|---|---:|---|"]
    for r in summary["notebooks"]:
        status = r["status"] + (f": {r['error']}" if r["error"] else "")
        numbers = ", ".join(f"{k} = {short(v)}" for k, v in r["records"].items())
        lines.append(f"| {r['notebook']} | {status.replace('|', '/')} | {r['duration_s']:.1f} | {numbers} |")
    ok = len(summary["notebooks"]) - summary["failed"]
    lines += ["", f"{ok}/{len(summary['notebooks'])} notebooks ok in {summary['duration_s']:.1f} s."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m par batch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2, help="ranks per launched job (default 2)")
    parser.add_argument("--backend", default="auto", help="auto | gloo | nccl (default auto)")
    parser.add_argument("--preset", default="tiny", help="GPT-lite preset: tiny | small | gpt3-small")
    parser.add_argument("--steps", type=int, default=20, help="training steps where a notebook trains")
    parser.add_argument("--out", type=Path, default=Path("runs"), help="runs/<time>/ goes here")
    parser.add_argument("--notebooks", default="notebooks/*.ipynb", help="glob of notebooks to run")
    parser.add_argument("--timeout", type=float, default=600,
                        help="seconds any one cell may run before the notebook is failed (papermill execution_timeout)")
    args = parser.parse_args(argv)
    notebooks = sorted(Path().glob(args.notebooks)) if not Path(args.notebooks).is_absolute() else \
        sorted(Path(args.notebooks).parent.glob(Path(args.notebooks).name))
    if not notebooks:
        print(f"error: no notebook matches {args.notebooks!r} (from {Path.cwd()}); run from the repository root "
              f"or pass --notebooks", flush=True)
        return 1
    parameters = {"world_size": args.world_size, "backend": args.backend, "preset": args.preset, "steps": args.steps}
    summary = run(notebooks, args.out, parameters, args.timeout)
    print("\n" + markdown(summary) + f"\nexecuted notebooks and summary: {summary['folder']}")
    return 1 if summary["failed"] else 0
