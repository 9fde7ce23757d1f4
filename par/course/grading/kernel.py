"""One ipykernel in the submission's sandbox, driven by the grader over unix sockets (zmq ipc) in its work folder.

    kernel = Kernel(box, env, deadline)        # started inside `box` (par.course.grading.sandbox), capped in processes
    reply = kernel.execute(code, cell_deadline)            # a Reply: status, error, output
    answer = kernel.call(name, payload, cell_deadline)     # a student function called over the grader's comm
    kernel.close()                                         # it and everything it started are gone

Its messages are signed with a key only the grader and the kernel hold; a message that does not verify is
ignored. What the grader holds of a kernel's messages is bounded whatever the student sends: one message at
most MAX_MESSAGE bytes, at most MAX_QUEUED of them unread per socket (zmq drops the rest). An answer zmq dropped is
noticed within seconds (`_Probe`): the call or cell fails with LOST instead of running to its time limit. KernelDied,
CellTimeout and NotebookTimeout are BaseExceptions: a check's `except Exception` cannot swallow them.
"""
from __future__ import annotations

import re
import secrets
import subprocess
import sys
import time

from par.course.grading import sandbox
from par.runtime import procs
from par.runtime.lifeline import dies_with_parent

MIME = "application/x-par-grader+json"
MAX_OUTPUT = 1 << 20        # characters of a cell's output kept
MAX_MESSAGE = 8 << 20       # bytes of one message from the kernel (a student's value, one output)
MAX_QUEUED = 32             # messages waiting unread on a socket: at most MAX_QUEUED * MAX_MESSAGE = 256 MB each
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
PROBE_AFTER = 1.0           # seconds an answer is awaited before the grader asks whether the kernel is done
SILENT = 3.0                # seconds of no iopub message after a probe's reply: the iopub connection is dead
LOST = (f"your kernel's answer never reached the grader (a message over {MAX_MESSAGE >> 20} MB, or a flood of output "
        f"before it): it is not read")


class KernelDied(BaseException):      # BaseException: a check's `except Exception` cannot swallow these
    pass


class CellTimeout(BaseException):
    pass


class NotebookTimeout(BaseException):
    pass


class Unstoppable(NotebookTimeout):
    """A cell past its limit did not stop within 10 s of the interrupt: the notebook ends there."""


class Reply:
    def __init__(self):
        self.status, self.ename, self.evalue, self.traceback = "", "", "", ""
        self.stdout, self.data = [], []

    @property
    def text(self) -> str:
        return "".join(self.stdout)

    def error_line(self) -> str:
        return f"{self.ename}: {self.evalue}" if self.evalue else self.ename


class Kernel:
    """One ipykernel in the submission's sandbox, talked to over unix sockets (zmq ipc) in its work folder."""

    def __init__(self, box: sandbox.Sandbox, env: dict | None, deadline: float):
        import zmq
        from jupyter_client.connect import write_connection_file
        from jupyter_client.session import Session as Signer
        self.deadline = deadline
        sockets = box.workdir / ".k"
        sockets.mkdir()
        key = secrets.token_hex(16)
        conn, info = write_connection_file(str(sockets / "kernel.json"), transport="ipc", ip=str(sockets / "s"),
                                           key=key.encode())
        cmd = box.wrap([sys.executable, "-m", "ipykernel_launcher", "-f", conn, "--HistoryManager.enabled=False"])
        self.log = open(box.workdir / ".kernel.log", "w")
        self.proc = subprocess.Popen(cmd, cwd=box.workdir, env=box.env(env), stdout=self.log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=dies_with_parent())   # a SIGKILLed grader takes its kernel along
        self.cap = sandbox.ProcessCap(self.proc, box.sandboxed)     # a fork bomb: the kernel and all it started die
        procs.register(self.proc)
        self.signer = Signer(key=key.encode(), signature_scheme=info.get("signature_scheme", "hmac-sha256"))
        self.ctx = zmq.Context()
        self.url = lambda port: f"ipc://{info['ip']}-{info[port]}"  # noqa: E731
        self.poller = zmq.Poller()
        self.shell, self.control = self._socket(zmq.DEALER, "shell_port"), self._socket(zmq.DEALER, "control_port")
        self.iopub = self._socket(zmq.SUB, "iopub_port")
        self.heard = time.monotonic()       # when the last iopub message came
        ready = min(deadline, time.monotonic() + 120)
        replied = published = False
        while not (replied and published):          # the kernel answers, and its iopub reaches us
            if time.monotonic() > ready or not self.alive():
                self.close()
                raise KernelDied("the kernel did not start" + ("" if self.alive() else " (it exited)"))
            self.signer.send(self.shell, "kernel_info_request", {})
            until = time.monotonic() + 0.5
            while time.monotonic() < until and not (replied and published):
                for sock, msg in self._receive(0.1):
                    replied |= sock is self.shell
                    published |= sock is self.iopub

    def _socket(self, kind: int, port: str):
        """A socket to the kernel's `port`. Shell and iopub read no message over MAX_MESSAGE (zmq closes the
        connection; a probe then tells that an answer is lost) and keep at most MAX_QUEUED unread (a flood from a
        thread of the student's: the rest dropped)."""
        import zmq
        sock = self.ctx.socket(kind)
        if kind == zmq.SUB:
            sock.setsockopt(zmq.SUBSCRIBE, b"")
        if port != "control_port":
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
            sock.setsockopt(zmq.RCVHWM, MAX_QUEUED)
            self.poller.register(sock, zmq.POLLIN)
        sock.linger = 0
        sock.connect(self.url(port))
        return sock

    def _reconnect_iopub(self) -> None:
        """A new iopub connection: the kernel sends nothing more on one that dropped a message over MAX_MESSAGE."""
        import zmq
        self.poller.unregister(self.iopub)
        self.iopub.close(linger=0)
        self.iopub, self.heard = self._socket(zmq.SUB, "iopub_port"), time.monotonic()

    def _receive(self, timeout: float):
        out = []
        for sock, _ in self.poller.poll(int(timeout * 1000)):
            if sock is self.iopub:
                self.heard = time.monotonic()
            try:
                _, parts = self.signer.feed_identities(sock.recv_multipart())
                out.append((sock, self.signer.deserialize(parts)))
            except Exception:  # a message that does not verify or parse: not from the kernel we started
                continue
        return out

    def alive(self) -> bool:
        return self.proc.poll() is None

    def execute(self, code: str, cell_deadline: float, silent: bool = False) -> Reply:
        """Run `code`; a Reply, or CellTimeout (interrupted), NotebookTimeout or KernelDied. `silent` (the
        grader's own calls): no execution count, no echo on iopub, about half the time per call."""
        content = {"code": code, "silent": silent, "store_history": False, "user_expressions": {},
                   "allow_stdin": False, "stop_on_error": False}
        msg_id = self.signer.send(self.shell, "execute_request", content)["header"]["msg_id"]
        reply, got_reply, idle, interrupted, size, got_at = Reply(), False, False, None, 0, 0.0
        probe = _Probe(self)
        while not (got_reply and (idle or (silent and reply.data))):   # a call's data is its last message
            interrupted = self._watch(cell_deadline, interrupted)
            if got_reply and time.monotonic() > got_at + 5:            # replied, but no idle status: enough
                break
            if not self.alive():
                raise KernelDied()
            if not got_reply:
                probe.send()
            for sock, msg in self._receive(0.05):
                if probe.answered_before(sock, msg, self.shell) and not got_reply:   # the execute_reply is lost
                    reply.status, reply.ename, reply.evalue = "error", "StudentError", LOST
                    got_reply = idle = True
                if msg.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                kind, content = msg["msg_type"], msg["content"]
                if sock is self.shell:
                    got_reply, got_at = True, time.monotonic()
                    reply.status = content.get("status", "error")
                    reply.ename, reply.evalue = str(content.get("ename", "")), str(content.get("evalue", ""))
                    reply.traceback = ANSI.sub("", "\n".join(map(str, content.get("traceback", []))))
                elif kind == "stream" and size < MAX_OUTPUT:
                    reply.stdout.append(str(content.get("text", ""))[:MAX_OUTPUT])
                    size += len(reply.stdout[-1])
                elif kind in ("display_data", "execute_result") and MIME in content.get("data", {}):
                    reply.data.append(content["data"][MIME])
                elif kind == "status" and content.get("execution_state") == "idle":
                    idle = True
        if interrupted is not None:
            raise CellTimeout()
        return reply

    def open_channel(self) -> None:
        self.comm_id = secrets.token_hex(16)
        self.signer.send(self.shell, "comm_open", {"comm_id": self.comm_id, "target_name": "par-grader", "data": {}})

    def call(self, name: str, payload: str, cell_deadline: float, **more) -> dict:
        """Call the student's function `name` over the comm; the kernel's answer ({"data"} or {"error"})."""
        msg_id = self.signer.send(self.shell, "comm_msg", {"comm_id": self.comm_id, "data": {
            "name": name, "payload": payload, **more}})["header"]["msg_id"]
        interrupted, probe = None, _Probe(self)
        while True:
            interrupted = self._watch(cell_deadline, interrupted)
            if not self.alive():
                raise KernelDied()
            probe.send()
            if probe.iopub_silent():
                self._reconnect_iopub()
                return {"error": ["StudentError", LOST]}
            for sock, msg in self._receive(0.05):
                if probe.answered_before(sock, msg, self.iopub):
                    if interrupted is not None:
                        raise CellTimeout()
                    return {"error": ["StudentError", LOST]}
                if (sock is self.iopub and msg["msg_type"] == "comm_msg"
                        and msg.get("parent_header", {}).get("msg_id") == msg_id):
                    if interrupted is not None:
                        raise CellTimeout()
                    data = msg["content"].get("data")
                    return data if isinstance(data, dict) else {"error": ["StudentError", "no answer"]}

    def _watch(self, cell_deadline: float, interrupted: float | None) -> float | None:
        """One tick of a wait: NotebookTimeout past the notebook's deadline, or Unstoppable 10 s after an interrupt
        the kernel ignores; past the cell's deadline the kernel is interrupted. Returns when it was (None: not yet)."""
        now = time.monotonic()
        if now > self.deadline:
            raise NotebookTimeout()
        if interrupted is None and now > cell_deadline:
            self.interrupt()
            return now
        if interrupted is not None and now > interrupted + 10:
            raise Unstoppable()
        return interrupted

    def interrupt(self) -> None:
        try:
            self.signer.send(self.control, "interrupt_request", {})
        except Exception:
            pass

    def close(self) -> None:
        self.cap.stop()
        if self.proc.poll() is None:
            procs.kill_tree(self.proc)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        procs.unregister(self.proc)
        self.ctx.destroy(linger=0)
        self.log.close()


class _Probe:
    """Tells, while the grader awaits an answer from the kernel, that the answer is lost (zmq dropped it: over
    MAX_MESSAGE, or past MAX_QUEUED). Once the answer has been awaited PROBE_AFTER s, a `kernel_info_request` is
    sent (one at a time). The kernel handles shell messages one at a time: it takes the probe up only when it is done
    with the request awaited, after it sent that request's answer. So the answer is lost when, on the socket that
    carries it, the probe's message comes first: its shell reply (for an execute_reply) or its iopub status (for a
    comm answer); or when iopub has been silent SILENT s after the probe's reply (the connection is dead)."""

    def __init__(self, kernel: Kernel):
        self.kernel, self.since, self.ids, self.pending, self.replied = kernel, time.monotonic(), set(), False, 0.0
        self.quiet = None       # the first probe reply since which iopub has said nothing

    def send(self) -> None:
        """Send a probe if none is pending; never blocks (a shell connection that zmq closed takes nothing)."""
        import zmq
        if not self.pending and time.monotonic() > max(self.since, self.replied) + PROBE_AFTER:
            msg = self.kernel.signer.msg("kernel_info_request", {})
            try:
                self.kernel.shell.send_multipart(self.kernel.signer.serialize(msg), flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            self.ids.add(msg["header"]["msg_id"])
            self.pending = True

    def answered_before(self, sock, msg, carrier) -> bool:
        """Whether `msg`, on `sock`, is the probe's and `sock` is the socket `carrier` of the awaited answer."""
        if msg.get("parent_header", {}).get("msg_id") not in self.ids:
            return False
        if sock is self.kernel.shell:
            self.pending, self.replied = False, time.monotonic()
            if self.quiet is None or self.kernel.heard > self.quiet:
                self.quiet = self.replied
        return sock is carrier

    def iopub_silent(self) -> bool:
        return self.quiet is not None and self.kernel.heard < self.quiet and time.monotonic() > self.quiet + SILENT
