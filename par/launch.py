"""Run a real multi-process job from a notebook cell (or a test) and get its results back.

`run("par.examples.collectives", nproc=4, args=[...])` starts

    torchrun --nnodes=1 --nproc-per-node=4 --master-addr=127.0.0.1 --master-port=<free> -m par.examples.collectives ...

in its own process group, streams every rank's output into the cell as it
happens, and returns the JSON that rank 0 saved with `par.dist.save_result`.
A non-zero exit raises `LaunchError` carrying the failing rank's traceback; a
timeout kills the whole process tree and raises too. Never a hang, never a
swallowed failure.
"""
from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings


class LaunchError(RuntimeError):
    """A launched job failed or timed out; the message holds the failing rank's traceback.

    `crashed` is True when a rank died from a signal (a C++ abort, a kill) without a Python
    exception: the message then holds that rank's last output, with faulthandler's stack dump.
    """

    def __init__(self, message: str, crashed: bool = False):
        super().__init__(message)
        self.crashed = crashed


def free_port() -> int:
    """Ask the OS for a TCP port nobody is listening on (127.0.0.1)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(target: str, nproc: int, args=(), port: int | None = None) -> list[str]:
    """The torchrun command line for `python -m target` (or a script, if `target` ends in .py) on `nproc` ranks."""
    program = [target] if target.endswith(".py") else ["-m", target]
    return [sys.executable, "-m", "torch.distributed.run",
            "--nnodes=1", f"--nproc-per-node={nproc}",
            "--master-addr=127.0.0.1", f"--master-port={port or free_port()}",
            f"--local-ranks-filter={','.join(map(str, range(nproc)))}", "--tee=3",
            "--max-restarts=0", "--monitor-interval=0.1",
            *program, *map(str, args)]


def _root_cause_rank(lines: list[str]) -> int | None:
    """The rank torchrun names under "Root Cause (first observed failure)", if any."""
    text = "".join(lines)
    m = re.search(r"Root Cause.*?rank\s*:\s*(\d+)", text, re.S)
    return int(m.group(1)) if m else None


def _tracebacks(lines: list[str], max_lines: int = 60) -> str:
    """The failing rank's traceback (the root cause torchrun names, else the first one printed)."""
    root = _root_cause_rank(lines)
    starts = [i for i, line in enumerate(lines)  # a rank's traceback, not torchrun's own ChildFailedError
              if "Traceback (most recent call last)" in line and line.startswith(("[rank", "[default"))]
    mine = [i for i in starts if f"[rank{root}]:" in lines[i] or f"[default{root}]:" in lines[i]]
    for i in mine[:1] or starts[:1]:
        prefix = lines[i][:lines[i].index("Traceback")]
        block = [l for l in lines[i:] if l.startswith(prefix)][:max_lines]
        head = f"rank {root} failed first:\n" if root is not None else ""
        return head + "".join(block)
    # no Python traceback (a rank killed by a signal, a C++ abort): show what the failing rank said last
    said = [l for l in lines if root is not None and l.startswith((f"[rank{root}]:", f"[default{root}]:"))]
    head = f"rank {root} failed first; its last output:\n{''.join(said[-20:])}\n" if said else ""
    return head + "".join(lines[-40:])


def run(module: str, nproc: int = 2, args=(), timeout: float = 300.0, backend: str = "auto",
        env: dict | None = None, quiet: bool = False, threads_per_rank: int = 1, retries_on_crash: int = 0):
    """Launch `module` on `nproc` ranks; return rank 0's saved result (or None).

    Output is streamed line by line (prefixed `[defaultN]:` by torchrun). Raises
    `LaunchError` on a non-zero exit or after `timeout` seconds. `retries_on_crash`: launch
    again, with a warning, when a rank died from a signal without a Python exception (the
    test suite uses 1 against a rare abort of gloo under load); a Python error never retries.
    """
    for attempt in range(retries_on_crash + 1):
        try:
            return _run_once(module, nproc, args, timeout, backend, env, quiet, threads_per_rank)
        except LaunchError as e:
            if not e.crashed or attempt == retries_on_crash:
                raise
            warnings.warn(f"launching {module} again: a rank crashed without a Python exception\n{e}")


def _run_once(module, nproc, args, timeout, backend, env, quiet, threads_per_rank):
    with tempfile.TemporaryDirectory(prefix="par-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        child_env = dict(os.environ)
        child_env.update({
            "PAR_RESULT": result_path,
            "PAR_BACKEND": backend,
            "OMP_NUM_THREADS": str(threads_per_rank),
            "PYTHONUNBUFFERED": "1",
            "PYTHONFAULTHANDLER": "1",  # a rank that crashes in C++ still shows where Python was
            "TORCHELASTIC_ERROR_FILE": os.path.join(tmp, "error.json"),
            "GLOO_SOCKET_IFNAME": child_env.get("GLOO_SOCKET_IFNAME", "lo"),
            "LOGLEVEL": "WARNING",
        })
        child_env.update(env or {})
        cmd = torchrun_command(module, nproc, args)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=child_env, start_new_session=True, bufsize=1)
        lines: list[str] = []
        q: queue.Queue = queue.Queue()
        reader = threading.Thread(target=lambda: ([q.put(l) for l in proc.stdout], q.put(None)), daemon=True)
        reader.start()
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    line = q.get(timeout=max(0.01, min(0.5, deadline - time.monotonic())))
                except queue.Empty:
                    line = ""
                if line is None:
                    break
                if line:
                    lines.append(line)
                    if not quiet:
                        print(line, end="", flush=True)
                if time.monotonic() > deadline:
                    raise LaunchError(f"{module} on {nproc} ranks timed out after {timeout:.0f}s and was killed.\n"
                                      f"Last output:\n{''.join(lines[-30:])}")
        except BaseException:  # timeout, or the notebook's interrupt button: leave no rank behind
            _kill_tree(proc)
            raise
        code = proc.wait()
        if code != 0:
            crashed = not any(l.startswith(("[rank", "[default")) and "Traceback (most recent call last)" in l
                              for l in lines) and re.search(r"exitcode\s*:\s*-\d+", "".join(lines)) is not None
            raise LaunchError(f"{module} on {nproc} ranks failed (exit code {code}).\n{_tracebacks(lines)}", crashed)
        if os.path.exists(result_path):
            with open(result_path) as f:
                return json.load(f)
        return None


def _descendants(pid: int) -> list[int]:
    """Every process below `pid`, parents first (from /proc on Linux, `ps` elsewhere)."""
    if os.path.isdir("/proc/self"):
        pairs = []
        for d in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{d}/stat") as f:
                    pairs.append((int(d), int(f.read().rsplit(")", 1)[1].split()[1])))
            except (OSError, IndexError, ValueError):
                pass
    else:
        out = subprocess.run(["ps", "-A", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
        pairs = [tuple(map(int, line.split())) for line in out.splitlines() if line.strip()]
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for child, parent in pairs if parent in frontier]
        found += frontier
    return found


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and every rank below it.

    Killing torchrun's process group is not enough: torchrun starts each rank in
    a session of its own, so the ranks are found by walking the process tree.
    """
    for pid in [proc.pid, *_descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
