"""A job on several machines: the torchrun command every node runs (`MultiNode`), checked before it is printed
(`MultiNodeError`, one line naming the fix). `python -m par train --nnodes` prints them; lecture 07b's emulated
cluster (`par.runtime.cluster`) runs them, one per host.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass


class MultiNodeError(ValueError):
    """A multi-node description that cannot work: one line naming the fix."""


@dataclass(frozen=True)
class MultiNode:
    """A job on `nnodes` machines with `nproc_per_node` ranks each, meeting at `rdzv_endpoint`.

    With the c10d rendezvous (the default) every node runs the SAME command:

        torchrun --nnodes=N --nproc-per-node=K --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT
                 --rdzv-id=ID --max-restarts=0 -m par.measure.X ...

    The agents meet at a TCP store served by the node at HOST, which numbers the nodes in the
    order they arrive. With `rdzv_backend="static"` each node is told its place instead
    (`--node-rank=i --master-addr=HOST --master-port=PORT`: the same command but for i), and the
    job starts only when all N have come. Either way torchrun numbers the ranks node by node:
    WORLD_SIZE = N·K, the K ranks of one node are consecutive (RANK = node · K + LOCAL_RANK),
    LOCAL_WORLD_SIZE = K, and MASTER_ADDR/MASTER_PORT point at rank 0's store. A job reads only
    these (`par.runtime.dist.init`), so it runs unchanged on one node or many.
    """
    nnodes: int
    nproc_per_node: int
    rdzv_endpoint: str               # HOST:PORT of the rendezvous (node rank 0)
    rdzv_id: str = "par"
    rdzv_backend: str = "c10d"       # or "static": node ranks given, not assigned
    max_restarts: int = 0            # never a silent second try (see run())

    def __post_init__(self):
        for name in ("nnodes", "nproc_per_node"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise MultiNodeError(f"{name} must be a positive integer, got {v!r}")
        if self.rdzv_backend not in ("c10d", "static"):
            raise MultiNodeError(f"rdzv_backend must be 'c10d' or 'static', got {self.rdzv_backend!r}")
        host, _, port = self.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise MultiNodeError(f"rdzv_endpoint must be HOST:PORT (e.g. node0:29500), got {self.rdzv_endpoint!r}")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def host(self) -> str:
        return self.rdzv_endpoint.rpartition(":")[0]

    def ranks_of(self, node: int) -> list[int]:
        """The global ranks on the node that is `node`-th in the rendezvous: consecutive."""
        return list(range(node * self.nproc_per_node, (node + 1) * self.nproc_per_node))

    def torchrun_args(self, node_rank: int) -> list[str]:
        """torchrun's options for node `node_rank` (without the program)."""
        if not 0 <= node_rank < self.nnodes:
            raise MultiNodeError(f"node_rank must be in 0..{self.nnodes - 1}, got {node_rank}")
        common = [f"--nnodes={self.nnodes}", f"--nproc-per-node={self.nproc_per_node}"]
        if self.rdzv_backend == "static":
            host, _, port = self.rdzv_endpoint.rpartition(":")
            meet = [f"--node-rank={node_rank}", f"--master-addr={host}", f"--master-port={port}"]
        else:
            meet = ["--rdzv-backend=c10d", f"--rdzv-endpoint={self.rdzv_endpoint}", f"--rdzv-id={self.rdzv_id}"]
        return [*common, *meet, f"--max-restarts={self.max_restarts}"]

    def command(self, target: str, args=(), node_rank: int = 0, torchrun=("torchrun",)) -> list[str]:
        """The exact command to type on node `node_rank` (`torchrun`: how to call torchrun there)."""
        program = [target] if target.endswith(".py") else ["-m", target]
        return [*torchrun, *self.torchrun_args(node_rank), *program, *map(str, args)]

    def commands(self, target: str, args=(), torchrun=("torchrun",)) -> list[list[str]]:
        """One command per node, node rank 0 first."""
        return [self.command(target, args, i, torchrun) for i in range(self.nnodes)]

    def describe(self, target: str, args=()) -> str:
        """The per-node commands as text to copy onto each machine."""
        how = ("every node runs the same command; the rendezvous numbers the nodes as they arrive"
               if self.rdzv_backend == "c10d" else "each node is told its node rank")
        lines = [f"# {self.nnodes} nodes × {self.nproc_per_node} ranks = world {self.world_size}; rendezvous at "
                 f"{self.rdzv_endpoint} ({self.rdzv_backend}: start it on that host; {how}). On each node:"]
        for i, cmd in enumerate(self.commands(target, args)):
            lines.append(f"node {i} (ranks {self.ranks_of(i)[0]}-{self.ranks_of(i)[-1]}): {shlex.join(cmd)}")
        return "\n".join(lines)
