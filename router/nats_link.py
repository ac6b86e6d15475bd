"""A NATS connection that comes when the server does.

What routers share over NATS (dispatches, budget charges) is an improvement, never a
condition: a router whose NATS server is down at start serves on alone, says so once, and
connects when the server answers (nats-py reconnects by itself only after a first connection).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nats.aio.client import Client

log = logging.getLogger(__name__)

RETRY_S = 5.0
CONNECT_WAIT_S = 2.0  # per attempt: a router's start waits at most this for a server that is down


class NatsLink:
    def __init__(
        self,
        url: str,
        name: str,
        what: str,
        on_connected: Callable[[Client], Awaitable[None]],
        retry_s: float | None = None,
    ) -> None:
        self.url = url
        self.name = name
        self.what = what  # for the log lines: what this router shares over it
        self.on_connected = on_connected
        self.retry_s = RETRY_S if retry_s is None else retry_s
        self.client: Client | None = None
        self._retry: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Connect now if the server answers, else keep trying in the background."""
        if await self._connect():
            return
        log.warning(
            "%s: NATS at %s does not answer; serving on alone, trying again every %g s",
            self.what,
            self.url,
            self.retry_s,
        )
        self._retry = asyncio.create_task(self._keep_trying(), name=f"{self.name}-connect")

    async def _keep_trying(self) -> None:
        while not await self._connect():
            await asyncio.sleep(self.retry_s)
        log.info("%s: connected to NATS at %s", self.what, self.url)

    async def _connect(self) -> bool:
        import nats

        try:
            # nats-py retries a first connection for as long as it would reconnect (forever
            # here): bounded, so this router starts and tries again later.
            async with asyncio.timeout(CONNECT_WAIT_S):
                client = await nats.connect(
                    self.url,
                    name=self.name,
                    max_reconnect_attempts=-1,
                    connect_timeout=2,
                    error_cb=quiet_errors,
                )
        except Exception as exc:  # refused, timed out, bad TLS: all mean "not yet"
            log.debug("%s: NATS at %s: %s", self.what, self.url, exc)
            return False
        self.client = client
        await self.on_connected(client)
        return True

    async def close(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
            await asyncio.gather(self._retry, return_exceptions=True)
        if self.client is not None:
            try:
                await self.client.drain()
            except Exception as exc:  # the server is gone: nothing left to flush to it
                log.debug("%s: NATS drain: %s", self.what, exc)
                await self.client.close()


async def quiet_errors(exc: Exception) -> None:
    """nats-py's error callback: its default logs every failed (re)connection with a
    traceback; a server that is down is said once by whoever connects."""
    log.debug("nats: %s", exc)
