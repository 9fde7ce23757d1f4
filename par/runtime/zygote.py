"""A warm zygote: one process per launcher that imported torch once and forks the agent of every gloo job.

    agent = zygote.start_agent(argv, env, cwd)   # a Popen-like handle (pid, stdout, poll, wait, returncode),
                                                 # or None: start `python -m par.runtime.agent` as before

`python -m par.runtime.agent --fork` imports torch and torch._dynamo before it forks the ranks (`agent.PRELOAD`):
about 3 s of one core for every job. A process that launches many jobs (a notebook kernel, the test suite, the
grader measuring layouts) pays it once here. Its second gloo launch starts `python -m par.runtime.zygote`, which
imports PRELOAD and waits on a socket; every launch then asks it for an agent, which it forks at once. The child
becomes what `python -m par.runtime.agent ARGV` would have been: the launch's working directory and environment,
its stdout and stderr on the pipe the launcher handed over (SCM_RIGHTS), stdin /dev/null, a session of its own,
the process name par-agent, and SIGTERM when the zygote dies (PR_SET_PDEATHSIG). The agent's exit code comes
back over the socket, where the launcher's handle waits for it. After its imports the zygote calls gc.freeze(),
so that an agent's garbage collections do not touch, and copy, the pages of the imported objects (what it saves
is measured in docs/instructor.md, "what a launch costs"). A process's first launch gets no zygote: one that
launches once imports torch once either way.

A zygote that cannot report (stopped, SIGSTOP) never holds a launch: an agent's exit is read from /proc when the
zygote does not say it (`Agent.wait`), and a stopped zygote serves no later launch (`Zygote.alive`).

What a zygote serves. torch reads some variables when it is imported (OpenMP's thread count, TORCH_* switches),
and Python others when it starts (PYTHONPATH, PYTHONFAULTHANDLER, ...). A zygote serves only the launches
whose such variables (`IMPORT_TIME`) and working directory are the ones it started with (`key`); a launch with
others gets a zygote of its own, and at most KEEP idle zygotes stay.

Lifetime. A zygote ends with its launcher: it reads the socket's end when the launcher exits, and gets SIGTERM
(its parent-death signal) if the launcher is killed; it is started from a thread that lives as long as the
launcher, since that signal follows the thread that started it. Its agents then get SIGTERM and stop their ranks.
PAR_ZYGOTE=0 turns it off: every job's agent is then a fresh interpreter.
"""
from __future__ import annotations

import gc
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from par.runtime import agent, lifeline, procs

IMPORT_TIME = ("PYTHON", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "LD_", "CUDA", "PATH")
PER_LAUNCH = ("PAR_RESULT", "TMPDIR", "TORCHELASTIC_ERROR_FILE")   # a launch's own: never the zygote's
MAX_MESSAGE = 1 << 20
POLL_S = 0.05          # how often the zygote looks for agents that exited
KEEP = 2               # idle zygotes kept per launcher
AGENT_NAME = "par-agent"
NAME = "par-zygote"


def key(env: dict, cwd: str) -> tuple:
    """What must be equal for a zygote to serve a launch: the variables read at import and the working directory."""
    return (cwd, *sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME) and k not in PER_LAUNCH))


# ---------------------------------------------------------------- the zygote's side
def send(sock: socket.socket, message: dict) -> None:
    sock.send(json.dumps(message).encode())


def serve(sock: socket.socket) -> None:
    """Fork an agent for each request and report its pid, then its exit code; return when the launcher is gone."""
    agents: set[int] = set()
    while True:
        readable, _, _ = select.select([sock], [], [], POLL_S if agents else None)
        if readable:
            try:
                data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 1)
            except OSError:
                return
            if not data:
                return
            request = json.loads(data)
            pid = fork_agent(request, fds[0], sock)
            os.close(fds[0])
            agents.add(pid)
            send(sock, {"id": request["id"], "pid": pid})
        for pid in list(agents):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                agents.discard(pid)
                send(sock, {"pid": pid, "exit": os.waitstatus_to_exitcode(status)})


def fork_agent(request: dict, out: int, sock: socket.socket) -> int:
    """Fork; the child becomes the agent (`become_agent`, never returns), the parent gets its pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    dies_with_zygote = lifeline.dies_with_parent(signal.SIGTERM)
    pid = os.fork()
    if pid == 0:
        become_agent(request, out, sock, dies_with_zygote)
    return pid


def become_agent(request: dict, out: int, sock: socket.socket, dies_with_zygote) -> None:
    """In the forked child: `python -m par.runtime.agent ARGV` in the launch's folder and environment. The agent's
    exit code leaves as SystemExit through the zygote's frames, so it exits as a fresh interpreter would."""
    sock.close()
    agent.detach(out)
    dies_with_zygote()                                    # SIGTERM when the zygote dies, or now if it already has
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None                               # the launch's TMPDIR, not the zygote's
    agent.set_process_name(AGENT_NAME)
    sys.argv = [agent.__file__, *request["argv"]]
    raise SystemExit(agent.main(request["argv"]))


def main(fd: int) -> int:
    """`python -m par.runtime.zygote FD`: import PRELOAD, say so on the socket FD, serve until the launcher is gone."""
    sock = socket.socket(fileno=fd)
    agent.set_process_name(NAME)
    if not agent.preload():
        send(sock, {"error": "torch cannot be imported here"})
        return 1
    gc.freeze()               # the imports' objects leave the collector: an agent's collections copy none of them
    if not agent.can_fork():
        send(sock, {"error": "the zygote runs more than one thread after importing torch"})
        return 1
    send(sock, {"ready": True})
    serve(sock)
    return 0


# ---------------------------------------------------------------- the launcher's side
class Agent:
    """An agent forked by the zygote, with the part of `subprocess.Popen` the launcher uses: pid, stdout (text),
    poll, wait (subprocess.TimeoutExpired), returncode (negative for a signal)."""

    def __init__(self, stdout):
        self.pid: int | None = None
        self.stdout = stdout
        self.returncode: int | None = None
        self.started = threading.Event()
        self.done = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The agent's exit code, as the zygote reports it, or as /proc shows it when the zygote cannot report (it is
        stopped: the agent exited and waits, a zombie, for the zygote to reap it; or gone); TimeoutExpired after
        `timeout` seconds otherwise."""
        end = None if timeout is None else time.monotonic() + timeout
        while not self.done.wait(POLL_S * 4):
            if self.pid is not None:
                code = procs.zombie_exit(self.pid)
                if code is not None or procs.state(self.pid) is None:
                    self.finish(code if code is not None else -signal.SIGKILL)
                    break
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(AGENT_NAME, timeout)
        return self.returncode

    def finish(self, code: int) -> None:
        self.returncode = code
        self.done.set()


class Zygote:
    """The launcher's end of one zygote: the socket, and a thread that started the zygote and reads its replies."""

    def __init__(self, env: dict, cwd: str, timeout_s: float = 120.0):
        self.key = key(env, cwd)
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.lock = threading.Lock()
        self.ids = 0
        self.waiting: dict[int, Agent] = {}      # request id -> agent without a pid yet
        self.running: dict[int, Agent] = {}      # pid -> agent without an exit code yet
        self.ready = threading.Event()
        self.error: str | None = None
        self.proc: subprocess.Popen | None = None
        env = {k: v for k, v in env.items() if k not in PER_LAUNCH}
        threading.Thread(target=self._run, args=(theirs, env, cwd), name=NAME, daemon=True).start()
        if not self.ready.wait(timeout_s):
            self.error = self.error or f"the zygote did not import torch within {timeout_s:.0f} s"
            self.close()

    def _run(self, theirs: socket.socket, env: dict, cwd: str) -> None:
        """Start the zygote from this thread (its parent-death signal follows the thread), then read its replies."""
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "par.runtime.zygote", str(theirs.fileno())],
                                         pass_fds=(theirs.fileno(),), env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         start_new_session=True, preexec_fn=lifeline.dies_with_parent(signal.SIGTERM))
        except OSError as e:
            self.error = f"the zygote could not start: {e}"
        finally:
            theirs.close()
        while self.proc is not None:
            try:
                data = self.sock.recv(MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                break
            self._read(json.loads(data))
        self.error = self.error or "the zygote ended"
        with self.lock:                         # the zygote is gone: nobody will reap its agents for us
            for agent in [*self.waiting.values(), *self.running.values()]:
                agent.started.set()
                agent.finish(-signal.SIGKILL)
            self.waiting.clear()
            self.running.clear()
        self.ready.set()
        if self.proc is not None:
            self.proc.wait()

    def _read(self, message: dict) -> None:
        if "ready" in message or "error" in message:
            self.error = message.get("error")
            self.ready.set()
            return
        with self.lock:
            if "id" in message:
                agent = self.waiting.pop(message["id"])
                agent.pid = message["pid"]
                self.running[agent.pid] = agent
                agent.started.set()
            else:
                agent = self.running.pop(message["pid"], None)
                if agent is not None:
                    agent.finish(message["exit"])

    @property
    def alive(self) -> bool:
        """It can serve: no error, and it is not stopped (SIGSTOP) or gone."""
        if self.error is None and self.proc is not None and procs.state(self.proc.pid) in ("T", "t", "Z", None):
            self.error = f"the zygote (pid {self.proc.pid}) is stopped or gone"
        return self.error is None

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def start(self, argv: list[str], env: dict, cwd: str, timeout_s: float = 30.0) -> Agent | None:
        """Fork an agent for `python -m par.runtime.agent ARGV`; None if the zygote cannot (then start it fresh)."""
        read, write = os.pipe()
        agent = Agent(open(read, "r", buffering=1))
        try:
            with self.lock:
                if not self.alive:
                    raise OSError(self.error)
                self.ids += 1
                self.waiting[self.ids] = agent
                request = json.dumps({"id": self.ids, "argv": list(argv), "env": dict(env), "cwd": cwd}).encode()
                socket.send_fds(self.sock, [request], [write])
        except OSError:
            agent.stdout.close()
            return None
        finally:
            os.close(write)
        if not agent.started.wait(timeout_s) or agent.pid is None:
            agent.stdout.close()
            return None
        return agent

    def close(self) -> None:
        """End the zygote: it reads the socket's end and exits (its agents, if any, get SIGTERM)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


_ZYGOTES: list[Zygote] = []          # this process's zygotes, the most recently used last
_LAUNCHES = [0]                      # gloo agents this process asked for
_REFUSED: dict[tuple, str] = {}      # keys whose zygote could not serve (OMP_NUM_THREADS > 1 starts threads), why
_OWNER = [os.getpid()]               # a forked launcher starts its own
_LOCK = threading.Lock()


def enabled() -> bool:
    return sys.platform.startswith("linux") and os.environ.get("PAR_ZYGOTE", "1") != "0"


def zygote_for(env: dict, cwd: str) -> Zygote | None:
    """This process's zygote for a launch in `env` and `cwd`, started if there is none (None if it cannot start)."""
    with _LOCK:
        wanted = key(env, cwd)
        if wanted in _REFUSED:
            return None
        for z in [z for z in _ZYGOTES if not z.alive]:
            _ZYGOTES.remove(z)
        found = next((z for z in _ZYGOTES if z.key == wanted), None)
        if found is None:
            found = Zygote(env, cwd)
            if not found.alive:
                _REFUSED[wanted] = found.error
                return None
            idle = [z for z in _ZYGOTES if z.idle]
            for z in idle[:max(0, len(idle) - KEEP + 1)]:
                z.close()
                _ZYGOTES.remove(z)
        else:
            _ZYGOTES.remove(found)
        _ZYGOTES.append(found)
        return found


def start_agent(argv: list[str], env: dict, cwd: str | None = None) -> Agent | None:
    """An agent for `python -m par.runtime.agent ARGV`, forked by this process's zygote; None when there is no
    zygote to ask: the caller starts the agent as a fresh interpreter. There is none for the first gloo launch of
    a process (one that launches once, like the grader's sandboxed jobs or `python -m par train`, would import
    torch once either way, and pay the zygote's fork on top), with PAR_ZYGOTE=0, off Linux, or without torch."""
    if not enabled():
        return None
    with _LOCK:
        if _OWNER[0] != os.getpid():         # a forked launcher: its parent's zygotes are not its own
            _ZYGOTES.clear()
            _LAUNCHES[0] = 0
            _OWNER[0] = os.getpid()
        _LAUNCHES[0] += 1
        if _LAUNCHES[0] == 1:
            return None
    cwd = cwd or os.getcwd()
    z = zygote_for(env, cwd)
    return z.start(argv, env, cwd) if z is not None else None


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
