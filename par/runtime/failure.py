"""What a failed job's ranks said, read into its root cause: torchrun's failure report (the agent prints the
same), each rank's output by its `[defaultN]:` prefix, a rank's last Python exception, and the stack
faulthandler printed for a rank that did not finish.

    describe_failure(lines)        -> (the root cause in one line, [its rank], crashed, details)
    describe_unfinished(lines, r)  -> 'ranks 0, 1 did not finish: rank 1 busy in main at job.py:44; ...'

The launcher (`par.runtime.launch`) and the emulated cluster (`par.runtime.cluster`) read their jobs' output
with these; the hang detector (`par.runtime.hang`) reads the stacks with `where`.

What a failure is also travels as data, the text being the fallback:

    record_exception(kind, value, tb)   a launched rank's uncaught exception, in torch elastic's error file
                                        (TORCHELASTIC_ERROR_FILE: what torchrun reads into its report, and copies
                                        the root cause's into its own error file, the launcher's)
    read_error_file(path)           -> {"exception": "Type: message", "where": "fn at file.py:12"} or None
    write_records(folder, records)      the agent: one record per rank (rank, exitcode, signal, exception,
                                        where, ended), the first failure first, in RECORDS
    read_records(folder)            -> those records, or None where no agent wrote them (torchrun)
"""
from __future__ import annotations

import json
import os
import re
import signal
import time
import traceback

from par.runtime.checks import CheckError, write_atomic

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


RECORDS = "ranks.json"           # the agent's records, in the folder of the launcher's TORCHELASTIC_ERROR_FILE


def record_exception(kind, value, tb) -> None:
    """Write a rank's uncaught exception where TORCHELASTIC_ERROR_FILE says, in torch elastic's format
    (`ErrorHandler.record_exception`: {"message": {"message", "extraInfo": {"py_callstack", "timestamp"}}}), with
    the innermost frame as "where". Nothing without the variable; a file that cannot be written is skipped (the
    traceback on stderr still says it)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    frames = traceback.extract_tb(tb)
    where = f"{frames[-1].name} at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""
    message = f"{kind.__name__}: {value}" if str(value) else kind.__name__
    try:
        write_atomic(path, json.dumps({"message": {"message": message, "extraInfo": {
            "py_callstack": "".join(traceback.format_exception(kind, value, tb)), "timestamp": str(int(time.time())),
            "where": where}}}))
    except CheckError:
        pass


def read_error_file(path: str) -> dict | None:
    """{"exception", "where"} of an error file `record_exception` (or torch's `@record`) wrote; None if none."""
    try:
        with open(path) as f:
            message = json.load(f)["message"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if isinstance(message, str):                 # torch writes a plain string for a failure it did not record
        return {"exception": message.strip().splitlines()[-1] if message.strip() else None, "where": None}
    if not isinstance(message, dict):
        return None
    extra = message.get("extraInfo") if isinstance(message.get("extraInfo"), dict) else {}
    return {"exception": message.get("message"), "where": extra.get("where")}


def write_records(folder: str, records: list[dict]) -> None:
    """The agent's records of a job's ranks (`RECORDS` in `folder`, written atomically), the first failure first;
    `CheckError` when the folder cannot be written."""
    write_atomic(os.path.join(folder, RECORDS), json.dumps(records))


def read_records(folder: str) -> list[dict] | None:
    """The records the agent wrote in `folder`; None where there are none (torchrun ran the job, or the agent
    died before it could write them)."""
    try:
        with open(os.path.join(folder, RECORDS)) as f:
            records = json.load(f)
    except (OSError, ValueError):
        return None
    return records if isinstance(records, list) and all(isinstance(r, dict) for r in records) else None


def failures(lines: list[str], records: list[dict] | None = None) -> list[dict]:
    """The failed ranks, root cause first: [{rank, exitcode}]. From the agent's `records` where there are some,
    else read from torchrun's failure report in `lines` (empty when it printed none)."""
    if records is not None:
        return [{"rank": r["rank"], "exitcode": r["exitcode"], "exception": r.get("exception")} for r in records
                if r.get("exitcode")]
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


def cause_first(found: list[dict], lines: list[str] = ()) -> list[dict]:
    """Failures ({rank, exitcode, exception?}) reordered so the cause leads, not its consequences: a rank killed by a
    signal the launcher did not send (SIGTERM is how the agent and torchrun stop the others), then a rank with an
    exception of its own, then ranks that only saw a peer vanish (gloo's connection errors). A failure's exception
    is its own "exception", else the last one its output in `lines` shows."""
    def rank_of(f):
        if f["exitcode"] < 0:
            return 0 if -f["exitcode"] != signal.SIGTERM else 3
        exc = f.get("exception") or exception_line(rank_lines(lines, f["rank"])) or ""
        return 2 if any(p in exc for p in PEER_GONE) else 1
    return sorted(found, key=rank_of)   # stable: torchrun's order within a kind


def left_early(lines: list[str], nproc: int, records: list[dict] | None = None) -> list[int]:
    """The ranks of a failed job that exited with code 0: absent from the failures (torchrun's report lists every
    rank that failed or that it stopped)."""
    failed = {f["rank"] for f in failures(lines, records)}
    return [r for r in range(nproc) if r not in failed] if failed else []


def describe_failure(lines: list[str], records: list[dict] | None = None) -> tuple[str, list[int], bool, str]:
    """(first line naming the root cause, [rank], crashed, details) of a job that exited non-zero: the failed ranks
    from the agent's `records` (else torchrun's report), a rank's exception from its output, else its record."""
    found = cause_first(failures(lines, records), lines)
    if not found:   # torchrun failed by itself, or printed no report: the last traceback anyone printed
        exc = exception_line(rank_lines(lines)) or exception_line(lines)
        return (exc or "the job failed without a traceback"), [], False, "".join(lines[-40:])
    rank, code = found[0]["rank"], found[0]["exitcode"]
    said = rank_lines(lines, rank)
    exc = exception_line(said)
    recorded = next((r.get("exception") for r in records or () if r["rank"] == rank), None)
    if exc is None and recorded:       # its output was cut short or never reached us; its error file says it
        return (f"rank {rank} failed: {recorded}", [rank], code < 0,
                f"rank {rank}'s last output:\n" + "".join(said[-30:]))
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
