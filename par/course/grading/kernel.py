"""One ipykernel in the submission's sandbox, driven by the grader over unix sockets (zmq ipc) in its work folder.

    kernel = Kernel(box, env, deadline)        # started inside `box` (par.course.grading.sandbox), capped in processes
    reply = kernel.execute(code, cell_deadline)            # a Reply: status, error, output
    answer = kernel.call(name, payload, cell_deadline)     # a student function called over the grader's comm
    kernel.close()                                         # it and everything it started are gone

Its messages are signed with a key only the grader and the kernel hold; a message that does not verify is
ignored. What the grader holds of a kernel's messages is bounded whatever the student sends: one message at
most MAX_MESSAGE bytes, at most MAX_QUEUED of them unread per socket (zmq drops the rest). KernelDied,
CellTimeout and NotebookTimeout are BaseExceptions: a check's `except Exception` cannot swallow them.
"""
from __future__ import annotations

import re
import secrets
import subprocess
import sys
import time

from par.course.grading import nbval_run, sandbox
from par.runtime.lifeline import dies_with_parent

MIME = "application/x-par-grader+json"
MAX_OUTPUT = 1 << 20        # characters of a cell's output kept
MAX_MESSAGE = 8 << 20       # bytes of one message from the kernel (a student's value, one output)
MAX_QUEUED = 32             # messages waiting unread on a socket: at most MAX_QUEUED * MAX_MESSAGE = 256 MB each
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class KernelDied(BaseException):      # BaseException: a check's `except Exception` cannot swallow these
    pass


class CellTimeout(BaseException):
    pass


class NotebookTimeout(BaseException):
    pass


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
        with nbval_run._LOCK:
            nbval_run._RUNNING.add(self.proc)
        self.signer = Signer(key=key.encode(), signature_scheme=info.get("signature_scheme", "hmac-sha256"))
        self.ctx = zmq.Context()
        url = lambda port: f"ipc://{info['ip']}-{port}"  # noqa: E731
        self.shell, self.control = self.ctx.socket(zmq.DEALER), self.ctx.socket(zmq.DEALER)
        self.iopub = self.ctx.socket(zmq.SUB)
        self.iopub.setsockopt(zmq.SUBSCRIBE, b"")
        for sock in (self.shell, self.iopub):      # a message over MAX_MESSAGE is not read (the call then runs to
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)   # its time limit); at most MAX_QUEUED wait unread (a
            sock.setsockopt(zmq.RCVHWM, MAX_QUEUED)        # flood from a thread of the student's: the rest dropped)
        for sock, port in ((self.shell, "shell_port"), (self.control, "control_port"), (self.iopub, "iopub_port")):
            sock.linger = 0
            sock.connect(url(info[port]))
        self.poller = zmq.Poller()
        self.poller.register(self.shell, zmq.POLLIN)
        self.poller.register(self.iopub, zmq.POLLIN)
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

    def _receive(self, timeout: float):
        out = []
        for sock, _ in self.poller.poll(int(timeout * 1000)):
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
        while not (got_reply and (idle or (silent and reply.data))):   # a call's data is its last message
            interrupted = self._watch(cell_deadline, interrupted)
            if got_reply and time.monotonic() > got_at + 5:            # replied, but no idle status: enough
                break
            if not self.alive():
                raise KernelDied()
            for sock, msg in self._receive(0.05):
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
        interrupted = None
        while True:
            interrupted = self._watch(cell_deadline, interrupted)
            if not self.alive():
                raise KernelDied()
            for sock, msg in self._receive(0.05):
                if (sock is self.iopub and msg["msg_type"] == "comm_msg"
                        and msg.get("parent_header", {}).get("msg_id") == msg_id):
                    if interrupted is not None:
                        raise CellTimeout()
                    data = msg["content"].get("data")
                    return data if isinstance(data, dict) else {"error": ["StudentError", "no answer"]}

    def _watch(self, cell_deadline: float, interrupted: float | None) -> float | None:
        """One tick of a wait: NotebookTimeout past the notebook's deadline, or 10 s after an interrupt the kernel
        ignores; past the cell's deadline the kernel is interrupted. Returns when it was (None: not yet)."""
        now = time.monotonic()
        if now > self.deadline:
            raise NotebookTimeout()
        if interrupted is None and now > cell_deadline:
            self.interrupt()
            return now
        if interrupted is not None and now > interrupted + 10:
            raise NotebookTimeout()
        return interrupted

    def interrupt(self) -> None:
        try:
            self.signer.send(self.control, "interrupt_request", {})
        except Exception:
            pass

    def close(self) -> None:
        from par.runtime.launch import _kill_tree
        self.cap.stop()
        if self.proc.poll() is None:
            _kill_tree(self.proc)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        with nbval_run._LOCK:
            nbval_run._RUNNING.discard(self.proc)
        self.ctx.destroy(linger=0)
        self.log.close()
