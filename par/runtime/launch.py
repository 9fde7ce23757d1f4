"""Run a real multi-process job from a notebook cell (or a test) and get its results back.

`run("par.comm.job", nproc=4, args=[...])` first checks that the backend can run
`nproc` ranks on this machine (`par.runtime.preflight.choose_backend`: a `BackendError` in one line,
before anything starts), then starts

    python -m par.runtime.agent [--fork] --nproc-per-node=4 --master-port=<free> -m par.comm.job ...

in its own process group, streams every rank's output into the cell as it happens, and
returns the JSON that rank 0 saved with `par.runtime.dist.save_result`. `par.runtime.agent` starts the ranks
exactly as `torchrun --nnodes=1 --max-restarts=0 --tee=3` would (the same environment, output prefix and
failure report); for a gloo job it imports torch once and forks the ranks from itself (`--fork`), for an
NCCL job each rank is a fresh interpreter. With `max_restarts=K` the job runs under torchrun itself
(`--max-restarts=K`), which restarts every rank when one fails. Never a hang, never a swallowed failure,
never a silent second try (unless asked for with `max_restarts`):

* a rank that fails makes the whole job fail: `LaunchError`, whose FIRST LINE is the root
  cause (which rank, the exception type and message, or the signal that killed it), followed
  by that rank's traceback or last output;
* the agent (or torchrun) ends the other ranks when one dies (even by SIGKILL: they would wait forever in
  their next collective);
* a job where a rank waits `hang_s` seconds (45 by default) for a peer that sleeps, blocks or spins, with a
  rank stopped that long, or waiting for a rank that exited (even with code 0), is hung (`par.runtime.hang`):
  the error names the stopped, stuck, spinning or vanished rank and what the others wait in;
* at `timeout` the launcher asks every rank still running where it is (SIGUSR1: Python's
  faulthandler, registered by `par.runtime.dist.init`, prints its stack), kills the whole process
  tree, and the error names the ranks that did not finish: which were busy where, and which
  were waiting for them in a collective;
* whatever stops the launcher (Ctrl-C, SIGTERM, SIGHUP, SIGKILL) stops the job, and the run leaves no
  file behind (`par.runtime.lifeline`).
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
import threading
import time

from par.runtime import agent, hang, lifeline, procs, zygote
from par.runtime.failure import (PEER_GONE, describe_failure, describe_unfinished, failures, left_early, main_stack,
                                 rank_lines, read_error_file, read_records, signal_name, where)
from par.runtime import preflight

EXIT_GRACE_S = 10.0              # a starter that closed its output must exit within the timeout and this
STACK_SIGNAL = signal.SIGUSR1     # "print your stack": par.runtime.dist.init registers faulthandler for it


class LaunchError(RuntimeError):
    """A launched job failed or timed out. The first line of the message is the root cause.

    `ranks`: the ranks the first line names (the failing rank, or those that did not finish).
    `crashed`: True when the failing rank died from a signal (a C++ abort, a kill) without a
    Python exception: the message then holds its last output, with faulthandler's stack dump.
    """

    def __init__(self, message: str, crashed: bool = False, ranks=(), streamed: bool = False):
        super().__init__(message)
        self.crashed = crashed
        self.ranks = list(ranks)
        self.streamed = streamed   # the ranks' output was already shown (run(quiet=False))

    @property
    def root_cause(self) -> str:
        return str(self).splitlines()[0]


def free_port() -> int:
    """Ask the OS for a TCP port nobody is listening on (127.0.0.1)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(target: str, nproc: int, args=(), port: int | None = None, max_restarts: int = 0) -> list[str]:
    """The torchrun command line for `python -m target` (or a script, if `target` ends in .py) on `nproc` ranks."""
    program = [target] if target.endswith(".py") else ["-m", target]
    return [sys.executable, "-m", "torch.distributed.run",
            "--nnodes=1", f"--nproc-per-node={nproc}",
            "--master-addr=127.0.0.1", f"--master-port={port or free_port()}",
            f"--local-ranks-filter={','.join(map(str, range(nproc)))}", "--tee=3",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.1",
            *program, *map(str, args)]


def agent_command(target: str, nproc: int, args=(), port: int | None = None, fork: bool = False) -> list[str]:
    """The same job started by `par.runtime.agent` (torchrun's one-node behaviour): with `fork`, the ranks are
    forked from an agent that imported torch once; without, each is a fresh interpreter."""
    program = [target] if target.endswith(".py") else ["-m", target]
    return [sys.executable, "-m", "par.runtime.agent", *(["--fork"] if fork else []), f"--nproc-per-node={nproc}",
            f"--master-port={port or free_port()}", *program, *map(str, args)]


# ---------------------------------------------------------------- the job's ranks among its processes
def rank_number(pid: int, environ: dict) -> int | None:
    """The rank process `pid` (whose /proc environment is `environ`) is, or None: a RANK in its environment (a
    fresh interpreter, torchrun's or the agent's), else its process name `par-rank<N>` (forked by the agent, it
    shows the agent's environment)."""
    if environ.get("RANK", "").isdigit() and environ.get("TORCHELASTIC_RUN_ID"):
        return int(environ["RANK"])
    name = procs.comm(pid)
    number = name[len(agent.RANK_NAME):]
    return int(number) if name.startswith(agent.RANK_NAME) and number.isdigit() else None


def _rank_pids(proc) -> dict[int, int]:
    """{rank: pid} of this launch's rank processes still alive (Linux; empty elsewhere): the processes below the
    agent (or torchrun) that are a rank (`rank_number`); a rank's own children come after it and are not."""
    ranks = {}
    for pid in procs.descendants(proc.pid):
        if (rank := rank_number(pid, procs.environ(pid))) is not None:
            ranks.setdefault(rank, pid)
    return ranks


def _ask_for_stacks(pids: list[int], q: queue.Queue, lines: list[str], quiet: bool, wait_s: float = 3.0) -> None:
    """Send STACK_SIGNAL to `pids` and collect what they print for up to `wait_s` seconds."""
    for pid in pids:
        try:
            os.kill(pid, STACK_SIGNAL)
        except ProcessLookupError:
            pass
    deadline, answered = time.monotonic() + wait_s, set()
    while time.monotonic() < deadline:
        try:
            line = q.get(timeout=0.3)
        except queue.Empty:
            if len(answered) >= len(pids):      # every rank answered, then went quiet
                break
            continue
        if line is None:
            break
        lines.append(line)
        m = re.match(r"\[default(\d+)\]:.*[Tt]hread 0x[0-9a-f]+ \(most recent call first\)", line)
        if m:
            answered.add(int(m.group(1)))
        if not quiet:
            print(line, end="", flush=True)


# ---------------------------------------------------------------- the launcher
def run(module: str, nproc: int = 2, args=(), timeout: float = 300.0, backend: str = "auto",
        env: dict | None = None, quiet: bool = False, threads_per_rank: int = 1, hang_s: float | None = None,
        max_restarts: int = 0):
    """Launch `module` on `nproc` ranks; return rank 0's saved result (or None).

    Raises `par.runtime.preflight.BackendError` before starting anything when `backend` cannot run `nproc`
    ranks here, and `LaunchError` (root cause on its first line) when the job fails, hangs (no rank made
    progress for `hang_s` seconds, default PAR_HANG_S or 45: `par.runtime.hang`) or runs past `timeout`
    seconds. Output is streamed line by line (prefixed `[defaultN]:`). `max_restarts` > 0 runs the job under torchrun,
    which restarts every rank (TORCHELASTIC_RESTART_COUNT counts the tries) up to that many times. SIGTERM and SIGHUP
    end the job like Ctrl-C (`par.runtime.lifeline.Stopped`); the run's files go with it."""
    chosen = preflight.choose_backend(nproc, backend, local_world_size=nproc)     # preflight: one line, nothing started
    hang_s = hang.hang_seconds(hang_s)
    with lifeline.run_dir() as tmp, lifeline.stops_raise():
        result_path = os.path.join(tmp, "result.json")
        child_env = dict(os.environ)
        child_env.update({
            "PAR_RESULT": result_path,
            "PAR_BACKEND": backend,
            hang.HANG_ENV: str(hang_s),     # the ranks set their collectives' timeout from it
            "TMPDIR": tmp,                  # torchrun's torchelastic_* log folder, any rank's temp file
            lifeline.LAUNCHER_ENV: str(os.getpid()),    # the ranks end when this process does
            "OMP_NUM_THREADS": str(threads_per_rank),
            "PYTHONUNBUFFERED": "1",
            "PYTHONFAULTHANDLER": "1",  # a rank that crashes in C++ still shows where Python was
            "TORCHELASTIC_ERROR_FILE": os.path.join(tmp, "error.json"),
            "GLOO_SOCKET_IFNAME": child_env.get("GLOO_SOCKET_IFNAME", "lo"),
            "LOGLEVEL": "WARNING",
        })
        child_env.update(env or {})
        name = os.path.basename(module) if module.endswith(".py") else module
        cmd = (procs.reaped(torchrun_command(module, nproc, args, max_restarts=max_restarts)) if max_restarts
               else agent_command(module, nproc, args, fork=chosen == "gloo"))    # the agent reaps by itself
        starter = "torchrun" if max_restarts else "par.runtime.agent"
        proc = _start(cmd, child_env)
        lines: list[str] = []
        q: queue.Queue = queue.Queue()
        reader = threading.Thread(target=lambda: ([q.put(l) for l in proc.stdout], q.put(None)), daemon=True)
        reader.start()
        deadline = time.monotonic() + timeout
        seen: dict[int, tuple] = {}   # rank -> (pid, start time), refreshed every second: to kill orphans if the
        #                               agent dies
        watch = hang.Watch(hang_s, nproc)
        next_look = time.monotonic()
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
                if time.monotonic() >= next_look:
                    alive = _rank_pids(proc)
                    seen.update({r: (p, procs.start_time(p)) for r, p in alive.items() if seen.get(r, (0,))[0] != p})
                    watch.look(alive)
                    next_look = time.monotonic() + 1.0
                    if watch.hung():
                        error = _hang_error(watch, alive, q, lines, quiet, f"{name} on {nproc} ranks", hang_s)
                        if error is not None:
                            raise error
                if time.monotonic() > deadline:
                    alive = _rank_pids(proc)
                    watch.look(alive)
                    stopped = watch.stopped()
                    _ask_for_stacks([p for r, p in alive.items() if r not in stopped], q, lines, quiet)
                    unfinished = describe_unfinished(lines, sorted(alive), stopped)
                    raise LaunchError(f"{name} on {nproc} ranks timed out after {timeout:.0f}s and was killed; "
                                      f"{unfinished}\nLast output:\n{''.join(lines[-40:])}", ranks=sorted(alive),
                                      streamed=not quiet)
        except BaseException:  # a hang, the timeout, Ctrl-C, SIGTERM/SIGHUP: leave no rank behind
            with lifeline.interrupts_held():    # a second Ctrl-C cannot cut the teardown short
                procs.kill_tree(proc, _still_ours(seen))
            raise
        try:                   # its output has ended: its exit comes at once, or the job is over anyway
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()) + EXIT_GRACE_S)
        except subprocess.TimeoutExpired:
            procs.kill_tree(proc, _still_ours(seen))
            raise LaunchError(f"{name} on {nproc} ranks: {starter} (pid {proc.pid}) closed its output but its exit "
                              f"code never came (is a process above it stopped?); it was killed\nLast output:\n"
                              f"{''.join(lines[-40:])}", ranks=[], streamed=not quiet) from None
        leftovers = _still_ours(seen)
        if leftovers:          # the agent itself died (killed?) and left ranks behind
            procs.kill_tree(proc, leftovers)
        if code != 0:
            records = read_records(tmp) or _torchrun_records(lines, child_env["TORCHELASTIC_ERROR_FILE"])
            head, ranks, crashed, details = describe_failure(lines, records)
            if code < 0 and not failures(lines, records):
                head = f"{starter} itself was killed by {signal_name(-code)}; {head}"
            early = left_early(lines, nproc, records) if any(p in head for p in PEER_GONE) else []
            if early:            # the connection errors are the consequence; the rank that left is the cause
                who = f"rank {early[0]}" if len(early) == 1 else "ranks " + ", ".join(map(str, early))
                head, ranks = f"{who} exited with code 0 before the job finished, while the others waited for it; {head}", early
            raise LaunchError(f"{head}\n{name} on {nproc} ranks failed (exit code {code}). {details}",
                              crashed, ranks, streamed=not quiet)
        if os.path.exists(result_path):
            try:
                with open(result_path) as f:
                    return json.load(f)
            except ValueError as e:   # rank 0's write was cut short (its temp folder's disk is full)
                raise LaunchError(f"rank 0's result {result_path} is not complete JSON ({e}): is the disk of the "
                                  f"temp folder ({tmp}) full?", ranks=[0], streamed=not quiet) from None
        return None


def _torchrun_records(lines: list[str], error_file: str) -> list[dict] | None:
    """torchrun's failures as records: the ranks from its report, the root cause's exception from the error file it
    copied from that rank (None without a report)."""
    found = failures(lines)
    if not found:
        return None
    said = read_error_file(error_file) or {}
    return [{**f, "exception": said.get("exception") if i == 0 else None} for i, f in enumerate(found)]


def _hang_error(watch, alive: dict[int, int], q, lines: list[str], quiet: bool, job: str,
                hang_s: float) -> LaunchError | None:
    """The LaunchError of a hung job: ask the ranks that can answer where they are, name the culprit first
    (None when their stacks say it is not a hang: `hang.Watch.confirmed`)."""
    stopped, idle, vanished, busy = watch.stopped(), watch.idle(), watch.vanished(), watch.busy()
    _ask_for_stacks([pid for rank, pid in alive.items() if rank not in stopped], q, lines, quiet)
    places = {rank: where(main_stack(rank_lines(lines, rank))) for rank in alive if rank not in stopped}
    if not watch.confirmed(places):
        return None
    files = {rank: found for rank, pid in alive.items() if (found := procs.open_files(pid)) is not None}
    head, culprits = hang.describe(stopped, idle, places, vanished, busy, files)
    return LaunchError(f"{head}\n{job} hung and was killed ({hang.HANG_ENV}={hang_s:g} s). "
                       f"Last output:\n{''.join(lines[-40:])}", ranks=culprits, streamed=not quiet)


def _still_ours(seen: dict[int, tuple]) -> list[int]:
    """The pids of `seen` ({rank: (pid, start time)}) still running as this launch's ranks: a pid may have been
    reused since, by a process that started later."""
    return [pid for pid, start in seen.values() if start is not None and procs.start_time(pid) == start]


def _start(cmd: list[str], env: dict):
    """The starter of the ranks (`cmd`) as a process the launcher reads and waits for. A gloo job's forking agent
    (`--fork`) is forked by this process's zygote (`par.runtime.zygote`: torch imported once per launcher, not
    once per job) where one can run; anything else starts as a fresh process, in a session of its own, with a
    parent-death signal."""
    if cmd[1:4] == ["-m", "par.runtime.agent", "--fork"]:
        forked = zygote.start_agent(cmd[3:], env)
        if forked is not None:
            return forked
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True, bufsize=1, preexec_fn=lifeline.dies_with_parent(signal.SIGTERM))
