"""`python -m par <command> ...`: the course's command line.

Each command lives in its own module; this file maps names to them, and is the one place that
decides how an error ends the command (a command only raises): an exception of a type in
`USER_ERRORS` (a config that cannot run, a backend this machine lacks, a bad argument, a missing
file, a full or read-only disk) prints `error: <message>` on stderr and exits 2, without a traceback. `--debug` anywhere on
the line (or PAR_DEBUG=1) shows the traceback instead, and is exported as PAR_DEBUG=1 while the
command runs, so that what it starts (ranks, notebooks, another `python -m par`) inherits it. A
launched job that failed (`par.runtime.launch.LaunchError`) prints its root cause and the failing
rank's details, and exits 1. Ctrl-C prints `error: interrupted` and exits 130 (the traceback with
--debug). Output piped into a reader that stops early (`| head`) ends quietly with 141, as a shell
reports SIGPIPE. Any other exception is a bug in par: its traceback is shown.

Before a command that starts ranks (`STARTS_RANKS`) is imported, `par.runtime.preflight` checks its
--backend and that this machine holds its ranks; `--oversubscribe` anywhere on its line (removed before
the command sees it) starts more ranks than that anyway. Arguments a command can check alone (numbers
>= 1, world sizes, output paths that must be writable) are checked by `par.runtime.checks` before its work.

A command module opts in by raising one of these types; nothing else is needed. New kinds of
user error are added to `USER_ERRORS` by name.
"""
from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading
from contextlib import contextmanager

from par.runtime import preflight as pf
from par.runtime.checks import unknown
from par.runtime.hang import hang_seconds
from par.runtime.lifeline import stops_raise

COMMANDS = {
    # name: (module, one-line help). The module's main(argv) does the work.
    "exercises": ("par.course.authoring.cli", "generate | check | record | release DIR: exercises/ from solutions/, the student bundle"),
    "grade": ("par.course.grading.grade", "grade with the instructor's checks: python -m par grade NB_OR_DIR... [--report grades.csv]"),
    "bench": ("par.bench", "benchmarks vs the torch built-ins: python -m par bench <name> (collectives, ...)"),
    "batch": ("par.course.batch.runner", "run every lecture notebook with papermill into runs/<time>/ and summarise "
                           "(--dry-run: check a GPU batch without a GPU)"),
    "train": ("par.train.cli", "train GPT-lite from a DeepSpeed-style JSON config: --config configs/3d.json --nproc 8"),
    "plan": ("par.train.planner", "rank 3D layouts by predicted memory and step time: --model 100,96,12288 --world 800"),
    "site": ("par.site.build", "the executed course as a static website: python -m par site [RUN_DIR] [--out DIR] "
                               "[--compare RUN_A RUN_B]"),
    "wheelhouse": ("par.course.server.wheelhouse", "wheels of the course for a GPU node without internet: --out DIR "
                                                   "[--set batch] [--python 3.12 --platform manylinux_2_28_x86_64]"),
    "gpu-check": ("par.course.server.gpu_check", "check a GPU server and record its course run: --minutes 8"),
    "torch-compat": ("par.course.server.torch_compat", "is every torch name par uses defined in another release? "
                     "WHEEL (a torch wheel, read without importing it)"),
    "memory": ("par.memory.accounting", "per-rank model-state memory per ZeRO stage (--params 7.5e9 --dp 64 | --model llama-7b)"),
}

# commands that start ranks: checked by par.runtime.preflight before their module is even imported (torch takes
# seconds to import on a busy machine); the value is the number of ranks when the command line names none
STARTS_RANKS = {"batch": "default", "train": 1, "bench": 1}

# "module:Class": exception types that mean "the user asked for something that cannot run".
USER_ERRORS = (
    "par.train.config:ConfigError",
    "par.runtime.preflight:BackendError",
    "par.dp.batch_size:BatchSizeError",
    "par.runtime.grid:GridError",
    "par.precision.mixed_precision:UnsupportedPrecision",
    "par.course.batch.launches:CourseError",
    "par.course.authoring.generate:ExerciseError",
    "par.course.authoring.release:ReleaseError",
    "par.course.grading.grade:SubmissionError",
    "par.runtime.checks:CheckError",
    "argparse:ArgumentError",       # a bad argument a command finds after parsing: ArgumentError(None, message)
    "builtins:FileNotFoundError",
    "builtins:IsADirectoryError",
    "builtins:NotADirectoryError",
    "builtins:PermissionError",
    "builtins:OSError",             # what the file system says: a full disk (ENOSPC), a read-only one (EROFS)
)


class UsageError(Exception):
    """Bad arguments on the command line (argparse's errors become this inside `python -m par`)."""


def is_user_error(error: BaseException) -> bool:
    """True when `error` is (a subclass of) a type named in USER_ERRORS. Compared by name, so that
    telling a user error apart imports nothing (modules that import torch take seconds)."""
    names = {f"{c.__module__}:{c.__qualname__}" for c in type(error).__mro__}
    return isinstance(error, UsageError) or bool(names & set(USER_ERRORS))


def one_line(error: BaseException) -> str:
    """The message of a user error as one line (a missing file says which)."""
    if isinstance(error, OSError) and error.filename is not None:
        where = "" if os.path.isabs(str(error.filename)) else f" (the path is relative to {os.getcwd()})"
        return f"{error.strerror or 'cannot open'}: {error.filename}{where}"
    if isinstance(error, OSError) and error.strerror:   # ENOSPC and the like, raised without a path
        return f"{error.strerror} (errno {error.errno}); free some space or choose another output path"
    text = " ".join(str(error).split())
    return text or type(error).__name__


@contextmanager
def argparse_errors_raise():
    """Inside the block, argparse's `parser.error(...)` raises UsageError instead of printing usage and exiting."""
    original = argparse.ArgumentParser.error

    def error(self, message):
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")
    argparse.ArgumentParser.error = error
    try:
        yield
    finally:
        argparse.ArgumentParser.error = original


@contextmanager
def debug_exported(debug: bool):
    """Inside the block, PAR_DEBUG=1 in the environment when `debug` (what the command starts inherits it);
    the environment as it was afterwards."""
    before = os.environ.get("PAR_DEBUG")
    if debug:
        os.environ["PAR_DEBUG"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PAR_DEBUG", None)
        else:
            os.environ["PAR_DEBUG"] = before


def preflight(name: str, argv: list[str], oversubscribe: bool = False) -> None:
    """`par.runtime.preflight` for a command that starts ranks: its --backend and whether this machine holds
    the ranks it asks for (`oversubscribe`: start more anyway). Not for help, nor for what starts nothing here:
    `batch --dry-run` checks an imagined GPU server, `train --nnodes` prints the commands of other machines."""
    if name not in STARTS_RANKS or {"-h", "--help", "--dry-run", "--nnodes"} & {a.split("=")[0] for a in argv}:
        return
    default = pf.default_world_size() if STARTS_RANKS[name] == "default" else STARTS_RANKS[name]
    pf.check_command_line(argv, default, oversubscribe)
    hang_seconds()                   # PAR_HANG_S=45s: refused here, naming the variable, not in the launcher


# a dependency missing from the interpreter that runs `python -m par`: the fix, in one line
MISSING_HINT = {m: f"{m} is not installed in this Python ({sys.executable}): create the course's environment "
                   f"with `python3 -m venv .venv && .venv/bin/pip install -r requirements.txt` and run "
                   f"`.venv/bin/python -m par ...`" for m in ("torch", "numpy", "matplotlib", "papermill", "nbformat")}


def usage() -> str:
    width = max(map(len, COMMANDS), default=0)
    rows = "\n".join(f"  {name:<{width}}  {help_}" for name, (_, help_) in sorted(COMMANDS.items()))
    return (f"usage: python -m par [--debug] <command> [options] [--oversubscribe]\n\ncommands:\n{rows}\n\n"
            f"--debug (or PAR_DEBUG=1): show the traceback of an error instead of its one line\n"
            f"--oversubscribe ({', '.join(sorted(STARTS_RANKS))}): start more ranks than this machine's cores hold "
            f"(par.runtime.preflight.RANKS_PER_CORE per core without it)\n")


def quiet_exit() -> None:
    """After a stop: a second Ctrl-C (or SIGTERM/SIGHUP) while Python exits is ignored, so that it cannot print
    "Exception ignored in atexit ... KeyboardInterrupt" under the command's one line."""
    if threading.current_thread() is threading.main_thread():
        for name in ("SIGINT", "SIGTERM", "SIGHUP"):
            if hasattr(signal, name):
                signal.signal(getattr(signal, name), signal.SIG_IGN)


def main(argv=None) -> int:
    as_program = argv is None        # `python -m par`, not a caller in the same process (a test)
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv or os.environ.get("PAR_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: {unknown('command', name, COMMANDS, 'python -m par --help')}", file=sys.stderr)
        return 2
    oversubscribe = name in STARTS_RANKS and "--oversubscribe" in rest
    rest = [a for a in rest if a != "--oversubscribe"] if name in STARTS_RANKS else rest
    try:
        with argparse_errors_raise(), debug_exported(debug), stops_raise():   # SIGTERM/SIGHUP: like Ctrl-C
            preflight(name, rest, oversubscribe)
            module = importlib.import_module(COMMANDS[name][0])
            return int(module.main(rest) or 0)
    except KeyboardInterrupt as e:   # Ctrl-C, or par.runtime.lifeline.Stopped (SIGTERM, SIGHUP)
        if debug:
            raise
        if as_program:
            quiet_exit()
        print(f"error: {str(e) or 'interrupted'}", file=sys.stderr, flush=True)
        return getattr(e, "exit_code", 130)
    except BrokenPipeError:          # the reader left (`python -m par plan | head`): not an error, nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # so the exit's flush cannot fail again
        return 141                   # 128 + SIGPIPE, what a shell reports for a command stopped by a closed pipe
    except Exception as e:
        if debug:
            raise
        if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] in MISSING_HINT:
            print(f"error: {MISSING_HINT[e.name.split('.')[0]]}", file=sys.stderr, flush=True)
            return 2
        from par.runtime.launch import LaunchError   # defers the launcher's import (0.3 s) to a command that failed
        if isinstance(e, LaunchError):   # the ranks' output is above when it was streamed
            print(f"error: {e.root_cause if e.streamed else e}", file=sys.stderr, flush=True)
            return 1
        if is_user_error(e):
            print(f"error: {one_line(e)}", file=sys.stderr, flush=True)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
