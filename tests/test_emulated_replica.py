"""The emulated replica as a router (or a person with the openai client) sees it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import aiohttp
import httpx
import msgspec
import openai
import pytest
import zmq
import zmq.asyncio

from kvroute.backends.process import free_ports
from kvroute.kvcore.kv_events import decode_event_batch
from kvroute.kvcore.stats import parse_metrics
from kvroute.kvcore.tokenizer import SimpleTokenizer

from .conftest import Running

END_SEQ = b"\xff" * 8


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=20)


async def _metrics(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
        text = await resp.text()
    return {s.name: s.value for s in parse_metrics(text).samples if not s.labels.get("le")}


LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 20


async def test_completion_and_usage(replica: Running) -> None:
    completion = await _client(replica.url).completions.create(
        model="tiny", prompt=LONG_PROMPT, max_tokens=7
    )
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 7
    assert completion.usage.prompt_tokens == len(SimpleTokenizer().encode(LONG_PROMPT))
    assert completion.choices[0].text


async def test_streaming_chat_with_usage(replica: Running) -> None:
    stream = await _client(replica.url).chat.completions.create(
        model="tiny",
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello there"},
        ],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    assert len(content) == 5
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finishing] == ["length"]
    assert (
        chunks[-1].choices == []
        and chunks[-1].usage is not None
        and chunks[-1].usage.completion_tokens == 5
    )


async def test_unknown_model_and_bad_bodies_get_vllm_errors(replica: Running) -> None:
    with pytest.raises(openai.NotFoundError):
        await _client(replica.url).completions.create(model="other", prompt="x")
    async with aiohttp.ClientSession() as http:
        async with http.post(replica.url + "/v1/completions", data=b"{nope") as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["type"] == "BadRequestError"
        too_long = {"model": "tiny", "prompt": "word " * 9000, "max_tokens": 10}
        async with http.post(replica.url + "/v1/completions", json=too_long) as resp:
            assert resp.status == 400
            assert "maximum context length" in (await resp.json())["error"]["message"]


async def test_metrics_have_vllm_names_and_count_prefix_hits(replica: Running) -> None:
    client = _client(replica.url)
    await client.completions.create(model="tiny", prompt=LONG_PROMPT, max_tokens=2)
    first = await _metrics(replica.url)
    await client.completions.create(model="tiny", prompt=LONG_PROMPT, max_tokens=2)
    second = await _metrics(replica.url)
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:cache_config_info",
        "vllm:time_to_first_token_seconds_count",
    ):
        assert name in second, name
    queried = second["vllm:prefix_cache_queries_total"] - first["vllm:prefix_cache_queries_total"]
    hit = second["vllm:prefix_cache_hits_total"] - first["vllm:prefix_cache_hits_total"]
    assert queried > 0
    assert hit >= queried - 16, "the second identical prompt should hit all its full blocks"
    assert first["vllm:prefix_cache_hits_total"] == 0


async def test_tokenize_detokenize_round_trip(replica: Running) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(replica.url + "/tokenize", json={"prompt": "Hello world"}) as resp:
            tokens = (await resp.json())["tokens"]
        async with http.post(replica.url + "/detokenize", json={"tokens": tokens}) as resp:
            assert (await resp.json())["prompt"] == "Hello world"
        chat = {"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": True}
        async with http.post(replica.url + "/tokenize", json=chat) as resp:
            count = (await resp.json())["count"]
    expected = SimpleTokenizer().encode(
        SimpleTokenizer().apply_chat_template(chat["messages"], True)
    )
    assert count == len(expected)


async def test_kv_events_live_and_replay(replica: Running) -> None:
    context = zmq.asyncio.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(replica.events)
    try:
        # A slow joiner misses early messages: send requests until one batch arrives.
        received: list[list[bytes]] = []
        async with asyncio.timeout(10):
            while not received:
                await _client(replica.url).completions.create(
                    model="tiny", prompt=LONG_PROMPT, max_tokens=20
                )
                if await sub.poll(200):
                    received.append(await sub.recv_multipart())
        topic, seq, payload = received[0]
        assert topic == b"kv-events" and len(seq) == 8
        _ts, events, rank = decode_event_batch(payload)
        assert rank == 0 and events
        assert type(events[0]).__name__ == "BlockStored"
        raw = msgspec.msgpack.decode(payload)
        assert (
            isinstance(raw, list)
            and isinstance(raw[1][0], dict)
            and raw[1][0]["type"] == "BlockStored"
        )

        dealer = context.socket(zmq.DEALER)
        dealer.connect(replica.replay)
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        async with asyncio.timeout(10):
            while True:
                frames = await dealer.recv_multipart()
                _, topic, seq, payload = frames
                if seq == END_SEQ:
                    break
                replayed.append(int.from_bytes(seq, "big"))
        assert replayed[0] == 0 and replayed == sorted(replayed)
        assert int.from_bytes(received[0][1], "big") in replayed
        dealer.close(linger=0)
    finally:
        sub.close(linger=0)
        context.term()


async def test_reset_prefix_cache_clears_hits(replica: Running) -> None:
    client = _client(replica.url)
    await client.completions.create(model="tiny", prompt=LONG_PROMPT, max_tokens=2)
    async with (
        aiohttp.ClientSession() as http,
        http.post(replica.url + "/reset_prefix_cache") as resp,
    ):
        assert resp.status == 200
    before = await _metrics(replica.url)
    await client.completions.create(model="tiny", prompt=LONG_PROMPT, max_tokens=2)
    after = await _metrics(replica.url)
    assert after["vllm:prefix_cache_hits_total"] == before["vllm:prefix_cache_hits_total"]


async def test_client_disconnect_aborts_the_request(replica: Running) -> None:
    async with aiohttp.ClientSession() as http:
        resp = await http.post(
            replica.url + "/v1/completions",
            json={"model": "tiny", "prompt": "x", "max_tokens": 900, "stream": True},
        )
        assert resp.status == 200, await resp.text()
        await resp.content.readline()
        assert replica.replica.engine.stats.num_running == 1
        resp.close()
    async with asyncio.timeout(5):
        while replica.replica.engine.has_unfinished_requests():
            await asyncio.sleep(0.01)


@pytest.mark.parametrize(
    ("faults", "check"),
    [
        ({"error_rate": 1.0}, "error"),
        ({"drop_after_chunks": 2}, "drop"),
    ],
)
async def test_fault_injection(replica: Running, faults: dict[str, object], check: str) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(replica.url + "/admin/faults", json=faults) as resp:
            assert resp.status == 200
        body = {"model": "tiny", "prompt": "x", "max_tokens": 20, "stream": True}
        if check == "error":
            async with http.post(replica.url + "/v1/completions", json=body) as resp:
                assert resp.status == 500
        else:
            async with http.post(replica.url + "/v1/completions", json=body) as resp:
                with pytest.raises(aiohttp.ClientPayloadError):
                    await resp.read()
        async with http.post(replica.url + "/admin/faults", json={"bogus": 1}) as resp:
            assert resp.status == 400
        async with http.get(replica.url + "/admin/faults") as resp:
            current = await resp.json()
        assert all(current[key] == value for key, value in faults.items())


async def test_stall_fault_accepts_but_answers_nothing(replica: Running) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(replica.url + "/admin/faults", json={"stall_s": 30}) as resp:
            assert resp.status == 200
        body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
        with pytest.raises(TimeoutError):
            async with (
                asyncio.timeout(0.5),
                http.post(replica.url + "/v1/completions", json=body) as resp,
            ):
                await resp.read()
        async with http.post(replica.url + "/admin/faults", json={}) as resp:  # faults off again
            assert resp.status == 200
        async with http.post(replica.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200


def test_exit_fault_ends_the_replica_process() -> None:
    (port,) = free_ports(1)
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvroute.cli",
            "replica",
            "--port",
            str(port),
            "--preset",
            "tiny-cpu",
        ],
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and process.poll() is None, "replica did not start"
            time.sleep(0.05)
        httpx.post(f"http://127.0.0.1:{port}/admin/faults", json={"exit_after_s": 0})
        assert process.wait(timeout=10) == 1
    finally:
        process.kill()
        process.wait()
