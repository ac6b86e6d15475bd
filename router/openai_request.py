"""Parse and validate OpenAI request bodies just enough to route them.

The body is forwarded to the replica byte for byte; what is decoded here is only what
routing needs (model, stream flag, token estimate, session key) plus the type checks that
must fail with a clear 400 instead of reaching a replica.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import msgspec

from .errors import ApiError, bad_request

# Without a tokenizer, a prompt's token count is estimated from its length.
CHARS_PER_TOKEN = 4
# OpenAI's default max_tokens for completions; chat has no default, so assume a typical reply.
DEFAULT_COMPLETION_MAX_TOKENS = 16
DEFAULT_CHAT_MAX_TOKENS = 256
# The load estimate never counts more output than this (a huge max_tokens is the replica's to reject).
MAX_TOKENS_FOR_LOAD = 32768


class _Common(msgspec.Struct, kw_only=True):
    model: str
    stream: bool = False
    max_tokens: int | None = None
    user: str | None = None
    # vLLM salts the first block's hash with it: requests with different salts share no blocks.
    cache_salt: str | None = None
    stream_options: dict[str, Any] | None = None
    # What the session is detected from (kvcore/agent_identity.py), read as sent: their types
    # are the detector's to check (a wrong one is skipped, not refused).
    prompt_cache_key: Any = None
    session_id: Any = None
    vllm_xargs: Any = None
    metadata: Any = None


def identity_fields(req: _Common) -> dict[str, Any]:
    """The top-level fields ``kvcore.agent_identity.detect`` reads."""
    return {
        "user": req.user,
        "prompt_cache_key": req.prompt_cache_key,
        "session_id": req.session_id,
        "vllm_xargs": req.vllm_xargs,
        "metadata": req.metadata,
    }


class CompletionBody(_Common, kw_only=True):
    prompt: str | list[Any]
    add_special_tokens: bool = True


class ChatFields(_Common, kw_only=True):
    """A chat body's fields but its messages."""

    max_completion_tokens: int | None = None
    add_generation_prompt: bool | None = None  # vLLM's default: true
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    # Both reach the chat template as in vLLM (ChatCompletionRequest.build_chat_params).
    documents: list[dict[str, str]] | None = None
    reasoning_effort: str | None = None


class ChatBody(ChatFields, kw_only=True):
    # Kept as dicts: chat templates may read any field (name, tool_calls, tool_call_id, ...).
    messages: list[dict[str, Any]]


_completion_decoder = msgspec.json.Decoder(CompletionBody)
_chat_decoder = msgspec.json.Decoder(ChatBody)


@dataclass(slots=True, frozen=True)
class ParsedRequest:
    model: str
    stream: bool
    prompt_tokens: int  # an estimate from the text length, until the router tokenizes
    max_tokens: int
    user: str | None
    cache_salt: str | None = None
    # What the replica will tokenize, for the router to tokenize the same way:
    prompt_text: str | None = None  # a completion's (first) string prompt
    prompt_ids: list[int] | None = None  # a completion's (first) token-id prompt
    messages: list[dict[str, Any]] | None = None  # a chat's messages
    chat_options: dict[str, Any] | None = None  # add_generation_prompt, tools, ...
    add_special_tokens: bool = True
    include_usage: bool = False  # the client asked for a stream's usage chunk
    # The API it came in on: "completions", "chat", or an agent API's ("messages",
    # "count_tokens", "responses"; router/agent_request.py). The body goes out in it as it came.
    api: str = "chat"
    # An agent API's conversation with inline system messages merged into the first, for
    # templates that require system-first ordering (as vLLM does); None: nothing to merge.
    merged_messages: list[dict[str, Any]] | None = None
    # Responses: the stored response this one continues (it lives on one replica).
    previous_response_id: str | None = None
    # The body's top-level fields the session is detected from (kvcore/agent_identity.py).
    fields: Mapping[str, Any] | None = None
    # Messages: the longest ``cache_control`` ttl it names, in seconds (kvcore/cache_hints.py).
    cache_ttl_s: float | None = None


def _include_usage(options: dict[str, Any] | None) -> bool:
    return isinstance(options, dict) and options.get("include_usage") is True


def parse_completion(body: bytes) -> ParsedRequest:
    req = _decode(_completion_decoder, body)
    prompt = req.prompt
    text: str | None = None
    ids: list[int] | None = None
    if isinstance(prompt, str):
        prompt_tokens = _estimate_tokens(len(prompt))
        text = prompt
    else:
        prompt_tokens = _list_prompt_tokens(prompt)
        # A batch of prompts is routed as one request, by its first prompt.
        first = prompt[0]
        if isinstance(first, str):
            text = first
        elif isinstance(first, list):
            ids = first
        else:
            ids = prompt
    max_tokens = _check_max_tokens(req.max_tokens, "max_tokens", DEFAULT_COMPLETION_MAX_TOKENS)
    return ParsedRequest(
        req.model,
        req.stream,
        prompt_tokens,
        max_tokens,
        req.user,
        cache_salt=req.cache_salt,
        prompt_text=text,
        prompt_ids=ids,
        add_special_tokens=req.add_special_tokens,
        include_usage=_include_usage(req.stream_options),
        api="completions",
        fields=identity_fields(req),
    )


def parse_chat(body: bytes) -> ParsedRequest:
    req = _decode(_chat_decoder, body)
    if not req.messages:
        raise bad_request("'messages' must contain at least one message.", "messages")
    return chat_request(req, req.messages, message_chars(req.messages))


def chat_request(req: ChatFields, messages: list[dict[str, Any]], chars: int) -> ParsedRequest:
    """The chat request of these fields and (checked) messages with ``chars`` of content."""
    if req.continue_final_message and req.add_generation_prompt:  # both given as true
        raise bad_request(
            "'continue_final_message' and 'add_generation_prompt' cannot both be true.",
            "continue_final_message",
        )
    requested = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    max_tokens = _check_max_tokens(requested, "max_tokens", DEFAULT_CHAT_MAX_TOKENS)
    # A few tokens per message for the chat template's role markers.
    prompt_tokens = _estimate_tokens(chars) + 4 * len(messages)
    options = {
        "add_generation_prompt": req.add_generation_prompt is not False,
        "continue_final_message": req.continue_final_message,
        "tools": req.tools,
        "chat_template_kwargs": req.chat_template_kwargs,
        "documents": req.documents,
        "reasoning_effort": req.reasoning_effort,
    }
    return ParsedRequest(
        req.model,
        req.stream,
        prompt_tokens,
        max_tokens,
        req.user,
        cache_salt=req.cache_salt,
        messages=messages,
        chat_options=options,
        add_special_tokens=req.add_special_tokens,
        include_usage=_include_usage(req.stream_options),
        fields=identity_fields(req),
    )


def message_chars(messages: list[dict[str, Any]], first_index: int = 0) -> int:
    """The messages' content characters; 400 for the first one whose role or content has the
    wrong type (numbered from ``first_index``)."""
    chars = _plain_chars(messages)
    return chars if chars is not None else _checked_chars(messages, first_index)


def _plain_chars(messages: list[dict[str, Any]]) -> int | None:
    """The content characters when every message's role is a string and its content a
    string or null (an agent's 300-message history: checked in C, not message by message),
    else None: ``_checked_chars`` decides."""
    n = len(messages)
    roles = map(dict.get, messages, repeat("role", n))
    contents = list(map(dict.get, messages, repeat("content", n)))
    if set(map(type, roles)) == _STR and set(map(type, contents)) <= _TEXT_OR_NULL:
        return sum(map(len, filter(None, contents)))
    return None


_STR = {str}
_TEXT_OR_NULL = {str, type(None)}


def _checked_chars(messages: list[dict[str, Any]], first_index: int) -> int:
    """The content characters, each message checked (400 for the first one that is wrong)."""
    chars = 0
    for i, message in enumerate(messages, first_index):
        role = message.get("role")
        if not isinstance(role, str):
            raise bad_request(
                f"Invalid request: 'messages[{i}].role' must be a string.", f"messages[{i}].role"
            )
        content = message.get("content")
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            for j, part in enumerate(content):
                text = part.get("text") if isinstance(part, dict) else part
                if text is not None and not isinstance(text, str):
                    raise bad_request(
                        f"Invalid request: 'messages[{i}].content[{j}].text' must be a string.",
                        f"messages[{i}].content[{j}].text",
                    )
                chars += len(text or "")
        elif content is not None:
            raise bad_request(
                f"Invalid request: 'messages[{i}].content' must be a string, a list of "
                "content parts, or null.",
                f"messages[{i}].content",
            )
    return chars


def _decode(decoder: msgspec.json.Decoder[Any], body: bytes) -> Any:
    """The decoded body; a 400 that says what is wrong with it."""
    if not body:
        raise bad_request("The request body is empty; expected a JSON object.")
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        reason, _, where = str(exc).partition(" - at ")
        param = where.strip("`").removeprefix("$").lstrip(".") or None
        if reason.startswith("Object missing required field"):
            field = reason.split("`")[1]
            param = f"{param}.{field}" if param else field
        reason = reason.replace("`", "'")
        raise bad_request(
            f"Invalid request: {reason}" + (f" at '{param}'" if param else ""), param
        ) from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad_request("The request body is nested too deeply.") from None


def _estimate_tokens(chars: int) -> int:
    return chars // CHARS_PER_TOKEN + 1


def _list_prompt_tokens(prompt: list[Any]) -> int:
    """A prompt given as a list: of strings, of token ids, or of token-id lists."""
    if not prompt:
        raise bad_request("'prompt' must not be an empty list.", "prompt")
    first = prompt[0]
    if isinstance(first, str):
        if not all(isinstance(p, str) for p in prompt):
            raise _bad_prompt()
        return sum(_estimate_tokens(len(p)) for p in prompt)
    if isinstance(first, int) and not isinstance(first, bool):
        if not all(_is_token_id(t) for t in prompt):
            raise _bad_prompt()
        return len(prompt)
    if isinstance(first, list):
        if not all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in prompt):
            raise _bad_prompt()
        return sum(len(p) for p in prompt)
    raise _bad_prompt()


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _bad_prompt() -> ApiError:
    return bad_request(
        "'prompt' must be a string, a list of strings, a list of token ids, "
        "or a list of token-id lists.",
        "prompt",
    )


def _check_max_tokens(value: int | None, param: str, default: int) -> int:
    if value is None:
        return default
    if value < 0:
        raise bad_request(f"'{param}' must be >= 0, got {value}.", param)
    return min(value, MAX_TOKENS_FOR_LOAD)
