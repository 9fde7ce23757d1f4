"""What a real-rank exercise's runner records while the student's code runs, kept out of the student's process.

    grader                                              every rank (`rank_io.main`)
    book = Ledger(io, nproc)      listens on io/ledger
                                                        rank_io.take_inputs: connect(io, rank), before the barrier
                                                        record(kind, a, b)      each event, sent as it happens
    records = book.close()        ──▶ rank_io.read_outputs: out["ledger"], a (k, 3) int64 tensor per rank

A record is three integers, (kind, a, b), whose meaning the exercise defines (02's READY i, LAUNCH call size,
...). Each one leaves the rank's process the moment it is made, over a unix socket to a thread of the grader, so
nothing the student's code does afterwards (rewriting a list through `sys._getframe`, clearing it, `gc` tricks)
changes what was recorded: a record can be added, never taken back. The grader accepts one connection per rank,
all made before any student code runs (the barrier that follows), and then no more; what a rank sends past
MAX_RECORDS, a connection that names no rank or a rank twice, or a partial record make that rank's records
None (read as "nothing recorded").

What it does not guarantee: the student's code runs in the rank's process and can write records of its own into
the rank's connection (by hunting down the socket); it cannot remove or reorder those the grader's hooks sent.

Run without a grader (the student's own launch, no `--io`), the records stay in the rank (`local`), and rank 0
verifies them as the grader would.

Reading them (`segments`): a runner marks where each of its parts starts (02's and 06's steps, 08's cases) with a
record (marker, i, 0); the records after it, up to the next marker, are part i's. The runner writes the markers
0, 1, ..., count − 1 in order; records in any other order (a marker forged by the student's code, one missing)
are read as no records at all.
"""
from __future__ import annotations

import os
import selectors
import socket
import struct
import threading
import time
from pathlib import Path

RECORD = struct.Struct("<qqq")
HELLO = struct.Struct("<q")
MAX_RECORDS = 1 << 16        # records per rank the grader keeps (a step of 02 or 06 makes a few dozen)
DRAIN_S = 5.0                # how long the grader reads after the job ended, for records still in flight
NAME = "ledger"


def path(folder) -> Path:
    return Path(folder) / NAME


# ---------------------------------------------------------------- on the rank
class Writer:
    """A rank's end: every record sent at once to the grader (`sock`), or kept in a list (`local`)."""

    def __init__(self, sock: socket.socket | None):
        self.sock, self.kept = sock, []

    def record(self, kind: int, a: int = 0, b: int = 0) -> None:
        if self.sock is None:
            self.kept.append((int(kind), int(a), int(b)))
        else:
            self.sock.sendall(RECORD.pack(int(kind), int(a), int(b)))


_WRITER: list = []


def connect(folder, rank: int) -> None:
    """The rank's connection to the grader's ledger in `folder` (made before any student code runs)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(path(folder)))
    sock.sendall(HELLO.pack(int(rank)))
    _WRITER[:] = [Writer(sock)]


def local() -> None:
    """No grader: the rank keeps its records (the student's own launch)."""
    _WRITER[:] = [Writer(None)]


def record(kind: int, a: int = 0, b: int = 0) -> None:
    """Record (kind, a, b) now. Outside a rank runner (a test calling run_rank directly) the records are kept."""
    if not _WRITER:
        local()
    _WRITER[0].record(kind, a, b)


def kept():
    """The records this rank kept (`local`), as a (k, 3) int64 tensor."""
    import torch
    rows = _WRITER[0].kept if _WRITER else []
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 3)


# ---------------------------------------------------------------- in the grader
class Ledger:
    """The grader's end: listens on `folder`/ledger for `nproc` ranks, reads their records in a thread."""

    def __init__(self, folder, nproc: int):
        self.nproc = int(nproc)
        self.data: dict[int, bytearray] = {}
        self.bad: set[int] = set()
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path(folder)))
        os.chmod(path(folder), 0o777)          # the sandbox's nobody connects to it
        self.server.listen(self.nproc)
        self.server.setblocking(False)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.server, selectors.EVENT_READ, None)
        self.accepted = 0
        self.ended = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True, name="grader-ledger")
        self.thread.start()

    def _serve(self) -> None:
        quiet_since = None
        while True:
            events = self.selector.select(0.05)
            for key, _ in events:
                if key.data is None:
                    self._accept()
                else:
                    self._read(key)
            open_ = [k for k in self.selector.get_map().values() if k.data is not None]
            if self.ended.is_set():
                quiet_since = quiet_since or time.monotonic()
                if not open_ or time.monotonic() > quiet_since + DRAIN_S:
                    return

    def _accept(self) -> None:
        try:
            conn, _ = self.server.accept()
        except (BlockingIOError, OSError):
            return
        self.accepted += 1
        if self.accepted >= self.nproc:          # every rank has its connection: no more
            self.selector.unregister(self.server)
            self.server.close()
        conn.setblocking(False)
        self.selector.register(conn, selectors.EVENT_READ, {"rank": None, "buf": bytearray()})

    def _read(self, key) -> None:
        conn, state = key.fileobj, key.data
        try:
            chunk = conn.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self.selector.unregister(conn)
            conn.close()
            if state["rank"] is not None and len(state["buf"]) % RECORD.size:
                self.bad.add(state["rank"])        # a partial record: the rank's records are not read
            return
        buf = state["buf"]
        buf += chunk
        if state["rank"] is None and len(buf) >= HELLO.size:
            rank = HELLO.unpack_from(buf)[0]
            del buf[:HELLO.size]
            if not 0 <= rank < self.nproc or rank in self.data:
                if rank in self.data:
                    self.bad.add(rank)             # a second connection naming a rank spoils that rank's records
                self.selector.unregister(conn)
                conn.close()
                return
            state["rank"], self.data[rank] = rank, buf
        if state["rank"] is not None and len(buf) > MAX_RECORDS * RECORD.size:
            self.bad.add(state["rank"])
            self.selector.unregister(conn)
            conn.close()

    def close(self) -> list:
        """Each rank's records ((k, 3) int64 tensor), None for a rank that sent none readable; after the job."""
        import torch
        self.ended.set()
        self.thread.join(DRAIN_S + 5)
        for key in list(self.selector.get_map().values()):
            key.fileobj.close()
        self.selector.close()
        out = []
        for rank in range(self.nproc):
            buf = self.data.get(rank)
            if buf is None or rank in self.bad or len(buf) % RECORD.size:
                out.append(None)
                continue
            rows = [RECORD.unpack_from(buf, i) for i in range(0, len(buf), RECORD.size)]
            out.append(torch.tensor(rows, dtype=torch.int64).reshape(-1, 3))
        return out


# ---------------------------------------------------------------- reading a rank's records
def segments(records, marker: int, count: int) -> list[list[tuple[int, int, int]]] | None:
    """The records of parts 0 … count − 1 (each a list of (kind, a, b)) from one rank's ledger, a (k, 3) integer
    tensor; what comes before the first marker belongs to no part. None for anything else (no records), or when
    the markers are not 0, 1, ..., count − 1 in order."""
    import torch
    if type(records) is not torch.Tensor or records.dim() != 2 or records.shape[1] != 3 or \
            records.is_floating_point() or records.is_complex():
        return None
    parts: list[list[tuple[int, int, int]]] = []
    for kind, a, b in records.tolist():
        if kind == marker:
            if a != len(parts):
                return None
            parts.append([])
        elif parts:
            parts[-1].append((kind, a, b))
    return parts if len(parts) == count else None
