"""Parse Anthropic Messages and OpenAI Responses bodies just enough to route them.

The body is forwarded to the replica as received (vLLM serves both APIs itself); what is
decoded here is what routing needs, and the conversation as vLLM will render it
(``kvcore.agent_apis``), so the router tokenizes exactly the replica's prompt and the chat
path's tokenizer, caches and prefix index serve these requests unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import msgspec

from kvroute.kvcore.agent_apis import (
    AgentRequestError,
    ChatConversion,
    check_messages_request,
    check_responses_request,
    messages_to_chat,
    responses_to_chat,
)
from kvroute.kvcore.cache_hints import cache_ttl_s

from .errors import ApiError, bad_request
from .openai_request import (
    CHARS_PER_TOKEN,
    DEFAULT_CHAT_MAX_TOKENS,
    MAX_TOKENS_FOR_LOAD,
    ParsedRequest,
)

MESSAGES = "messages"
COUNT_TOKENS = "count_tokens"
RESPONSES = "responses"
# The APIs whose streams are events of their own (``event:`` lines, no [DONE]).
AGENT_APIS = frozenset((MESSAGES, COUNT_TOKENS, RESPONSES))


def parse_messages(body: bytes) -> ParsedRequest:
    """A /v1/messages body: checked, and its conversation as vLLM renders it."""
    request = _checked(body, check_messages_request)
    parsed = _parsed(
        request, _converted(messages_to_chat, request), MESSAGES, request["max_tokens"]
    )
    ttl = cache_ttl_s(request)
    return replace(parsed, cache_ttl_s=ttl) if ttl is not None else parsed


def parse_count_tokens(body: bytes) -> ParsedRequest:
    """A /v1/messages/count_tokens body. It generates nothing, and is not keyed: the
    replica renders it and caches nothing of it, so no prefix is predicted anywhere."""
    request = _checked(body, lambda obj: check_messages_request(obj, count_tokens=True))
    parsed = _parsed(request, _converted(messages_to_chat, request), COUNT_TOKENS, 0)
    return _unkeyed(parsed)


def parse_responses(body: bytes) -> ParsedRequest:
    """A /v1/responses body: checked, and its conversation as vLLM renders it. One that
    continues a stored response is not keyed: its history lives on the replica holding it."""
    request = _checked(body, check_responses_request)
    limit = request.get("max_output_tokens")
    parsed = _parsed(request, _converted(responses_to_chat, request), RESPONSES, limit)
    previous = request.get("previous_response_id")
    if previous:
        parsed = _unkeyed(parsed, previous_response_id=previous)
    return parsed


def _checked(body: bytes, check: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
    if not body:
        raise bad_request("The request body is empty; expected a JSON object.")
    try:
        obj = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad_request("The request body is nested too deeply.") from None
    try:
        checked: dict[str, Any] = check(obj)
    except AgentRequestError as exc:
        raise _invalid(exc) from None
    except (TypeError, AttributeError, KeyError) as exc:  # a shape the checks did not foresee
        raise _misshapen(exc) from None
    return checked


def _converted(
    convert: Callable[[dict[str, Any]], ChatConversion], request: dict[str, Any]
) -> ChatConversion:
    try:
        return convert(request)
    except AgentRequestError as exc:  # an input item vLLM cannot convert either
        raise _invalid(exc) from None
    except (TypeError, AttributeError, KeyError) as exc:  # a shape the checks did not foresee
        raise _misshapen(exc) from None


def _invalid(exc: AgentRequestError) -> ApiError:
    return ApiError(400, f"Invalid request: {exc}", param=exc.param)


def _misshapen(exc: Exception) -> ApiError:
    """A body whose fields have types vLLM's request models would refuse too: a 400 (never a
    500), saying what Python found."""
    return ApiError(400, f"Invalid request: a field has the wrong type or shape ({exc}).")


def _parsed(
    request: dict[str, Any], conversion: ChatConversion, api: str, max_tokens: int | None
) -> ParsedRequest:
    chars = sum(_chars(m.get("content")) for m in conversion.messages)
    tools = conversion.tools
    if tools:
        chars += len(msgspec.json.encode(tools))
    return ParsedRequest(
        request["model"],
        bool(request.get("stream")),
        chars // CHARS_PER_TOKEN + 1 + 4 * len(conversion.messages),
        min(max_tokens if max_tokens is not None else DEFAULT_CHAT_MAX_TOKENS, MAX_TOKENS_FOR_LOAD),
        _user_of(request),
        cache_salt=request.get("cache_salt")
        if isinstance(request.get("cache_salt"), str)
        else None,
        messages=conversion.messages,
        chat_options=conversion.chat_options(),
        add_special_tokens=conversion.add_special_tokens,
        api=api,
        merged_messages=conversion.merged_messages,
        fields=request,
    )


def _unkeyed(parsed: ParsedRequest, **changes: Any) -> ParsedRequest:
    """The same request routed by load alone (no prompt for the router to tokenize)."""
    return replace(parsed, messages=None, merged_messages=None, **changes)


def _user_of(request: dict[str, Any]) -> str | None:
    """OpenAI's ``user`` (Responses). The session, Messages' ``metadata.user_id`` (Claude
    Code's) included, is detected from the whole body (kvcore/agent_identity.py)."""
    user = request.get("user")
    return user if isinstance(user, str) and user else None


def _chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        texts = (p.get("text") for p in content if isinstance(p, dict))
        return sum(len(t) for t in texts if isinstance(t, str))
    return 0
