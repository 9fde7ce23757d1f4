"""Checks judged in the grader's process, on plain data fetched from the student's kernel.

    result = run(assembled, reference, timeout=600, cell_timeout=300)     # a NotebookRun, cell by cell

The grader drives one ipykernel itself (`par.course.grading.kernel`: jupyter_client over unix sockets in the
submission's work folder, inside `par.course.grading.sandbox` when bwrap is here). Cells go where they can be trusted:

    answer cells, cells the student added, setup     run in the student's kernel (the reply's status is recorded)
    setup cells                                      also run in the grader's namespace (the checks use them)
    check cells (all of them)                        run in the grader's own process, in that namespace, where
                                                     every name the answer cells define (`bytes_per_param`) is a
                                                     proxy (`par.course.grading.proxies`): calling it sends the
                                                     arguments to the kernel as data (`par.course.grading.codec`), calls
                                                     the student's function there, and returns the result as
                                                     data; 09's dispatch buffer joins the grader's autograd
                                                     graph (its backward runs in the kernel), 07's plan is
                                                     recomputed by the grader's planner from its layout
    `par.runtime.launch.run` in a check              the job starts from the grader, in a sandbox of its own over
                                                     the submission's folder (never through the kernel); for the
                                                     real-rank exercises the grader draws the inputs and judges
                                                     the ranks' raw outputs itself (`par.course.grading.rank_io`)

In the kernel's view of par (sandboxed), the exercise's reference answers are stubs that raise
(`par.course.grading.stubs`). No check cell reaches the kernel, so no hook of the student's can see or skip one.

What stays attackable: how a real-rank job's numbers travelled (ranks that share their inputs through a file,
or that hunt down and undo the guards of `par.course.grading.guards` in their own process, produce right
numbers); code the student copies from par's source elsewhere; everything the sandbox does not cover when it
is off.

The student's function gets copies of its arguments (they travel as data); what it does to them is never
written into the grader's objects, so an expected value computed from them after the call is the grader's own.
A check that judges what the function does to its arguments (an in-place step, "do not modify your
argument") asks for the kernel's copies with `par.course.grading.compare.arguments_after`. Patching torch,
builtins, par, IPython or the setup helpers in the kernel changes what the student's functions return, never
what the checks compare them with, nor whether an assert ran.

Hidden cases stay hidden (`withheld`): an error raised on a line of a check where its hidden cases may run is
reported by its exception type only, with the reason. The error of every cell after a check with hidden cases
started (the student's code may have kept the hidden inputs in the kernel, and an answer cell, an added cell, a
rank or a later check's assert on a returned value can carry them in a message) reaches the student the same
way: the gradebook keeps its message for the instructor, the feedback tells its type (`report.Flag`: the text and
what the student is told); a check's traceback keeps its line numbers, a kernel cell's is not told. The
handed-out stub's own error is the one message always kept.
"""
from __future__ import annotations

import builtins
import dataclasses
from dataclasses import dataclass, field
import io
import re
import time
import traceback as tb_module
from pathlib import Path

from par.course.authoring.markers import STUB
from par.course.grading import sandbox, stubs
from par.course.grading.codec import KERNEL_HELPER
from par.course.grading.kernel import MAX_OUTPUT, CellTimeout, Kernel, KernelDied, NotebookTimeout, Reply, Unstoppable
from par.course.grading.report import Flag, told
from par.course.grading.proxies import (Proxy, Session, StudentError, launching_import,
                                 sandboxed_launch)
from par.course.authoring.generate import defined_names, is_answer
from par.course.authoring.markers import HIDDEN_BEGIN


# ---------------------------------------------------------------- what happened to the cells
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
    """What happened to every code cell of one run of a notebook, the grader's cell by cell."""
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


def traceback_summary(text: str) -> tuple[str, str]:
    """(one line naming the error, the traceback's last lines) of a failed cell's traceback or a launch's error
    (a launched rank's root cause first, named with its rank)."""
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


# ---------------------------------------------------------------- one notebook
def student_names(reference) -> set[str]:
    """The names the answer cells of the reference define: in checks, they stand for the student's functions."""
    return {n for c in reference.cells if is_answer(c) for n in defined_names(c.source) if isinstance(n, str)}


def hidden_from(source: str) -> int | None:
    """The line (1-based) where a check's hidden cases begin, None if it has none."""
    lines = source.splitlines()
    return next((i + 1 for i, line in enumerate(lines) if line.strip() == HIDDEN_BEGIN), None)


ON_HIDDEN = "on a case this check may keep hidden"
AFTER_HIDDEN = "after a check with hidden cases ran"
_STUB_KIND, _STUB_MESSAGE = re.fullmatch(r'raise (\w+)\("(.*)"\)', STUB).groups()    # the handed-out stub's error
_STUB_ERROR = re.compile(re.escape(f"{_STUB_KIND}: {_STUB_MESSAGE}") + r"( \(rank \d\))?")   # on a rank or not
_TYPES = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)} | {
    "LaunchError", "AnswerError"}      # exception types whose name is no text of the student's


def withheld(line: str, why: str) -> str:
    """An error's one line (`Type: message`) as its type only, saying `why` (ON_HIDDEN, AFTER_HIDDEN): its message
    may carry a hidden case's inputs. A type of the student's own naming is "an error"; the handed-out stub's
    error (`_STUB_ERROR`), which carries nothing of the student's, is kept as it is."""
    if _STUB_ERROR.fullmatch(line.strip()):
        return line
    name = re.match(r"\s*([\w.]+)", line)
    kind = name.group(1) if name and name.group(1) in _TYPES else "an error"
    return f"{kind} {why} (its message is not shown: it could carry the hidden inputs)"


def _error_of(e: BaseException, source_name: str, hidden: int | None = None,
              after_hidden: bool = False) -> tuple[str, str]:
    """(one line, traceback lines in the check only: no source text, which may be hidden) of a check's error.
    An error raised at or after the line `hidden` (where hidden cases may be running), or in a cell after a check
    with hidden cases started (`after_hidden`), keeps only its type (`withheld`)."""
    line = f"{type(e).__name__}: {e}" if not isinstance(e, StudentError) else str(e)
    if type(e).__name__ == "LaunchError":      # a rank's root cause first (`traceback_summary`)
        line = traceback_summary(str(e))[0] or line
    frames = [f for f in tb_module.extract_tb(e.__traceback__) if f.filename == source_name]
    where = "".join(f"  check line {f.lineno}\n" for f in frames[-3:])
    if hidden is not None and (not frames or frames[-1].lineno >= hidden):
        line = withheld(line, ON_HIDDEN)
    line = " ".join(line.split())[:300]
    return (Flag(line, withheld(line, AFTER_HIDDEN)) if after_hidden else line), where.rstrip()


def run(assembled, reference, *, timeout: float, cell_timeout: float, env: dict | None = None,
        package: Path | None = None, sandboxed: bool | None = None) -> tuple[NotebookRun, list[str]]:
    """Run the assembled notebook (see the module docstring): (what happened to every cell, notes)."""
    start = time.monotonic()
    deadline = start + timeout
    result, notes = NotebookRun(), []
    workdir = sandbox.temporary_workdir()
    box = sandbox.Sandbox.create(workdir, package, cpu_seconds=timeout, sandboxed=sandboxed)
    if not box.sandboxed:
        notes.append("unsandboxed (no bwrap here): the submission ran as the grader's user")
    else:   # par's own answers to this exercise are stubs in the kernel's view of par (par.course.grading.stubs)
        box = dataclasses.replace(box, overlays=stubs.overlays(stubs.answers_of(reference), box.pythonpath))
    kernel = None
    try:
        try:
            kernel = Kernel(box, env, deadline)
            setup = kernel.execute(KERNEL_HELPER, deadline)
            if setup.status != "ok":
                raise KernelDied(f"the grader's helper failed in the kernel: {setup.error_line()}")
            kernel.open_channel()
        except KernelDied as e:
            result.exit_code, result.output = 4, str(e) or "the kernel did not start"
            return result, notes
        session = Session(kernel)
        outputs: list[str] = []
        namespace = {"__name__": "__main__", "print": lambda *a, **k: print(*a, **{**k, "file": _Sink(outputs)}),
                     "__builtins__": {**builtins.__dict__,
                                      "__import__": launching_import(sandboxed_launch(box, env, session))}}
        for name in student_names(reference):
            namespace[name] = Proxy(session, name)
        hidden_ran = False      # a check with hidden cases has started: every later cell's error is withheld
        for i, (role, cid) in enumerate(assembled.roles):
            cell = assembled.notebook.cells[i]
            res = result.cells[i] = CellResult(ran=True)
            after_hidden = hidden_ran
            hidden_ran = hidden_ran or (role == "check" and hidden_from(cell.source) is not None)
            result.running = i
            t0 = time.monotonic()
            session.cell_deadline = min(deadline, t0 + cell_timeout)
            try:
                if role == "check":
                    name = f"<check {cid}>"
                    try:
                        exec(compile(cell.source, name, "exec"), namespace)  # noqa: S102  (the instructor's check)
                        res.passed = True
                    except (KernelDied, NotebookTimeout, CellTimeout):
                        raise
                    except Exception as e:  # the check failed: an assert, or the student's function raised
                        res.error, res.traceback = _error_of(e, name, hidden_from(cell.source), after_hidden)
                else:
                    reply = kernel.execute(cell.source, session.cell_deadline)
                    if reply.status != "ok":
                        res.error, res.traceback = _kernel_error(reply, after_hidden)
                    res.passed = reply.status == "ok"
                    if role == "setup" and not str(cid).startswith("demo"):   # demos: nothing a check uses
                        try:
                            exec(compile(cell.source, f"<setup {cid}>", "exec"), namespace)  # noqa: S102
                        except (KernelDied, NotebookTimeout, CellTimeout):
                            raise
                        except Exception as e:
                            error = _error_of(e, f"<setup {cid}>", after_hidden=after_hidden)[0]
                            notes.append(Flag(f"setup cell {cid} failed in the grader: {error}",
                                              f"setup cell {cid} failed in the grader: {told(error)}"))
            except CellTimeout:
                res.passed, res.timed_out = False, True
                res.error = f"Timeout of {cell_timeout:g} seconds exceeded while executing cell"
            except Unstoppable:     # the cells after it cannot run: the notebook ends here (result.running is i)
                res.passed, res.timed_out = False, True
                res.error = f"Timeout of {cell_timeout:g} seconds exceeded while executing cell; the interrupt was ignored"
                return result, notes
            except NotebookTimeout:
                res.passed, result.timed_out = False, True
                res.error = "the notebook ran past its time limit"
                return result, notes
            except KernelDied:
                res.passed, result.kernel_died = False, i
                res.error = "the kernel died"
                if kernel.cap.tripped:
                    notes.append(f"the kernel was stopped: more than {kernel.cap.limit} processes at once "
                                 f"(a fork bomb?)")
                return result, notes
            finally:
                res.seconds = time.monotonic() - t0
        result.running = None
        return result, notes
    finally:
        if kernel is not None:
            kernel.close()
        result.seconds = time.monotonic() - start
        sandbox.remove(workdir)


def _kernel_error(reply: Reply, after_hidden: bool = False) -> tuple[str, str]:
    """(one line, the traceback's last lines) of a cell that failed in the kernel (a launched rank's root cause
    first, `traceback_summary`); after a check with hidden cases started, its type only and no traceback."""
    line, lines = traceback_summary(reply.traceback) if reply.traceback else ("", "")
    line = line or reply.error_line() or "error"
    return (Flag(line, withheld(line, AFTER_HIDDEN)), Flag(lines, "")) if after_hidden else (line, lines)


class _Sink(io.TextIOBase):
    def __init__(self, out: list):
        self.out = out

    def write(self, s):
        if sum(map(len, self.out)) < MAX_OUTPUT:
            self.out.append(s)
        return len(s)
