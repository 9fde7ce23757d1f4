"""Exercise 08's check on real ranks: the student's causal ring attention against SDPA, judged by the grader.

    par.runtime.launch.run("par.course.grading.exercise_ring_attention", nproc=3,
                   args=["--answer", "my_ring_attention.py"], env={"PAR_NCCL_EMULATION": "1"})

For each case the grader draws q, k, v of shape (B, h, N·t, d) (shapes and values random per run; one case
with scores large enough that exp overflows without the max subtracted) and computes
`scaled_dot_product_attention(q, k, v, is_causal=True)` before any rank starts. Rank r gets tokens
r·t … (r+1)·t − 1 of each (the contiguous layout), loads the student's module and calls
`ring_attention(q_r, k_r, v_r)`, while torch's and par's collectives raise (`par.course.grading.answers`:
by name, on the process group objects, in torch's dispatcher): only sends and receives. Around each call the
rank records, outside the student's module,

    sent    bytes handed to the process group's `send` (every isend, send and batch_isend_irecv goes through
            it), per destination rank: the ring sends 2·(N−1)·|K_r| bytes, all to one neighbour
    flops   the matmul FLOPs of the call (`torch.utils.flop_counter.FlopCounterMode`): with blocks above the
            diagonal skipped, rank r scores r + 1 blocks, at most (r + 1)·4·B·h·t²·d

`verify` compares every rank's output with its rows of SDPA's: in the grader's own process when the grader
launched the job (`--io`, `par.course.grading.rank_io`), on rank 0 otherwise. The counts are what the ranks
report: like every count of a real-rank exercise, a student who hunts down the counters in their own process
can change them; the outputs are judged by the grader alone.

Result: world_size, backend, and
    cases  [{name, max_error (largest |yours − SDPA| over the ranks, inf for NaN or a missing output),
            tolerance (the largest max_error that passes: TOLERANCE),
            sent_ratio [per rank: bytes sent / 2(N−1)·|K_r|, None when not reported],
            off_ring [per rank: bytes sent to a rank that is not a neighbour],
            flops_ratio [per rank: matmul FLOPs / (r + 1) blocks' worth, None when not reported]}]
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from par.course.grading import answers, rank_io
from par.cp.ring_attention import ring_attention_bytes
from par.runtime.job_args import JobArgs, arg

WHY = "the exercise asks for a ring of sends and receives"
FORBIDDEN, P2P_ONLY = answers.COLLECTIVES, True    # only sends and receives (rank_io.guarded)
CASES = ("small", "wide", "one_token", "large_scores")
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
    """Within the block, the bytes every `send` of a process group or backend object hands over, per
    destination rank (yields the dict; the sends still happen)."""
    from torch._C import _distributed_c10d as c10d
    sent: dict[int, int] = {}
    saved = []

    def make(original):
        def send(self, tensors, dst, *args, **kwargs):
            sent[int(dst)] = sent.get(int(dst), 0) + sum(t.numel() * t.element_size() for t in tensors)
            return original(self, tensors, dst, *args, **kwargs)
        send.__name__ = "send"
        return send
    try:
        for cls in (c10d.ProcessGroup, c10d.Backend):
            original = cls.__dict__.get("send")
            if original is not None:
                saved.append((cls, original))
                cls.send = make(original)
        yield sent
    finally:
        for cls, original in reversed(saved):
            cls.send = original


def run_rank(module, inputs: dict, rank: int, device, wire: dict) -> dict:
    from torch.utils.flop_counter import FlopCounterMode
    out, sent, flops = {}, {}, {}
    for name in CASES:
        q, k, v = (inputs[name][x].to(device) for x in "qkv")
        with bytes_sent() as to, FlopCounterMode(display=False) as counter:
            got = module.ring_attention(q, k, v)
        out[name] = got if isinstance(got, torch.Tensor) else None
        sent[name] = {int(p): int(b) for p, b in to.items()}
        flops[name] = int(counter.get_total_flops())
    return {"out": out, "sent": sent, "flops": flops}


def _number(outputs: dict | None, key: str, name: str):
    """outputs[key][name] when it is a plain int, else None (a rank that reported nothing readable)."""
    value = outputs.get(key) if outputs is not None else None
    value = value.get(name) if type(value) is dict else None
    return value if type(value) is int else None


def _sent(outputs: dict | None, name: str) -> dict | None:
    value = outputs.get("sent") if outputs is not None else None
    value = value.get(name) if type(value) is dict else None
    if type(value) is not dict or not all(type(p) is int and type(b) is int for p, b in value.items()):
        return None
    return value


def verify(args: Args, context: dict, outputs: list) -> dict:
    """The result, from SDPA's rows and what every rank returned and reported (None: a rank that produced nothing)."""
    n, cases = len(outputs), []
    for name in CASES:
        want = context[name]
        worst, ratios, off_ring, flops = 0.0, [], [], []
        for r, out in enumerate(outputs):
            got = out.get("out") if out is not None else None
            got = rank_io.tensor(got if type(got) is dict else None, name)
            worst = max(worst, rank_io.error(got, want["want"][r]))
            sent = _sent(out, name)
            ratios.append(None if sent is None else sum(sent.values()) / want["bytes"][r] if want["bytes"][r]
                          else float(sum(sent.values())))
            off_ring.append(sent is not None and any(b and p not in ((r + 1) % n, (r - 1) % n)
                                                     for p, b in sent.items()))
            f = _number(out, "flops", name)
            flops.append(None if f is None else f / want["flops"][r])
        cases.append({"name": name, "max_error": worst, "tolerance": TOLERANCE[name], "sent_ratio": ratios,
                      "off_ring": off_ring,
                      "flops_ratio": flops})
    return {"cases": cases}


if __name__ == "__main__":
    raise SystemExit(rank_io.main(sys.modules[__name__]))
