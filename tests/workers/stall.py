"""A tiny job for tests/test_stops.py: ranks that step through all-reduces, and one that stops making progress.

steps:    every rank steps through all-reduces for ever (the test then stops one of them with SIGSTOP)
sleep:    like `steps`, but at step 5 the last rank sleeps for ever inside `sleep_in_step`, while the
          others wait for it in their next all-reduce
spin:     like `sleep`, but the last rank spins in a busy loop (100% CPU, no progress) in `spin_in_step`
exit0:    the last rank exits with code 0 before joining the job; the others wait for it in init
leave:    like `steps`, but at step 5 the last rank exits with code 0 while the others wait in all_reduce
tmpdir:   rank 0 returns where its temp files went (TMPDIR, a file it made there) and its stdout (a pipe to the
          agent, or torchrun's log file)

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


def spin_in_step() -> None:
    """A rank that computes for ever without reaching the next collective (a loop whose exit never comes)."""
    x = 0
    while True:
        x += 1


def main(mode: str) -> None:
    if mode == "exit0" and os.environ.get("RANK") == str(int(os.environ["WORLD_SIZE"]) - 1):
        sys.exit(0)
    env = par.runtime.dist.init()
    if sys.argv[2:]:
        with open(f"{sys.argv[2]}.{env.rank}", "w") as f:
            f.write(str(os.getpid()))
    if mode == "tmpdir":
        fd, made = tempfile.mkstemp()
        os.close(fd)
        par.runtime.dist.save_result({"tmpdir": tempfile.gettempdir(), "made": made,
                                      "stdout": os.readlink("/proc/self/fd/1")})
    else:
        step = 0
        while True:
            if mode in ("sleep", "spin", "leave") and step == 5 and env.rank == env.world_size - 1:
                {"sleep": sleep_in_step, "spin": spin_in_step, "leave": lambda: os._exit(0)}[mode]()
            C.all_reduce(torch.ones(256))
            step += 1
    par.runtime.dist.teardown()


if __name__ == "__main__":
    main(sys.argv[1])
