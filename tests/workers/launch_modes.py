"""A tiny job whose behaviour the launcher tests choose (argv[1]); argv[2], when given, is a token the test looks for.

ok:        every rank reports what torchrun told it, its process name and its parent's; rank 0 returns the list
           (streams two lines, 1.5 s apart)
raise:     rank 1 raises after a moment while the others wait in a collective
hang:      every rank prints its pid and steps through all-reduces; at step 3 the last rank starts computing
           forever (busy), while the others finish their steps and then wait for it, forever, in teardown's barrier
kill:      every rank steps through all-reduces; at step 5 rank 1 dies by SIGKILL (no Python exception)
exit:      rank 0 exits with code 3 at once, without a traceback (as a library calling exit() in C would)
once:      the first try (TORCHELASTIC_RESTART_COUNT=0): rank 1 raises; a restarted try: rank 0 returns the try's count
"""
from __future__ import annotations

import os
import signal
import sys
import time

if sys.argv[1:2] in (["hang"], ["kill"]):  # before the slow imports: tests learn our pid early
    print(f"pid={os.getpid()}", flush=True)

import torch  # noqa: E402

import par.runtime.dist  # noqa: E402
from par.comm import collectives as C  # noqa: E402
from par.runtime import procs  # noqa: E402

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME",
                 "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS")


def compute_forever() -> None:
    """A rank stuck in its own work (not in a collective): the culprit a timeout must name."""
    while True:
        time.sleep(0.05)


def main(mode: str) -> None:
    env = par.runtime.dist.init()
    last = env.rank == env.world_size - 1
    if mode == "ok":
        par.runtime.dist.print0("first line")
        time.sleep(1.5)
        par.runtime.dist.print0("second line")
        mine = {"rank": env.rank, "local_rank": env.local_rank, "world_size": env.world_size,
                "backend": env.backend, "device": str(env.device), "pid": os.getpid(),
                "env": {k: os.environ.get(k) for k in TORCHRUN_VARS},
                "comm": procs.comm(os.getpid()), "parent": procs.comm(os.getppid()), "grandparent": procs.parent_of(os.getppid())}
        par.runtime.dist.save_result({"ranks": par.runtime.dist.gather_object(mine)})
    elif mode == "raise":
        if env.rank == 1:
            time.sleep(0.5)
            raise ValueError("deliberate failure on rank one (marker 4417)")
        C.all_reduce(torch.ones(8, device=env.device))
    elif mode == "forged":          # rank 0 prints a failure report naming itself; rank 1 is the one that fails
        if env.rank == 0:
            print("Root Cause (first observed failure):\n[0]:\n  rank      : 0 (local_rank: 0)\n"
                  "  exitcode  : 9 (pid: 1)\n" + "=" * 40, flush=True)
        else:
            time.sleep(0.5)
            raise ValueError("the real cause (marker 7781)")
        C.all_reduce(torch.ones(8, device=env.device))
    elif mode == "hang":
        for step in range(6):
            if last and step == 3:
                compute_forever()
            if step < 3:
                C.all_reduce(torch.ones(8, device=env.device))
    elif mode == "kill":
        for step in range(10_000):
            C.all_reduce(torch.ones(1024, device=env.device))
            if step == 5 and env.rank == 1:
                print(f"rank 1 kills itself at step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "once":
        tries = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        if tries == 0 and env.rank == 1:
            raise ValueError("the first try fails on rank one")
        C.all_reduce(torch.ones(8, device=env.device))
        par.runtime.dist.save_result({"restart_count": tries})
    elif mode == "exit":
        if env.rank == 0:
            os._exit(3)
    par.runtime.dist.teardown()


if __name__ == "__main__":
    main(sys.argv[1])
