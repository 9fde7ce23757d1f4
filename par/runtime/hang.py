"""A hung rank is named within a minute: which one stopped making progress, and what the others wait for.

A rank makes progress when its main thread runs: it trains, computes, copies. A rank that waits in a
collective for a peer uses no CPU, nor does one that sleeps, blocks on a lock, or was stopped (SIGSTOP).
So the heartbeat the launcher reads is the one the kernel already keeps for every process: the main
thread's CPU clock and run state, in `/proc/<pid>/task/<pid>/stat`, read once a second (`Watch.look`). A look
finds progress when the main thread used at least IDLE_SHARE of a core since the look before: a rank that
waits may still poll (rank 0 waiting in init for its store's clients uses about 2 % of a core), and that is
not progress however long it lasts.
Nothing runs inside the rank to produce it, so it is right even for a stopped rank or one stuck in C code.

The job may be hung (`Watch.hung`) when

* a rank has been stopped (state T) for `hang_s` seconds, or
* some rank's main thread has used less than IDLE_SHARE of a core at every look for `hang_s` seconds: it waits for a
  peer that does not come (one that sleeps, blocks, or spins in a busy loop without reaching the
  collective), or
* a rank's process is gone (it exited, even with code 0, or was never seen) and every rank left has made no
  progress for GONE_S seconds since: they wait for it.

The launcher then asks the ranks that can answer where they are (their Python stacks). When every rank
is idle, or a rank is stopped, the job is hung. Otherwise (`confirmed`) only when the stacks agree: every
idle rank waits inside a collective (or init), and, when no rank is gone, some busy rank is outside one
(it spins). `describe` then names the culprit first: the stopped rank, the rank that is gone, the one
that is not inside a collective (with the function it was last in), then what the others wait in. A job
whose ranks all compute looks busy, not hung: only the launcher's overall timeout ends it.

`hang_s` defaults to 45 s (PAR_HANG_S; 0 turns the watch off). gloo and NCCL get a collective timeout
a little later, `collective_timeout()` (60 s by default), so that the launcher's diagnosis comes first and
the collectives themselves still fail when nobody watches (a job started by hand with torchrun). Linux
only (/proc); elsewhere only the timeouts apply.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

from par.runtime.checks import env_number

HANG_ENV = "PAR_HANG_S"
DEFAULT_HANG_S = 45.0
IDLE_SHARE = 0.05                # less of a core than this since the look before: no progress
COLLECTIVE_MARGIN_S = 15.0       # the collectives' own timeout comes this long after the launcher's verdict
MIN_COLLECTIVE_S = 60.0
GONE_S = 5.0                     # a rank is gone and the others made no progress since, this long: they wait for it


def hang_seconds(value: float | None = None) -> float:
    """The hang limit in seconds: `value`, else PAR_HANG_S (a finite number >= 0, else `CheckError` naming it),
    else 45. 0 (or less) turns the watch off."""
    if value is None:
        value = env_number(HANG_ENV, DEFAULT_HANG_S)
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
    cpu: float                      # main-thread CPU seconds at the last look
    progress_at: float              # the last look that found progress (time.monotonic)
    stopped_at: float | None = None  # since when it is stopped, if it is
    quiet_at: float | None = None   # the last look that found no progress (None: none yet, busy since progress_at)
    seen_at: float | None = None    # when the last look was (None: at progress_at)


class Watch:
    """Every rank's last sign of progress; `look` once a second, then ask `hung`."""

    def __init__(self, hang_s: float, nproc: int, clock=time.monotonic):
        self.hang_s, self.nproc, self.clock = hang_s, nproc, clock
        self.ranks: dict[int, RankClock] = {}
        self.gone: dict[int, float] = {}      # rank -> when its process was found gone (or first missed)
        self.first_look: float | None = None
        self.refuted_at: float | None = None  # when the stacks last said "not hung": ask again hang_s later

    def look(self, pids: dict[int, int]) -> None:
        """Read the main-thread clock and state of each {rank: pid}; a rank that is gone is remembered as gone."""
        now = self.clock()
        if pids and self.first_look is None:
            self.first_look = now
        for rank in set(self.ranks) - set(pids):
            del self.ranks[rank]
            self.gone.setdefault(rank, now)
        if self.first_look is not None and now - self.first_look >= GONE_S:   # never seen: gone before the first look
            for rank in set(range(self.nproc)) - set(pids) - set(self.gone):
                if rank not in self.ranks:
                    self.gone[rank] = self.first_look
        for rank, pid in pids.items():
            self.gone.pop(rank, None)      # missed at first (slow to start), here now
            stat = main_thread_stat(pid)
            if stat is None:
                continue
            state, cpu = stat
            c = self.ranks.get(rank)
            if c is None or c.pid != pid:
                c = self.ranks[rank] = RankClock(pid, cpu, now, quiet_at=now, seen_at=now)
            since = now - (c.progress_at if c.seen_at is None else c.seen_at)
            if since > 0:                  # two looks at once say nothing about progress
                if cpu - c.cpu >= IDLE_SHARE * since:
                    c.progress_at = now
                else:
                    c.quiet_at = now
                c.cpu, c.seen_at = cpu, now
            c.stopped_at = (c.stopped_at or now) if state in "Tt" else None

    def stopped(self) -> dict[int, float]:
        """{rank: seconds it has been stopped}."""
        now = self.clock()
        return {r: now - c.stopped_at for r, c in sorted(self.ranks.items()) if c.stopped_at is not None}

    def idle(self) -> dict[int, float]:
        """{rank: seconds since its main thread last made progress}."""
        now = self.clock()
        return {r: now - c.progress_at for r, c in sorted(self.ranks.items())}

    def busy(self) -> dict[int, float]:
        """{rank: seconds its main thread has made progress at every look} of the ranks busy now."""
        now = self.clock()
        return {r: now - c.quiet_at for r, c in sorted(self.ranks.items())
                if c.quiet_at is not None and c.progress_at > c.quiet_at}

    def vanished(self) -> dict[int, float]:
        """{rank: seconds since its process was found gone} while other ranks still run."""
        now = self.clock()
        return {r: now - t for r, t in sorted(self.gone.items())} if self.ranks else {}

    def waiting_for_gone(self) -> bool:
        """A rank is gone and no rank left has made progress for GONE_S seconds since it went."""
        if not self.ranks or not self.gone:
            return False
        since = max(self.gone.values())
        now = self.clock()
        return all(now - max(c.progress_at, since) >= min(GONE_S, self.hang_s) for c in self.ranks.values())

    def hung(self) -> bool:
        """Whether to ask the ranks where they are: a rank stopped or idle for hang_s, or the ranks left waiting
        for one that is gone (not again within hang_s of stacks that said "not hung")."""
        if not self.hang_s:
            return False
        if any(s >= self.hang_s for s in self.stopped().values()):
            return True
        if self.refuted_at is not None and self.clock() - self.refuted_at < self.hang_s:
            return False
        idle, busy = self.idle(), self.busy()
        waited = [r for r, s in idle.items() if s >= self.hang_s]
        spun = all(r in waited or busy.get(r, 0) >= self.hang_s for r in idle)   # the others all along busy
        return bool(waited) and spun and len(idle) >= self.nproc or self.waiting_for_gone()

    def confirmed(self, places: dict[int, tuple[bool, str]]) -> bool:
        """Whether the stacks the ranks gave (`places`: {rank: par.runtime.failure.where(stack)}) make `hung` a hang: a stopped
        rank, or every rank idle; else every idle rank waits in a collective and a rank is gone or one that is
        busy is outside a collective (it spins). When they do not, `hung` stays quiet for hang_s."""
        idle = self.idle()
        if self.stopped() or (len(idle) >= self.nproc and min(idle.values()) >= self.hang_s):
            return True
        limit = min(self.hang_s, GONE_S) if self.gone else self.hang_s
        quiet = [r for r, s in idle.items() if s >= limit]
        busy = [r for r in self.busy() if r not in quiet]
        waits = quiet and all(places.get(r, (False, ""))[0] for r in quiet)
        ok = bool(waits) and (bool(self.vanished()) or any(not places.get(r, (True, ""))[0] for r in busy))
        if not ok:
            self.refuted_at = self.clock()
        return ok


def describe(stopped: dict[int, float], idle: dict[int, float], places: dict[int, tuple[bool, str]],
             vanished: dict[int, float] | None = None, busy: dict[int, float] | None = None,
             files: dict[int, tuple[int, int]] | None = None) -> tuple[str, list[int]]:
    """(one line, [culprit ranks]) of a hung job, from `Watch.stopped()`, `Watch.idle()`, `places`:
    {rank: par.runtime.failure.where(its stack)} of the ranks that answered, `Watch.vanished()` and `Watch.busy()`.

    The culprits are the stopped ranks, else the ranks that are gone, else the ranks that have used up their file
    descriptors (`files`: {rank: (open, limit)}, `exhausted`: a rank that can open no socket or file waits for ever
    on what needed one), else the ranks outside a collective (asleep: 'rank 1 made no progress for 45 s, last in
    step at job.py:12'; or spinning: 'rank 1 spins in step at job.py:12 (busy, never reaching the collective the
    others wait in)'); then what the others wait in."""
    vanished, busy = vanished or {}, busy or {}
    full = exhausted(files or {})
    culprits = list(stopped) or list(vanished) or full or [r for r in idle if not places.get(r, (False, ""))[0]]
    longest = max(idle.values(), default=0)

    def said(r: int) -> str:
        if r in stopped:
            return f"rank {r} is stopped (SIGSTOP: process state T) for {stopped[r]:.0f} s"
        if r in vanished:
            return f"rank {r} exited (its process is gone) while the others still wait for it"
        if r in full:
            used, limit = files[r]
            return (f"rank {r} has {used} of its {limit} file descriptors open (EMFILE: it can open no socket or "
                    f"file; close what it opens, or raise ulimit -n)")
        text = places.get(r, (False, "no answer"))[1]
        if r in busy and text.startswith("busy in "):
            return (f"rank {r} spins in {text[len('busy in '):]} (busy for {longest:.0f} s, never reaching the "
                    f"collective the others wait in)")
        return f"rank {r} made no progress for {idle.get(r, 0):.0f} s{_last(text)}"
    others = [f"rank {r} " + (text.replace("waiting in", "waits in", 1) if waiting else
                              text.replace("busy in", "is in", 1))
              for r, (waiting, text) in sorted(places.items()) if r not in culprits]
    if not culprits:
        return (f"no rank made progress for {min(idle.values(), default=0):.0f} s, every rank waits "
                f"(mismatched collectives?): " + "; ".join(others)), sorted(places)
    return "; ".join([said(r) for r in culprits] + others), culprits


def exhausted(files: dict[int, tuple[int, int]], margin: int = 8) -> list[int]:
    """The ranks with at most `margin` file descriptors left under their limit."""
    return sorted(r for r, (used, limit) in files.items() if used >= limit - margin)


def _last(text: str) -> str:
    """', last in step at job.py:12' for par.runtime.failure.where's 'busy in step at job.py:12' (a hung rank is rarely busy);
    ' (no stack: ...)' when it could not say."""
    return f", last {text[len('busy '):]}" if text.startswith("busy in ") else f" ({text})"
