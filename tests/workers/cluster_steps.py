"""Steps of all-reduces across the emulated cluster, one line per step (`step k on RANK`), 0.2 s apart;
rank 0 saves what torchrun told each rank (the test powers a host off after `step 3`). argv[1]: steps."""
from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

import par.runtime.dist


def main() -> None:
    env = par.runtime.dist.init()
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    x = torch.ones(1000)
    for k in range(steps):
        dist.all_reduce(x)
        x /= env.world_size
        print(f"step {k} on rank {env.rank}", flush=True)
        time.sleep(0.2)
    seen = {v: os.environ.get(v) for v in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")}
    ranks = par.runtime.dist.gather_object(seen)
    if env.rank == 0:
        par.runtime.dist.save_result({"world_size": env.world_size, "backend": env.backend, "per_rank": ranks})
    par.runtime.dist.teardown()


if __name__ == "__main__":
    main()
