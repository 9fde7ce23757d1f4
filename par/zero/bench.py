"""Benchmark: par ZeRO-1 vs torch ZeroRedundancyOptimizer, par ZeRO-3 vs FSDP2 `fully_shard`.

    python -m par bench zero [--worlds 2,4] [--preset small] [--batch-size 8] [--rounds 9]

One launch per world size (gloo on a CPU mesh here, NCCL when every rank has a GPU) of the job
`par.zero.bench_job`, which trains the same GPT-lite from the same seed with

* par ZeRO-1 (`par.zero.engine.Zero(stage=1)`)  vs  DDP(gradient_as_bucket_view) + ZeroRedundancyOptimizer(Adam)
* par ZeRO-3 (`par.zero.engine.Zero(stage=3)`, with and without prefetch)  vs  FSDP2: `fully_shard` on every
  `to_layers()` unit and the root (`par.zero.torch_api`)

par's collectives run both as par's hand-written ring (`ring`) and through torch.distributed
(`torch`). The engines take turns, one step each per round; a step's time is the slowest rank's.
The report gives, per row, the median step time over the rounds with its spread (min … max), and per
par row the ratio par / torch computed round by round (the two steps of a round ran back to back,
under the same load) as its median with the spread of the rounds. Memory per rank: the CUDA peak on
a GPU, the model-state bytes after backward on the CPU. Targets: time <= 1.25x, memory <= 1.0x.
World sizes above the machine's physical cores oversubscribe it: such rows are marked, their time
measures the scheduler more than the algorithm.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import par.runtime.dist
import par.runtime.launch
from par.runtime.checks import positive_float, positive_int, world_sizes

TARGET_TIME, TARGET_MEMORY = 1.25, 1.0


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m par bench zero", description="par ZeRO vs torch ZeRO-1 / FSDP2")
    p.add_argument("--worlds", type=world_sizes, default=(2, 4), help="comma-separated world sizes")
    p.add_argument("--preset", default="small")
    p.add_argument("--batch-size", type=positive_int, default=8, help="global batch (a multiple of every world size)")
    p.add_argument("--rounds", type=positive_int, default=9, help="timed steps per engine (>= 9 for a median with spread)")
    p.add_argument("--warmup", type=positive_int, default=2)
    p.add_argument("--impls", default="ring,torch", help="par collectives to try: ring, torch")
    p.add_argument("--only", default="", help="comma-separated row names (default: every row)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--timeout", type=positive_float, default=900)
    return p.parse_args(argv)


# ---------------------------------------------------------------- the report
def reference_of(name: str) -> str:
    return "torch ZeroRedundancyOptimizer" if "ZeRO-1" in name else "torch FSDP2 fully_shard"


def ratios(rows: dict) -> list[dict]:
    """par / torch for every par row against its torch counterpart (ZeRO-1 vs ZeRO-1, ZeRO-3 vs FSDP2),
    round by round: the median ratio and its min and max."""
    out = []
    for name, row in rows.items():
        ref = rows.get(reference_of(name))
        if not name.startswith("par") or ref is None:
            continue
        per_round = [a / b for a, b in zip(row["times"], ref["times"])]
        out.append({"name": name, "time_ratio": statistics.median(per_round), "time_ratio_min": min(per_round),
                    "time_ratio_max": max(per_round), "memory_ratio": row["memory"] / ref["memory"]})
    return out


def report(world: int, result: dict, cores: int) -> str:
    over = world > cores
    lines = [f"world size {world} ({result['backend']}), Ψ = {result['numel']:,}, "
             f"{len(next(iter(result['rows'].values()))['times'])} rounds"
             + (f"  [OVERSUBSCRIBED: {world} ranks on {cores} physical cores]" if over else ""),
             f"  {'':36}{'step ms (median, min … max)':>30}{'memory MB':>12}"]
    for name, row in result["rows"].items():
        t = [x * 1e3 for x in row["times"]]
        lines.append(f"  {name:36}{statistics.median(t):12.1f} ({min(t):7.1f} … {max(t):7.1f}){row['memory'] / 1e6:12.3f}")
    for r in ratios(result["rows"]):
        ok = "ok" if r["time_ratio"] <= TARGET_TIME and r["memory_ratio"] <= TARGET_MEMORY else "MISSES TARGET"
        lines.append(f"  {r['name']:36} time x{r['time_ratio']:.2f} ({r['time_ratio_min']:.2f} … "
                     f"{r['time_ratio_max']:.2f})  memory x{r['memory_ratio']:.2f}  {ok}"
                     + ("  (oversubscribed)" if over else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    cores = par.runtime.dist.physical_cores()
    print(f"par ZeRO vs torch (targets: time <= {TARGET_TIME}x, memory <= {TARGET_MEMORY}x); "
          f"timings on a shared machine are noisy")
    for world in args.worlds:
        if args.batch_size % world:
            raise argparse.ArgumentError(None, f"--batch-size {args.batch_size} is not a multiple of world size "
                                               f"{world}")
        job = ["--preset", args.preset, "--batch-size", args.batch_size, "--rounds", args.rounds,
               "--warmup", args.warmup, "--impls", args.impls, "--only", args.only]
        result = par.runtime.launch.run("par.zero.bench_job", nproc=world, args=job, timeout=args.timeout,
                                        backend=args.backend, quiet=True)
        print(report(world, result, cores), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
