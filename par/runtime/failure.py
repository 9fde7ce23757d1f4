"""What a failed job's ranks said, read into its root cause: torchrun's failure report (the agent prints the
same), each rank's output by its `[defaultN]:` prefix, a rank's last Python exception, and the stack
faulthandler printed for a rank that did not finish.

    describe_failure(lines)        -> (the root cause in one line, [its rank], crashed, details)
    describe_unfinished(lines, r)  -> 'ranks 0, 1 did not finish: rank 1 busy in main at job.py:44; ...'

The launcher (`par.runtime.launch`) and the emulated cluster (`par.runtime.cluster`) read their jobs' output
with these; the hang detector (`par.runtime.hang`) reads the stacks with `where`.
"""
from __future__ import annotations

import os
import re
import signal

COMM_FILES = ("torch/distributed/", "par/comm/collectives.py", "par/comm/coalesced.py", "par/comm/thread.py",
              "par/runtime/nccl_emulation.py", "par/runtime/dist.py")     # a stack inside these waits for a peer

PREFIX = re.compile(r"^\[default(\d+)\]:(?:\[rank\d+\]: ?)?")


def rank_lines(lines: list[str], rank: int | None = None) -> list[str]:
    """What `rank` (None: any rank) printed, prefixes removed (the agent and torchrun write `[defaultN]:`, torch adds
    `[rankN]: `)."""
    out = []
    for line in lines:
        m = PREFIX.match(line)
        if m and (rank is None or int(m.group(1)) == rank):
            out.append(line[m.end():])
    return out


def failures(lines: list[str]) -> list[dict]:
    """torchrun's failure report (the agent prints the same), root cause first: [{rank, exitcode}] (empty when it
    printed none)."""
    text = "".join(lines)
    found = []
    for section in (r"Root Cause \(first observed failure\):(.*?)(?:={10,}|$)", r"Failures:(.*?)-{10,}"):
        m = re.search(section, text, re.S)
        if m:
            for rank, code in re.findall(r"rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", m.group(1), re.S):
                if int(rank) not in [f["rank"] for f in found]:
                    found.append({"rank": int(rank), "exitcode": int(code)})
    return found


def exception_line(said: list[str]) -> str | None:
    """`Type: message` of the last Python traceback in a rank's output (None without one)."""
    starts = [i for i, line in enumerate(said) if line.startswith("Traceback (most recent call last)")]
    if not starts:
        return None
    block = said[starts[-1]:]
    frames = [i for i, line in enumerate(block) if line.startswith('  File "')]
    i = (frames[-1] + 1) if frames else 1
    while i < len(block) and block[i].startswith(" "):   # the frame's source line and its ^^^ markers
        i += 1
    return block[i].strip() if i < len(block) else None


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused")


def cause_first(found: list[dict], lines: list[str]) -> list[dict]:
    """torchrun's failures reordered so the cause leads, not its consequences: a rank killed by a
    signal the launcher did not send (SIGTERM is how the agent and torchrun stop the others), then a rank with an
    exception of its own, then ranks that only saw a peer vanish (gloo's connection errors)."""
    def rank_of(f):
        if f["exitcode"] < 0:
            return 0 if -f["exitcode"] != signal.SIGTERM else 3
        exc = exception_line(rank_lines(lines, f["rank"])) or ""
        return 2 if any(p in exc for p in PEER_GONE) else 1
    return sorted(found, key=rank_of)   # stable: torchrun's order within a kind


def left_early(lines: list[str], nproc: int) -> list[int]:
    """The ranks of a failed job that exited with code 0: absent from torchrun's failure report, which lists every
    rank that failed or that it stopped."""
    failed = {f["rank"] for f in failures(lines)}
    return [r for r in range(nproc) if r not in failed] if failed else []


def describe_failure(lines: list[str]) -> tuple[str, list[int], bool, str]:
    """(first line naming the root cause, [rank], crashed, details) of a job that exited non-zero."""
    found = cause_first(failures(lines), lines)
    if not found:   # torchrun failed by itself, or printed no report: the last traceback anyone printed
        exc = exception_line(rank_lines(lines)) or exception_line(lines)
        return (exc or "the job failed without a traceback"), [], False, "".join(lines[-40:])
    rank, code = found[0]["rank"], found[0]["exitcode"]
    said = rank_lines(lines, rank)
    exc = exception_line(said)
    if code < 0 and exc is None:
        head = (f"rank {rank} was killed by {signal_name(-code)} (signal {-code}) without a Python exception; "
                f"the others were then stopped")
        return head, [rank], True, f"rank {rank}'s last output:\n" + "".join(said[-30:])
    refused = [l.strip() for l in said if l.startswith("error: ")]
    if exc is None and refused:        # a job that refused its input (`SystemExit("error: ...")`): that line
        return f"rank {rank}: {refused[-1]}", [rank], False, f"rank {rank}'s last output:\n" + "".join(said[-30:])
    if exc is None:
        return (f"rank {rank} exited with code {code} without a Python traceback", [rank], False,
                f"rank {rank}'s last output:\n" + "".join(said[-30:]))
    start = max(i for i, l in enumerate(said) if l.startswith("Traceback (most recent call last)"))
    died = f" (then died by {signal_name(-code)})" if code < 0 else ""
    return (f"rank {rank} failed: {exc}{died}", [rank], code < 0,
            f"rank {rank}'s traceback:\n" + "".join(said[start:][:80]))


def main_stack(said: list[str]) -> list[tuple[str, int, str]]:
    """The main thread's frames (file, line, function), innermost first, from the last faulthandler dump.

    faulthandler lists the threads newest first, so the main thread is the last block of a dump."""
    heads = [i for i, line in enumerate(said) if re.match(r"(Current thread|Thread) 0x[0-9a-f]+", line)]
    if not heads:
        return []
    frames = []
    for line in said[heads[-1] + 1:]:
        m = re.match(r'\s+File "(.*)", line (\d+) in (.*)', line)
        if not m:
            break
        frames.append((m.group(1), int(m.group(2)), m.group(3).strip()))
    return frames


def where(frames: list[tuple[str, int, str]]) -> tuple[bool, str]:
    """(waiting in a collective?, 'all_reduce at job.py:46') for one rank's main-thread stack."""
    def comm(frame):
        return any(part in frame[0].replace(os.sep, "/") for part in COMM_FILES)
    if not frames:
        return False, "no stack (it had not reached par.runtime.dist.init)"
    inner = 0
    while inner < len(frames) and comm(frames[inner]):
        inner += 1
    if inner == 0:
        file, line, fn = frames[0]
        return False, f"busy in {fn} at {os.path.basename(file)}:{line}"
    called = frames[inner - 1][2]
    if inner == len(frames):
        return True, f"waiting in {called}"
    file, line, fn = frames[inner]
    return True, f"waiting in {called} at {os.path.basename(file)}:{line}"


def describe_unfinished(lines: list[str], ranks: list[int], stopped=()) -> str:
    """'ranks 0, 1 did not finish: rank 1 busy in main at job.py:44; rank 0 waiting in all_reduce at job.py:46'.

    A rank in `stopped` (SIGSTOP) cannot print its stack: it is said to be stopped."""
    if not ranks:
        return "no rank process was left (the process that started them did not finish)"
    status = {r: (False, "is stopped (SIGSTOP: process state T)") if r in stopped else
              where(main_stack(rank_lines(lines, r))) for r in ranks}
    busy = [f"rank {r} {text}" for r, (waiting, text) in status.items() if not waiting]
    waiting = [f"rank {r} {text}" for r, (waiting, text) in status.items() if waiting]
    who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
    return f"{who} did not finish: " + "; ".join(busy + waiting)
