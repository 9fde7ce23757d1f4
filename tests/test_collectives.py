"""par's ring collectives equal torch.distributed, and send exactly the bytes the formulas say.

In-process: the chunk arithmetic, the ring's schedule simulated on plain Python numbers, the byte formulas.
Multi-process: one launch per world size (2, 3, 4) runs every case of tests/workers/collectives_check.py
(ring and torch front doors, sum/avg/max, sizes that do not divide, subgroups); the ranks assert
against torch.distributed and return the bytes par.comm.commlog counted, which are checked here again.
The 3-rank launch runs once more with NCCL's point-to-point semantics emulated on gloo
(`PAR_NCCL_EMULATION=1`: one Work per `batch_isend_irecv`, received data valid only after it is waited).
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
from collections import defaultdict
from pathlib import Path

import pytest
from tiers import tiered_one
import torch

from par.comm import collectives as C
from par.comm import commlog

WORKER = Path(__file__).parent / "workers" / "collectives_check.py"
_CACHE: dict = {}


def worker_module():
    spec = importlib.util.spec_from_file_location("collectives_check", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LAUNCHES = [(2, False), (3, False), (4, False), (3, True)]   # (ranks, NCCL emulation)


def run_worker(n: int, nccl: bool = False) -> dict:
    if (n, nccl) not in _CACHE:
        from par.runtime import launch
        out = launch.run(str(WORKER), nproc=n, timeout=300, quiet=True,
                         env={"PAR_NCCL_EMULATION": "1"} if nccl else None)
        assert out["world_size"] == n and len(out["ranks"]) == n
        assert all(mine["nccl_emulation"] == nccl for mine in out["ranks"]), "the emulation was (not) active"
        _CACHE[n, nccl] = out
    return _CACHE[n, nccl]


def launch_id(case) -> str:
    return f"{case[0]}ranks" + ("-nccl-emulation" if case[1] else "")


# ---------------------------------------------------------------- pure: chunks, schedule, bytes
@pytest.mark.parametrize("numel", [0, 1, 2, 5, 7, 8, 1001])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_chunk_bounds_tile_the_tensor(numel, n):
    bounds = C.chunk_bounds(numel, n)
    assert len(bounds) == n and bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(b[1] == nxt[0] for b, nxt in zip(bounds, bounds[1:]))
    sizes = [e - s for s, e in bounds]
    assert sizes == [numel // n + (1 if i < numel % n else 0) for i in range(n)]


def simulate_ring(values: list[list[float]]) -> tuple[list, list]:
    """Ring all-reduce on plain numbers with par's schedule: values[r][c] = rank r's chunk c.

    Returns (state after reduce-scatter, state after all-gather). Every rank sends at the
    same time in each step, so messages are read from the state before the step.
    """
    n = len(values)
    state = [list(v) for v in values]
    for k in range(n - 1):
        msgs = [(r, *C.reduce_scatter_chunks(r, n, k)) for r in range(n)]
        outgoing = {(r + 1) % n: (s, state[r][s]) for r, s, _ in msgs}
        for r, _, got in msgs:
            chunk, value = outgoing[r]
            assert chunk == got, f"rank {r} expects chunk {got} but its left neighbour sent {chunk}"
            state[r][got] += value
    after_rs = [list(v) for v in state]
    for k in range(n - 1):
        msgs = [(r, *C.all_gather_chunks(r, n, k)) for r in range(n)]
        outgoing = {(r + 1) % n: (s, state[r][s]) for r, s, _ in msgs}
        for r, _, got in msgs:
            chunk, value = outgoing[r]
            assert chunk == got
            state[r][got] = value
    return after_rs, state


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_ring_schedule_reduces_every_chunk(n):
    values = [[10.0 ** r * (c + 1) for c in range(n)] for r in range(n)]  # digits tell which ranks were added
    totals = [sum(values[r][c] for r in range(n)) for c in range(n)]
    after_rs, after_ag = simulate_ring(values)
    assert [after_rs[r][r] for r in range(n)] == totals, "after reduce-scatter rank r holds chunk r in full"
    assert after_ag == [totals] * n, "after all-gather every rank holds every chunk"


def exact_bytes(kind: str, numel: int, n: int, me: int, itemsize: int = 4) -> int:
    """Counted independently: reduce-scatter sends every chunk but mine; all-gather every chunk but my right's."""
    sizes = [e - s for s, e in C.chunk_bounds(numel, n)]
    rs = (numel - sizes[me]) * itemsize
    ag = (numel - sizes[(me + 1) % n]) * itemsize
    return {"reduce_scatter": rs, "all_gather": ag, "all_reduce": rs + ag}[kind] if n > 1 else 0


@pytest.mark.parametrize("numel", [1, 5, 7, 12, 1001, 4096])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_byte_formulas(numel, n):
    per_rank = [C.ring_all_reduce_bytes(numel, n, r) for r in range(n)]
    assert sum(per_rank) == 2 * (n - 1) * numel * 4, "every chunk crosses N-1 links in each phase"
    for r in range(n):
        assert C.ring_reduce_scatter_bytes(numel, n, r) == exact_bytes("reduce_scatter", numel, n, r)
        assert C.ring_all_gather_bytes(numel, n, r) == exact_bytes("all_gather", numel, n, r)
        if numel % n == 0:
            assert per_rank[r] == C.all_reduce_formula_bytes(numel * 4, n) == 2 * (n - 1) / n * numel * 4
    assert C.ring_all_reduce_bytes(numel, 1, 0) == 0


@pytest.mark.parametrize("numel,n,want", [(12, 4, 3 * 3 * 4), (13, 4, 3 * 4 * 4), (1, 3, 2 * 1 * 4), (5, 1, 0)])
def test_padded_chunk_bytes(numel, n, want):
    assert C.padded_chunk_bytes(numel, n) == want
    if numel % n == 0 and n > 1:   # equal chunks: torch's reduce-scatter moves what the ring does
        assert want == C.ring_reduce_scatter_bytes(numel, n, 0) == C.ring_all_gather_bytes(numel, n, 0)


def test_alpha_beta_time_model_and_fit():
    alpha, beta = 40e-6, 1 / 2e9   # 40 µs a step, 2 GB/s
    assert C.ring_all_reduce_time(0, 4, alpha, beta) == pytest.approx(6 * alpha)   # 2(N-1) latency steps
    assert C.ring_all_reduce_time(1e6, 2, alpha, beta) == pytest.approx(2 * alpha + 1e6 * beta)
    sizes = [256, 4096, 65536, 1 << 20, 1 << 24]
    samples = [(n, s, C.ring_all_reduce_time(s, n, alpha, beta)) for n in (2, 3, 4) for s in sizes]
    assert C.fit_alpha_beta(samples) == pytest.approx((alpha, beta), rel=1e-9)
    # noise of ±10 %, one world size: still the right magnitude
    g = torch.Generator().manual_seed(0)
    noisy = [(2, s, t * (1 + 0.1 * (2 * torch.rand(1, generator=g).item() - 1))) for _, s, t in samples[:5]]
    a, b = C.fit_alpha_beta(noisy)
    assert a == pytest.approx(alpha, rel=0.3) and b == pytest.approx(beta, rel=0.3)
    # pure latency data: beta cannot be negative, so it is 0 and alpha carries everything
    a, b = C.fit_alpha_beta([(2, 100, 1e-3), (2, 200, 0.9e-3), (2, 400, 0.8e-3)])
    assert b >= 0 and a > 0
    with pytest.raises(ValueError, match="at least 2"):
        C.fit_alpha_beta([(2, 100, 1e-3), (1, 100, 1e-3)])


def test_group_helpers_have_one_home():
    from par.dp import compression
    from par.tp import layers as tensor_parallel, ops as tp_ops
    assert tp_ops.group_size is C.group_size and tensor_parallel.group_rank is C.group_rank
    assert not hasattr(C, "_size") and not hasattr(C, "_rank")
    assert "collectives._" not in Path(compression.__file__).read_text()
    assert C.group_size() == 1 and C.group_rank() == 0   # no process group running


def test_communication_thread_runs_in_order_and_hands_errors_back():
    from par.comm import thread as comm_thread
    assert not hasattr(C, "run_async") and not hasattr(C, "Pending")   # its own module
    order, ticks = [], itertools.count()   # a thread-safe clock that only moves forward
    jobs = [comm_thread.run_async(lambda i=i: order.append(i), clock=lambda: next(ticks)) for i in range(5)]
    for p in jobs:
        assert p.wait() is p and p.submitted <= p.start <= p.end
    assert order == list(range(5))

    def boom():
        raise RuntimeError("rank 1 left")
    with pytest.raises(RuntimeError, match="rank 1 left"):
        comm_thread.run_async(boom).wait()
    t = torch.ones(3)
    assert comm_thread.all_reduce_async(t, "avg").wait() and torch.equal(t, torch.ones(3))  # one process: no-op


def test_single_process_front_doors_are_no_ops():
    t = torch.arange(5.0)
    with commlog.capture() as log:
        assert C.all_reduce(t) is t and C.all_gather(t) is t
        assert torch.equal(C.reduce_scatter(t), torch.arange(5.0))
    assert torch.equal(t, torch.arange(5.0)) and log.total_bytes() == 0


# ---------------------------------------------------------------- multi-process
@pytest.mark.parametrize("case", tiered_one(LAUNCHES, launch_id))
def test_ring_and_torch_collectives_match(case):
    n = case[0]
    out = run_worker(*case)
    module = worker_module()
    ops = len(module.OPS)
    per_group = (len(module.SIZES) + len(module.TORCH_SIZES)) * (2 * ops + 1) + len(module.TORCH_SIZES) * ops + 3
    subgroups = {2: [[0, 1]], 3: [[0, 2]], 4: [[1, 3], [0, 2, 3]]}[n]
    for rank, mine in enumerate(out["ranks"]):
        assert mine["world"]["checked"] == per_group
        assert mine["trace_steps"] == 2 * (n - 1)
        in_groups = sorted(k for k in mine if k.startswith("group"))
        assert len(in_groups) == sum(rank in g for g in subgroups), (rank, in_groups)
        for key in in_groups:
            assert mine[key]["checked"] == per_group and rank in mine[key]["members"]


def travelled_bytes(row: dict) -> int:
    """What a logged call must say it sent: the ring's exact count; for torch, the same ring for an
    all-reduce, equal padded chunks for a native reduce-scatter or an all-gather, and the whole
    all-reduce for gloo's reduce-scatter (an all-reduce that keeps one chunk)."""
    kind, numel, n, me, itemsize = row["kind"], row["numel"], row["n"], row["me"], row["itemsize"]
    if row["impl"] == "ring":
        return exact_bytes(kind, numel, n, me, itemsize)
    if kind == "all_reduce" or (kind == "reduce_scatter" and not row["native"]):
        return exact_bytes("all_reduce", numel, n, me, itemsize)
    return (n - 1) * -(-numel // n) * itemsize


@pytest.mark.parametrize("case", tiered_one(LAUNCHES, launch_id))
def test_counted_bytes_equal_formula(case):
    n = case[0]
    out = run_worker(*case)
    totals, rows = defaultdict(int), defaultdict(int)  # summed over a group's ranks, per kind of case
    kinds = set()
    for mine in out["ranks"]:
        for key, part in mine.items():
            for row in part["rows"] if isinstance(part, dict) else []:
                size_bytes = row["numel"] * row["itemsize"]
                assert row["bytes"] == travelled_bytes(row), row
                if row["kind"] == "all_reduce" and row["numel"] % row["n"] == 0:
                    assert row["bytes"] == 2 * (row["n"] - 1) / row["n"] * size_bytes
                kinds.add((row["impl"], row["kind"], row["native"]))
                if row["impl"] == "ring" or row["numel"] % row["n"] == 0 and (row["native"] or
                                                                              row["kind"] != "reduce_scatter"):
                    case = (key, row["kind"], row["impl"], row["native"], size_bytes, row["n"])
                    totals[case] += row["bytes"]
                    rows[case] += 1
    assert sum(rows.values()) > 100 * n
    assert {("torch", "reduce_scatter", True), ("torch", "reduce_scatter", False)} <= kinds
    for case, total in totals.items():
        _, kind, _, _, size_bytes, size = case
        calls, phases = rows[case] / size, (2 if kind == "all_reduce" else 1)
        assert total == calls * phases * (size - 1) * size_bytes, "every chunk crosses N-1 links per phase"


def test_bench_cli_lists_and_dispatches():
    from par import bench as cli
    from par.comm import bench as bench
    assert "collectives" in cli.available() and "cli" not in cli.available()
    with pytest.raises(argparse.ArgumentError, match="unknown benchmark 'no-such-bench': use one of .*collectives"):
        cli.main(["no-such-bench"])
    from par.comm.job import quartiles
    ring, torch_, ratios = [0.011, 0.012, 0.013], [0.010, 0.010, 0.010], [1.1, 1.2, 1.3]
    rows = [{"world_size": 2, "backend": "gloo", "numel": 1 << 20, "ring_all": ring, "torch_all": torch_,
             "ring_q": quartiles(ring), "torch_q": quartiles(torch_), "ratio_q": quartiles(ratios)},
            {"world_size": 4, "backend": "gloo", "numel": 1 << 24, "ring_all": [0.2], "torch_all": [0.2],
             "ring_q": quartiles([0.2]), "torch_q": quartiles([0.2]), "ratio_q": quartiles([1.0])}]
    text = bench.table(rows, cores=2)
    assert "1,048,576" in text and "1.20 (1.15-1.25)" in text and "12.00 (11.50-12.50)" in text
    assert "> 1.15" in text.splitlines()[1] and "1.10" in text.splitlines()[1]   # fastest: 0.011 / 0.010
    assert "oversubscribed" in text.splitlines()[2] and "> 1.15" not in text.splitlines()[2]
    assert quartiles([3.0]) == [3.0, 3.0, 3.0]
