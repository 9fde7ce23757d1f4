"""Benchmark: par's 1F1B pipeline vs torch.distributed.pipelining Schedule1F1B, same stages and micro-batches.

    python -m par bench pipeline [--world-sizes 2] [--preset small] [--microbatches 8] [--micro-batch-size 4]

For each world size, one launch of `par.pp.bench_job` times both runtimes in alternating
rounds (`--rounds`, `--steps` timed steps each) on the same GPT-lite stages (one per rank), the same
batch and the same micro-batches, and checks that their first-step gradients agree. It prints the
median step time (slowest rank) with the spread of the round medians, the ratio par / torch (the
median of the rounds' ratios, with their min-max; target <= 1.15), and the bubble: measured on an
executed par step, simulated from that step's own stage costs, and the formula (p-1)/(m+p-1).

Timings are only meaningful with a core per rank: world sizes above `par.runtime.dist.physical_cores()`
are skipped with a note (the default is every one of 2 and 4 that fits). The machine's load
average is printed with the results.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from par.runtime import dist, launch
from par.runtime.checks import check_writable, positive_float, positive_int, world_sizes

TARGET = 1.15


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m par bench pipeline", description="par 1F1B vs torch.distributed.pipelining Schedule1F1B")
    p.add_argument("--world-sizes", type=world_sizes, default=None, help="comma-separated (default: 2 and 4, those that fit the cores)")
    p.add_argument("--preset", default="small")
    p.add_argument("--microbatches", type=positive_int, default=8)
    p.add_argument("--micro-batch-size", type=positive_int, default=4)
    p.add_argument("--steps", type=positive_int, default=5)
    p.add_argument("--rounds", type=positive_int, default=4)
    p.add_argument("--backend", default="gloo")
    p.add_argument("--timeout", type=positive_float, default=600)
    p.add_argument("--json", default=None, help="also write all results to this file")
    args = p.parse_args(argv)
    if args.json:
        check_writable(args.json)
    return args


def sizes_to_time(requested: tuple[int, ...] | None, cores: int, backend: str) -> tuple[list[int], list[str]]:
    """The world sizes to time, and a note for each one skipped (more ranks than CPU cores on gloo)."""
    sizes = [2, 4] if requested is None else list(requested)
    if backend == "nccl":
        return sizes, []
    keep = [n for n in sizes if n <= cores]
    notes = [f"skipped {n} ranks: this machine has {cores} physical cores, and a rank without a core of its own "
             f"times its waiting, not its work" for n in sizes if n > cores]
    return keep, notes


def spread(xs: list[float], scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    return f"{fmt.format(min(xs) * scale)}-{fmt.format(max(xs) * scale)}"


def table(results: list[dict]) -> str:
    rows = [f"{'ranks':>5} {'par ms':>8} {'(rounds)':>13} {'torch ms':>9} {'(rounds)':>13} {'par/torch':>9} "
            f"{'(rounds)':>11}  {'grad diff':>9}  {'bubble measured':>15} {'simulated':>9} {'formula':>7}"]
    for r in results:
        rows.append(f"{r['world_size']:>5} {r['par']['median_s'] * 1e3:8.1f} {spread(r['par']['rounds'], 1e3):>13} "
                    f"{r['torch']['median_s'] * 1e3:9.1f} {spread(r['torch']['rounds'], 1e3):>13} "
                    f"{r['ratio']:9.2f} {spread(r['round_ratios'], fmt='{:.2f}'):>11}  {r['grad_diff']:9.1e}  "
                    f"{r['bubble']:15.3f} {r['bubble_simulated']:9.3f} {r['bubble_formula']:7.3f}")
    return "\n".join(rows)


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    sizes, notes = sizes_to_time(args.world_sizes, dist.physical_cores(), args.backend)
    for note in notes:
        print(note)
    if not sizes:
        raise argparse.ArgumentError(None, "no world size left to time: pass --world-sizes with at most "
                                           f"{dist.physical_cores()} ranks")
    results = []
    for n in sizes:
        load = os.getloadavg()[0]
        r = launch.run("par.pp.bench_job", nproc=n, backend=args.backend, timeout=args.timeout, quiet=True,
                       args=["--preset", args.preset, "--microbatches", args.microbatches,
                             "--micro-batch-size", args.micro_batch_size, "--steps", args.steps,
                             "--rounds", args.rounds])
        r["load_before"], r["load_after"] = load, os.getloadavg()[0]
        r.pop("spans", None)
        results.append(r)
    first = results[0]
    print(f"pipeline step time, 1F1B: preset {args.preset} ({first['numel']:,} parameters), m = {args.microbatches} "
          f"micro-batches of {args.micro_batch_size} sequences, backend {first['backend']}, "
          f"{dist.physical_cores()} physical CPU cores; median of {args.rounds} rounds x {args.steps} steps "
          f"(min-max of the round medians in brackets)")
    print(table(results))
    print("load average (1 min) before/after each world size: "
          + ", ".join(f"{r['world_size']} ranks {r['load_before']:.1f}/{r['load_after']:.1f}" for r in results))
    for r in results:
        verdict = "meets" if r["ratio"] <= TARGET else "misses"
        print(f"{r['world_size']} ranks: par / torch = {r['ratio']:.2f} ({verdict} the {TARGET} target)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
