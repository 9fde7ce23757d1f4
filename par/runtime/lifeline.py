"""A job never outlives whoever started it, and leaves nothing behind in /tmp.

A launched job is a tree of processes: the launcher (`python -m par train`, a notebook kernel, the
grader) starts the rank starter (`par.runtime.agent`, or torchrun when restarts are asked for), which starts one
process per rank. Whatever stops the launcher, the tree
below it goes too:

* Ctrl-C, SIGTERM (a `kill`, a CI timeout, `timeout`) and SIGHUP (a closed terminal) all raise `Stopped`
  in the launcher (`stops_raise`): a KeyboardInterrupt, so the launcher's usual teardown runs (every rank
  killed) and the command prints one line;
* SIGKILL cannot be caught, so the kernel does it: the starter is started with a parent-death signal
  (`dies_with_parent`, Linux `prctl(PR_SET_PDEATHSIG)`) and receives SIGTERM the moment the launcher dies;
  it then stops its ranks;
* the starter itself killed (SIGKILL, the OOM killer) leaves its ranks orphaned: a watchdog thread in every
  rank (`watch_parent`, started by `par.runtime.dist.init`) sees its parent change, or its launcher
  (PAR_LAUNCHER_PID) gone, and ends the rank within a second.

Files: every launch works in a folder of its own, `par-run-<pid>-*` in the temp dir (`run_dir`), and
the starter and the ranks get it as TMPDIR, so their temp files (and torchrun's `torchelastic_*` log folders)
land inside it. It is
removed when the launch ends, however it ends; after a SIGKILL of the launcher (nothing can run then)
the next launch removes it (`sweep_run_dirs`).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import threading
import time

PR_SET_PDEATHSIG = 1             # linux/prctl.h
STOP_SIGNALS = ("SIGTERM", "SIGHUP")
RUN_PREFIX = "par-run-"
LAUNCHER_ENV = "PAR_LAUNCHER_PID"   # set by the launcher for its ranks: the process whose death ends them


# ---------------------------------------------------------------- the launcher is stopped
class Stopped(KeyboardInterrupt):
    """The launching process got SIGTERM or SIGHUP: handled exactly like Ctrl-C, with the signal's name."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum
        self.exit_code = 128 + signum      # what the shell reports for a process ended by this signal


STOPPING = threading.Event()     # set once a stop signal arrived: what is said after it is the teardown's noise


def _raise_stopped(signum, frame):
    """The first SIGTERM/SIGHUP raises (and sets STOPPING); later ones are ignored, so that a second `kill` cannot
    cut the teardown short (the handlers come back when `stops_raise`'s block ends)."""
    STOPPING.set()
    for name in STOP_SIGNALS:
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    raise Stopped(signum)


@contextlib.contextmanager
def stops_raise():
    """Inside the block, SIGTERM and SIGHUP raise `Stopped` (in the main thread; elsewhere nothing changes).

    Without it Python's default for both is to die on the spot: no `finally` runs, and a job started
    in a session of its own lives on. The previous handlers come back when the block ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for name in STOP_SIGNALS:
        number = getattr(signal, name, None)
        if number is not None:
            previous[number] = signal.signal(number, _raise_stopped)
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


@contextlib.contextmanager
def interrupts_held():
    """Inside the block (a teardown), Ctrl-C is ignored (in the main thread; elsewhere nothing changes): a second
    one cannot cut the killing of a job short and leave ranks behind. The handler comes back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


# ---------------------------------------------------------------- the launcher dies
def _prctl_pdeathsig(signum: int) -> bool:
    """Ask Linux to send `signum` to this process when the thread that started it ends. False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def dies_with_parent(signum: int = signal.SIGTERM):
    """A `preexec_fn` for subprocess.Popen: the child gets `signum` when its parent dies (Linux; no-op elsewhere).

    The kernel sends it when the *thread* that started the child ends, so start the child from a thread
    that waits for it (`launch.run` does). A parent that died between fork and prctl is caught by
    comparing the parent's pid."""
    parent = os.getpid()

    def preexec():
        if _prctl_pdeathsig(signum) and os.getppid() != parent:
            os.kill(os.getpid(), signum)
    return preexec


def _alive(pid: int) -> bool:
    """`pid` is a running process (a zombie, dead but not yet reaped, is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def watch_parent(interval: float = 1.0, what: str = "rank") -> threading.Thread:
    """Start a daemon thread that ends this process (exit code 1, one line on stderr) once its parent, or
    the launcher named in PAR_LAUNCHER_PID, is gone.

    An orphan is adopted by another process (init, or a subreaper), so its parent pid changes: that is
    the sign, checked every `interval` seconds. A rank orphaned before this thread started (torchrun died
    while the rank was still importing torch) sees no change, so the launcher's own pid is watched too.
    Costs a getppid() and a kill(pid, 0) a second."""
    parent, launcher = os.getppid(), int(os.environ.get(LAUNCHER_ENV) or 0)

    def watch():
        while True:
            if os.getppid() != parent or (launcher and not _alive(launcher)):
                print(f"{what} {os.getpid()}: its launcher is gone; exiting", file=sys.stderr, flush=True)
                os._exit(1)
            time.sleep(interval)
    thread = threading.Thread(target=watch, name="par-watch-parent", daemon=True)
    thread.start()
    return thread


# ---------------------------------------------------------------- nothing left in /tmp
def sweep_run_dirs(root: str | None = None) -> list[str]:
    """Remove the run folders whose launcher is gone (it was SIGKILLed before it could); return them."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        owner = name[len(RUN_PREFIX):].split("-", 1)[0]
        if name.startswith(RUN_PREFIX) and owner.isdigit() and not _alive(int(owner)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            removed.append(name)
    return removed


@contextlib.contextmanager
def run_dir():
    """A folder of this launch's own (`<temp>/par-run-<pid>-XXXX`), removed when the block ends, however."""
    sweep_run_dirs()
    path = tempfile.mkdtemp(prefix=f"{RUN_PREFIX}{os.getpid()}-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
