"""Executing notebooks headless (papermill, nbclient): wait for the kernel's replies in short slices.

nbclient waits for a cell's reply with one `socket.poll(cell timeout)` on jupyter_client's asyncio
channel. On a busy machine the wake-up for a reply that has arrived is sometimes lost; the poll then
sleeps for the whole cell timeout, finds the reply at its end and carries on as if nothing happened: a
cell of 0.2 s took 300 s, reported as a success. We saw it on lecture 01's widget cell, during a CI run
and under load (3 of 25 runs of that cell with 3 busy processes beside it; 0 of 25 polled in slices).
Those are the open jupyter/nbclient#312 and jupyter/nbconvert#1921 ("execute sometimes blocks on a
widget cell").

`sliced()` makes every such wait a loop of polls of at most SLICE_S: a lost wake-up then costs at most
SLICE_S, and a real timeout still raises `queue.Empty` at its deadline, as before.
"""
from __future__ import annotations

import contextlib
import time
from queue import Empty

SLICE_S = 0.5


async def get_msg_in_slices(channel, timeout: float | None = None) -> dict:
    """`AsyncZMQSocketChannel.get_msg`, polling at most SLICE_S at a time until `timeout` (None: forever)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        wait = SLICE_S if deadline is None else min(SLICE_S, max(0.0, deadline - time.monotonic()))
        if await channel.socket.poll(int(wait * 1000)):
            return await channel._recv()
        if deadline is not None and time.monotonic() >= deadline:
            raise Empty


@contextlib.contextmanager
def sliced():
    """Inside the block, jupyter_client's asyncio channels wait with `get_msg_in_slices`."""
    from jupyter_client.channels import AsyncZMQSocketChannel
    original = AsyncZMQSocketChannel.get_msg
    AsyncZMQSocketChannel.get_msg = get_msg_in_slices
    try:
        yield
    finally:
        AsyncZMQSocketChannel.get_msg = original
