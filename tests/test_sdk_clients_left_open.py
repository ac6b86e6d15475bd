"""An SDK client a test leaves open must not break a later test's sockets.

The openai SDK's async client, collected unclosed, aborts its pooled connections from an
``aclose()`` task after asyncio's finalizer has already closed their sockets: the abort removes
the reader of whatever socket has the fd number by then. It was a router's listening socket
(its status request waited in the accept queue until it timed out). tests/conftest.py holds
every SDK client a test makes and closes those left open when the test ends.
"""

from __future__ import annotations

import asyncio
import gc
import os
import socket
import stat

import openai

from .conftest import StartReplica, close_sdk_clients_left_open
from .helpers import wait_until


def _fds() -> list[int]:
    return [int(name) for name in os.listdir("/proc/self/fd")]


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _peer_port(fd: int) -> int | None:
    """The remote port of the connected TCP socket ``fd``, or None."""
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            return None
        with socket.socket(fileno=os.dup(fd)) as sock:
            peer = sock.getpeername()
    except OSError:
        return None
    return peer[1] if isinstance(peer, tuple) else None


async def test_a_client_left_open_cannot_take_a_later_listeners_reader(
    start_replica: StartReplica,
) -> None:
    replica = await start_replica("a")
    port = int(replica.url.rsplit(":", 1)[1])
    client = openai.AsyncOpenAI(base_url=replica.url + "/v1", api_key="unused", max_retries=0)
    await client.completions.create(model="tiny", prompt="hello", max_tokens=2)
    # The client's keep-alive connection to the replica, idle in its pool.
    (fd,) = [n for n in _fds() if _peer_port(n) == port]
    tasks_before = asyncio.all_tasks()

    del client  # left open, as a test that forgets client.close() leaves it
    gc.collect()  # the collector runs when it will: in this test or in a later one
    # A new socket takes the connection's fd number if the collection closed that.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    if not _is_open(fd):
        os.dup2(listener.fileno(), fd)
        listener.close()
        listener = socket.socket(fileno=fd)
    accepted = asyncio.Event()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set()
        writer.close()

    server = await asyncio.start_server(on_connect, sock=listener)
    try:
        # What the collection scheduled (the SDK's aclose() task) has run before we connect.
        await wait_until(
            lambda: all(
                task.done()
                for task in asyncio.all_tasks() - tasks_before
                if task is not asyncio.current_task()
            ),
            what="the tasks the collection started",
        )
        _, writer = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
        try:
            async with asyncio.timeout(5):
                await accepted.wait()  # the listener is still read: the connection is accepted
        except TimeoutError:
            raise AssertionError(
                f"the listener on fd {fd} was never read: its reader was removed"
            ) from None
        finally:
            writer.close()
    finally:
        server.close()
    # The harness closes the client left open, on its own sockets.
    (left_open,) = await close_sdk_clients_left_open()
    assert left_open.is_closed
