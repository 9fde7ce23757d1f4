"""Exercise 08's check on real ranks: the student's causal ring attention against SDPA, judged by the grader.

    par.runtime.launch.run("par.course.grading.exercise_ring_attention", nproc=3,
                   args=["--answer", "my_ring_attention.py"], env={"PAR_NCCL_EMULATION": "1"})

For each case the grader draws q, k, v of shape (B, h, N·t, d) (shapes and values random per run; one case
with scores large enough that exp overflows without the max subtracted) and computes
`scaled_dot_product_attention(q, k, v, is_causal=True)` before any rank starts. Rank r gets tokens
r·t … (r+1)·t − 1 of each (the contiguous layout), loads the student's module and calls
`ring_attention(q_r, k_r, v_r)`, while torch's and par's collectives raise (`par.course.grading.guards`:
by name, on the process group objects, in torch's dispatcher): only sends and receives. Around each call the
rank records, each record sent to the grader the moment it is made (`par.course.grading.ledger`), so that nothing
the student's code does afterwards changes it:

    CASE c              case c (of CASES) starts: the records until the next CASE are its
    SENT p, b           b bytes handed to the process group's `send` for rank p (every isend, send and
                        batch_isend_irecv goes through it): the ring sends 2·(N−1)·|K_r| bytes, all to one neighbour
    FLOPS counter, f    the matmul FLOPs of the call, by two counters: MODES, torch's FlopCounterMode (a Python
                        dispatch mode, which `_disable_current_modes()` switches off), and PROFILER, torch's profiler
                        (`matmul_flops`: the aten matmul and attention ops it records on every thread of the rank,
                        with their input shapes, below Python's modes). A profiler the student's code stopped makes
                        the grader's end of it fail: no PROFILER record. The count judged is the larger of the two;
                        with blocks above the diagonal skipped, rank r scores r + 1 blocks, at most
                        (r + 1)·4·B·h·t²·d

`verify` compares every rank's output with its rows of SDPA's, and reads the counts from the records: in the
grader's own process when the grader launched the job (`--io`, `par.course.grading.rank_io`), on rank 0
otherwise. Like every count of a real-rank exercise, a count the student's code can reach is not proof: it could
send records of its own (only add them, so a count judged by its largest record or its sum only grows), or keep
matmuls from both counters (with torch's record functions switched off as well, or scores computed without a
matmul); the outputs are judged by the grader alone.

Result: world_size, backend, and
    cases  [{name, max_error (largest |yours − SDPA| over the ranks, inf for NaN or a missing output),
            tolerance (the largest max_error that passes: TOLERANCE),
            sent_ratio [per rank: bytes sent / 2(N−1)·|K_r|, None when not recorded],
            off_ring [per rank: bytes sent to a rank that is not a neighbour],
            flops_ratio [per rank: matmul FLOPs (the larger count) / (r + 1) blocks' worth, None when either
                         counter recorded nothing]}]
"""
from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch._C._profiler import _ExperimentalConfig
from torch.autograd import (ProfilerActivity, ProfilerConfig, ProfilerState, _disable_profiler, _enable_profiler,
                            _prepare_profiler)

from par.course.grading import guards, ledger, rank_io
from par.course.grading.exercise import Exercise
from par.cp.ring_attention import ring_attention_bytes
from par.runtime.job_args import JobArgs, arg

EXERCISE = Exercise(
    "08_online_softmax", runner=__name__,
    why="the exercise asks for a ring of sends and receives",
    forbidden=guards.COLLECTIVES,
    p2p_only=True,
    stubs=[("par.cp.ring_attention", n) for n in (
           "ring_attention", "_RingAttention.forward", "_RingAttention._forward", "_RingAttention.backward",
           "_RingAttention._backward", "_pass_on", "flash_attention", "_FlashAttention.forward")])
CASES = ("small", "wide", "one_token", "large_scores")
CASE, SENT, FLOPS = range(3)           # the kinds of the records
MODES, PROFILER = range(2)             # the FLOP counters
# the largest |yours - SDPA| that passes. large_scores: scores of a few hundred carry float32 rounding of ~2e-5
# each, so a correct ring that orders its sums differently from SDPA is off by ~1e-5 (1.17e-5 measured for one
# that scores every block); an overflow still gives inf
TOLERANCE = {"small": 1e-5, "wide": 1e-5, "one_token": 1e-5, "large_scores": 1e-4}


@dataclass(frozen=True)
class Args(JobArgs):
    answer: str = arg("my_ring_attention.py", "the student's module file")
    io: str = arg("", "the grader's folder of inputs and outputs (par.course.grading.rank_io); none: rank 0 verifies")


def shape(name: str, g: torch.Generator) -> tuple[int, int, int, int]:
    """(B, h, t, d) of a case: t tokens per rank, drawn per run."""
    pick = lambda lo, hi: int(torch.randint(lo, hi + 1, (), generator=g))
    if name == "one_token":
        return 1, 2, 1, pick(4, 8)
    if name == "wide":
        return 2, 3, pick(4, 6), 8
    return 1, 2, pick(2, 5), 4


def make_inputs(args: Args, n: int, seed: int):
    """(each rank's q, k, v per case, what verify needs: each rank's rows of SDPA's output and the formulas)."""
    g = torch.Generator().manual_seed(seed)
    inputs, context = [{} for _ in range(n)], {}
    for name in CASES:
        b, h, t, d = shape(name, g)
        q, k, v = (torch.randn(b, h, n * t, d, generator=g) for _ in range(3))
        if name == "large_scores":               # scores of a few hundred: exp overflows float32 without the max
            q = q * 60
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        for r in range(n):
            rows = slice(r * t, (r + 1) * t)
            inputs[r][name] = {"q": q[..., rows, :].clone(), "k": k[..., rows, :].clone(),
                               "v": v[..., rows, :].clone()}
        context[name] = {"want": [want[..., r * t:(r + 1) * t, :].clone() for r in range(n)],
                         "bytes": [ring_attention_bytes([t] * n, r, b, h * d)["forward"] for r in range(n)],
                         "flops": [(r + 1) * 4 * b * h * t * t * d for r in range(n)]}
    return inputs, context


@contextmanager
def bytes_sent():
    """Within the block, the bytes every `send` of a process group or backend object hands over are recorded
    (SENT destination, bytes; the sends still happen)."""
    from torch._C import _distributed_c10d as c10d
    saved = []

    def make(original):
        def send(self, tensors, dst, *args, **kwargs):
            ledger.record(SENT, int(dst), sum(t.numel() * t.element_size() for t in tensors))
            return original(self, tensors, dst, *args, **kwargs)
        send.__name__ = "send"
        return send
    try:
        for cls in (c10d.ProcessGroup, c10d.Backend):
            original = cls.__dict__.get("send")
            if original is not None:
                saved.append((cls, original))
                cls.send = make(original)
        yield
    finally:
        for cls, original in reversed(saved):
            cls.send = original


# ---------------------------------------------------------------- the FLOPs torch's profiler sees
# the aten ops whose FLOPs are counted: op -> the index of its first matrix among its inputs
MM = {"aten::mm": 0, "aten::addmm": 1}                                   # (m, k) @ (k, n)
BMM = {"aten::bmm": 0, "aten::baddbmm": 1, "aten::addbmm": 1}            # (b, m, k) @ (b, k, n)
MV = {"aten::mv": 0, "aten::addmv": 1, "aten::dot": 0, "aten::vdot": 0}  # (m, k) @ (k,), (k,) · (k,)
ATTENTION = {f"aten::{name}": 0 for name in (                            # q, k, v: (..., s, d)
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable")}
MATMULS = {**MM, **BMM, **MV, **ATTENTION}


def op_flops(name: str, shapes: list) -> int:
    """The FLOPs of one op of MATMULS from its inputs' shapes, as FlopCounterMode counts them (2 per multiply-add;
    attention: q·kᵀ and the scores times v, every (query, key) pair); 0 when the shapes are not a matmul's."""
    first = MATMULS[name]
    a, b, *more = shapes[first:first + 3] + [[], [], []]
    if name in MM and len(a) == 2 and len(b) == 2:
        return 2 * a[0] * a[1] * b[1]
    if name in BMM and len(a) == 3 and len(b) == 3:
        return 2 * a[0] * a[1] * a[2] * b[2]
    if name in MV and a:
        return 2 * (a[0] * a[1] if len(a) == 2 else a[0])
    v = more[0]
    if name in ATTENTION and len(a) >= 2 and len(b) >= 2 and v:
        batch = 1
        for size in a[:-2]:
            batch *= size
        return 2 * batch * a[-2] * b[-2] * (a[-1] + v[-1])
    return 0


def matmul_flops(events) -> int:
    """The FLOPs of the matmul and attention ops (MATMULS) among the profiler's `events`, each counted once: an op
    inside another counted op of its thread (matmul's bmm under a dispatch mode that calls it again, an attention
    kernel under its wrapper) is part of the outer one."""
    total, ends = 0, {}
    ops = sorted((e for e in events if e.name() in MATMULS),
                 key=lambda e: (e.start_thread_id(), e.start_ns(), -e.end_ns()))
    for e in ops:
        thread = e.start_thread_id()
        if e.start_ns() < ends.get(thread, -1):
            continue
        ends[thread] = e.end_ns()
        total += op_flops(e.name(), [list(shape) for shape in e.shapes()])
    return total


# bound before any student module is imported (rank_io.main imports this module first)
PROFILER_CALLS = (_prepare_profiler, _enable_profiler, _disable_profiler, time.time_ns)


@contextmanager
def profiled():
    """Within the block, torch's profiler records every aten op of every thread of this process, with the
    shapes of its inputs; yields a list that holds, after the block, the FLOPs of its matmuls (`matmul_flops`).
    It stays empty when the profiler could not be started, or when the session running at the end is not the one
    started here (the student's code stopped it, or stopped it and started its own: the session's start time
    says so)."""
    prepare, enable, disable, now = PROFILER_CALLS
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")        # kineto's start and stop lines: none on the rank's stderr
    config = ProfilerConfig(ProfilerState.KINETO, True, False, False, False, False,
                            _ExperimentalConfig(profile_all_threads=True))
    activities, flops = {ProfilerActivity.CPU}, []
    started = now()
    try:
        prepare(config, activities)
        enable(config, activities)
    except RuntimeError:
        yield flops
        return
    ready = now()
    try:
        yield flops
    finally:
        try:
            result = disable()
        except RuntimeError:
            result = None
        if result is not None and started <= result.trace_start_ns() <= ready:
            flops.append(matmul_flops(result.events()))


def run_rank(module, inputs: dict, rank: int, device, wire: dict) -> dict:
    from torch.utils.flop_counter import FlopCounterMode
    out = {}
    for c, name in enumerate(CASES):
        ledger.record(CASE, c)
        q, k, v = (inputs[name][x].to(device) for x in "qkv")
        with bytes_sent(), profiled() as seen, FlopCounterMode(display=False) as counter:
            got = module.ring_attention(q, k, v)
        out[name] = got if isinstance(got, torch.Tensor) else None
        ledger.record(FLOPS, MODES, int(counter.get_total_flops()))
        for flops in seen:
            ledger.record(FLOPS, PROFILER, flops)
    return {"out": out}


def _counts(rows: list | None) -> tuple[dict | None, int | None]:
    """({destination: bytes sent}, the FLOPs judged) of one case's records: each destination's bytes summed, the
    larger of the two counters' FLOPs (None when either recorded nothing, or without records)."""
    if rows is None:
        return None, None
    sent, flops = {}, {}
    for kind, a, b in rows:
        if kind == SENT:
            sent[a] = sent.get(a, 0) + b
        elif kind == FLOPS:
            flops[a] = max(flops.get(a, b), b)
    return sent, max(flops.values()) if MODES in flops and PROFILER in flops else None


def verify(args: Args, context: dict, outputs: list) -> dict:
    """The result, from SDPA's rows, what every rank returned and its records (None: a rank that produced
    nothing)."""
    n, cases = len(outputs), []
    parts = [ledger.segments(out.get("ledger") if out is not None else None, CASE, len(CASES)) for out in outputs]
    for c, name in enumerate(CASES):
        want = context[name]
        worst, ratios, off_ring, flops = 0.0, [], [], []
        for r, out in enumerate(outputs):
            got = out.get("out") if out is not None else None
            got = rank_io.tensor(got if type(got) is dict else None, name)
            worst = max(worst, rank_io.error(got, want["want"][r]))
            sent, f = _counts(parts[r][c] if parts[r] is not None else None)
            ratios.append(None if sent is None else sum(sent.values()) / want["bytes"][r] if want["bytes"][r]
                          else float(sum(sent.values())))
            off_ring.append(sent is not None and any(b and p not in ((r + 1) % n, (r - 1) % n)
                                                     for p, b in sent.items()))
            flops.append(None if f is None else f / want["flops"][r])
        cases.append({"name": name, "max_error": worst, "tolerance": TOLERANCE[name], "sent_ratio": ratios,
                      "off_ring": off_ring, "flops_ratio": flops})
    return {"cases": cases}


if __name__ == "__main__":
    raise SystemExit(rank_io.main(sys.modules[__name__]))
