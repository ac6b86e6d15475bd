"""KV-event subscribers: one per replica event source, feeding the prefix index.

A source is one vLLM ``ZmqEventPublisher`` (a replica, or one data-parallel rank of it): a PUB
endpoint with live frames ``[topic, seq (8 bytes big-endian, from 0), payload]`` and optionally
a ROUTER replay endpoint (``reference/vllm-interface.md`` 1.6). The subscriber reads live frames
with a SUB socket and asks for replays with a DEALER (a REQ socket only ever gets the first
reply), decodes payloads with :func:`simulator.engine.decode_event_batch` and applies events to
an :class:`EventSink` in sequence order:

* seq == last + 1: applied.
* seq > last + 1 (a gap: the PUB dropped or we missed frames): replay from last + 1, apply the
  replayed batches in order, then carry on with live frames. Live frames that arrive during the
  replay wait in the SUB socket's queue; those already replayed are dropped as duplicates. With
  no replay endpoint, a replay that starts after last + 1 (the ring buffer moved on) or one that
  times out, the gap cannot be repaired: the replica's entries are dropped (resync) and the
  stream continues from the current seq.
* seq <= the last live seq (the live stream went backwards: the publisher restarted, vLLM
  counts from 0 again): the replica's entries are dropped and the stream starts over.
* The first frame (seq may be > 0 when the router started after the replica): replay from 0
  when a replay endpoint exists (vLLM keeps 10,000 batches), so the index learns what the
  replica already holds; otherwise start at that seq.

Bad frames and payloads are counted in :attr:`SubscriberStats.malformed` and skipped; nothing
but cancellation ends the task.

Limits: a publisher restart is seen only when the seq goes backwards; a restarted publisher
whose seq has already passed ours (a long disconnection) looks like a gap. A data-parallel
replica's ranks are routing endpoints of their own (router/dp_ranks.py), each with its source: a
resync of one rank clears that rank's entries only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Protocol

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvroute.kvcore.block_hashing import extra_key
from kvroute.kvcore.cache_groups import GROUP_KINDS, sparse_stores_last
from kvroute.kvcore.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    MalformedEventBatch,
    decode_event_batch,
    tier_of,
)

log = logging.getLogger(__name__)

END_SEQ = b"\xff" * 8
# What one publisher may make the router hold: a message (one batch) larger than this drops the
# connection (ZMQ_MAXMSGSIZE; ZMQ reconnects, the gap is then repaired or resynced), and a
# replay answer longer than this many batches is abandoned for a resync. vLLM's largest batch,
# a million-token prefill's token ids, is a few MB; its replay buffer holds 10,000 steps.
MAX_MESSAGE_BYTES = 64 << 20
MAX_REPLAY_BATCHES = 100_000
# A whole replay, however its publisher drips it (each message within replay_timeout_s).
MAX_REPLAY_S = 60.0
"""The replay end marker's seq frame (``(-1).to_bytes(8, "big", signed=True)``)."""


class EventSink(Protocol):
    """What the subscriber feeds: the prefix index implements it."""

    def apply_stored(
        self,
        replica: str,
        engine_hashes: Sequence[int | bytes],
        parent_engine_hash: int | bytes | None,
        token_ids: Sequence[int],
        block_size: int,
        medium: str | None = "GPU",
        extra_key: str | None = None,
        group: int = 0,
        group_kind: str | None = None,
        group_window: int | None = None,
    ) -> int: ...

    def apply_removed(
        self,
        replica: str,
        engine_hashes: Sequence[int | bytes],
        medium: str | None = "GPU",
        group: int = 0,
    ) -> int: ...

    def clear_replica(self, replica: str) -> None: ...


@dataclass
class SubscriberStats:
    batches: int = 0  # batches applied (live and replayed)
    events: int = 0  # events applied
    gaps: int = 0  # forward seq jumps seen on the live stream
    replayed_batches: int = 0  # batches applied from a replay
    resyncs: int = 0  # times the replica's entries were dropped (gap not repaired, restart)
    malformed: int = 0  # bad frames or payloads skipped
    last_seq: int | None = None  # last seq applied
    connected: bool = False  # the SUB socket has a live connection
    replay_timeouts: int = 0
    replay_overflows: int = 0  # replays abandoned past max_replay_batches (then resynced)
    sink_errors: int = 0  # exceptions raised by the sink (logged, skipped)


_COUNTERS = tuple(
    f.name for f in fields(SubscriberStats) if f.name not in ("last_seq", "connected")
)


def _binds(endpoint: str) -> bool:
    """Whether the router binds ``endpoint`` rather than connecting to it.

    A wildcard TCP host binds: the publisher was given this router's address and dials out. vLLM
    always binds ipc:// (and inproc://) endpoints itself, so the router connects to those.
    """
    if endpoint.startswith(("ipc://", "inproc://")):
        return False
    return "*" in endpoint or "::" in endpoint


def _split(frames: list[bytes]) -> tuple[int, bytes] | None:
    """``[topic, seq, payload]`` (vLLM >= 0.26) or ``[seq, payload]`` -> (seq, payload)."""
    if len(frames) == 3:
        _, seq, payload = frames
    elif len(frames) == 2:
        seq, payload = frames
    else:
        return None
    if len(seq) != 8:
        return None
    return int.from_bytes(seq, "big"), payload


class KVEventSubscriber:
    """Follows one event source and keeps ``sink`` in step with it (see the module doc)."""

    def __init__(
        self,
        replica: str,
        endpoint: str,
        replay_endpoint: str | None,
        sink: EventSink,
        *,
        context: zmq.asyncio.Context | None = None,
        replay_timeout_s: float = 2.0,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        max_replay_batches: int = MAX_REPLAY_BATCHES,
    ) -> None:
        self.replica = replica
        self.max_message_bytes = max_message_bytes
        self.max_replay_batches = max_replay_batches
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint or None
        self.sink = sink
        self.replay_timeout_s = replay_timeout_s
        self.stats = SubscriberStats()
        self._own_context = context is None
        self._context = context if context is not None else zmq.asyncio.Context()
        self._sub: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._dealer: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._last: int | None = None  # last seq applied (or skipped as malformed)
        self._live_last: int | None = None  # last seq seen on the live stream
        # The seq a snapshot's blocks of this source reach (resume_from), until a live frame.
        self._resumed_at: int | None = None
        self._closed = False

    # --- lifecycle ------------------------------------------------------------------------------

    def resume_from(self, seq: int) -> None:
        """The sink holds this source's blocks up to ``seq`` already (an index snapshot): take
        live events after it, the missed ones replayed as for any gap. Before ``start``."""
        if self._tasks:
            raise RuntimeError("resume_from after start")
        self._last = self._resumed_at = seq
        self.stats.last_seq = seq

    @property
    def last_seq(self) -> int | None:
        """The last seq whose blocks the sink holds (None: none yet, or since a resync)."""
        return self._last

    def start(self) -> None:
        """Open the sockets and start following the source (needs a running event loop)."""
        if self._tasks or self._closed:
            raise RuntimeError("subscriber already started or closed")
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        sub.set_hwm(100_000)  # vLLM's PUB hwm; frames wait here while a replay runs
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._monitor = sub.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
        )
        if _binds(self.endpoint):
            sub.bind(self.endpoint)
        else:
            sub.connect(self.endpoint)
        self._sub = sub
        name = f"kv-subscriber {self.replica} {self.endpoint}"
        self._tasks = [
            asyncio.create_task(self._run(), name=name),
            asyncio.create_task(self._watch_connection(), name=name + " monitor"),
        ]

    async def close(self) -> None:
        """Stop the tasks and close the sockets (and the context, when this created it)."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._sub is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sub.disable_monitor()
            self._sub.close(linger=0)
        if self._monitor is not None:
            self._monitor.close(linger=0)
        self._close_dealer()
        self.stats.connected = False
        if self._own_context:
            self._context.term()

    # --- the live stream ------------------------------------------------------------------------

    async def _run(self) -> None:
        assert self._sub is not None
        while True:
            try:
                frames = await self._sub.recv_multipart()
            except zmq.ContextTerminated:
                return
            except zmq.ZMQError as exc:  # transient socket trouble: log, back off, go on
                log.warning("%s: receiving KV events failed: %s", self.replica, exc)
                await asyncio.sleep(0.1)
                continue
            try:
                await self._on_live(frames)
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one frame end the subscriber
                self.stats.malformed += 1
                log.exception("%s: failed to handle a KV event frame", self.replica)

    async def _on_live(self, frames: list[bytes]) -> None:
        split = _split(frames)
        if split is None:
            self.stats.malformed += 1
            log.warning("%s: skipping a KV event message of %d frames", self.replica, len(frames))
            return
        seq, payload = split
        resumed_at, self._resumed_at = self._resumed_at, None
        if resumed_at is not None and seq <= resumed_at:
            # Frames published after this router started cannot be older than the snapshot
            # it loaded: the publisher started over since.
            log.warning(
                "%s: KV event seq %d is not past the snapshot's %d: publisher restarted, resyncing",
                self.replica,
                seq,
                resumed_at,
            )
            self._resync()
        elif self._live_last is not None and seq <= self._live_last:
            log.warning(
                "%s: KV event seq went back from %d to %d: publisher restarted, resyncing",
                self.replica,
                self._live_last,
                seq,
            )
            self._resync()
            self._last = None
        self._live_last = seq
        if self._last is None:
            await self._begin(seq, payload)
        elif seq <= self._last:
            pass  # already applied from a replay
        elif seq == self._last + 1:
            self._apply(seq, payload)
        else:
            self.stats.gaps += 1
            await self._repair(seq, payload)

    async def _begin(self, seq: int, payload: bytes) -> None:
        """First frame from this publisher: learn its history from the replay buffer if any."""
        if seq > 0 and self.replay_endpoint is not None:
            batches = await self._replay(0)
            if batches:
                self._apply_replayed(batches)
        if self._last is None or seq == self._last + 1:
            self._apply(seq, payload)
        elif seq > self._last + 1:  # the replay ended before this frame (should not happen)
            self._resync()
            self._apply(seq, payload)

    async def _repair(self, seq: int, payload: bytes) -> None:
        assert self._last is not None
        want = self._last + 1
        log.info("%s: KV event gap: expected seq %d, got %d", self.replica, want, seq)
        batches = await self._replay(want) if self.replay_endpoint is not None else None
        if batches and batches[0][0] <= want:
            self._apply_replayed(batches)
        if seq <= self._last:
            return  # the replay covered this frame
        if seq != self._last + 1:
            log.warning(
                "%s: KV event gap %d..%d not repaired, resyncing", self.replica, want, seq - 1
            )
            self._resync()
        self._apply(seq, payload)

    def _resync(self) -> None:
        self.stats.resyncs += 1
        self._call_sink(self.sink.clear_replica, self.replica)
        self._last = None

    # --- replay ---------------------------------------------------------------------------------

    async def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """The publisher's buffered batches from ``start`` on, or None if it did not answer."""
        assert self.replay_endpoint is not None
        if self._dealer is None:
            self._dealer = self._context.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
            self._dealer.connect(self.replay_endpoint)
        dealer = self._dealer
        batches: list[tuple[int, bytes]] = []
        try:
            async with asyncio.timeout(MAX_REPLAY_S):
                await dealer.send_multipart((b"", start.to_bytes(8, "big")))
                # Messages, good or bad: a flood of either ends the replay, not the router.
                for _ in range(self.max_replay_batches + 1):
                    frames = await asyncio.wait_for(dealer.recv_multipart(), self.replay_timeout_s)
                    if not frames or frames[0] != b"":
                        self.stats.malformed += 1
                        continue
                    if len(frames) >= 3 and frames[-2] == END_SEQ:
                        return batches
                    split = _split(frames[1:])
                    if split is None:
                        self.stats.malformed += 1
                        continue
                    batches.append(split)
                self.stats.replay_overflows += 1
                log.warning(
                    "%s: KV event replay from %d sent more than %d messages: abandoned",
                    self.replica,
                    start,
                    self.max_replay_batches,
                )
        except TimeoutError:
            self.stats.replay_timeouts += 1
            log.warning(
                "%s: KV event replay from %d timed out after %d batches",
                self.replica,
                start,
                len(batches),
            )
        except zmq.ZMQError as exc:
            log.warning("%s: KV event replay from %d failed: %s", self.replica, start, exc)
        # Late replies to this request must not be read as the next one's: a fresh socket.
        self._close_dealer()
        return None

    def _apply_replayed(self, batches: list[tuple[int, bytes]]) -> None:
        """Apply replayed batches that follow ``last`` without a hole; skip older ones."""
        for seq, payload in batches:
            if self._last is not None and seq <= self._last:
                continue
            if self._last is not None and seq != self._last + 1:
                return
            self._apply(seq, payload)
            self.stats.replayed_batches += 1

    def _close_dealer(self) -> None:
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None

    # --- applying -------------------------------------------------------------------------------

    def _apply(self, seq: int, payload: bytes) -> None:
        self._last = seq
        self.stats.last_seq = seq
        try:
            _, events, _ = decode_event_batch(payload)
        except MalformedEventBatch as exc:
            self.stats.malformed += 1
            log.warning("%s: skipping malformed KV event batch %d: %s", self.replica, seq, exc)
            return
        self.stats.batches += 1
        for event in sparse_stores_last(events):
            self.stats.events += 1
            if isinstance(event, BlockStored):
                args: tuple[object, ...] = (
                    self.replica,
                    event.block_hashes,
                    event.parent_block_hash,
                    event.token_ids,
                    event.block_size,
                    tier_of(event.medium, event.locality),
                    root_extra_key(event),
                )
                if event.group_idx or event.kv_cache_spec_kind in GROUP_KINDS:
                    # A hybrid model's group (vLLM names group 0 of every model: a plain one
                    # is told nothing, its hot path unchanged).
                    args += (
                        event.group_idx or 0,
                        event.kv_cache_spec_kind,
                        event.kv_cache_spec_sliding_window,
                    )
                self._call_sink(self.sink.apply_stored, *args)
            elif isinstance(event, BlockRemoved):
                where = tier_of(event.medium, event.locality)
                if event.group_idx:
                    self._call_sink(
                        self.sink.apply_removed,
                        self.replica,
                        event.block_hashes,
                        where,
                        event.group_idx,
                    )
                else:
                    self._call_sink(
                        self.sink.apply_removed, self.replica, event.block_hashes, where
                    )
            elif isinstance(event, AllBlocksCleared):
                self._call_sink(self.sink.clear_replica, self.replica)

    def _call_sink(self, method: object, *args: object) -> None:
        try:
            method(*args)  # type: ignore[operator]
        except Exception:
            self.stats.sink_errors += 1
            log.exception("%s: the KV event sink failed", self.replica)

    # --- connection state -----------------------------------------------------------------------

    async def _watch_connection(self) -> None:
        assert self._monitor is not None
        while True:
            try:
                frames = await self._monitor.recv_multipart()
                event = parse_monitor_message(frames)["event"]
            except zmq.ContextTerminated:
                return
            except (zmq.ZMQError, ValueError, KeyError) as exc:
                log.debug("%s: monitor: %s", self.replica, exc)
                await asyncio.sleep(0.1)
                continue
            if event in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED):
                self.stats.connected = True
            elif event == zmq.EVENT_DISCONNECTED:
                self.stats.connected = False
                self._reconnect()

    def _reconnect(self) -> None:
        """Connect anew after a drop. ZMQ reconnects by itself after a lost connection, but
        not after a protocol error, and a message past max_message_bytes is one: without this
        a single oversized batch would end the replica's event feed for good. Disconnecting
        first keeps it one connection either way."""
        if self._sub is None or self._closed or _binds(self.endpoint):
            return  # a bound endpoint: the publisher connects, and reconnects, to us
        with contextlib.suppress(zmq.ZMQError):
            self._sub.disconnect(self.endpoint)
        try:
            self._sub.connect(self.endpoint)
        except zmq.ZMQError as exc:
            log.warning("%s: reconnecting to %s failed: %s", self.replica, self.endpoint, exc)


class KVEventSubscribers:
    """The subscribers of a fleet, sharing one ZMQ context."""

    def __init__(self, sink: EventSink, *, replay_timeout_s: float = 2.0) -> None:
        self.sink = sink
        self.replay_timeout_s = replay_timeout_s
        self._context = zmq.asyncio.Context()
        self.subscribers: list[KVEventSubscriber] = []
        self._started = False

    def add(
        self, replica: str, endpoint: str, replay_endpoint: str | None = None
    ) -> KVEventSubscriber:
        """Follow one more source (started at once if the others are running)."""
        subscriber = KVEventSubscriber(
            replica,
            endpoint,
            replay_endpoint,
            self.sink,
            context=self._context,
            replay_timeout_s=self.replay_timeout_s,
        )
        self.subscribers.append(subscriber)
        if self._started:
            subscriber.start()
        return subscriber

    async def remove(self, subscriber: KVEventSubscriber) -> None:
        self.subscribers.remove(subscriber)
        await subscriber.close()

    def start_all(self) -> None:
        self._started = True
        for subscriber in self.subscribers:
            if not subscriber._tasks:
                subscriber.start()

    async def close_all(self) -> None:
        self._started = False
        await asyncio.gather(*(s.close() for s in self.subscribers))
        self._context.term()

    def stats_by_source(self) -> dict[tuple[str, str], SubscriberStats]:
        """Each source's stats, keyed by (replica, endpoint)."""
        return {(s.replica, s.endpoint): s.stats for s in self.subscribers}

    def totals(self) -> SubscriberStats:
        """Counters summed over all sources; ``connected`` is True when every one is."""
        total = SubscriberStats(connected=all(s.stats.connected for s in self.subscribers))
        for subscriber in self.subscribers:
            for name in _COUNTERS:
                setattr(total, name, getattr(total, name) + getattr(subscriber.stats, name))
        return total


def root_extra_key(event: BlockStored) -> str | None:
    """What seeds the hash chain of a sequence's first block besides its tokens.

    vLLM publishes each block's extra keys untagged: a LoRA adapter's name, ``(mm_hash,
    offset)`` pairs for images, and on the first block the request's ``cache_salt``, all bare
    values. The router seeds a first block with the same pair it takes from a request
    (:func:`router.block_hashing.extra_key`), so a salted prompt only matches blocks stored under
    that salt.
    """
    keys = event.extra_keys[0] if event.extra_keys else None
    strings = [k for k in keys if isinstance(k, str)] if keys else []
    if event.lora_name and strings and strings[0] == event.lora_name:
        strings = strings[1:]
    return extra_key(event.lora_name, strings[-1] if strings else None)
