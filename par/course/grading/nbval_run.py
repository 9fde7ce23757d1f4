"""Run one notebook under nbval in a fresh temporary directory, and say what happened to every code cell.

    result = run(nb, timeout=600, cell_timeout=300)
    result.cells[3].passed, result.cells[3].error      # code cell 3 (nbval's numbering: code cells only)

The notebook runs as `pytest --nbval-lax` does it: one fresh kernel of this interpreter, cells top to
bottom, a cell fails when it raises (outputs are not compared). The kernel's working directory is the
temporary directory, so a cell that writes a file (`%%writefile my_ring.py`) writes it there, and a job
the cell launches finds it there; this `par` comes first on the kernel's PYTHONPATH, so the notebook and
the ranks it launches use the same code as the grader.

Nothing can hang or crash the caller:

* a cell running past `cell_timeout` is interrupted by nbval (KeyboardInterrupt) and fails; the later
  cells still run;
* the whole run past `timeout` is killed with every process below it (kernel, launched ranks);
  `result.timed_out` is set and `result.running` names the cell that was running;
* a kernel that dies (a segfault, `os._exit`, out of memory) is noticed within a fraction of a second by
  a watchdog in the pytest process, which records it (`result.kernel_died`) and ends the run.

This module is also the pytest plugin that records the cells (`-p par.course.grading.nbval_run`): one JSON line per
event in the file named by `PAR_NBVAL_REPORT`.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPORT_ENV = "PAR_NBVAL_REPORT"
_RUNNING: set = set()          # the pytest processes of runs in progress (stop_all ends them)
_LOCK = threading.Lock()
KERNEL_DIED_EXIT = 3
from par.runtime.paths import ROOT
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
LAUNCH_ROOT_CAUSE = re.compile(r"\brank (\d+) failed: (.+)$")
ERROR_LINE = re.compile(r"^\s*(?:\[\w+\]:\s*)*[\w.]+(?:Error|Exception|Interrupt|Exit)\b")


@dataclass
class CellResult:
    passed: bool = False
    ran: bool = False          # the cell's code was sent to the kernel (its setup did not fail)
    error: str = ""            # one line: the exception, or why the cell did not run
    traceback: str = ""        # the last lines of the cell's traceback, ANSI colours removed
    timed_out: bool = False    # interrupted at the cell timeout
    seconds: float = 0.0


@dataclass
class NotebookRun:
    """What happened to every code cell of one run of a notebook (nbval's, or the grader's cell by cell)."""
    cells: dict[int, CellResult] = field(default_factory=dict)
    timed_out: bool = False            # the whole notebook ran past `timeout` and was killed
    kernel_died: int | None = None     # the code cell during which the kernel died
    running: int | None = None         # the code cell that was running when the run ended early
    exit_code: int = 0
    output: str = ""                   # pytest's own output (the tail), for a run that went wrong
    seconds: float = 0.0

    @property
    def cell_timeouts(self) -> list[int]:
        return [i for i, c in self.cells.items() if c.timed_out]


# ---------------------------------------------------------------- the caller's side
def run(nb, *, timeout: float = 600, cell_timeout: float = 300, name: str = "notebook.ipynb",
        env: dict | None = None) -> NotebookRun:
    """Run the notebook node `nb` (see the module docstring); never raises for what the notebook does."""
    import nbformat
    from par.runtime.procs import kill_tree
    from par.runtime.lifeline import dies_with_parent   # the grader SIGKILLed: pytest, its kernel and ranks go too
    with tempfile.TemporaryDirectory(prefix="par-grade-") as tmp:
        tmp = Path(tmp)
        path, report, log = tmp / name, tmp / ".cells.jsonl", tmp / ".pytest.log"
        nbformat.write(nb, path)
        (tmp / "pytest.ini").write_text("[pytest]\n")  # no ini or conftest of any repository applies
        cmd = [sys.executable, "-m", "pytest", "--nbval-lax", "--nbval-current-env",
               f"--nbval-cell-timeout={max(1, int(cell_timeout))}", "-p", "no:cacheprovider",
               "-p", "par.course.grading.nbval_run", "-q", "-rN", "--color=no", path.name]
        child_env = {**os.environ, REPORT_ENV: str(report), "MPLBACKEND": "Agg", "PYTHONUNBUFFERED": "1",
                     "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
                     "TMPDIR": str(tmp),   # nbval's kernel connection file: removed with the folder, even after a kill
                     **(env or {})}
        child_env.pop("PYTEST_ADDOPTS", None)
        child_env.pop("PYTEST_CURRENT_TEST", None)
        start = time.monotonic()
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, cwd=tmp, env=child_env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=dies_with_parent())
            with _LOCK:
                _RUNNING.add(proc)
            timed_out = False
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:  # the kernel and any ranks it launched go too (sessions of their own)
                timed_out = True
                kill_tree(proc)
            except BaseException:
                kill_tree(proc)
                raise
            finally:
                with _LOCK:
                    _RUNNING.discard(proc)
        result = parse_report(report)
        result.timed_out, result.exit_code = timed_out, proc.returncode
        result.seconds = time.monotonic() - start
        result.output = log.read_text(errors="replace")[-4000:]
        return result


def stop_all() -> None:
    """Kill every run in progress, with its kernel and what that launched (Ctrl-C in the grader)."""
    from par.runtime.procs import kill_tree
    with _LOCK:
        running = list(_RUNNING)
    for proc in running:
        if proc.poll() is None:
            kill_tree(proc)


def parse_report(path: Path) -> NotebookRun:
    """The NotebookRun described by the plugin's JSON lines (cells that never reported are absent)."""
    result, started, phases = NotebookRun(), [], {}
    lines = Path(path).read_text().splitlines() if Path(path).exists() else []
    for line in lines:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a kill
            continue
        cell = event.get("cell")
        if event.get("event") == "start":
            started.append(cell)
        elif event.get("event") == "kernel_died":
            result.kernel_died = cell
        elif "when" in event:
            phases.setdefault(cell, []).append(event)
    for cell, events in phases.items():
        failed = [e for e in events if e["outcome"] != "passed"]
        ran = any(e["when"] == "call" for e in events)
        first = failed[0] if failed else {}
        result.cells[cell] = CellResult(passed=ran and not failed, ran=ran, error=first.get("error", ""),
                                        traceback=first.get("traceback", ""),
                                        timed_out=any(e.get("timed_out") for e in events),
                                        seconds=sum(e.get("duration", 0.0) for e in events))
    dead = [c for c, r in sorted(result.cells.items()) if "Kernel dead on test start" in r.traceback + r.error]
    if result.kernel_died is None and dead:  # it died between two cells, where the watchdog does not look
        result.kernel_died = dead[0]
    finished = {c for c, events in phases.items() if any(e["when"] == "teardown" for e in events)}
    unfinished = [c for c in started if c not in finished]
    result.running = unfinished[-1] if unfinished else None
    return result


# ---------------------------------------------------------------- the pytest plugin (inside the run)
def _cell(nodeid: str) -> int | None:
    return int(nodeid.rsplit(" ", 1)[1]) if "::Cell " in nodeid else None


def _write(event: dict) -> None:
    path = os.environ.get(REPORT_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(event) + "\n")
            f.flush()


def summary(text: str) -> tuple[str, str]:
    """(one line naming the error, the traceback's last lines) of nbval's report of a failed cell."""
    text = ANSI.sub("", text or "")
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    if "Timeout of" in text:
        line = next(line for line in lines if "Timeout of" in line)
        return line.strip(), "\n".join(lines[-15:])
    launched = next((m for m in map(LAUNCH_ROOT_CAUSE.search, lines) if m), None)
    if launched:    # a launched job failed: par.runtime.launch.LaunchError's first line names the rank and the error
        return f"{launched.group(2).strip()} (rank {launched.group(1)})"[:300], "\n".join(lines[-15:])
    error = next((line for line in reversed(lines) if re.match(ERROR_LINE, line)), lines[-1] if lines else "")
    rank = re.match(r"^\s*(?:\[\w+\]:\s*)*\[rank(\d+)\]:", error)     # a launched rank's error, prefixed by torchrun
    error = re.sub(r"^\s*(?:\[\w+\]:\s*)+", "", error).strip() + (f" (rank {rank.group(1)})" if rank else "")
    return error[:300], "\n".join(lines[-15:])


def pytest_runtest_logstart(nodeid, location):
    cell = _cell(nodeid)
    if cell is not None:
        _write({"cell": cell, "event": "start"})


def pytest_runtest_logreport(report):
    cell = _cell(report.nodeid)
    if cell is None:
        return
    event = {"cell": cell, "when": report.when, "outcome": report.outcome, "duration": report.duration}
    if report.outcome != "passed":
        text = report.longreprtext if report.longrepr is not None else ""
        if getattr(report, "wasxfail", None):
            text = text or "not run: an earlier cell timed out"
        event["error"], event["traceback"] = summary(text)
        event["timed_out"] = "Timeout of" in text
    _write(event)


def _kernel_process(item):
    kernel = getattr(getattr(item, "parent", None), "kernel", None)
    km = getattr(kernel, "km", None)
    return getattr(getattr(km, "provisioner", None), "process", None)


try:
    import pytest

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(item):
        """Watch the kernel while the cell runs: nbval would wait for a dead kernel's reply for ever."""
        proc, cell, done = _kernel_process(item), _cell(item.nodeid), threading.Event()

        def watch():
            while not done.wait(0.2):
                if proc.poll() is not None:
                    _write({"cell": cell, "event": "kernel_died", "code": proc.returncode})
                    sys.stdout.flush()
                    os._exit(KERNEL_DIED_EXIT)

        if proc is not None and cell is not None and os.environ.get(REPORT_ENV):
            threading.Thread(target=watch, daemon=True).start()
        try:
            yield
        finally:
            done.set()
except ImportError:  # pytest is only needed inside the run
    pass
