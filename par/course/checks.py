"""Checks judged in the grader's process, on plain data fetched from the student's kernel.

    result = run(assembled, reference, timeout=600, cell_timeout=300)     # an nbval_run.Run, cell by cell

The grader drives one ipykernel itself (jupyter_client over unix sockets in the submission's work folder,
inside `par.course.sandbox` when bwrap is here). Cells go where they can be trusted:

    answer cells, cells the student added, setup     run in the student's kernel (the reply's status is recorded)
    setup cells                                      also run in the grader's namespace (the checks use them)
    check cells                                      run in the grader's own process, in that namespace, where
                                                     every name the answer cells define (`bytes_per_param`) is a
                                                     proxy: calling it sends the arguments to the kernel as
                                                     data, calls the student's function there, and returns the
                                                     result as data
    `par.runtime.launch.run` in a check              the job starts from the grader, in a sandbox of its own over
                                                     the submission's folder (never through the kernel); its
                                                     result comes back as data
    check cells with metadata "judge": "kernel"      run in the kernel (07's best_plan returns planner objects,
                                                     09's dispatch buffer needs autograd through the student's
                                                     code); they pass only when the execute reply says "ok" AND
                                                     the cell printed a random token appended after its last line

What stays attackable: a kernel-judged check (a student's IPython hook sees the cell, token included, before
it runs); a rank of a real-rank job can write the result file of its own job (the harness shares its process);
an answer may call par's own implementation (the kernel needs par).

Data is what JSON holds, plus tuples, dicts with any plain keys, floats inf/nan and tensors (dtype, shape,
values): the grader decodes it into its own plain objects, so nothing the student returns has behaviour (an
object equal to everything arrives as an error). Arguments the student's function changes in place (a list, a
dict, a tensor) come back and are written into the grader's objects, so checks such as "do not modify your
argument" keep their meaning. Patching torch, builtins, par, IPython or the setup helpers in the kernel changes
what the student's functions return, never what the checks compare them with, nor whether an assert ran.
"""
from __future__ import annotations

import io
import json
import re
import secrets
import subprocess
import sys
import time
import traceback as tb_module
from pathlib import Path

from par.course import nbval_run, sandbox
from par.runtime.lifeline import dies_with_parent
from par.course.nbval_run import CellResult, Run

MIME = "application/x-par-grader+json"
MAX_OUTPUT = 1 << 20        # characters of a cell's output kept
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

# The codec, run both in the grader and in the kernel (so both sides speak the same data).
CODEC = r'''
_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")


def _encode(x, depth=0):
    if depth > 64:
        raise ValueError("the value is nested too deeply to be graded")
    if x is None or type(x) in (bool, int, str, float):
        return x
    if type(x) is list:
        return [_encode(v, depth + 1) for v in x]
    if type(x) is tuple:
        return {"__tuple__": [_encode(v, depth + 1) for v in x]}
    if type(x) is dict:
        return {"__dict__": [[_encode(k, depth + 1), _encode(v, depth + 1)] for k, v in x.items()]}
    module = type(x).__module__ or ""
    if module.startswith("torch"):
        import torch
        if type(x) is torch.Size:
            return {"__tuple__": [int(v) for v in x]}
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu()
            dtype = str(t.dtype).replace("torch.", "")
            if dtype not in _DTYPES:
                raise TypeError(f"a tensor of dtype {dtype} cannot be graded")
            return {"__tensor__": [dtype, [int(s) for s in t.shape], t.reshape(-1).tolist()]}
    if module == "numpy":
        return _encode(x.tolist(), depth + 1)
    raise TypeError(f"the grader takes plain data (numbers, strings, lists, tuples, dicts, tensors), "
                    f"not a {type(x).__module__}.{type(x).__qualname__}")


def _decode(y, depth=0):
    if depth > 64:
        raise ValueError("the value is nested too deeply to be graded")
    if y is None or type(y) in (bool, int, str, float):
        return y
    if type(y) is list:
        return [_decode(v, depth + 1) for v in y]
    if type(y) is dict and len(y) == 1:
        (tag, body), = y.items()
        if tag == "__tuple__" and type(body) is list:
            return tuple(_decode(v, depth + 1) for v in body)
        if tag == "__dict__" and type(body) is list:
            out = {}
            for pair in body:
                if type(pair) is not list or len(pair) != 2:
                    raise ValueError("a malformed dict")
                out[_decode(pair[0], depth + 1)] = _decode(pair[1], depth + 1)
            return out
        if tag == "__tensor__" and type(body) is list and len(body) == 3 and body[0] in _DTYPES:
            import torch
            dtype, shape, values = body
            if type(shape) is not list or not all(type(s) is int and s >= 0 for s in shape):
                raise ValueError("a malformed tensor shape")
            if type(values) is not list or not all(type(v) in (bool, int, float) for v in values):
                raise ValueError("a malformed tensor")
            n = 1
            for s in shape:
                n *= s
            if n != len(values):
                raise ValueError("a tensor whose shape does not match its values")
            return torch.tensor(values, dtype=getattr(torch, dtype)).reshape(shape)
    raise ValueError(f"not plain data: {str(y)[:80]}")
'''

KERNEL_HELPER = CODEC + r'''

class __par_grader__:
    """The grader's end of the data channel in this kernel (see par.course.checks): a comm, whose messages call
    the student's functions on the kernel's main thread without IPython's cell machinery (~1 ms a call)."""

    @staticmethod
    def call(name, payload):
        import json
        from IPython import get_ipython
        args, kwargs = _decode(json.loads(payload))
        namespace = get_ipython().user_ns
        if name not in namespace:
            raise NameError(f"name {name!r} is not defined")
        result = namespace[name](*args, **kwargs)
        return json.dumps({"result": _encode(result), "args": _encode(args), "kwargs": _encode(kwargs)})

    @staticmethod
    def opened(comm, _):
        @comm.on_msg
        def received(msg):
            data = msg["content"]["data"]
            try:
                comm.send({"data": __par_grader__.call(data["name"], data["payload"])})
            except BaseException as e:  # the student's exception (or the grader's interrupt) goes back as data
                comm.send({"error": [type(e).__name__, str(e)[:2000]]})


get_ipython().kernel.comm_manager.register_target("par-grader", __par_grader__.opened)
'''

_codec: dict = {}
exec(CODEC, _codec)  # noqa: S102  (our own source, above)
encode, decode = _codec["_encode"], _codec["_decode"]


class StudentError(Exception):
    """The student's function raised an exception the grader has no class for (its name and message)."""


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


# ---------------------------------------------------------------- the kernel, driven by the grader
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
        with nbval_run._LOCK:
            nbval_run._RUNNING.add(self.proc)
        self.signer = Signer(key=key.encode(), signature_scheme=info.get("signature_scheme", "hmac-sha256"))
        self.ctx = zmq.Context()
        url = lambda port: f"ipc://{info['ip']}-{port}"  # noqa: E731
        self.shell, self.control = self.ctx.socket(zmq.DEALER), self.ctx.socket(zmq.DEALER)
        self.iopub = self.ctx.socket(zmq.SUB)
        self.iopub.setsockopt(zmq.SUBSCRIBE, b"")
        for sock in (self.shell, self.iopub):      # a student's value or output of 256 MB is not read (the call
            sock.setsockopt(zmq.MAXMSGSIZE, 256 << 20)   # then runs to its time limit)
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
            now = time.monotonic()
            if now > self.deadline:
                raise NotebookTimeout()
            if interrupted is None and now > cell_deadline:
                interrupted = now
                self.interrupt()
            if interrupted is not None and now > interrupted + 10:    # it ignores the interrupt: give up on it
                raise NotebookTimeout()
            if got_reply and now > got_at + 5:                          # replied, but no idle status: enough
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

    def call(self, name: str, payload: str, cell_deadline: float) -> dict:
        """Call the student's function `name` over the comm; the kernel's answer ({"data"} or {"error"})."""
        msg_id = self.signer.send(self.shell, "comm_msg", {"comm_id": self.comm_id, "data": {
            "name": name, "payload": payload}})["header"]["msg_id"]
        interrupted = None
        while True:
            now = time.monotonic()
            if now > self.deadline:
                raise NotebookTimeout()
            if interrupted is None and now > cell_deadline:
                interrupted = now
                self.interrupt()
            if interrupted is not None and now > interrupted + 10:
                raise NotebookTimeout()
            if not self.alive():
                raise KernelDied()
            for sock, msg in self._receive(0.05):
                if (sock is self.iopub and msg["msg_type"] == "comm_msg"
                        and msg.get("parent_header", {}).get("msg_id") == msg_id):
                    if interrupted is not None:
                        raise CellTimeout()
                    data = msg["content"].get("data")
                    return data if isinstance(data, dict) else {"error": ["StudentError", "no answer"]}

    def interrupt(self) -> None:
        try:
            self.signer.send(self.control, "interrupt_request", {})
        except Exception:
            pass

    def close(self) -> None:
        from par.runtime.launch import _kill_tree
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


# ---------------------------------------------------------------- the grader's end of a student function
class Proxy:
    """Stands for the student's function `name` in the grader's namespace: data in, data out."""

    def __init__(self, session: "Session", name: str):
        self.session, self.__name__ = session, name

    def __call__(self, *args, **kwargs):
        return self.session.call(self.__name__, args, kwargs)

    def __repr__(self):
        return f"<your function {self.__name__}, called in your kernel>"


def _raise_as(ename: str, evalue: str):
    import builtins
    kind = getattr(builtins, ename, None)
    if isinstance(kind, type) and issubclass(kind, Exception) and kind not in (SystemExit,):
        raise kind(evalue)
    raise StudentError(f"{ename}: {evalue}" if evalue else ename)


def merge_back(original, new):
    """Write `new` (the argument as the student's function left it) into `original` in place, where it can be."""
    import torch
    if isinstance(original, torch.Tensor) and isinstance(new, torch.Tensor):
        if original.shape == new.shape and not torch.equal(original.detach().to(new.dtype), new):
            with torch.no_grad():
                original.copy_(new.to(original.dtype))
        return original
    if type(original) is list and type(new) is list:
        if len(original) == len(new):
            for i, v in enumerate(new):
                original[i] = merge_back(original[i], v)
        else:
            original[:] = new
        return original
    if type(original) is dict and type(new) is dict:
        for k in [k for k in original if k not in new]:
            del original[k]
        for k, v in new.items():
            original[k] = merge_back(original[k], v) if k in original else v
        return original
    if type(original) is tuple and type(new) is tuple and len(original) == len(new):
        for a, b in zip(original, new):
            merge_back(a, b)
        return original
    return new if type(original) is not type(new) or original != new else original


class Session:
    def __init__(self, kernel: Kernel):
        self.kernel = kernel
        self.cell_deadline = float("inf")
        self.calls = 0

    def call(self, name, args, kwargs):
        payload = json.dumps(encode([list(args), dict(kwargs)]))
        answer = self.kernel.call(name, payload, self.cell_deadline)
        self.calls += 1
        if "error" in answer:
            error = answer["error"]
            ok = isinstance(error, list) and len(error) == 2
            _raise_as(str(error[0]) if ok else "StudentError", str(error[1]) if ok else "")
        try:
            back = json.loads(answer.get("data"))
            result, new_args, new_kwargs = (decode(back[k]) for k in ("result", "args", "kwargs"))
        except (ValueError, KeyError, TypeError) as e:
            raise StudentError(f"{name} returned data the grader cannot read: {e}") from None
        for old, new in zip(args, new_args if isinstance(new_args, list) else []):
            merge_back(old, new)
        for key, old in kwargs.items():
            if isinstance(new_kwargs, dict) and key in new_kwargs:
                merge_back(old, new_kwargs[key])
        return result


# ---------------------------------------------------------------- jobs on real ranks, launched by the grader
LAUNCH_MARK = "@@par-grader-launch@@"


class _Shim:
    """A stand-in for a module in a check's namespace: the real module's attributes, some replaced."""

    def __init__(self, real, **replaced):
        self._real, self._replaced = real, replaced

    def __getattr__(self, name):
        return self._replaced[name] if name in self._replaced else getattr(self._real, name)


def sandboxed_launch(box: sandbox.Sandbox, env: dict | None, session: "Session"):
    """`par.runtime.launch.run` as a check in the grader calls it: the job starts in a sandbox of its own (the
    submission's folder, not its kernel), from the grader; its result comes back as data on the launcher's
    stdout. Replacing `par.runtime.launch` in the student's kernel changes nothing here."""
    def run(module: str, nproc: int = 2, args=(), timeout: float = 300.0, backend: str = "auto",
            env_: dict | None = None, quiet: bool = False, threads_per_rank: int = 1, **kw):
        from par.runtime.launch import LaunchError, _kill_tree
        spec = {"module": module, "nproc": int(nproc), "args": [str(a) for a in args], "timeout": float(timeout),
                "backend": backend, "env": {str(k): str(v) for k, v in (kw.get("env") or env_ or {}).items()},
                "quiet": True, "threads_per_rank": int(threads_per_rank)}
        cmd = box.wrap([sys.executable, "-m", "par.course.checks", "launch", json.dumps(spec)])
        proc = subprocess.Popen(cmd, cwd=box.workdir, env=box.env(env), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, text=True,
                                preexec_fn=dies_with_parent())
        with nbval_run._LOCK:
            nbval_run._RUNNING.add(proc)
        try:
            limit = min(session.cell_deadline, session.kernel.deadline, time.monotonic() + timeout + 60)
            out, _ = proc.communicate(timeout=max(1.0, limit - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill_tree(proc)
            proc.wait()
            raise (NotebookTimeout() if time.monotonic() >= session.kernel.deadline else CellTimeout()) from None
        finally:
            with nbval_run._LOCK:
                nbval_run._RUNNING.discard(proc)
            if proc.poll() is None:
                _kill_tree(proc)
        marked = [line[len(LAUNCH_MARK):] for line in out.splitlines() if line.startswith(LAUNCH_MARK)]
        if not marked:
            raise LaunchError(f"the job launcher ended without a result (exit code {proc.returncode}): "
                              f"{out.strip().splitlines()[-1:] or ['no output']}")
        try:
            answer = json.loads(marked[-1])
        except ValueError:
            raise LaunchError("the job launcher's result cannot be read") from None
        if "error" in answer:
            raise LaunchError(str(answer["error"]))
        return answer.get("result")
    return run


def launching_import(run):
    """An `__import__` for the checks' namespace: `par.runtime.launch` is the one whose `run` is `run`."""
    import builtins
    import par
    import par.runtime
    import par.runtime.launch as real
    launch = _Shim(real, run=run)
    runtime = _Shim(par.runtime, launch=launch)
    top = _Shim(par, runtime=runtime)

    def imp(name, globals=None, locals=None, fromlist=(), level=0):
        module = builtins.__import__(name, globals, locals, fromlist, level)
        if level == 0 and name in ("par.runtime.launch", "par.runtime", "par"):
            if not fromlist:
                return top
            return {"par.runtime.launch": launch, "par.runtime": runtime, "par": top}[name]
        return module
    return imp


def _launch_main(spec_text: str) -> int:
    """`python -m par.course.checks launch SPEC`: inside a sandbox, launch the job; print its result as data."""
    from par.runtime.launch import LaunchError, run
    spec = json.loads(spec_text)
    try:
        answer = {"result": run(**spec)}
    except LaunchError as e:
        answer = {"error": str(e)}
    except Exception as e:  # a preflight error, a bad spec: the check fails with it
        answer = {"error": f"{type(e).__name__}: {e}"}
    sys.stdout.write("\n" + LAUNCH_MARK + json.dumps(answer) + "\n")
    sys.stdout.flush()
    return 0


# ---------------------------------------------------------------- one notebook
def student_names(reference) -> set[str]:
    """The names the answer cells of the reference define: in checks, they stand for the student's functions."""
    from par.course.exercises import defined_names, is_answer
    return {n for c in reference.cells if is_answer(c) for n in defined_names(c.source) if isinstance(n, str)}


def _error_of(e: BaseException, source_name: str) -> tuple[str, str]:
    """(one line, traceback lines in the check only: no source text, which may be hidden) of a check's error."""
    line = f"{type(e).__name__}: {e}" if not isinstance(e, StudentError) else str(e)
    if type(e).__name__ == "LaunchError":      # a rank's root cause, as nbval_run reports it
        line = nbval_run.summary(str(e))[0] or line
    frames = [f for f in tb_module.extract_tb(e.__traceback__) if f.filename == source_name]
    where = "".join(f"  check line {f.lineno}\n" for f in frames[-3:])
    return " ".join(line.split())[:300], where.rstrip()


def run(assembled, reference, *, timeout: float, cell_timeout: float, env: dict | None = None,
        package: Path | None = None, sandboxed: bool | None = None) -> tuple[Run, list[str]]:
    """Run the assembled notebook (see the module docstring): (what happened to every cell, notes)."""
    start = time.monotonic()
    deadline = start + timeout
    result, notes = Run(), []
    workdir = sandbox.temporary_workdir()
    box = sandbox.Sandbox.create(workdir, package, cpu_seconds=timeout, sandboxed=sandboxed)
    if not box.sandboxed:
        notes.append("unsandboxed (no bwrap here): the submission ran as the grader's user")
    kernel = None
    try:
        try:
            kernel = Kernel(box, env, deadline)
            setup = kernel.execute(KERNEL_HELPER, deadline)
            if setup.status != "ok":
                raise KernelDied(f"the grader's helper failed in the kernel: {setup.error_line()}")
            kernel.open_channel()
        except KernelDied as e:
            result.exit_code, result.output = 4, str(e) or "the kernel did not start"
            return result, notes
        session = Session(kernel)
        outputs: list[str] = []
        import builtins
        namespace = {"__name__": "__main__", "print": lambda *a, **k: print(*a, **{**k, "file": _Sink(outputs)}),
                     "__builtins__": {**builtins.__dict__,
                                      "__import__": launching_import(sandboxed_launch(box, env, session))}}
        for name in student_names(reference):
            namespace[name] = Proxy(session, name)
        for i, (role, cid) in enumerate(assembled.roles):
            cell = assembled.notebook.cells[i]
            res = result.cells[i] = CellResult(ran=True)
            result.running = i
            t0 = time.monotonic()
            session.cell_deadline = min(deadline, t0 + cell_timeout)
            try:
                if role == "check" and cell.metadata.get("judge") != "kernel":
                    name = f"<check {cid}>"
                    try:
                        exec(compile(cell.source, name, "exec"), namespace)  # noqa: S102  (the instructor's check)
                        res.passed = True
                    except (KernelDied, NotebookTimeout, CellTimeout):
                        raise
                    except Exception as e:  # the check failed: an assert, or the student's function raised
                        res.error, res.traceback = _error_of(e, name)
                elif role == "check":
                    token = secrets.token_hex(16)
                    reply = kernel.execute(cell.source + f"\n__import__('sys').stdout.write('\\n{token}\\n')\n",
                                           session.cell_deadline)
                    res.passed = reply.status == "ok" and f"\n{token}\n" in reply.text
                    if reply.status != "ok":
                        res.error, res.traceback = _kernel_error(reply)
                    elif not res.passed:
                        res.error = "the check did not run to its end (its end-of-check token is missing)"
                else:
                    reply = kernel.execute(cell.source, session.cell_deadline)
                    if reply.status != "ok":
                        res.error, res.traceback = _kernel_error(reply)
                    res.passed = reply.status == "ok"
                    if role == "setup" and not str(cid).startswith("demo"):   # demos: nothing a check uses
                        try:
                            exec(compile(cell.source, f"<setup {cid}>", "exec"), namespace)  # noqa: S102
                        except (KernelDied, NotebookTimeout, CellTimeout):
                            raise
                        except Exception as e:
                            notes.append(f"setup cell {cid} failed in the grader: {type(e).__name__}: {e}")
            except CellTimeout:
                res.passed, res.timed_out = False, True
                res.error = f"Timeout of {cell_timeout:g} seconds exceeded while executing cell"
            except NotebookTimeout:
                res.passed, result.timed_out = False, True
                res.error = "the notebook ran past its time limit"
                return result, notes
            except KernelDied:
                res.passed, result.kernel_died = False, i
                res.error = "the kernel died"
                return result, notes
            finally:
                res.seconds = time.monotonic() - t0
        result.running = None
        return result, notes
    finally:
        if kernel is not None:
            kernel.close()
        result.seconds = time.monotonic() - start
        sandbox.remove(workdir)


def _kernel_error(reply: Reply) -> tuple[str, str]:
    """(one line, the traceback's last lines) of a cell that failed in the kernel (a launched rank's root cause
    first, as nbval_run reports it)."""
    line, lines = nbval_run.summary(reply.traceback) if reply.traceback else ("", "")
    return line or reply.error_line() or "error", lines


class _Sink(io.TextIOBase):
    def __init__(self, out: list):
        self.out = out

    def write(self, s):
        if sum(map(len, self.out)) < MAX_OUTPUT:
            self.out.append(s)
        return len(s)


if __name__ == "__main__":
    if sys.argv[1:2] == ["launch"]:
        raise SystemExit(_launch_main(sys.argv[2]))
    print(__doc__)
