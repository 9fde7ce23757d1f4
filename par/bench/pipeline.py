"""Benchmark: par's 1F1B pipeline vs torch.distributed.pipelining Schedule1F1B, same stages and micro-batches.

    python -m par.bench.pipeline [--world-sizes 2,4] [--preset small] [--microbatches 8] [--micro-batch-size 4]

For each world size, one launch of `par.jobs.bench_pipeline` times both runtimes in alternating
rounds on the same GPT-lite stages (one per rank), the same batch and the same micro-batches, and
checks that their first-step gradients agree. It prints the median step time (slowest rank), the
ratio par / torch (target <= 1.15), and the bubble: measured on an executed par step, simulated
from that step's own stage costs, and the formula (p-1)/(m+p-1). Timings on a shared machine are
only as quiet as the machine: the load average is printed with them.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

TARGET = 1.15


def parse(argv):
    p = argparse.ArgumentParser(description="par 1F1B vs torch.distributed.pipelining Schedule1F1B")
    p.add_argument("--world-sizes", default="2,4")
    p.add_argument("--preset", default="small")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--backend", default="gloo")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", default=None, help="also write all results to this file")
    return p.parse_args(argv)


def table(results: list[dict]) -> str:
    rows = [f"{'ranks':>5} {'par ms':>9} {'torch ms':>9} {'par/torch':>9}  {'grad diff':>9}  "
            f"{'bubble measured':>15} {'simulated':>9} {'formula':>7}"]
    for r in results:
        rows.append(f"{r['world_size']:>5} {r['par']['median_s'] * 1e3:9.1f} {r['torch']['median_s'] * 1e3:9.1f} "
                    f"{r['ratio']:9.2f}  {r['grad_diff']:9.1e}  {r['bubble']:15.3f} {r['bubble_simulated']:9.3f} "
                    f"{r['bubble_formula']:7.3f}")
    return "\n".join(rows)


def main(argv=None) -> int:
    from par.launch import run
    args = parse(sys.argv[1:] if argv is None else argv)
    results = []
    for n in map(int, args.world_sizes.split(",")):
        load = os.getloadavg()[0]
        r = run("par.jobs.bench_pipeline", nproc=n, backend=args.backend, timeout=args.timeout, quiet=True,
                args=["--preset", args.preset, "--microbatches", args.microbatches,
                      "--micro-batch-size", args.micro_batch_size, "--steps", args.steps, "--rounds", args.rounds])
        r["load_before"], r["load_after"] = load, os.getloadavg()[0]
        r.pop("spans", None)
        results.append(r)
    first = results[0]
    print(f"pipeline step time, 1F1B: preset {args.preset} ({first['numel']:,} parameters), m = {args.microbatches} "
          f"micro-batches of {args.micro_batch_size} sequences, backend {first['backend']}, "
          f"{os.cpu_count()} CPU cores")
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
