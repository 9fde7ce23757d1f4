"""A tiny job whose behaviour the launcher tests choose: `ok`, `raise`, `hang` or `exit`.

ok:    every rank reports what torchrun told it; rank 0 returns the list (streams two lines, 1.5 s apart)
raise: rank 1 raises after a moment while the others wait in a collective
hang:  every rank prints its pid (argv[2] is a token the test looks for afterwards); the last rank sleeps forever, the others wait in a collective
exit:  rank 0 exits with code 3 without a traceback
"""
from __future__ import annotations

import os
import sys
import time

if sys.argv[1:2] == ["hang"]:  # before the slow imports: the test must learn our pid even on a loaded machine
    print(f"pid={os.getpid()}", flush=True)

import torch  # noqa: E402

import par.dist  # noqa: E402
from par import collectives as C  # noqa: E402

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "GROUP_RANK", "TORCHELASTIC_RUN_ID")


def main(mode: str) -> None:
    env = par.dist.init()
    if mode == "ok":
        par.dist.print0("first line")
        time.sleep(1.5)
        par.dist.print0("second line")
        mine = {"rank": env.rank, "local_rank": env.local_rank, "world_size": env.world_size,
                "backend": env.backend, "device": str(env.device), "pid": os.getpid(),
                "env": {k: os.environ.get(k) for k in TORCHRUN_VARS}}
        par.dist.save_result({"ranks": par.dist.gather_object(mine)})
    elif mode == "raise":
        if env.rank == 1:
            time.sleep(0.5)
            raise ValueError("deliberate failure on rank one (marker 4417)")
        C.all_reduce(torch.ones(8, device=env.device))
    elif mode == "hang":
        if env.rank == env.world_size - 1:
            time.sleep(10_000)
        C.all_reduce(torch.ones(8, device=env.device))
    elif mode == "exit":
        if env.rank == 0:
            sys.exit(3)
    par.dist.teardown()


if __name__ == "__main__":
    main(sys.argv[1])
