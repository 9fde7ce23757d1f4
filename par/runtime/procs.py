"""Processes as Linux shows them in /proc: a process's state, parent, start time and exit code, its children and
everything below it, its open files; and a job's reaper, which takes over what a rank leaves behind.

    state(pid)             "R", "S", "T" (stopped), "Z" (exited, not yet reaped), ... or None when it is gone
    descendants(pid)       every process below `pid`, parents first
    zombie_exit(pid)       the exit code of an exited process its parent has not reaped yet (None otherwise)
    become_subreaper()     orphans below this process are reparented to it, not to init (PR_SET_CHILD_SUBREAPER)
    reap_orphans(keep)     SIGKILL and reap every child of this process but `keep`: what a job's ranks left behind
    open_files(pid)        (file descriptors open, the soft limit RLIMIT_NOFILE)
    members(...)           the processes of a pid namespace, of a session, or naming a text in their command line
    kill_tree(proc)        SIGKILL a started process (a Popen, or an agent's handle) and everything below it
    started(proc)          the block during which `proc` is one of this process's running children, which
                           `stop_all()` (Ctrl-C in the grader) kills with all below them

Off Linux (no /proc) `descendants` asks `ps`, and the others answer None or nothing.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

PR_SET_CHILD_SUBREAPER = 36


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (field 3, the state, first), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def stat_field(pid: int, field: int) -> int | None:
    """Field `field` of /proc/PID/stat as numbered in proc(5) (4 the parent, 22 the start time, 52 the exit code)."""
    fields = _stat(pid)
    try:
        return int(fields[field - 3]) if fields else None
    except (IndexError, ValueError):
        return None


def state(pid: int) -> str | None:
    """The process's state letter (R running, S sleeping, D disk, T stopped, t traced, Z zombie), None if gone."""
    fields = _stat(pid)
    return fields[0] if fields else None


def environ(pid: int) -> dict:
    """The environment `pid` started with ({} when /proc does not say)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return dict(item.split("=", 1) for item in f.read().decode(errors="replace").split("\0") if "=" in item)
    except OSError:
        return {}


def comm(pid: int) -> str:
    """The process name of `pid` (its /proc comm: what `prctl(PR_SET_NAME)` set), "" when gone."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def parent_of(pid: int) -> int | None:
    return stat_field(pid, 4)


def start_time(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot): with the pid, a process's identity."""
    return stat_field(pid, 22)


def zombie_exit(pid: int) -> int | None:
    """The exit code (negative: the signal) of `pid` when it has exited and its parent has not reaped it yet."""
    if state(pid) != "Z":
        return None
    status = stat_field(pid, 52)
    return None if status is None else os.waitstatus_to_exitcode(status)


def children(pid: int | None = None) -> list[int]:
    """The children of `pid` (default: this process), from every thread's /proc/PID/task/TID/children."""
    pid = os.getpid() if pid is None else pid
    found = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return found


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, parents first (from /proc on Linux, `ps` elsewhere)."""
    if os.path.isdir("/proc/self"):
        pairs = [(int(d), parent) for d in filter(str.isdigit, os.listdir("/proc"))
                 if (parent := parent_of(int(d))) is not None]
    else:
        out = subprocess.run(["ps", "-A", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
        pairs = [tuple(map(int, line.split())) for line in out.splitlines() if line.strip()]
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for child, parent in pairs if parent in frontier]
        found += frontier
    return found


def pid_namespace(pid: int) -> str | None:
    """The pid namespace of `pid` ("pid:[4026531836]"), None where it cannot be read."""
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def members(namespace: str | None = None, session: int | None = None, naming: bytes | None = None) -> list[int]:
    """Every process (this one aside) in the pid namespace `namespace`, or in the session `session`, or whose
    command line holds `naming`: a sandbox's processes, a session's, those still using a folder."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        pid = int(name)
        try:
            if namespace is not None:
                found = pid_namespace(pid) == namespace
            elif session is not None:
                found = os.getsid(pid) == session
            else:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    found = naming is not None and naming in f.read()
        except OSError:
            continue
        if found:
            out.append(pid)
    return out


def become_subreaper() -> bool:
    """Make this process the reaper of every orphan below it (Linux 3.4+): a rank's child, or a daemon it
    double-forked, is reparented here when its parent exits, not to init. False where the kernel cannot."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes
    return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def reap_orphans(keep=(), timeout_s: float = 5.0) -> list[int]:
    """SIGKILL every child of this process but `keep` (pids) and everything below them, and reap them, until no
    other child is left or `timeout_s` has passed; the pids killed. With `become_subreaper`, what a job's ranks
    forked or daemonised is among them once the rank is gone."""
    killed, end = [], time.monotonic() + timeout_s
    while time.monotonic() < end:
        others = [c for c in children() if c not in keep]
        if not others:
            break
        for pid in [*others, *(d for c in others for d in descendants(c))]:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except (ProcessLookupError, PermissionError):
                pass
        for pid in others:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
    return killed


def open_files(pid: int) -> tuple[int, int] | None:
    """(file descriptors `pid` has open, its soft RLIMIT_NOFILE), or None when /proc does not say."""
    try:
        count = len(os.listdir(f"/proc/{pid}/fd"))
        with open(f"/proc/{pid}/limits") as f:
            line = next(line for line in f if line.startswith("Max open files"))
        soft = line.split()[3]
        return count, (int(soft) if soft.isdigit() else 1 << 30)
    except (OSError, StopIteration, IndexError):
        return None


def kill_tree(proc, also=(), wait_s: float = 10.0) -> None:
    """SIGKILL `proc` (a `subprocess.Popen`, or any handle with pid, wait(timeout)), every process below it and
    `also` (pids seen below it earlier, should it be gone), then wait up to `wait_s` for `proc`.

    Killing its process group is not enough: an agent, like torchrun, starts each rank in a session of its own,
    so the processes are found by walking the tree. The wait is bounded: a handle whose exit is reported by
    another process (a zygote's agent) may never hear of it if that process is stopped."""
    for pid in [proc.pid, *descendants(proc.pid), *also]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        pass


_RUNNING: set = set()            # processes started and not yet ended (`started`), for `stop_all`
_LOCK = threading.Lock()


@contextmanager
def started(proc):
    """Within the block, `proc` (a Popen or a handle with pid, poll, wait) is registered as running: `stop_all`
    kills it and everything below it."""
    with _LOCK:
        _RUNNING.add(proc)
    try:
        yield proc
    finally:
        with _LOCK:
            _RUNNING.discard(proc)


def register(proc) -> None:
    """`proc` is running until `unregister(proc)` (for a process whose end is not a block: a kernel's)."""
    with _LOCK:
        _RUNNING.add(proc)


def unregister(proc) -> None:
    with _LOCK:
        _RUNNING.discard(proc)


def stop_all() -> None:
    """Kill every registered process still running, with everything below it (Ctrl-C in the grader)."""
    with _LOCK:
        running = list(_RUNNING)
    for proc in running:
        if proc.poll() is None:
            kill_tree(proc)


def reaped(cmd: list[str]) -> list[str]:
    """`cmd` run below a reaper (`python -m par.runtime.procs reap -- cmd`): what it leaves behind ends with it."""
    return [sys.executable, "-m", "par.runtime.procs", "reap", "--", *cmd]


def reap_main(cmd: list[str]) -> int:
    """`python -m par.runtime.procs reap -- CMD`: become the subreaper, run CMD (SIGTERM, SIGINT and SIGHUP passed
    on to it), then end every orphan below, and exit with CMD's exit code."""
    become_subreaper()
    child = subprocess.Popen(cmd)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: child.send_signal(signum))
    code = child.wait()
    reap_orphans()
    if code < 0:                                   # killed by a signal: die by it too, as the launcher expects
        if -code not in (signal.SIGKILL, signal.SIGSTOP):    # neither can be given a handler (EINVAL)
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    if sys.argv[1:3] != ["reap", "--"] or len(sys.argv) < 4:
        sys.exit("usage: python -m par.runtime.procs reap -- CMD ...")
    sys.exit(reap_main(sys.argv[3:]))
