"""KV events over ZMQ exactly as vLLM's ZmqEventPublisher sends them (vLLM >= 0.26 framing).

Live: PUB frames ``[topic, seq (8 bytes big-endian, from 0), payload]``. Replay: a ROUTER
socket takes ``[client, b"", start_seq]`` and answers each buffered batch with
``[client, b"", topic, seq, payload]``, then the end marker ``[client, b"", b"", END_SEQ, b""]``.
Like vLLM, an ``ipc://`` endpoint or one with a wildcard host (``tcp://*:P``) is bound and any
other is connected to; the replay endpoint is always bound. Unlike vLLM, a wildcard TCP endpoint
can be bound on one address only (``bind_host``: the replica's own --host), so a replica that
serves on loopback does not publish what its cache holds on every interface.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque

import zmq
import zmq.asyncio

from kvroute.kvcore.kv_events import KVEvent, encode_event_batch

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _bind(sock: zmq.asyncio.Socket, endpoint: str, host: str | None) -> None:
    """Bind ``endpoint``; a wildcard TCP one on ``host`` alone when that is a single address."""
    if host and host not in ("0.0.0.0", "::") and endpoint.startswith("tcp://*:"):
        if ":" in host:  # IPv6
            sock.ipv6 = True
            host = f"[{host}]"
        endpoint = f"tcp://{host}:{endpoint.removeprefix('tcp://*:')}"
    sock.bind(endpoint)


class KVEventPublisher:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str = "",
        layout: str = "map",
        buffer_steps: int = 10_000,
        data_parallel_rank: int = 0,
        bind_host: str | None = None,
    ) -> None:
        self._context = zmq.asyncio.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(100_000)
        if _binds(endpoint):
            _bind(self._pub, endpoint, bind_host)
        else:
            self._pub.connect(endpoint)
        self._replay: zmq.asyncio.Socket | None = None
        if replay_endpoint:
            self._replay = self._context.socket(zmq.ROUTER)
            _bind(self._replay, replay_endpoint, bind_host)
        self._topic = topic.encode()
        self._layout = layout
        self._rank = data_parallel_rank
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._replay_task: asyncio.Task[None] | None = None
        self.paused = False  # fault injection: drop batches (the subscriber sees a gap)

    def start(self) -> None:
        if self._replay is not None:
            self._replay_task = asyncio.create_task(self._serve_replay(), name="kv-replay")

    def publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        payload = encode_event_batch(time.time(), events, self._rank, self._layout)
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        if self.paused:
            return
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart(
                (self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK
            )

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                log.warning("ignoring malformed replay request with %d frames", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await self._replay.send_multipart(
                        (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                    )
            await self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            await asyncio.gather(self._replay_task, return_exceptions=True)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._context.term()
