"""Parse and validate OpenAI request bodies just enough to route them.

The body is forwarded to the replica byte for byte; what is decoded here is only what
routing needs (model, stream flag, token estimate, session key) plus the type checks that
must fail with a clear 400 instead of reaching a replica.
"""

from __future__ import annotations

from dataclasses import dataclass
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


class CompletionBody(_Common, kw_only=True):
    prompt: str | list[Any]


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[Any] | None = None


class ChatBody(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


_completion_decoder = msgspec.json.Decoder(CompletionBody)
_chat_decoder = msgspec.json.Decoder(ChatBody)


@dataclass(slots=True, frozen=True)
class ParsedRequest:
    model: str
    stream: bool
    prompt_tokens: int
    max_tokens: int
    user: str | None


def parse_completion(body: bytes) -> ParsedRequest:
    req = _decode(_completion_decoder, body)
    prompt = req.prompt
    if isinstance(prompt, str):
        prompt_tokens = _estimate_tokens(len(prompt))
    else:
        prompt_tokens = _list_prompt_tokens(prompt)
    max_tokens = _check_max_tokens(req.max_tokens, "max_tokens", DEFAULT_COMPLETION_MAX_TOKENS)
    return ParsedRequest(req.model, req.stream, prompt_tokens, max_tokens, req.user)


def parse_chat(body: bytes) -> ParsedRequest:
    req = _decode(_chat_decoder, body)
    if not req.messages:
        raise bad_request("'messages' must contain at least one message.", "messages")
    chars = 0
    for message in req.messages:
        content = message.content
        if isinstance(content, str):
            chars += len(content)
        elif content is not None:
            chars += sum(len(part.get("text", "")) for part in content if isinstance(part, dict))
    requested = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    max_tokens = _check_max_tokens(requested, "max_tokens", DEFAULT_CHAT_MAX_TOKENS)
    # A few tokens per message for the chat template's role markers.
    prompt_tokens = _estimate_tokens(chars) + 4 * len(req.messages)
    return ParsedRequest(req.model, req.stream, prompt_tokens, max_tokens, req.user)


def _decode(decoder: msgspec.json.Decoder[Any], body: bytes) -> Any:
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
