"""A lost wake-up while waiting for a kernel's reply costs at most a slice, not the cell's timeout (par.course.batch.kernel_poll)."""
import asyncio
import time
from queue import Empty

import pytest
from jupyter_client.channels import AsyncZMQSocketChannel

from par.course.batch import kernel_poll


class LostWakeUp:
    """A socket whose reply has arrived, but whose first poll misses the wake-up: it sleeps its whole timeout
    and only then sees the reply, as pyzmq's asyncio poll sometimes does on a busy machine. `arrives=False`:
    no reply ever comes."""

    def __init__(self, arrives: bool = True):
        self.polls_ms: list[int] = []
        self.arrives = arrives

    async def poll(self, timeout_ms):
        self.polls_ms.append(timeout_ms)
        if len(self.polls_ms) == 1 or not self.arrives:
            await asyncio.sleep(timeout_ms / 1000)
        return int(self.arrives)


class Channel:
    def __init__(self, socket):
        self.socket = socket

    async def _recv(self):
        return {"msg_type": "execute_reply"}


def waited(get_msg, channel, timeout):
    start = time.monotonic()
    try:
        return asyncio.run(get_msg(channel, timeout)), time.monotonic() - start
    except Empty:
        return Empty, time.monotonic() - start


def test_one_poll_for_the_whole_timeout_waits_it_all_out():
    """What jupyter_client does: the reply is there, yet the cell waits for its timeout (then succeeds)."""
    reply, seconds = waited(AsyncZMQSocketChannel.get_msg, Channel(LostWakeUp()), timeout=2.0)
    assert reply == {"msg_type": "execute_reply"} and seconds >= 2.0


def test_polling_in_slices_loses_at_most_a_slice():
    socket = LostWakeUp()
    reply, seconds = waited(kernel_poll.get_msg_in_slices, Channel(socket), timeout=30.0)
    assert reply == {"msg_type": "execute_reply"}
    assert seconds < kernel_poll.SLICE_S + 0.5, seconds
    assert max(socket.polls_ms) <= kernel_poll.SLICE_S * 1000


def test_a_real_timeout_still_raises_at_its_deadline():
    reply, seconds = waited(kernel_poll.get_msg_in_slices, Channel(LostWakeUp(arrives=False)), timeout=1.2)
    assert reply is Empty and 1.2 <= seconds < 1.2 + kernel_poll.SLICE_S + 0.5, seconds


def test_sliced_swaps_the_channel_method_and_puts_it_back():
    original = AsyncZMQSocketChannel.get_msg
    with kernel_poll.sliced():
        assert AsyncZMQSocketChannel.get_msg is kernel_poll.get_msg_in_slices
    assert AsyncZMQSocketChannel.get_msg is original
    with pytest.raises(RuntimeError):
        with kernel_poll.sliced():
            raise RuntimeError("a failing notebook")
    assert AsyncZMQSocketChannel.get_msg is original
