"""Benchmark: par's data parallelism vs torch DistributedDataParallel, same model, data and world size.

    python -m par.dp.bench [--world-sizes 2,4] [--preset small] [--batch 8] [--bucket-kb 1024]

For each world size, one launch of `par.dp.bench_job` times, side by side and in rotating turns:
DDP, par's bucketed DP and naive DP with torch's all-reduce (the same transport as DDP, so the
ratio measures the bucketing/overlap machinery), and both again with par's hand-written ring.
It prints the median step time (slowest rank) and the ratio to DDP. Target: bucketed <= 1.10x DDP.
Timings on a shared machine are only as quiet as the machine: the load average is printed with them,
and a world size above the physical cores is flagged (its ranks wait for a core).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from par.runtime import dist, launch
from par.runtime.checks import check_writable, positive_float, positive_int, world_sizes


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m par bench dp", description="par data parallel vs torch DDP")
    p.add_argument("--world-sizes", type=world_sizes, default=(2, 4))
    p.add_argument("--preset", default="small")
    p.add_argument("--batch", type=positive_int, default=8, help="sequences per rank per step")
    p.add_argument("--bucket-kb", type=positive_float, default=1024)
    p.add_argument("--steps", type=positive_int, default=5)
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--variants", default="ddp,bucketed,naive,bucketed-ring,naive-ring")
    p.add_argument("--backend", default="auto")
    p.add_argument("--timeout", type=positive_float, default=600)
    p.add_argument("--json", default=None, help="also write all results to this file")
    args = p.parse_args(argv)
    if args.json:
        check_writable(args.json)
    return args


def table(results: list[dict]) -> str:
    rows = [f"{'ranks':>5}  {'variant':<14} {'median ms':>10} {'/ DDP':>7}"]
    for r in results:
        ddp = r["variants"].get("ddp", {}).get("median_s")
        for name, v in r["variants"].items():
            ratio = f"{v['median_s'] / ddp:7.2f}" if ddp else "      -"
            rows.append(f"{r['world_size']:>5}  {name:<14} {v['median_s'] * 1e3:10.1f} {ratio}")
    return "\n".join(rows)


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    results = []
    for n in args.world_sizes:
        load = os.getloadavg()[0]
        r = launch.run("par.dp.bench_job", nproc=n, backend=args.backend, timeout=args.timeout, quiet=True,
                       args=["--preset", args.preset, "--batch", args.batch, "--bucket-kb", args.bucket_kb,
                             "--steps", args.steps, "--rounds", args.rounds, "--variants", args.variants])
        r["load_before"], r["load_after"] = load, os.getloadavg()[0]
        results.append(r)
    first = results[0]
    print(f"data-parallel step time: preset {args.preset} ({first['numel']:,} parameters), {args.batch} "
          f"sequences per rank, bucket {args.bucket_kb:g} KiB, backend {first['backend']}, "
          f"{os.cpu_count()} CPU cores")
    print(table(results))
    print("load average (1 min) before/after each world size: "
          + ", ".join(f"{r['world_size']} ranks {r['load_before']:.1f}/{r['load_after']:.1f}" for r in results))
    cores = dist.physical_cores()
    for r in results:
        bucketed = r.get("ratios", {}).get("bucketed/ddp")
        if bucketed is not None:
            verdict = "meets" if bucketed <= 1.10 else "misses"
            crowded = f"; {r['world_size']} ranks on {cores} cores: oversubscribed" if r["world_size"] > cores else ""
            print(f"{r['world_size']} ranks: bucketed / DDP = {bucketed:.2f} ({verdict} the 1.10 target){crowded}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
