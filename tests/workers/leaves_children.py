"""A rank that leaves processes behind: a child it never waits for and a daemon it double-forks, each asleep for
`sleep_s` seconds with MARK in its command line; their pids go to DIR/pids-<rank>. Rank 0 then saves a result.

    launched as tests/workers/leaves_children.py DIR MARK [sleep_s]
"""
from __future__ import annotations

import os
import subprocess
import sys

import par.runtime.dist


def sleeper(mark: str, sleep_s: str) -> list[str]:
    """A process asleep for `sleep_s` seconds with `mark` in its command line."""
    return [sys.executable, "-c", f"import time; time.sleep({float(sleep_s)})", mark]


def daemon(mark: str, sleep_s: str) -> int:
    """Fork twice: the grandchild sleeps with `mark` in its command line, its parent exits at once (parent 1)."""
    read, write = os.pipe()
    if os.fork() == 0:
        os.setsid()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            os.execv(sys.executable, sleeper(mark, sleep_s))
        os.write(write, str(pid).encode())
        os._exit(0)
    os.close(write)
    pid = int(os.read(read, 32))
    os.wait()
    return pid


def main(folder: str, mark: str, sleep_s: str = "300") -> None:
    env = par.runtime.dist.init()
    child = subprocess.Popen(sleeper(mark, sleep_s), start_new_session=True)
    with open(os.path.join(folder, f"pids-{env.rank}"), "w") as f:
        f.write(f"{child.pid} {daemon(mark, sleep_s)}\n")
    if env.rank == 0:
        par.runtime.dist.save_result({"world_size": env.world_size})
    par.runtime.dist.teardown()


if __name__ == "__main__":
    main(*sys.argv[1:])
