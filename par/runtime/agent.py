"""The ranks of a one-machine job, started the way torchrun starts them, at a fraction of the cost.

    python -m par.runtime.agent --nproc-per-node=4 --master-port=29500 -m par.comm.job --parts show
    python -m par.runtime.agent --fork --nproc-per-node=4 --master-port=29500 -m par.comm.job --parts show

does, for one node and no restarts, what `torchrun --nnodes=1 --nproc-per-node=4 --tee=3 --max-restarts=0`
does, in the same words, so that `par.runtime.launch` reads either:

* every rank runs `python -m <module> <args>` in a session of its own, with torchrun's environment
  (RANK = LOCAL_RANK = GROUP-local index, WORLD_SIZE = LOCAL_WORLD_SIZE = nproc, MASTER_ADDR/PORT,
  TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT = 0, ...) and no agent store, so rank 0 serves the
  rendezvous store at MASTER_PORT (`torch.distributed.rendezvous`: `TORCHELASTIC_USE_AGENT_STORE=False`);
* every line a rank prints (stdout and stderr, in order) comes out as `[default<rank>]:<line>`;
* when a rank exits non-zero the others get SIGTERM, then SIGKILL after `--close-s` seconds (torchrun's
  `_close`: 30), and torchrun's failure report follows on stderr, root cause (first exit observed) last;
  the agent exits 1; when every rank exits 0, so does the agent;
* SIGTERM, SIGINT or SIGHUP to the agent stop every rank the same way (the agent then exits 128 + signal);
* each rank has an error file of its own (TORCHELASTIC_ERROR_FILE, beside the agent's), where a rank that raises
  writes its exception (`par.runtime.failure.record_exception`); after a failure the agent writes one record per
  rank beside them (`par.runtime.failure.write_records`: rank, exitcode, signal, exception, where, ended), and
  copies the root cause's error file into its own, as torchrun does.

How a rank starts. Without `--fork`, every rank is a fresh interpreter (`python -m <module>`), and the agent
never imports torch. With `--fork`, the agent imports torch once (`PRELOAD`: torch, and torch._dynamo, which
torch imports on the first optimizer step or dispatch mode of every process; a job module that needs less says so
with a `PRELOAD` of its own, `preload_of`) and forks the ranks from itself:
each child starts a session, points its stdin at /dev/null and its stdout and stderr at the agent's pipe, takes
the rank's environment, names itself `par-rank<N>` (the process name `ps` shows; `par.runtime.launch` finds
the ranks by it) and runs the module as `__main__` (`runpy`), so a rank's exit code, traceback and exit handlers
are a fresh interpreter's. The imports are then paid once per job, not once per rank (the measured trade is in
docs/instructor.md, "what a launch costs"). `par.runtime.launch` asks for `--fork` for gloo jobs only: a process
that may have touched CUDA cannot be forked safely, so NCCL jobs get fresh interpreters. The agent forks only
while it is a single thread; otherwise it starts fresh interpreters.

What the ranks leave. The agent is their subreaper (`par.runtime.procs.become_subreaper`): a process a rank forks
or daemonises is reparented to the agent when its parent exits, and the agent ends every such orphan when the job
ends (`procs.reap_orphans`), so nothing of a job outlives it with parent 1.

Why the agent exists: torchrun's agent imports torch before it starts a rank, on the critical path of every
launch, and the test suite and the grader launch several hundred jobs. Several nodes, restarts and rendezvous
backends stay torchrun's (`par.runtime.launch.run(max_restarts=...)`, `par.runtime.multinode.MultiNode`).
"""
from __future__ import annotations

import argparse
import gc
import os
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from datetime import datetime

from par.runtime import failure, procs
from par.runtime.checks import CheckError

POLL_S = 0.05
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
PRELOAD = ("torch", "torch._dynamo")    # what a forking agent imports once for all its ranks
RANK_NAME = "par-rank"                  # a forked rank's process name: par-rank0, par-rank1, ...


def rank_env(rank: int, nproc: int, port: int, run_id: str) -> dict[str, str]:
    """The variables torchrun's local agent gives rank `rank` of a one-node job (local_elastic_agent._start_workers)."""
    return {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
        "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": str(nproc), "WORLD_SIZE": str(nproc),
        "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }


class Forked:
    """A rank forked from the agent, with the part of `subprocess.Popen` the agent uses (pid, stdout, poll, wait,
    returncode: negative for a signal)."""

    def __init__(self, pid: int, stdout):
        self.pid, self.stdout, self.returncode = pid, stdout, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            time.sleep(POLL_S / 5)
        return self.returncode


def set_process_name(name: str) -> None:
    """The name `ps` and /proc/<pid>/comm show (Linux prctl(PR_SET_NAME), at most 15 bytes; no-op elsewhere)."""
    try:
        import ctypes
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)     # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def can_fork() -> bool:
    """Forking is safe here: Linux, and this process runs a single thread (a fork copies only the calling one)."""
    try:
        return sys.platform.startswith("linux") and threading.active_count() == 1 and \
            len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


def preload_of(program: list[str]) -> tuple[str, ...]:
    """What the agent imports before it forks the ranks of `program` ([python, -m, MODULE, ...] or [python,
    SCRIPT, ...]): the job module's own `PRELOAD = (...)` if it states one at its top level (read from its source,
    never imported: importing it would be the ranks' work), else PRELOAD. A job whose ranks take no optimizer step
    and run no dispatch mode never imports torch._dynamo and says `PRELOAD = ("torch",)`."""
    import ast
    import importlib.util
    try:
        path = importlib.util.find_spec(program[2]).origin if program[1] == "-m" else program[1]
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (ImportError, AttributeError, ValueError, TypeError, OSError, SyntaxError):
        return PRELOAD
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["PRELOAD"]:
            try:
                stated = ast.literal_eval(node.value)
            except ValueError:
                return PRELOAD
            return tuple(stated) if isinstance(stated, (tuple, list)) and all(isinstance(m, str) for m in stated) \
                else PRELOAD
    return PRELOAD


def preload(modules: tuple[str, ...] = PRELOAD) -> bool:
    """Import `modules` with the ranks' thread count (OpenMP reads it when torch loads). False when it fails."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        for module in modules:
            __import__(module)
    except Exception:   # noqa: BLE001  (no torch here: the ranks start as fresh interpreters and say why)
        return False
    return True


def fork_rank(rank: int, program: list[str], env: dict[str, str], others: list) -> Forked:
    """Fork rank `rank`: the child becomes the rank (`become_rank`), the parent gets a Forked with its output pipe."""
    read, write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        for pipe in others:                                     # the earlier ranks' outputs are not the child's
            pipe.close()
        become_rank(rank, program, env, write)                  # never returns
    os.close(write)
    return Forked(pid, os.fdopen(read, "rb"))


def detach(out: int) -> None:
    """In a forked child: a session of its own, stdin /dev/null, stdout and stderr on the pipe `out`."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)


def become_rank(rank: int, program: list[str], env: dict[str, str], out: int) -> None:
    """In a forked child: what `python -m MODULE ARGS` (or `python SCRIPT ARGS`) would be, then exit. The module's
    SystemExit, or its exception, leaves through the agent's own frames to the interpreter, which prints it and
    exits as a fresh one would (exit handlers run, output flushed)."""
    detach(out)
    os.environ.clear()
    os.environ.update(env)
    set_process_name(f"{RANK_NAME}{rank}")
    if program[1] == "-m":
        sys.argv = [program[2], *program[3:]]
        runpy.run_module(program[2], run_name="__main__", alter_sys=True)
    else:
        sys.argv = program[1:]
        sys.path[0] = os.path.dirname(os.path.abspath(program[1]))
        runpy.run_path(program[1], run_name="__main__")
    raise SystemExit(0)


class Rank:
    """One rank's process and the thread that copies its output, prefixed, to the agent's stdout."""

    def __init__(self, rank: int, proc):
        self.rank, self.proc = rank, proc
        self.exit_seen_at: float | None = None    # wall time the agent saw it exit
        self.copier: threading.Thread | None = None

    @classmethod
    def spawn(cls, rank: int, program: list[str], env: dict[str, str]) -> "Rank":
        return cls(rank, subprocess.Popen(program, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True))

    def copy_output(self, out_lock: threading.Lock) -> None:
        self.copier = threading.Thread(target=self._copy, args=(out_lock,), daemon=True)
        self.copier.start()

    def _copy(self, out_lock: threading.Lock) -> None:
        prefix = f"[default{self.rank}]:".encode()
        out = sys.stdout.buffer
        for line in self.proc.stdout:
            if not line.endswith(b"\n"):
                line += b"\n"
            with out_lock:
                out.write(prefix + line)
                out.flush()

    def poll(self) -> int | None:
        code = self.proc.poll()
        if code is not None and self.exit_seen_at is None:
            self.exit_seen_at = time.time()
        return code

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, sig)
            except ProcessLookupError:
                pass


def error_folder() -> str | None:
    """The folder of the agent's own error file (TORCHELASTIC_ERROR_FILE, the launcher's), where the ranks' error
    files and the records go; None without one."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    return os.path.dirname(os.path.abspath(path)) if path else None


def error_file(folder: str, rank: int) -> str:
    return os.path.join(folder, f"error-rank{rank}.json")


def start_ranks(nproc: int, program: list[str], port: int, run_id: str, fork: bool) -> list[Rank]:
    """Every rank, forked from this process (`fork`, when it is safe and torch imports) or as fresh interpreters."""
    folder = error_folder()
    envs = [{**os.environ, **rank_env(r, nproc, port, run_id),
             **({"TORCHELASTIC_ERROR_FILE": error_file(folder, r)} if folder else {})} for r in range(nproc)]
    if fork and can_fork() and preload(preload_of(program)) and can_fork():   # one thread before the imports, and after
        gc.freeze()         # the imports' objects leave the collector: a rank's collections copy none of their pages
        ranks: list[Rank] = []
        for r in range(nproc):
            ranks.append(Rank(r, fork_rank(r, program, envs[r], [x.proc.stdout for x in ranks])))
        return ranks
    return [Rank.spawn(r, program, envs[r]) for r in range(nproc)]


def close(ranks: list[Rank], timeout_s: float) -> None:
    """SIGTERM every rank still running, wait up to `timeout_s`, then SIGKILL what is left (torchrun's `_close`)."""
    for r in ranks:
        r.signal(signal.SIGTERM)
    end = time.monotonic() + timeout_s
    for r in ranks:
        try:
            r.proc.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for r in ranks:
        r.signal(signal.SIGKILL)
    for r in ranks:
        r.proc.wait()
        r.poll()


def report(title: str, failed: list[Rank]) -> str:
    """torchrun's failure report (torch.distributed.elastic.multiprocessing.errors.ChildFailedError.format_msg)
    for the ranks that exited non-zero: the first one seen is the root cause, the others are `Failures`."""
    root = min(failed, key=lambda r: r.exit_seen_at)

    def entry(idx: int, r: Rank) -> str:
        code = r.proc.returncode
        name = ""
        if code < 0:
            try:
                name = f" ({signal.Signals(-code).name})"
            except ValueError:
                pass
        how = f"Signal {-code}{name} received by PID {r.proc.pid}" if code < 0 else "<N/A>"
        return (f"[{idx}]:\n  time      : {datetime.fromtimestamp(r.exit_seen_at).isoformat(timespec='seconds')}\n"
                f"  host      : {socket.gethostname()}\n  rank      : {r.rank} (local_rank: {r.rank})\n"
                f"  exitcode  : {code} (pid: {r.proc.pid}){name}\n  error_file: <N/A>\n  traceback : {how}")
    others = [entry(i, r) for i, r in enumerate(failed) if r is not root] or ["  <NO_OTHER_FAILURES>"]
    width = min(60, max(len(title) + 7, 40))
    return "\n".join(["", "=" * width, f"{title} FAILED", "-" * width, "Failures:", *others, "-" * width,
                      "Root Cause (first observed failure):", entry(failed.index(root), root), "=" * width, ""])


def supervise(ranks: list[Rank], close_s: float, title: str) -> int:
    """Wait for the ranks; at the first non-zero exit stop the others and print the report. The agent's exit code."""
    stop: list[int] = []
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, frame: stop.append(signum))
    while True:
        codes = [r.poll() for r in ranks]
        if stop:
            close(ranks, close_s)
            return 128 + stop[0]
        if any(c not in (None, 0) for c in codes) or all(c == 0 for c in codes):
            break
        time.sleep(POLL_S)
    close(ranks, close_s)
    for r in ranks:                    # every line a rank printed comes before the report
        if r.copier is not None:
            r.copier.join(timeout=2.0)
    failed = [r for r in ranks if r.proc.returncode != 0]
    if not failed:
        return 0
    record(ranks)
    sys.stdout.flush()
    print(report(title, failed), file=sys.stderr, flush=True)
    return 1


def record(ranks: list[Rank]) -> None:
    """One record per rank in the error folder (`par.runtime.failure.write_records`), the root cause first (the
    first to fail, its consequences after it: `failure.cause_first`), and the root cause's error file copied to the
    agent's own (torchrun's `ErrorHandler.dump_error_file`)."""
    folder = error_folder()
    if folder is None:
        return
    records = []
    for r in sorted(ranks, key=lambda r: r.exit_seen_at):
        code = r.proc.returncode
        said = failure.read_error_file(error_file(folder, r.rank)) or {}
        records.append({"rank": r.rank, "exitcode": code, "signal": failure.signal_name(-code) if code < 0 else None,
                        "exception": said.get("exception"), "where": said.get("where"), "ended": r.exit_seen_at})
    bad = failure.cause_first([x for x in records if x["exitcode"]])     # the cause first, not its consequences
    records = bad + [x for x in records if not x["exitcode"]]
    try:
        failure.write_records(folder, records)
        root = error_file(folder, bad[0]["rank"])
        if os.path.exists(root):
            os.replace(root, os.environ["TORCHELASTIC_ERROR_FILE"])
    except (OSError, CheckError):       # a full or vanished folder: the report on stderr still says it all
        pass


def parse(argv: list[str]):
    """(nproc, port, close_s, program, title, fork): the agent's own `--name=value` options, then `-m MODULE ...`
    or `SCRIPT ...`, whose arguments are the program's, never the agent's."""
    own = argparse.ArgumentParser(prog="python -m par.runtime.agent")
    own.add_argument("--nproc-per-node", type=int, required=True)
    own.add_argument("--master-port", type=int, required=True)
    own.add_argument("--close-s", type=float, default=30.0, help="SIGTERM to SIGKILL (torchrun: 30 s)")
    own.add_argument("--fork", action="store_true", help="fork the ranks from an agent that imported torch")
    split = next((i for i, a in enumerate(argv) if not a.startswith("--")), len(argv))
    a = own.parse_args(argv[:split])
    rest = argv[split:]
    if not rest or (rest[0] == "-m" and len(rest) < 2):
        own.error("the program is missing: -m MODULE [ARGS] or SCRIPT [ARGS]")
    if rest[0] == "-m":
        return a.nproc_per_node, a.master_port, a.close_s, [sys.executable, "-m", *rest[1:]], rest[1], a.fork
    return a.nproc_per_node, a.master_port, a.close_s, [sys.executable, *rest], rest[0], a.fork


def main(argv=None) -> int:
    """The agent: start the ranks, supervise them; what they forked or daemonised is reparented to the agent
    (`procs.become_subreaper`) and ends with the job (`procs.reap_orphans`), so nothing is left with parent 1."""
    nproc, port, close_s, program, title, fork = parse(sys.argv[1:] if argv is None else list(argv))
    run_id = os.environ.get("TORCHELASTIC_RUN_ID") or uuid.uuid4().hex[:12]
    procs.become_subreaper()
    ranks = start_ranks(nproc, program, port, run_id, fork)
    lock = threading.Lock()
    for r in ranks:
        r.copy_output(lock)
    try:
        return supervise(ranks, close_s, title)
    finally:
        procs.reap_orphans(keep=[r.proc.pid for r in ranks if r.proc.poll() is None])


if __name__ == "__main__":
    sys.exit(main())
