"""A student who cheats, second round (issue 40): every trick gets exactly the points the honest part deserves.

Each file in tests/fixtures/cheats (see its README) is an answer cell that tries to score without the work; the
rest of its notebook is the solution. Each is graded in its exercise's class (`exercise_class`, tests/classroom.py:
graded once, 2 at a time, shared with the other test files); each test asserts that a submission failed exactly the
checks its trick was aimed at. A defence must not cost a right answer its points: each file in
tests/fixtures/valid_answers (another right way to answer, which a check once failed) gets full marks. The unit
tests below name the defence each trick meets, and fail when it is removed:

    mutation flowing back into the grader's objects    the Proxy returns copies; nothing is written back
    shapes not judged (an empty tensor)                 compare.close / compare.equal
    par's twins of an answer                            stubs.twins (the sandbox's par)
    collectives below Python                            guards.refused_in_dispatcher
    the wire counter replaced by the student's module   rank_io.guarded, entered before the import (fixture)
    checks that missed what they claimed               07's workload, 03's ZB-H1 rules (the fixtures)
    a huge reply, a deeply nested one                   proxies.MAX_REPLY, the decoder's depth
    hidden inputs in feedback                           checks._error_of withholds messages of hidden cases
    cleanup through a symlink                           sandbox.remove
    an iopub flood, a 256 MB reply                      kernel.MAX_MESSAGE, MAX_QUEUED, proxies.MAX_REPLY
    an answer zmq dropped, noticed at once              kernel._Probe (the same test)
    an honest answer too large to read                 codec._MAX_VALUES, counted in the kernel
    two grading threads reading par's source at once    generate.parse_python / source_of, one lock
"""
import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import nbformat
import pytest
import torch
from tiers import slow

import test_grading as tg
from classroom import fixture_files
from par.course.grading import compare, proxies, sandbox, stubs
from par.course.grading.report import format_grade
from par.course.authoring.generate import is_answer, is_check

ROOT = Path(__file__).resolve().parents[1]
SANDBOX = sandbox.available()


CHEATS_ALL = fixture_files("cheats")   # [(exercise, fixture, cell, must fail, needs the sandbox, source)]
VALID = fixture_files("valid_answers")  # the same, none of them failing


def test_every_cheat_names_real_cells():
    assert len(CHEATS_ALL) >= 15
    for name, fixture, cell, must_fail, _, _ in CHEATS_ALL:
        cells = {c.id: c for c in tg.solution(name).cells}
        assert cell in cells and is_answer(cells[cell]), f"{name}/{fixture}: {cell} is not an answer cell"
        assert must_fail and all(c in cells and is_check(cells[c]) for c in must_fail), f"{name}/{fixture}"


@slow
@pytest.mark.parametrize("name, fixture, cell, must_fail, needs_sandbox, source", CHEATS_ALL,
                         ids=[f"{c[0]}/{c[1]}" for c in CHEATS_ALL])
def test_a_cheat_gets_only_the_honest_points(exercise_class, course, name, fixture, cell, must_fail, needs_sandbox,
                                            source):
    if needs_sandbox and not SANDBOX:
        pytest.skip("the defence is the sandbox's view of par (needs bwrap)")
    g = exercise_class(name)[f"cheat__{name}__{fixture}"]
    assert g.exercise == name, g.reason
    assert sorted(g.failed_checks) == sorted(must_fail), \
        f"failed {g.failed_checks}, expected exactly {must_fail}:\n{format_grade(g, course)}"
    full = tg.full_marks(name)
    lost = sum(c.points for c in g.checks if c.id in must_fail)
    assert g.points == full - lost


def test_every_valid_answer_names_a_real_answer_cell_and_no_check():
    assert VALID
    for name, fixture, cell, must_fail, _, _ in VALID:
        cells = {c.id: c for c in tg.solution(name).cells}
        assert cell in cells and is_answer(cells[cell]) and not must_fail, f"{name}/{fixture}"


@slow
@pytest.mark.parametrize("name, fixture", [v[:2] for v in VALID], ids=[f"{v[0]}/{v[1]}" for v in VALID])
def test_a_valid_answer_gets_full_marks(exercise_class, course, name, fixture):
    g = exercise_class(name)[f"valid__{name}__{fixture}"]
    assert g.exercise == name and g.status == "ok" and g.points == g.max_points == tg.full_marks(name), \
        format_grade(g, course)


@slow
def test_feedback_never_shows_the_hidden_scenario(exercise_class, course):
    text = format_grade(exercise_class("07_layout")["cheat__07_layout__raises_with_its_arguments"], course)
    assert "scenario:" in text, "the visible checks still show the student's own message"
    assert "V100" not in text and "v100" not in text, text


# ---- the defences, one by one (no kernel) -------------------------------------------------------------------

class _Kernel:
    """A kernel stand-in: answers every call with `reply(args, kwargs)` encoded as the kernel's helper does."""

    def __init__(self, reply):
        self.reply, self.deadline = reply, float("inf")

    def call(self, name, payload, deadline, **more):
        from par.course.grading.codec import decode, encode
        args, kwargs = decode(json.loads(payload))
        result = self.reply(args, kwargs)
        if isinstance(result, str) and result.startswith("RAW:"):
            return {"data": result[4:]}
        return {"data": json.dumps({"result": encode(result), "args": encode(args), "kwargs": encode(kwargs)})}


def test_what_the_student_does_to_an_argument_never_reaches_the_graders_object():
    def zero_it(args, kwargs):
        args[0].zero_()
        args[1].clear()
        return 1
    f = proxies.Proxy(proxies.Session(_Kernel(zero_it)), "f")
    x, nbytes = torch.ones(3), [4, 4]
    assert f(x, nbytes) == 1
    assert torch.equal(x, torch.ones(3)) and nbytes == [4, 4], "the grader's objects are its own"
    result, (x_after, nbytes_after), _ = compare.arguments_after(f, x, nbytes)
    assert torch.equal(x_after, torch.zeros(3)) and nbytes_after == [], "a check can still see what it did"
    assert x_after is not x


def test_arguments_after_copies_in_the_students_own_notebook():
    state = {"scale": 8.0}

    def update(s):
        s["scale"] = 4.0
        return s
    _, (after,), _ = compare.arguments_after(update, state)
    assert after == {"scale": 4.0} and state == {"scale": 8.0}


def test_close_judges_type_shape_and_dtype_first():
    want = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(torch.empty(0, 2, 3), want), "torch.allclose broadcasts (why compare exists)"
    assert not compare.close(torch.empty(0, 2, 3), want)
    assert not compare.close(want[:1], want) and not compare.close(want.double(), want)
    assert not compare.close(want.tolist(), want) and not compare.equal(want.tolist(), want)
    assert compare.close(want * (1 + 1e-7), want) and compare.equal(want.clone(), want)   # rtol 1e-5: relative
    assert not compare.close(torch.full((2, 3), float("nan")), torch.full((2, 3), float("nan")))


def test_a_reply_too_large_or_too_deep_is_not_decoded():
    big = proxies.Proxy(proxies.Session(_Kernel(lambda a, k: "RAW:" + " " * (proxies.MAX_REPLY + 1))), "f")
    with pytest.raises(proxies.StudentError, match="more than"):
        big()
    deep = proxies.Proxy(proxies.Session(_Kernel(lambda a, k: "RAW:" + "[" * 100_000 + "]" * 100_000)), "f")
    with pytest.raises(proxies.StudentError, match="cannot read"):
        deep()
    text = proxies.Proxy(proxies.Session(_Kernel(lambda a, k: "F0 " * proxies.MAX_STRING)), "f")
    with pytest.raises(proxies.StudentError, match="string over"):
        text()


def test_an_answer_too_large_to_read_is_refused_in_the_kernel_before_it_is_encoded(monkeypatch):
    """The grader's helper in the kernel counts an answer's values first: one over _MAX_VALUES could never be read
    (each value takes 2 characters or more of the MAX_REPLY the grader decodes), so the honest student is told at
    once instead of waiting for 256 MB to be encoded and dropped."""
    import types
    import IPython
    from par.course.grading import codec
    left, limit = codec._codec["_values_left"], codec._codec["_MAX_VALUES"]
    assert 2 * limit >= proxies.MAX_REPLY
    assert left([[0]] * (limit + 1), limit) < 0 and left([[0] * 10] * (limit // 10 + 1), limit) < 0
    assert left(torch.ones(limit + 1), limit) < 0 and left({"a": (torch.ones(limit),)}, limit) < 0
    assert left([torch.ones(limit // 2), list(range(100))], limit) >= 0 and left({"x": 1.0}, limit) >= 0
    kernel = {"huge": lambda: [[0]] * 52_000_000, "fine": lambda: [torch.ones(3), {"k": (1, 2)}]}
    shell = types.SimpleNamespace(user_ns=kernel, kernel=types.SimpleNamespace(
        comm_manager=types.SimpleNamespace(register_target=lambda *a: None)))
    helper = {"get_ipython": lambda: shell}
    exec(codec.KERNEL_HELPER, helper)   # noqa: S102  (par's own helper, as the kernel runs it)
    call, empty = helper["__par_grader__"].call, json.dumps(codec.encode([[], {}]))
    monkeypatch.setattr(IPython, "get_ipython", lambda: shell)
    with pytest.raises(ValueError, match=f"holds more than {limit} values: the grader reads 4 MB"):
        call("huge", empty)
    assert codec.decode(json.loads(call("fine", empty))["result"])[1] == {"k": (1, 2)}


def test_the_twins_of_an_answer_are_stubbed_and_the_given_tools_are_not():
    def names(exercise):
        return set(stubs.answers_of(tg.solution(exercise)))
    pp = names("03_pipelines")
    assert {("par.pp.schedules", "one_f_one_b_actions"), ("par.pp.schedules", "zb_h1_actions")} <= pp
    assert ("par.pp.schedules", "from_lists") not in pp and not any(m == "par.pp.sim" for m, _ in pp)
    cp = names("08_online_softmax")
    assert {("par.cp.ring_attention", "block_scores"), ("par.cp.ring_attention", "finish")} <= cp
    plan = names("07_layout")
    assert ("par.train.planner", "predict") not in plan and ("par.train.planner", "rank_plans") in plan
    assert ("par.train.planner", "layer_params") not in plan, "predict (a tool 07 gives) needs it"


def test_collectives_are_refused_in_the_dispatcher(tmp_path):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc
    from par.course.grading import guards
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        with guards.refused_in_dispatcher("sends and receives only"):
            for call in (lambda: dist.all_reduce(torch.ones(2)),
                         lambda: dist.distributed_c10d._get_default_group().allreduce([torch.ones(2)]).wait(),
                         lambda: fc.wait_tensor(fc.all_reduce(torch.ones(2), "sum", dist.group.WORLD)),
                         lambda: dist.all_to_all_single(torch.empty(2), torch.ones(2))):
                with pytest.raises(Exception, match="sends and receives only"):
                    call()
        t = torch.ones(2)
        dist.all_reduce(t)
        assert torch.equal(t, torch.ones(2)), "torch's own kernels again after the block"
    finally:
        dist.destroy_process_group()


def test_an_error_in_a_check_with_hidden_cases_keeps_only_its_type():
    from par.course.grading import checks
    source = textwrap.dedent('''\
        cases = [1]
        assert len(cases) == 1, "a visible message"
        ### BEGIN HIDDEN CHECKS
        cases += [256]
        ### END HIDDEN CHECKS
        for c in cases:
            assert c < 100, f"the hidden case {c}"
        ''')
    for text, shown in ((source, False), (source.replace("len(cases) == 1", "len(cases) == 2"), True)):
        try:
            exec(compile(text, "<check x>", "exec"), {})
        except AssertionError as e:
            line, _ = checks._error_of(e, "<check x>", checks.hidden_from(text))
        assert ("256" in line) is False and ("a visible message" in line) is shown, line


def test_cleanup_never_changes_a_host_file_through_a_link(tmp_path):
    host = tmp_path / "host.txt"
    host.write_text("the grader's")
    host.chmod(0o600)
    work = tmp_path / "work"
    (work / "locked").mkdir(parents=True)
    (work / "locked" / "link").symlink_to(host)
    (work / "locked").chmod(0o500)
    sandbox.remove(work)
    assert not work.exists()
    assert stat.S_IMODE(host.stat().st_mode) == 0o600 and host.read_text() == "the grader's"


def test_cleanup_never_changes_the_folders_parent(tmp_path):
    """The parent of a work folder (/tmp, where the graders' folders live) keeps its mode, whatever removing the
    folder runs into: here a folder already gone, for which rmtree reports the folder itself."""
    parent = tmp_path / "tmp"
    parent.mkdir()
    parent.chmod(0o1777)
    sandbox.remove(parent / "par-grade-gone")
    (parent / "work" / "locked").mkdir(parents=True)
    (parent / "work" / "locked").chmod(0o500)
    sandbox.remove(parent / "work")
    assert not (parent / "work").exists() and stat.S_IMODE(parent.stat().st_mode) == 0o1777


# ---- the grader's memory, whatever the student sends ---------------------------------------------------------

FLOOD = '''
import threading


def bytes_per_param(precision, optimizer):
    return 4


# past the grader's helper in the kernel (the student owns it): every answer is 256 MB of JSON; decoded, it would be
# 52 million lists (the grader grew 2.9 GB on 48 MB)
__par_grader__.call = staticmethod(
    lambda name, payload: '{"result": [' + "[0]," * 52_000_000 + '0], "args": [], "kwargs": {"__dict__": []}}')


def _flood():
    import sys
    for _ in range(200):              # 200 outputs of 4 MB from a thread, while the grader runs its checks
        sys.stdout.write("y" * (4 << 20) + "\\n")
        sys.stdout.flush()


threading.Thread(target=_flood, daemon=True).start()
'''
PEAK = '''
import json, resource, sys
from pathlib import Path
from par.course.grading import grade
g = grade.grade_one(Path(sys.argv[1]), grade.load_course(), timeout=400, cell_timeout=120)
print("PEAK", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, g.points)
print("GRADE", json.dumps({"status": g.status, "errors": {c.id: c.error for c in g.checks if not c.passed}}))
'''
GRADER_BOUND = 600 << 20    # the grader's own growth for one submission, whatever it sends (kernel.MAX_QUEUED
#                             * MAX_MESSAGE per socket is 256 MB; a decoded reply ~250 MB at most)


@slow
@pytest.mark.timeout(900)
def test_the_graders_memory_stays_bounded_with_a_256_mb_reply_and_an_iopub_flood(tmp_path):
    peaks, grades = {}, {}
    for label, nb in (("control", tg.solved("01_model_state_bytes")),
                      ("flood", tg.solved("01_model_state_bytes", {"bytes-per-param": FLOOD}))):
        path = tmp_path / f"{label}_01_model_state_bytes.ipynb"
        nbformat.write(nb, path)
        out = subprocess.run([sys.executable, "-c", PEAK, str(path)], capture_output=True, text=True, cwd=ROOT,
                             timeout=600, env={**os.environ})
        line = [x for x in out.stdout.splitlines() if x.startswith("PEAK")]
        assert line, out.stdout[-2000:] + out.stderr[-2000:]
        peaks[label] = int(line[-1].split()[1])
        grades[label] = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("GRADE"))[6:])
    assert grades["control"] == {"status": "ok", "errors": {}}, grades["control"]
    flood = grades["flood"]     # each lost answer is noticed at once: no cell runs to its 120 s limit
    assert flood["status"] == "failed", flood
    assert "never reached the grader" in flood["errors"]["check-bytes-per-param"], flood
    growth = peaks["flood"] - peaks["control"]
    print(f"\ngrader peak: control {peaks['control'] >> 20} MB, flood {peaks['flood'] >> 20} MB")
    assert growth < GRADER_BOUND, f"the grader grew by {growth >> 20} MB"


@slow
def test_the_twins_stubbed_do_not_depend_on_what_the_grader_imported_before():
    """A job module's `if __name__ == "__main__": main()` runs as a script, never on import: importing the job
    (as the grader's other work does) must not make its `main`'s callees count as needed by the given tools."""
    import subprocess
    code = ("import sys; import par.pp.job, par.pp.bench_job, par.pp.vs_torch_job\n"
            "sys.path.insert(0, 'tests'); import test_grading as tg\n"
            "from par.course.grading import stubs\n"
            "print(('par.pp.schedules', 'one_f_one_b_actions') in stubs.answers_of(tg.solution('03_pipelines')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.stdout.strip().splitlines()[-1:] == ["True"], out.stdout[-1000:] + out.stderr[-2000:]


def test_two_grading_threads_read_source_without_the_ast_recursion_error():
    """CPython 3.11 keeps one recursion counter for building Python AST objects, shared by all threads: a
    thread switch in the middle (a finalizer run by the collector) made a check fail with "SystemError: AST
    constructor recursion depth mismatch" when one grading thread stubbed par's twins while another read a
    class's source (inspect parses its module). Every parse the grader does goes through one lock."""
    import inspect
    import json.decoder
    import threading
    from par.course.authoring.generate import parse_python, source_of
    classes = [json.decoder.JSONDecoder, json.decoder.JSONDecodeError]
    text, errors = inspect.getsource(json.decoder), []

    class Finalized:
        def __del__(self):
            sum(range(50))

    def garbage():
        for _ in range(200):
            g = Finalized()
            g.cycle = g

    def reads(work):
        try:
            for _ in range(100):
                work()
                garbage()
        except SystemError as e:
            errors.append(e)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=reads, args=(lambda: [source_of(c) for c in classes],)),
                   threading.Thread(target=reads, args=(lambda: parse_python(text),))]
        [t.start() for t in threads]
        [t.join() for t in threads]
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[0]
