"""The router follows its replicas' KV events: its prefix index holds what they cache, under the
router's own block hashes, and /metrics shows the subscription."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import aiohttp
import openai
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from kvroute.backends.process import free_ports
from kvroute.kvcore.block_hashing import block_hashes
from kvroute.kvcore.kv_events import BlockStored, encode_event_batch
from kvroute.kvcore.stats import parse_metrics
from kvroute.kvcore.tokenizer import SimpleTokenizer
from kvroute.router.kv_subscriber import MAX_REPLAY_BATCHES

from .conftest import Running, StartReplica, StartRouter
from .helpers import wait_until

EMPTY_BATCH = encode_event_batch(0.0, [])
PROMPT = "Every full block of this prompt ends up in the router's index. " * 12


async def test_index_learns_what_the_replica_caches(
    replica: Running, start_router: StartRouter
) -> None:
    source = {
        "url": replica.url,
        "name": "emu",
        "kv_events": replica.events,
        "kv_replay": replica.replay,
    }
    r = await start_router([source])
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
    await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    hashes = block_hashes(SimpleTokenizer().encode(PROMPT), 16)
    assert len(hashes) >= 8

    def held() -> int:
        match = r.router.index.match(hashes, now=0.0).get("emu")
        return match.confirmed if match else 0

    # The subscriber may join after the first batch: replay from 0 fills it in.
    await wait_until(
        lambda: held() == len(hashes), what="the index to hold every full prompt block"
    )

    async with aiohttp.ClientSession() as http, http.get(r.url + "/metrics") as resp:
        text = await resp.text()
    samples = {(s.name, s.labels.get("replica")): s.value for s in parse_metrics(text).samples}
    assert samples[("kvroute_kv_event_batches_total", "emu")] >= 1
    assert samples[("kvroute_kv_event_connected", "emu")] == 1
    assert samples[("kvroute_prefix_index_entries", None)] >= len(hashes)


class _HostileReplay:
    """A replay socket that floods its first request with garbage past the router's limit
    (100,000 messages, no end marker) and never answers another: one replay overflow, then
    one replay timeout. A thread with a plain ZMQ socket, to send the flood fast."""

    def __init__(self, port: int) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.SNDHWM, 0)  # queue the whole flood: a ROUTER drops past it
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(f"tcp://127.0.0.1:{port}")
        self.asked = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.socket.poll(50):
                continue
            client, *_ = self.socket.recv_multipart()
            self.asked += 1
            if self.asked == 1:
                for _ in range(MAX_REPLAY_BATCHES + 1):
                    self.socket.send_multipart([client, b"", b"garbage"])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.socket.close(linger=0)
        self.context.term()


async def test_abandoned_replays_show_on_metrics(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    """A publisher whose replay floods, then one that does not answer: each abandoned replay
    is counted on /metrics (kvroute_kv_event_replay_{overflows,timeouts}_total), as an
    operator's Prometheus parses it, and the router resyncs and goes on."""
    events_port, replay_port = free_ports(2)
    context = zmq.asyncio.Context()
    pub = context.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{events_port}")
    replay = _HostileReplay(replay_port)
    a = await start_replica("a")
    source = {
        "url": a.url,
        "name": "hostile",
        "kv_events": f"tcp://127.0.0.1:{events_port}",
        "kv_replay": f"tcp://127.0.0.1:{replay_port}",
    }
    r = await start_router([source])
    seq = 10  # a first frame past 0 makes the router ask for the history: the flood

    async def scrape() -> dict[str, Any]:
        async with aiohttp.ClientSession() as http, http.get(r.url + "/metrics") as resp:
            text = await resp.text()
        return {f.name: f for f in text_string_to_metric_families(text)}

    def value(families: dict[str, Any], name: str) -> float:
        (sample,) = [s for s in families[name].samples if s.labels.get("replica") == "hostile"]
        return float(sample.value)

    async def publish_until(name: str, jump: int) -> dict[str, Any]:
        """Publish frames (each ``jump`` past the last) until /metrics counts ``name``."""
        nonlocal seq
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while True:
            await pub.send_multipart([b"kv", seq.to_bytes(8, "big"), EMPTY_BATCH])
            seq += jump
            families = await scrape()
            if name in families and value(families, name) >= 1:
                return families
            assert loop.time() < deadline, f"{name} never counted: asked {replay.asked} times"
            await asyncio.sleep(0.1)

    try:
        families = await publish_until("kvroute_kv_event_replay_overflows", 1)
        assert value(families, "kvroute_kv_event_replay_overflows") == 1
        assert value(families, "kvroute_kv_event_replay_timeouts") == 0
        assert value(families, "kvroute_kv_event_malformed") >= MAX_REPLAY_BATCHES
        # A gap: the router asks for the missing frames; nothing answers within 2 s.
        families = await publish_until("kvroute_kv_event_replay_timeouts", 5)
        assert value(families, "kvroute_kv_event_replay_timeouts") == 1
        assert value(families, "kvroute_kv_event_replay_overflows") == 1
        assert value(families, "kvroute_kv_event_resyncs") >= 1
        for name in ("kvroute_kv_event_replay_overflows", "kvroute_kv_event_replay_timeouts"):
            assert families[name].type == "counter" and "resynced" in families[name].documentation
        # After the resync the next frame asks for the history again (not answered either).
        assert replay.asked >= 2
    finally:
        pub.close(linger=0)
        context.term()
        replay.close()


async def test_an_event_the_index_fails_to_apply_is_counted_and_the_stream_goes_on(
    start_replica: StartReplica, start_router: StartRouter, monkeypatch: Any
) -> None:
    """A bug in the prefix index (stood in for by an apply that raises once): the event is
    skipped, kvroute_kv_event_sink_errors_total counts it on /metrics, the next is applied."""
    (events_port,) = free_ports(1)
    context = zmq.asyncio.Context()
    pub = context.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{events_port}")
    a = await start_replica("a")
    source = {"url": a.url, "name": "buggy", "kv_events": f"tcp://127.0.0.1:{events_port}"}
    r = await start_router([source])
    index = r.router.index
    real_apply = index.apply_stored
    failures = []

    def apply_once_broken(*args: Any, **kwargs: Any) -> Any:
        if not failures:
            failures.append(args)
            raise RuntimeError("a bug in the index")
        return real_apply(*args, **kwargs)

    monkeypatch.setattr(index, "apply_stored", apply_once_broken)
    seq = 0

    async def publish(block: int) -> None:
        nonlocal seq
        stored = BlockStored([block], None, [1] * 16, 16)
        await pub.send_multipart([b"kv", seq.to_bytes(8, "big"), encode_event_batch(0.0, [stored])])
        seq += 1

    async def sink_errors() -> float:
        async with aiohttp.ClientSession() as http, http.get(r.url + "/metrics") as resp:
            text = await resp.text()
        families = {f.name: f for f in text_string_to_metric_families(text)}
        family = families["kvroute_kv_event_sink_errors"]
        assert family.type == "counter" and "prefix index" in family.documentation
        (sample,) = [s for s in family.samples if s.labels.get("replica") == "buggy"]
        return float(sample.value)

    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        while not failures:  # until the subscriber is connected and the first event reached it
            await publish(seq + 1)
            assert loop.time() < deadline, "no event reached the index"
            await asyncio.sleep(0.1)
        assert await sink_errors() == 1
        await publish(999)
        await wait_until(lambda: index.entries >= 1, timeout_s=10, what="the next event")
        assert await sink_errors() == 1
    finally:
        pub.close(linger=0)
        context.term()
