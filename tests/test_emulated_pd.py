"""Prefill/decode disaggregation on emulated replicas, spoken as vLLM's NIXL proxy speaks it."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx
import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from kvroute.backends.process import free_ports
from kvroute.kvcore import pd
from kvroute.kvcore.kv_events import BlockStored, decode_event_batch
from kvroute.kvcore.stats import parse_metrics
from kvroute.kvcore.tokenizer import SimpleTokenizer
from kvroute.simulator.engine import EngineConfig, latency_preset
from kvroute.simulator.replica.cli import add_replica_command
from kvroute.simulator.replica.faults import Faults
from kvroute.simulator.replica.server import EmulatedReplica, ReplicaOptions

NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
# What vLLM's toy proxy (and kvroute's router) sends on the prefill leg.
PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
PRESET = "llama-3.1-70b-8xh100"  # a 2,000-token prefill (~90 ms) dwarfs its NVLink transfer
BLOCK_SIZE = 16
PROMPT = [(i * 7919) % 30_000 + 1 for i in range(2000)]
END_SEQ = b"\xff" * 8


@dataclass
class Replica:
    emulated: EmulatedReplica
    url: str
    port: int
    replay: str
    runner: web.AppRunner


Launch = Callable[..., Awaitable[Replica]]


@pytest.fixture
async def launch() -> AsyncIterator[Launch]:
    runners: list[web.AppRunner] = []

    async def start(
        kv_transfer: dict[str, Any] | None = NIXL,
        hold_timeout_s: float = pd.HOLD_TIMEOUT_S,
    ) -> Replica:
        port, events_port, replay_port = free_ports(3)
        options = ReplicaOptions(
            served_model_name="tiny",
            engine=EngineConfig(
                block_size=BLOCK_SIZE,
                num_blocks=1024,
                max_num_seqs=8,
                latency=latency_preset(PRESET),
            ),
            kv_events={
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{events_port}",
                "replay_endpoint": f"tcp://*:{replay_port}",
            },
            kv_bind_host="127.0.0.1",
            kv_transfer=kv_transfer,
            kv_link="nvlink",
            kv_hold_timeout_s=hold_timeout_s,
        )
        emulated = EmulatedReplica(options, SimpleTokenizer(), Faults())
        runner = web.AppRunner(emulated.build_app(), handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        url = f"http://127.0.0.1:{port}"
        return Replica(emulated, url, port, f"tcp://127.0.0.1:{replay_port}", runner)

    yield start
    for runner in runners:
        await runner.cleanup()  # a second cleanup of a stopped one does nothing


async def _post(
    url: str, body: dict[str, Any], request_id: str = "pd"
) -> tuple[int, dict[str, Any], float]:
    """A non-streamed request: status, JSON answer, seconds it took."""
    start = time.monotonic()
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + "/v1/completions", json=body, headers={"X-Request-Id": request_id}) as r,
    ):
        return r.status, await r.json(), time.monotonic() - start


async def _stream(url: str, body: dict[str, Any]) -> tuple[list[dict[str, Any]], float]:
    """A streamed request: its chunks and the seconds to the first one with text."""
    start = time.monotonic()
    ttft = -1.0
    chunks: list[dict[str, Any]] = []
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + "/v1/completions", json={**body, "stream": True}) as response,
    ):
        assert response.status == 200
        async for line in response.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft < 0 and chunk["choices"] and chunk["choices"][0]["text"]:
                ttft = time.monotonic() - start
            chunks.append(chunk)
    return chunks, ttft


async def _by_source(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as response:
        text = await response.text()
    return {
        s.labels["source"]: s.value
        for s in parse_metrics(text).samples
        if s.name.startswith("vllm:prompt_tokens_by_source")
    }


async def _prefill(replica: Replica, **extra: Any) -> dict[str, Any]:
    """The prefill leg, as the proxy sends it; the kv_transfer_params it answers."""
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": PREFILL_PARAMS,
        **extra,
    }
    status, answer, _ = await _post(replica.url, body)
    assert status == 200, answer
    params = answer["kv_transfer_params"]
    assert isinstance(params, dict)
    return params


def _decode_body(params: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 4,
        "kv_transfer_params": params,
        **extra,
    }


async def _stored_tokens(replica: Replica) -> list[int]:
    """The token ids of every BlockStored the replica published, from its replay socket."""
    context = zmq.asyncio.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(replica.replay)
    tokens: list[int] = []
    try:
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        async with asyncio.timeout(10):
            while True:
                _, _topic, seq, payload = await dealer.recv_multipart()
                if seq == END_SEQ:
                    return tokens
                for event in decode_event_batch(payload)[1]:
                    if isinstance(event, BlockStored):
                        tokens += event.token_ids
    finally:
        dealer.close(linger=0)
        context.term()


async def test_prefill_leg_answers_one_token_and_where_its_blocks_are(launch: Launch) -> None:
    prefill = await launch()
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": PREFILL_PARAMS,
    }
    status, answer, _ = await _post(prefill.url, body, request_id="leg-1")
    assert status == 200
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 1
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert str(uuid.UUID(params["remote_engine_id"])) == params["remote_engine_id"]
    assert len(params["remote_block_ids"]) == -(-len(PROMPT) // BLOCK_SIZE)
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", prefill.port)
    assert params["remote_request_id"] == answer["id"] and "leg-1" in answer["id"]
    assert params["tp_size"] == 1
    # The blocks stay held for the decode replica: not evictable, counted as used.
    assert prefill.emulated.engine.num_held == 1
    assert prefill.emulated.engine.stats.kv_cache_usage > 0
    # The engine id is the process's: the next prefill answers the same one.
    assert (await _prefill(prefill))["remote_engine_id"] == params["remote_engine_id"]


async def test_decode_leg_reads_the_prompt_instead_of_computing_it(launch: Launch) -> None:
    prefill, decode = await launch(), await launch()
    start = time.monotonic()
    params = await _prefill(prefill, temperature=0)
    prefill_s = time.monotonic() - start

    chunks, ttft = await _stream(decode.url, _decode_body(params, temperature=0))

    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and text
    assert all(c["kv_transfer_params"] is None for c in chunks)  # vLLM's decode answer: null
    latency = latency_preset(PRESET)
    transfer = pd.transfer_s(len(PROMPT), latency.kv_bytes_per_token, pd.NVLINK_BYTES_PER_S)
    prefill_compute = latency.step_time(
        len(PROMPT), len(PROMPT) * (len(PROMPT) + 1) // 2, len(PROMPT)
    )
    assert transfer < prefill_compute / 10  # the premise: moving the KV beats computing it
    # TTFT = the transfer + one decode step (+ HTTP), nowhere near a prefill.
    assert transfer <= ttft < prefill_s / 2, (ttft, prefill_s)
    assert await _by_source(decode.url) == {
        "external_kv_transfer": len(PROMPT),
        "local_compute": 1,  # the last prompt token, for its logits, as vLLM
        "local_cache_hit": 0,
    }
    # The read ended the prefill replica's hold; the decode replica caches and announces the
    # blocks it pulled, as vLLM's decode side does.
    assert prefill.emulated.engine.num_held == 0
    full = len(PROMPT) // BLOCK_SIZE * BLOCK_SIZE
    assert (await _stored_tokens(decode))[:full] == PROMPT[:full]


async def test_decode_leg_reads_only_what_it_does_not_hold(launch: Launch) -> None:
    prefill, decode = await launch(), await launch()
    half = PROMPT[:1024]
    status, _, _ = await _post(decode.url, {"model": "tiny", "prompt": half, "max_tokens": 1})
    assert status == 200
    before = await _by_source(decode.url)
    params = await _prefill(prefill)
    status, answer, _ = await _post(decode.url, _decode_body(params))
    assert status == 200 and answer["kv_transfer_params"] is None
    after = await _by_source(decode.url)
    delta = {source: after[source] - before[source] for source in after}
    moved = len(PROMPT) - len(half)
    assert delta == {
        "external_kv_transfer": moved,
        "local_cache_hit": len(half),
        "local_compute": 1,
    }


async def test_decode_recomputes_when_the_prefill_replica_is_gone(launch: Launch) -> None:
    prefill, decode = await launch(), await launch()
    params = await _prefill(prefill)
    await prefill.runner.cleanup()

    status, answer, _ = await _post(decode.url, _decode_body(params))

    assert status == 200 and answer["usage"]["completion_tokens"] == 4
    assert answer["kv_transfer_params"] is None
    assert await _by_source(decode.url) == {
        "external_kv_transfer": 0,
        "local_compute": len(PROMPT),
        "local_cache_hit": 0,
    }


@pytest.mark.parametrize(
    "change",
    [
        {"remote_engine_id": str(uuid.uuid4())},  # the prefill replica restarted
        {"remote_request_id": "cmpl-unknown-0"},
        {"remote_block_ids": [0, 1]},  # fewer blocks than the prompt fills
        {"remote_request_id": None},  # incomplete: vLLM "will not utilize KVTransfer"
        {"remote_port": 0},
        {"remote_host": "no such host"},
    ],
)
async def test_a_decode_leg_that_cannot_read_recomputes(
    launch: Launch, change: dict[str, Any]
) -> None:
    prefill, decode = await launch(), await launch()
    params = {**await _prefill(prefill), **change}
    status, answer, _ = await _post(decode.url, _decode_body(params))
    assert status == 200 and answer["usage"]["completion_tokens"] == 4
    assert (await _by_source(decode.url))["local_compute"] == len(PROMPT)


async def test_blocks_are_read_once_then_a_second_read_recomputes(launch: Launch) -> None:
    prefill, decode = await launch(), await launch()
    params = await _prefill(prefill)
    assert (await _post(decode.url, _decode_body(params)))[0] == 200
    # The same parameters again (a retried decode leg): the hold ended, so the read fails and
    # the prompt is computed.
    other = await launch()
    assert (await _post(other.url, _decode_body(params)))[0] == 200
    assert (await _by_source(other.url))["local_compute"] == len(PROMPT)


async def test_unread_blocks_are_freed_after_the_hold_timeout(launch: Launch) -> None:
    prefill = await launch(hold_timeout_s=2.0)  # past the round trip on a loaded box
    await _prefill(prefill)
    assert prefill.emulated.engine.num_held == 1
    deadline = time.monotonic() + 10
    while prefill.emulated.engine.num_held:
        assert time.monotonic() < deadline, "the hold never timed out"
        await asyncio.sleep(0.02)
    assert prefill.emulated.engine.stats.kv_cache_usage == 0  # freed, and still cached
    assert prefill.emulated.engine.reset_prefix_cache()


async def test_without_a_connector_kv_transfer_params_are_ignored(launch: Launch) -> None:
    plain = await launch(kv_transfer=None)
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 1,
        "kv_transfer_params": PREFILL_PARAMS,
    }
    status, answer, _ = await _post(plain.url, body)
    assert status == 200 and answer["kv_transfer_params"] is None
    assert plain.emulated.engine.num_held == 0
    # Nor does a decode leg read anything: the prompt is computed.
    fake = {**PREFILL_PARAMS, "do_remote_decode": False, "do_remote_prefill": True}
    status, answer, _ = await _post(plain.url, _decode_body({**fake, "remote_port": "x"}))
    assert status == 200 and answer["kv_transfer_params"] is None
    assert (await _by_source(plain.url))["external_kv_transfer"] == 0
    # And a request without them is answered as before, without the key.
    status, answer, _ = await _post(plain.url, {"model": "tiny", "prompt": PROMPT[:32]})
    assert status == 200 and "kv_transfer_params" not in answer


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ("yes", "kv_transfer_params"),
        ({"do_remote_decode": "true"}, "do_remote_decode"),
        ({"do_remote_prefill": True, "remote_block_ids": "1,2"}, "remote_block_ids"),
        ({"do_remote_prefill": True, "remote_block_ids": [1, -2]}, "remote_block_ids"),
        ({"do_remote_prefill": True, "remote_port": "8000"}, "remote_port"),
        ({"do_remote_prefill": True, "remote_port": True}, "remote_port"),
        ({"do_remote_prefill": True, "remote_host": 127}, "remote_host"),
    ],
)
async def test_bad_kv_transfer_params_are_a_400(launch: Launch, params: Any, field: str) -> None:
    replica = await launch()
    body = {"model": "tiny", "prompt": PROMPT[:32], "kv_transfer_params": params}
    status, answer, _ = await _post(replica.url, body)
    assert status == 400
    assert answer["error"]["code"] == 400 and answer["error"]["type"] == "BadRequestError"
    assert answer["error"]["param"] == "kv_transfer_params" and field in answer["error"]["message"]


async def test_kv_read_of_unknown_blocks_is_a_404(launch: Launch) -> None:
    replica = await launch()
    assert replica.emulated.connector is not None
    read = {"engine_id": replica.emulated.connector.engine_id, "request_id": "x", "block_ids": []}
    async with aiohttp.ClientSession() as http:
        async with http.post(replica.url + "/kvroute/kv_read", json=read) as response:
            assert response.status == 404
        async with http.post(replica.url + "/kvroute/kv_read", json={"block_ids": 1}) as response:
            assert response.status == 400


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvroute")
    add_replica_command(parser.add_subparsers())
    return parser.parse_args(["replica", *argv])


def test_cli_checks_the_kv_flags(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parse("--kv-transfer-config", json.dumps(NIXL), "--kv-link", "25")
    assert args.kv_transfer_config == NIXL and args.kv_link == "25"
    assert _parse().kv_transfer_config is None and _parse().kv_link == "rdma"
    for argv, message in [
        (["--kv-transfer-config", "{nope"], "not valid JSON"),
        (["--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_role": "x"}'], "kv_role"),
        (["--kv-transfer-config", '{"kv_connector": "Other", "kv_role": "kv_both"}'], "Other"),
        (["--kv-link", "carrier-pigeon"], "unknown link"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            _parse(*argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert "--kv-" in err and message in err


@pytest.mark.slow  # seconds to start a process on a loaded box
def test_cli_replica_answers_a_prefill_leg() -> None:
    (port,) = free_ports(1)
    command = [sys.executable, "-m", "kvroute.cli", "replica", "--port", str(port)]
    command += ["--preset", "tiny-cpu", "--kv-transfer-config", json.dumps(NIXL)]
    process = subprocess.Popen(command, stderr=subprocess.DEVNULL)
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
        body = {"prompt": "hello there", "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS}
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body).json()
        params = answer["kv_transfer_params"]
        assert params["remote_port"] == port and params["remote_block_ids"]
    finally:
        process.kill()
        process.wait()
