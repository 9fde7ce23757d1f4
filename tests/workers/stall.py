"""A tiny job for tests/test_stops.py: ranks that step through all-reduces, and one that stops making progress.

steps:    every rank steps through all-reduces for ever (the test then stops one of them with SIGSTOP)
sleep:    like `steps`, but at step 5 the last rank sleeps for ever inside `sleep_in_step`, while the
          others wait for it in their next all-reduce
tmpdir:   rank 0 returns where its temp files and its torchrun log went (TMPDIR, its stdout's file)

argv[2], when given: each rank writes its pid to the file `<argv[2]>.<rank>` once it has joined the job.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time

import torch

import par.runtime.dist
from par.comm import collectives as C


def sleep_in_step() -> None:
    """A rank that stops making progress in the middle of a step (a lost lock, a blocking read)."""
    while True:
        time.sleep(3600)


def main(mode: str) -> None:
    env = par.runtime.dist.init()
    if sys.argv[2:]:
        with open(f"{sys.argv[2]}.{env.rank}", "w") as f:
            f.write(str(os.getpid()))
    if mode == "tmpdir":
        par.runtime.dist.save_result({"tmpdir": tempfile.gettempdir(), "stdout": os.readlink("/proc/self/fd/1")})
    else:
        step = 0
        while True:
            if mode == "sleep" and step == 5 and env.rank == env.world_size - 1:
                sleep_in_step()
            C.all_reduce(torch.ones(256))
            step += 1
    par.runtime.dist.teardown()


if __name__ == "__main__":
    main(sys.argv[1])
