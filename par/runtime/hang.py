"""A hung rank is named within a minute: which one stopped making progress, and what the others wait for.

A rank makes progress when its main thread runs: it trains, computes, copies. A rank that waits in a
collective for a peer uses no CPU, nor does one that sleeps, blocks on a lock, or was stopped (SIGSTOP).
So the heartbeat the launcher reads is the one the kernel already keeps for every process: the main
thread's CPU clock and run state, in `/proc/<pid>/task/<pid>/stat`, read once a second (`Watch.look`).
Nothing runs inside the rank to produce it, so it is right even for a stopped rank or one stuck in C code.

The job is hung (`Watch.hung`) when

* a rank has been stopped (state T) for `hang_s` seconds, or
* no rank's main thread has used more than IDLE_CPU_S of CPU for `hang_s` seconds: the ranks that
  wait in a collective wait for one that does not come.

The launcher then asks the ranks that can answer where they are (their Python stacks) and
`describe` names the culprit first: the stopped rank, or the one that is not inside a collective
(with the function it was last in), then what the others wait in. A rank that spins forever without
waiting looks busy, not hung: only the launcher's overall timeout ends it.

`hang_s` defaults to 45 s (PAR_HANG_S; 0 turns the watch off). gloo and NCCL get a collective timeout
a little later, `collective_timeout()` (60 s by default), so that the launcher's diagnosis comes first and
the collectives themselves still fail when nobody watches (a job started by hand with torchrun). Linux
only (/proc); elsewhere only the timeouts apply.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

HANG_ENV = "PAR_HANG_S"
DEFAULT_HANG_S = 45.0
IDLE_CPU_S = 0.05                # less CPU than this since the last sign of progress: no progress
COLLECTIVE_MARGIN_S = 15.0       # the collectives' own timeout comes this long after the launcher's verdict
MIN_COLLECTIVE_S = 60.0


def hang_seconds(value: float | None = None) -> float:
    """The hang limit in seconds: `value`, else PAR_HANG_S, else 45. 0 (or less) turns the watch off."""
    if value is None:
        value = float(os.environ.get(HANG_ENV) or DEFAULT_HANG_S)
    return max(0.0, float(value))


def collective_timeout(hang_s: float | None = None) -> float | None:
    """Seconds a gloo/NCCL collective may wait: past the launcher's verdict, at least a minute (None: watch off)."""
    hang_s = hang_seconds(hang_s)
    return max(MIN_COLLECTIVE_S, hang_s + COLLECTIVE_MARGIN_S) if hang_s else None


def main_thread_stat(pid: int) -> tuple[str, float] | None:
    """(state letter, CPU seconds) of process `pid`'s main thread, from /proc (None: gone, or not Linux)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    return fields[0], (int(fields[11]) + int(fields[12])) / ticks     # fields 3, 14 (utime), 15 (stime)


@dataclass
class RankClock:
    pid: int
    cpu: float                      # main-thread CPU seconds at the last sign of progress
    progress_at: float              # when that was (time.monotonic)
    stopped_at: float | None = None  # since when it is stopped, if it is


class Watch:
    """Every rank's last sign of progress; `look` once a second, then ask `hung`."""

    def __init__(self, hang_s: float, nproc: int, clock=time.monotonic):
        self.hang_s, self.nproc, self.clock = hang_s, nproc, clock
        self.ranks: dict[int, RankClock] = {}

    def look(self, pids: dict[int, int]) -> None:
        """Read the main-thread clock and state of each {rank: pid}; forget ranks that are gone."""
        now = self.clock()
        for rank in set(self.ranks) - set(pids):
            del self.ranks[rank]
        for rank, pid in pids.items():
            stat = main_thread_stat(pid)
            if stat is None:
                continue
            state, cpu = stat
            c = self.ranks.get(rank)
            if c is None or c.pid != pid:
                c = self.ranks[rank] = RankClock(pid, cpu, now)
            if cpu - c.cpu >= IDLE_CPU_S:
                c.cpu, c.progress_at = cpu, now
            c.stopped_at = (c.stopped_at or now) if state in "Tt" else None

    def stopped(self) -> dict[int, float]:
        """{rank: seconds it has been stopped}."""
        now = self.clock()
        return {r: now - c.stopped_at for r, c in sorted(self.ranks.items()) if c.stopped_at is not None}

    def idle(self) -> dict[int, float]:
        """{rank: seconds since its main thread last made progress}."""
        now = self.clock()
        return {r: now - c.progress_at for r, c in sorted(self.ranks.items())}

    def hung(self) -> bool:
        if not self.hang_s:
            return False
        if any(s >= self.hang_s for s in self.stopped().values()):
            return True
        idle = self.idle()
        return len(idle) >= self.nproc and min(idle.values()) >= self.hang_s


def describe(stopped: dict[int, float], idle: dict[int, float],
             places: dict[int, tuple[bool, str]]) -> tuple[str, list[int]]:
    """(one line, [culprit ranks]) of a hung job, from `Watch.stopped()`, `Watch.idle()` and `places`:
    {rank: launch.where(its stack)} of the ranks that answered.

    The culprits are the stopped ranks, or else the ranks that made no progress outside a collective:
    'rank 1 made no progress for 45 s, last in step at job.py:12; rank 0 waits in all_reduce at job.py:30'."""
    culprits = list(stopped) or [r for r in idle if not places.get(r, (False, ""))[0]]
    said = [f"rank {r} is stopped (SIGSTOP: process state T) for {stopped[r]:.0f} s" if r in stopped else
            f"rank {r} made no progress for {idle[r]:.0f} s{_last(places.get(r, (False, 'no answer'))[1])}"
            for r in culprits]
    others = [f"rank {r} " + (text.replace("waiting in", "waits in", 1) if waiting else
                              text.replace("busy in", "is in", 1))
              for r, (waiting, text) in sorted(places.items()) if r not in culprits]
    if not culprits:
        return (f"no rank made progress for {min(idle.values(), default=0):.0f} s, every rank waits "
                f"(mismatched collectives?): " + "; ".join(others)), sorted(places)
    return "; ".join(said + others), culprits


def _last(text: str) -> str:
    """', last in step at job.py:12' for launch.where's 'busy in step at job.py:12' (a hung rank is rarely busy);
    ' (no stack: ...)' when it could not say."""
    return f", last {text[len('busy '):]}" if text.startswith("busy in ") else f" ({text})"
