"""The rare gloo-era abort at exit, provoked on purpose: a thread comes back from torch's C++ while Python finalizes.

Every rank starts a daemon thread that multiplies matrices in a loop (each torch.mm releases the GIL in
C++ and takes it back on return), holds an object whose finalizer keeps the interpreter's finalization
busy for FINALIZE_S seconds, and then ends:

teardown: par.runtime.dist.teardown() -> exit code 0 (os._exit skips finalization)
raise:    raises ValueError after init -> exit code 1 with the traceback (par's excepthook skips finalization)
raw:      destroy_process_group() and a normal interpreter exit -> during finalization the thread returns from
          C++, CPython ends it with pthread_exit, the unwinding crosses pybind11's noexcept GIL guard:
          "terminate called without an active exception", SIGABRT (what par.runtime.dist.teardown avoids)
"""
from __future__ import annotations

import sys
import threading
import time

import torch
import torch.distributed as dist

import par.runtime.dist

FINALIZE_S = 5.0


class SlowFinalizer:
    """Keeps the interpreter in its finalization for FINALIZE_S seconds (a busy machine does it for free)."""

    def __del__(self):
        time.sleep(FINALIZE_S)


def multiply_forever() -> None:
    a = torch.randn(384, 384)
    while True:
        torch.mm(a, a)


def main(mode: str) -> None:
    par.runtime.dist.init()
    threading.Thread(target=multiply_forever, daemon=True).start()
    time.sleep(0.2)
    globals()["_slow"] = SlowFinalizer()
    if mode == "teardown":
        par.runtime.dist.teardown()
    elif mode == "raise":
        raise ValueError("deliberate failure with a C++ thread running (marker 5521)")
    elif mode == "raw":
        dist.barrier()
        dist.destroy_process_group()
    print(f"rank {dist.get_rank() if dist.is_initialized() else '?'} leaves", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
