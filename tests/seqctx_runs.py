"""One launch of tests/workers/seqctx_check.py per (world size, point-to-point semantics), shared by
test_context_parallel.py and test_sequence_parallel.py so that each configuration starts once."""
from __future__ import annotations

from pathlib import Path

from par.runtime import launch

WORKER = Path(__file__).parent / "workers" / "seqctx_check.py"
_CACHE: dict = {}


def ranks(n: int, env: dict | None = None) -> list[dict]:
    """Every rank's result dict of the n-rank launch (env: {} for gloo, the NCCL emulation's otherwise)."""
    key = (n, tuple(sorted((env or {}).items())))
    if key not in _CACHE:
        out = launch.run(str(WORKER), nproc=n, timeout=240, quiet=True, env=env)
        assert out["world_size"] == n and out["nccl_emulation"] == bool(env)
        _CACHE[key] = out["ranks"]
    return _CACHE[key]
