"""What stands in the grader's namespace for the student's code: the checks call these, never the kernel's objects.

    Proxy(session, "bytes_per_param")(*args)     the student's function: arguments to the kernel as data
                                                 (par.course.grading.codec), its result back as data; what it
                                                 did to its arguments stays with the kernel's copies (a check
                                                 that needs them: `compare.arguments_after`); a result that
                                                 needs autograd (09's dispatch buffer) joins the grader's
                                                 graph, its backward computed in the kernel; a planner Plan
                                                 (07) recomputed here
    sandboxed_launch(box, env, session)          `par.runtime.launch.run` in a check: the job starts from the
                                                 grader in a sandbox of its own; for the real-rank exercises
                                                 the grader draws the inputs and judges the raw outputs
                                                 (par.course.grading.rank_io), never the ranks' own result
    launching_import(run)                        the checks' `__import__`: `par.runtime.launch` is the above
"""
from __future__ import annotations

import dataclasses
import functools
import json
import secrets
import subprocess
import sys
import threading
import time

from par.course.grading import launcher, ledger, sandbox, stubs
import par.runtime.launch
from par.runtime import procs
from par.runtime.launch import LaunchError
from par.course.grading.codec import decode, encode
from par.course.grading.kernel import CellTimeout, Kernel, NotebookTimeout
from par.runtime.lifeline import dies_with_parent


class StudentError(Exception):
    """The student's function raised an exception the grader has no class for (its name and message)."""


# ---------------------------------------------------------------- the grader's end of a student function
class Proxy:
    """Stands for the student's function `name` in the grader's namespace: data in, data out."""

    def __init__(self, session: "Session", name: str):
        self.session, self.__name__ = session, name

    def __call__(self, *args, **kwargs):
        return self.session.call(self.__name__, args, kwargs)[0]

    def arguments_after(self, *args, **kwargs):
        """(result, args, kwargs) as the student's function left them: the kernel's copies, decoded here anew."""
        return self.session.call(self.__name__, args, kwargs)

    def __repr__(self):
        return f"<your function {self.__name__}, called in your kernel>"


def _raise_as(ename: str, evalue: str):
    import builtins
    kind = getattr(builtins, ename, None)
    if isinstance(kind, type) and issubclass(kind, Exception) and kind not in (SystemExit,):
        raise kind(evalue)
    raise StudentError(f"{ename}: {evalue}" if evalue else ename)


MAX_REPLY = 4 << 20      # characters of a reply the grader decodes (decoded: at most ~250 MB; 4 MB of `[[]],` 244 MB)
MAX_STRING = 1 << 16     # characters of one string in a result (a schedule's text is a few hundred)


def _longest_string(x, depth=0) -> int:
    """The length of the longest string in `x` (lists, tuples, dicts: keys too), 64 levels down."""
    if type(x) is str:
        return len(x)
    if type(x) in (list, tuple) and depth < 64:
        return max((_longest_string(v, depth + 1) for v in x), default=0)
    if type(x) is dict and depth < 64:
        return max((_longest_string(v, depth + 1) for v in (*x.keys(), *x.values())), default=0)
    return 0


def torch_tensor():
    import torch
    return torch.Tensor


def _leaves(x) -> list:
    """The tensors that require grad in `x`, in the order the kernel's helper lists them (`leaves`)."""
    if isinstance(x, torch_tensor()):
        return [x] if x.requires_grad else []
    if type(x) in (list, tuple):
        return [t for v in x for t in _leaves(v)]
    if type(x) is dict:
        return [t for v in x.values() for t in _leaves(v)]
    return []


@functools.lru_cache(maxsize=None)
def _remote():
    """The autograd Function of a student's result (made on first use: torch is imported only then)."""
    import torch

    class Remote(torch.autograd.Function):
        """The student's result in the grader's autograd graph: its backward asks the kernel for the gradients."""

        @staticmethod
        def forward(ctx, session, graph, value, *leaves):
            ctx.session, ctx.graph, ctx.leaves = session, graph, leaves
            return value.detach().clone()

        @staticmethod
        def backward(ctx, grad):
            return (None, None, None, *ctx.session.backward(ctx.graph, grad, ctx.leaves))
    return Remote


class Session:
    def __init__(self, kernel: Kernel):
        self.kernel = kernel
        self.cell_deadline = float("inf")
        self.calls = 0

    def call(self, name, args, kwargs):
        """(result, args, kwargs) of the student's function `name` called in the kernel on copies of `args`:
        what it did to them comes back as new objects, never written into the grader's."""
        payload = json.dumps(encode([list(args), dict(kwargs)]))
        answer = self.kernel.call(name, payload, self.cell_deadline)
        result, back = self._answer(name, answer)
        result = self._plans(result, args, kwargs)
        graph = back.get("graph")
        if type(graph) is int and isinstance(result, torch_tensor()):    # autograd through the student's code
            leaves = _leaves([list(args), dict(kwargs)])
            result = _remote().apply(self, graph, result, *leaves) if leaves else result
        new_args, new_kwargs = back["args"], back["kwargs"]
        return (result, new_args if type(new_args) is list else [],
                new_kwargs if type(new_kwargs) is dict else {})

    def backward(self, graph: int, grad, leaves) -> list:
        """The gradients of the student's result `graph` for the upstream `grad`, computed in the kernel."""
        answer = self.kernel.call("", json.dumps(encode(grad)), self.cell_deadline, op="backward", graph=graph)
        grads, _ = self._answer("backward", answer)
        if type(grads) is not list or len(grads) != len(leaves):
            raise StudentError("the gradients of your function cannot be read")
        out = []
        for g, leaf in zip(grads, leaves):
            if g is not None and (not isinstance(g, torch_tensor()) or g.shape != leaf.shape):
                raise StudentError("your function's gradient does not have its input's shape")
            out.append(None if g is None else g.to(leaf.dtype))
        return out

    def _plans(self, result, args, kwargs):
        """A plan the student's function named ({"__plan__": layout}), as the grader's own planner predicts it
        for the call's Workload and Hardware: the student chooses the layout, the grader computes its numbers."""
        if type(result) is dict and set(result) == {"__plan__"}:
            from par.train import planner   # defers torch (the planner) to a check that asks for a plan
            given = [*args, *kwargs.values()]
            w = next((a for a in given if isinstance(a, planner.Workload)), None)
            hw = next((a for a in given if isinstance(a, planner.Hardware)), planner.Hardware())
            if w is None:
                raise StudentError("a plan returned by a function that was given no Workload")
            p = result["__plan__"]
            try:
                return planner.predict(w, p["dp"], p["pp"], p["tp"], p.get("zero_stage", 0), p.get("microbatches", 1),
                                       hw, offload=bool(p.get("offload", False)), cp=p.get("cp", 1))
            except KeyError:
                raise StudentError("your plan does not name its layout") from None
        if type(result) in (list, tuple):
            return type(result)(self._plans(v, args, kwargs) for v in result)
        return result

    def _answer(self, name, answer):
        self.calls += 1
        if "error" in answer:
            error = answer["error"]
            ok = isinstance(error, list) and len(error) == 2
            _raise_as(str(error[0]) if ok else "StudentError", str(error[1]) if ok else "")
        data = answer.get("data")
        if type(data) is not str or len(data) > MAX_REPLY:
            raise StudentError(f"{name} returned more than {MAX_REPLY >> 20} MB of data (or none): the grader "
                               f"does not read it")
        try:
            back = json.loads(data)
            result, new_args, new_kwargs = (decode(back[k]) for k in ("result", "args", "kwargs"))
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise StudentError(f"{name} returned data the grader cannot read: {str(e)[:200]}") from None
        if _longest_string([result, new_args, new_kwargs]) > MAX_STRING:
            raise StudentError(f"{name} returned a string over {MAX_STRING} characters: the grader does not read it")
        return result, {"args": new_args, "kwargs": new_kwargs, "graph": back.get("graph")}


# ---------------------------------------------------------------- jobs on real ranks, launched by the grader
LAUNCH_MARK = launcher.MARK


class _Shim:
    """A stand-in for a module in a check's namespace: the real module's attributes, some replaced."""

    def __init__(self, real, **replaced):
        self._real, self._replaced = real, replaced

    def __getattr__(self, name):
        return self._replaced[name] if name in self._replaced else getattr(self._real, name)


def sandboxed_launch(box: sandbox.Sandbox, env: dict | None, session: "Session"):
    """`par.runtime.launch.run` as a check in the grader calls it: the job starts in a sandbox of its own (the
    submission's folder, not its kernel), from the grader; its result comes back as data on the launcher's
    stdout. Replacing `par.runtime.launch` in the student's kernel changes nothing here. For the real-rank
    exercises (`par.course.grading.rank_io`), whose ranks run the student's module, nothing the job says is believed:
    the grader draws the inputs, and computes the result itself from the raw outputs the ranks left in a folder
    of its own, mounted into the job's sandbox only."""
    def run(module: str, nproc: int = 2, args=(), timeout: float = 300.0, backend: str = "auto",
            env_: dict | None = None, quiet: bool = False, threads_per_rank: int = 1, **kw):
        from par.course.grading import rank_io   # defers torch (rank_io) to a launch from the student's kernel
        exercise, args = rank_io.exercise(module), [str(a) for a in args]
        job_box, io = box, None
        if exercise is not None:
            job_args = exercise.Args.parse(args)
            inputs, context = exercise.make_inputs(job_args, int(nproc), secrets.randbits(62))
            io = sandbox.temporary_workdir("io")
            rank_io.write_inputs(io, inputs)
            args = [*args, "--io", str(io)]
            job_box = dataclasses.replace(box, binds=(*box.binds, io), overlays=stubs.overlays(
                stubs.on_the_ranks(module), box.pythonpath) if box.sandboxed else ())
        else:                       # par's own job (07's training run): the real par, no student module on it
            job_box = dataclasses.replace(box, overlays=())
        book = ledger.Ledger(io, int(nproc)) if io is not None else None
        try:
            spec = {"module": module, "nproc": int(nproc), "args": args, "timeout": float(timeout),
                    "backend": backend, "env": {str(k): str(v) for k, v in (kw.get("env") or env_ or {}).items()},
                    "quiet": True, "threads_per_rank": int(threads_per_rank)}
            answer = _launch(job_box, env, session, spec)
            records = book.close() if book is not None else None
            book = None
            if "error" in answer:
                raise LaunchError(str(answer["error"]))
            if exercise is None:
                return answer.get("result")
            try:
                outputs = rank_io.read_outputs(io, int(nproc), records)
            except rank_io.OutputRefused as e:
                raise LaunchError(str(e)) from None
            return exercise.verify(job_args, context, outputs)
        finally:
            if book is not None:
                book.close()
            if io is not None:
                sandbox.remove(io)
    return run


def _launch(box: sandbox.Sandbox, env: dict | None, session: "Session", spec: dict) -> dict:
    """Run `python -m par.course.grading.launcher SPEC` in `box`; the launcher's answer ({"result"} or {"error"})."""
    cmd = box.wrap([sys.executable, "-m", "par.course.grading.launcher", json.dumps(spec)])
    # PYTHONSAFEPATH: `-m` would put the submission's folder first on sys.path, where a `par/` the student wrote
    # would stand in for the package (Python >= 3.11; the ranks inherit it)
    proc = subprocess.Popen(cmd, cwd=box.workdir, env={**box.env(env), "PYTHONSAFEPATH": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, preexec_fn=dies_with_parent())
    cap = sandbox.ProcessCap(proc, box.sandboxed)
    procs.register(proc)
    reader = _BoundedOutput(proc.stdout)
    try:
        limit = min(session.cell_deadline, session.kernel.deadline, time.monotonic() + spec["timeout"] + 60)
        proc.wait(timeout=max(1.0, limit - time.monotonic()))
    except subprocess.TimeoutExpired:
        procs.kill_tree(proc)
        proc.wait()
        raise (NotebookTimeout() if time.monotonic() >= session.kernel.deadline else CellTimeout()) from None
    finally:
        cap.stop()
        procs.unregister(proc)
        if proc.poll() is None:
            procs.kill_tree(proc)
        reader.join()
    if cap.tripped:
        raise LaunchError(f"the job was stopped: more than {cap.limit} processes at once (a fork bomb?)")
    if reader.marked is None:
        raise LaunchError(f"the job launcher ended without a result (exit code {proc.returncode}): "
                          f"{reader.last or 'no output'}")
    try:
        answer = json.loads(reader.marked)
    except ValueError:
        raise LaunchError("the job launcher's result cannot be read") from None
    return answer if isinstance(answer, dict) else {"error": "the job launcher's result cannot be read"}


class _BoundedOutput:
    """Reads the launcher's output in a thread, keeping at most MAX_LINE bytes of a line and only what the grader
    uses: the last line marked LAUNCH_MARK (the result) and the last other line. A rank can write to the
    launcher's output too (/proc/PID/fd/1): whatever it writes costs the grader at most two lines."""

    MAX_LINE = 4 << 20          # bytes of one line kept (the result of par's own job is a few KB)

    def __init__(self, pipe):
        self.pipe, self.marked, self.last = pipe, None, ""
        self.thread = threading.Thread(target=self._read, daemon=True, name="launcher-output")
        self.thread.start()

    def _read(self) -> None:
        line, overflow = bytearray(), False
        while chunk := self.pipe.read1(1 << 16):
            while chunk:
                cut = chunk.find(b"\n")
                part, chunk = (chunk, b"") if cut < 0 else (chunk[:cut], chunk[cut + 1:])
                if len(line) + len(part) > self.MAX_LINE:
                    overflow = True
                else:
                    line += part
                if cut >= 0:
                    if not overflow:
                        self._keep(line.decode("utf-8", "replace"))
                    line, overflow = bytearray(), False
        if line and not overflow:
            self._keep(line.decode("utf-8", "replace"))

    def _keep(self, line: str) -> None:
        if line.startswith(LAUNCH_MARK):
            self.marked = line[len(LAUNCH_MARK):]
        elif line.strip():
            self.last = line.strip()[:500]

    def join(self) -> None:
        self.thread.join(10)
        self.pipe.close()


def launching_import(run):
    """An `__import__` for the checks' namespace: `par.runtime.launch` is the one whose `run` is `run`."""
    import builtins
    launch = _Shim(par.runtime.launch, run=run)
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
