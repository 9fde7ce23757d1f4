"""Lecture 00's job: every collective on a few ranks, the ring step by step, bytes counted, ring vs torch timed.

    par.runtime.launch.run("par.comm.job", nproc=4, args=["--parts", "show,trace,bytes,timing"])

Each part returns plain data (lists, dicts) that rank 0 saves as JSON:

* env:    what torchrun told every rank (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...) and par's Env;
* show:   what every rank holds before and after broadcast, all-reduce,
          reduce-scatter, all-gather and a send/recv around the ring;
* trace:  the ring all-reduce on a tensor of `--trace-numel` elements, one
          snapshot per step: which chunk each rank sent, received, and what it held;
* bytes:  bytes counted by par.comm.commlog for a ring all-reduce of several sizes,
          beside the exact count and the formula 2(N-1)/N * S;
* timing: seconds of par's ring all-reduce and of dist.all_reduce per size, in alternating turns
          (each call from the last rank's entry to the last rank's exit, see `_elapsed`): every repetition (ring_all, torch_all), the
          medians (ring_s, torch_s), the ratio ring / torch of each turn (ratios: a pair of calls run
          back to back, so load drifts hit both alike) and its median (ratio), and [q1, median, q3]
          of each (ring_q, torch_q, ratio_q); the same calls on the load-proof clock, the worst rank's
          (`_elapsed`): every repetition (ring_steady_all, torch_steady_all), [q1, median, q3] (ring_steady_q,
          torch_steady_q) and the fastest call (ring_steady_min_s, torch_steady_min_s: the one the machine's
          other work disturbed least);
* steps:  seconds of one ring step per chunk size (`--step-sizes`): a reduce-scatter step (send a chunk right,
          receive one from the left, add it) and an all-gather step (store it), the medians and [q1, median, q3],
          and on the load-proof clock the fastest (reduce_scatter_steady_min_s, all_gather_steady_min_s) and
          [q1, median, q3] (reduce_scatter_steady_q, all_gather_steady_q): what
          `par.comm.collectives.ring_time_from_steps` adds up to simulate rings of more ranks than cores.
"""
from __future__ import annotations

import os
import socket
import statistics
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

import par.runtime.dist
from par import clock
from par.comm import collectives as C, commlog
from par.measure import JobResult, sync
from par.runtime.job_args import arg, JobArgs
from par.runtime.job_work import Collectives

PARTS = ("env", "show", "trace", "bytes", "timing", "steps")
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID")


def _values(t: torch.Tensor) -> list:
    return [round(v, 4) for v in t.tolist()]


def _everyone(obj):
    """obj from every rank, as a list on rank 0 (None elsewhere)."""
    return par.runtime.dist.gather_object(obj)


def environment(env) -> list[dict]:
    """Every rank's view of the job: torchrun's variables, par's Env, host and process id."""
    mine = {"env": {k: os.environ.get(k) for k in TORCHRUN_VARS}, "host": socket.gethostname(), "pid": os.getpid(),
            "rank": env.rank, "local_rank": env.local_rank, "world_size": env.world_size,
            "backend": env.backend, "device": str(env.device)}
    return _everyone(mine)


def show_collectives(env, numel: int = 4) -> dict:
    """Before/after of each collective; rank r starts from r*10 + [1, 2, ...] so values tell who sent what."""
    dev, r, n = env.device, env.rank, env.world_size
    start = lambda: torch.arange(1, numel + 1, dtype=torch.float32, device=dev) + 10 * r  # noqa: E731
    out = {}

    t = start() if r == 0 else torch.zeros(numel, device=dev)
    before = _values(t)
    C.broadcast(t, src=0)
    out["broadcast"] = (before, _values(t))

    t = start()
    before = _values(t)
    C.all_reduce(t, op="sum")
    out["all_reduce"] = (before, _values(t))

    t = start()
    before = _values(t)
    mine = C.reduce_scatter(t, op="sum")
    out["reduce_scatter"] = (before, _values(mine))

    t = torch.zeros(numel, device=dev)
    a, b = C.chunk_bounds(numel, n)[r]
    t[a:b] = start()[a:b]
    before = _values(t)
    C.all_gather(t)
    out["all_gather"] = (before, _values(t))

    t = start()
    got = torch.zeros(numel, device=dev)
    before = _values(t)
    for work in C.send_recv(sends=[(t, (r + 1) % n)], recvs=[(got, (r - 1) % n)]):   # one group, as NCCL needs
        work.wait()
    out["send_recv"] = (before, _values(got))

    ranks = _everyone(out)
    if ranks is None:
        return {}
    return {name: {"before": [ranks[i][name][0] for i in range(n)],
                   "after": [ranks[i][name][1] for i in range(n)]} for name in out}


def trace_ring(env, numel: int) -> dict:
    """Run the real ring all-reduce and snapshot every rank's tensor after every step.

    Rank r starts with the value 2**r everywhere, so every sum names the ranks in it
    (bit r set = rank r's value was added): after reduce-scatter step k a chunk holds k+2 ranks.
    """
    t = torch.full((numel,), float(2 ** env.rank), device=env.device)
    steps = [{"phase": "start", "step": -1, "sent": None, "received": None, "held": _values(t)}]

    def on_step(phase, k, sent, received, flat):
        steps.append({"phase": phase, "step": k, "sent": sent, "received": received, "held": _values(flat)})

    C.ring_all_reduce(t, on_step=on_step)
    ranks = _everyone(steps)
    if ranks is None:
        return {}
    return {"numel": numel, "world_size": env.world_size,
            "bounds": C.chunk_bounds(numel, env.world_size), "ranks": ranks}


def count_bytes(env, sizes: list[int]) -> list[dict]:
    """Counted bytes of one ring all-reduce per size, beside the exact count and 2(N-1)/N * S."""
    rows = []
    for numel in sizes:
        t = torch.ones(numel, device=env.device)
        with commlog.capture() as log:
            C.all_reduce(t)
        rows.append({"numel": numel, "size_bytes": numel * 4, "rank": env.rank,
                     "counted": log.total_bytes("all_reduce"),
                     "exact": C.ring_all_reduce_bytes(numel, env.world_size, env.rank),
                     "formula": C.all_reduce_formula_bytes(numel * 4, env.world_size)})
    ranks = _everyone(rows)
    return [row for rank_rows in ranks for row in rank_rows] if ranks is not None else []


def one_host() -> bool:
    """Do all ranks run on this machine (so that `time.perf_counter`, a monotonic system-wide clock on
    Linux, is the same clock in every rank)?"""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "0")) == int(os.environ.get("WORLD_SIZE", "1")) \
        and sys.platform.startswith("linux")


def _elapsed(start: clock.Reading, took: clock.Elapsed, env, same_clock: bool) -> tuple[float, float]:
    """A collective's time, (wall, steady): from the moment the last rank entered it to the moment the last rank left
    it.

    The ranks leave the barrier before it at slightly different times; a rank's own end - start
    would count that skew as the collective's. With one clock on every rank (one host) the wall time is
    max(end) - max(start); across hosts, the slowest rank's own end - start. The steady time is the worst rank's
    on the load-proof clock (`par.clock`: its span less its run-queue wait, never below its CPU seconds), less
    the time it spent waiting for the last rank to enter (one host): what the collective took had every rank
    had a core of its own, except where one rank waited on another that was kept from its core (then the wait
    stays in, on the rank that waited). On a GPU the steady time is the wall time: the device's work, which the
    host's run queue does not hold up."""
    steady = took.wall if torch.device(env.device).type == "cuda" else took.steady
    if same_clock:
        t = torch.tensor([start.wall, start.wall + took.wall, start.wall + steady], dtype=torch.float64,
                         device=env.device)
    else:
        t = torch.tensor([0.0, took.wall, steady], dtype=torch.float64, device=env.device)
    with commlog.tag("timing bookkeeping"):
        C.all_reduce(t, op="max", impl="torch")
    return (t[1] - t[0]).item(), max(0.0, (t[2] - t[0]).item())


def _timed(fn, env) -> tuple[float, float]:
    """(wall, steady) seconds of one call of `fn()` on every rank, started together after a barrier (`_elapsed`)."""
    dist.barrier()
    start = clock.read()
    fn()
    sync(env.device)
    return _elapsed(start, clock.since(start), env, one_host())


def quartiles(xs: list[float]) -> list[float]:
    """[q1, median, q3] of the repetitions: the median and its spread (the interquartile range)."""
    if len(xs) < 2:
        return [xs[0]] * 3
    return statistics.quantiles(xs, n=4, method="inclusive")


def time_all_reduce(env, sizes: list[int], reps: int = 5, warmup: int = 2) -> list[dict]:
    """Times of par's ring and of dist.all_reduce for each size, alternating the two (which goes
    first alternates too), on the wall and the load-proof clock. Each row: every repetition, the medians, the
    median of the paired ratios, the fastest call on the load-proof clock."""
    rows = []
    for numel in sizes:
        t = torch.randn(numel, device=env.device)
        times = {"ring": [], "torch": []}
        steady = {"ring": [], "torch": []}
        for i in range(warmup + reps):
            for impl in (("ring", "torch") if i % 2 == 0 else ("torch", "ring")):
                wall, load_proof = _timed(lambda: C.all_reduce(t, impl=impl), env)
                if i >= warmup:
                    times[impl].append(wall)
                    steady[impl].append(load_proof)
        ring, torch_ = statistics.median(times["ring"]), statistics.median(times["torch"])
        paired = [a / b for a, b in zip(times["ring"], times["torch"])]
        rows.append({"numel": numel, "ring_s": ring, "torch_s": torch_, "ratio": statistics.median(paired),
                     "ratios": paired, "ring_all": times["ring"], "torch_all": times["torch"],
                     "ring_q": quartiles(times["ring"]), "torch_q": quartiles(times["torch"]),
                     "ratio_q": quartiles(paired),
                     "ring_steady_all": steady["ring"], "torch_steady_all": steady["torch"],
                     "ring_steady_q": quartiles(steady["ring"]), "torch_steady_q": quartiles(steady["torch"]),
                     "ring_steady_min_s": min(steady["ring"]), "torch_steady_min_s": min(steady["torch"])})
        par.runtime.dist.print0(f"  {numel:>10,} floats  ring {ring * 1e3:8.2f} ms  torch {torch_ * 1e3:8.2f} ms  "
                                f"ratio {rows[-1]['ratio']:.2f}  (steady, fastest: ring "
                                f"{min(steady['ring']) * 1e3:.2f} ms, torch {min(steady['torch']) * 1e3:.2f} ms)")
    return rows


def time_ring_steps(env, sizes: list[int], reps: int = 5, warmup: int = 2) -> list[dict]:
    """One reduce-scatter step and one all-gather step of the ring (`_ring_reduce_scatter`'s and
    `_ring_all_gather`'s loop bodies) per chunk size, timed like `time_all_reduce`."""
    me, n, right, left = C.ring_neighbours()
    rows = []
    for numel in sizes:
        send, acc, buf = (torch.randn(numel, device=env.device) for _ in range(3))
        times = {"reduce_scatter": [], "all_gather": []}
        steady = {"reduce_scatter": [], "all_gather": []}
        for i in range(warmup + reps):
            for phase in times:
                piece = C.PIECE if phase == "reduce_scatter" else max(numel, 1)

                def step():
                    for a, b in C.exchange(send, right, buf, left, None, piece):
                        if phase == "reduce_scatter":
                            acc[a:b].add_(buf[a:b])

                wall, load_proof = _timed(step, env)
                if i >= warmup:
                    times[phase].append(wall)
                    steady[phase].append(load_proof)
        rows.append({"numel": numel, **{f"{k}_s": statistics.median(v) for k, v in times.items()},
                     **{f"{k}_q": quartiles(v) for k, v in times.items()},
                     **{f"{k}_steady_min_s": min(v) for k, v in steady.items()},
                     **{f"{k}_steady_q": quartiles(v) for k, v in steady.items()}})
    return rows


@dataclass(frozen=True)
class Args(JobArgs):
    parts: tuple[str, ...] = arg(PARTS, f"comma-separated subset of {PARTS}")
    show_numel: int = arg(4)
    trace_numel: int = arg(0, "default: 2 elements per rank")
    bytes_sizes: tuple[int, ...] = arg((1, 5, 7, 1001, 4096, 65536), "element counts whose bytes are counted")
    sizes: tuple[int, ...] = arg((1024, 65536, 1048576), "element counts timed", minimum=1)
    step_sizes: tuple[int, ...] = arg((256, 16384), "chunk sizes (elements) of the timed ring steps", minimum=1)
    reps: int = arg(5, minimum=1)
    warmup: int = arg(2)


@dataclass(frozen=True, kw_only=True)
class Result(JobResult):
    """What rank 0 saves: one entry per part the launch ran (the module's docstring says what each holds)."""
    env: list | None = None          # per rank: torchrun's variables and par's Env
    show: dict | None = None         # per collective: every rank's tensor before and after
    trace: dict | None = None        # the ring all-reduce step by step
    bytes: list | None = None        # per size and rank: counted, exact, formula
    timing: list | None = None       # per size: ring vs torch seconds, ratios, quartiles
    steps: list | None = None        # per chunk size: one reduce-scatter and all-gather step's seconds

def work(args: Args, nproc: int) -> list:
    """What a launch of these arguments computes (the course's dry run costs it): the counted sizes and the
    timed ones, `warmup + reps` times each (ring and torch)."""
    counted = args.bytes_sizes if "bytes" in args.parts else ()
    return [Collectives((*counted, *(args.sizes if "timing" in args.parts else ())), args.reps + args.warmup)]


def main(argv=None) -> None:
    args = Args.parse(argv)
    env = par.runtime.dist.init()
    parts = args.parts
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise SystemExit(f"unknown part(s) {sorted(unknown)}: choose from {PARTS}")
    result = {"world_size": env.world_size, "backend": env.backend}
    if "env" in parts:
        result["env"] = environment(env)
    if "show" in parts:
        result["show"] = show_collectives(env, args.show_numel)
    if "trace" in parts:
        result["trace"] = trace_ring(env, args.trace_numel or 2 * env.world_size)
    if "bytes" in parts:
        result["bytes"] = count_bytes(env, list(args.bytes_sizes))
    if "timing" in parts:
        result["timing"] = time_all_reduce(env, list(args.sizes), args.reps, args.warmup)
    if "steps" in parts and env.world_size > 1:
        result["steps"] = time_ring_steps(env, list(args.step_sizes), args.reps, args.warmup)
    par.runtime.dist.save_result(result)
    par.runtime.dist.teardown()


if __name__ == "__main__":
    main()
