"""Tokens sent once (``routing.send_tokens``): which requests go to vLLM as token ids, and how.

The pure part (the generate request, the answer in the client's API) is kvcore/token_path.py.
Here: reading a request's top-level fields without decoding its conversation again, one try's
body and answer, and the counts on /metrics. Which replicas take token ids, with their context
length and sampling defaults, the health probe finds out (health/probe.py).
"""

from __future__ import annotations

import logging
import os
import time
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from prometheus_client.core import CounterMetricFamily, Metric

from kvroute.kvcore import token_path as tp

from .sse import sse_error

log = logging.getLogger(__name__)

# How a request went (kvroute_send_tokens_requests_total's ``path``).
TOKENS = "tokens"  # as token ids to /inference/v1/generate
# A field the token path cannot answer exactly (tools, ...), or a prompt that leaves no room.
NEEDS_TEXT = "request_needs_text"
NOT_TOKENIZED = "not_tokenized"  # no tokenizer, a template error, a broken worker pool
# The replica takes text only: no /inference/v1/generate, a reasoning parser, or not probed yet.
REPLICA_TAKES_TEXT = "replica_takes_text"

# Top-level fields never needed to decide or to answer: the conversation itself (rendered and
# tokenized by the router already) and tools (whose presence alone sends a request as text).
_NOT_DECODED = frozenset(("messages", "input", "system", "tools"))
_TOP_LEVEL = msgspec.json.Decoder(dict[str, msgspec.Raw])


def request_fields(body: bytes) -> dict[str, Any] | None:
    """The body's top-level fields but its conversation, decoded; None if it is not an object.
    The conversation's keys stay (present, not decoded): ``blocker`` sees every field."""
    try:
        top = _TOP_LEVEL.decode(body)
        return {
            k: _presence(raw) if k in _NOT_DECODED else msgspec.json.decode(raw)
            for k, raw in top.items()
        }
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def _presence(raw: msgspec.Raw) -> bool | None:
    """True for a field with content, None for null or an empty list (as if absent)."""
    return None if bytes(raw).strip() in (b"null", b"[]") else True


def blocker(api: str, fields: Mapping[str, Any]) -> str | None:
    """Why this request goes as text, or None. ``tools`` count only when non-empty, as vLLM
    renders no tools for an empty list (its value is not decoded: present means some)."""
    if fields.get("tools") is not None:
        return "the field 'tools'"
    return tp.blocker(api, {k: v for k, v in fields.items() if k not in _NOT_DECODED})


@dataclass(slots=True)
class TokenRequest:
    """A request that may go as token ids: what every try at it needs."""

    api: str
    fields: dict[str, Any]  # request_fields
    model: str
    ids: Sequence[int]  # an array or a list: made a list only for a try that sends them
    stream: bool
    cache_salt: str | None
    # The last replica's body: replicas of a model mostly share context length and defaults.
    _made: tuple[tp.ReplicaTokenPath, tuple[bytes, int | None] | None] | None = None

    def body(self, replica: tp.ReplicaTokenPath) -> tuple[bytes, int | None] | None:
        """The generate body for a replica with this context length and these defaults, and
        its max_tokens; None when the client asks for as much as the context holds or more, or
        the prompt leaves no room for a token: vLLM's own endpoints refuse those with their own
        error (the context's length, or Responses' limit), where generate would clamp or be
        asked for no token at all."""
        if self._made is not None and self._made[0] == replica:
            return self._made[1]
        made: tuple[bytes, int | None] | None = None
        asked = tp.asked_max_tokens(self.api, self.fields)
        room = replica.max_model_len - len(self.ids)
        if room > 0 and (asked is None or asked < replica.max_model_len):
            params = tp.sampling_params(
                self.api, self.fields, replica.defaults, len(self.ids), replica.max_model_len
            )
            priority = self.fields.get("priority")
            ids = self.ids
            body = tp.generate_body(
                self.model,
                ids.tolist() if isinstance(ids, array) else list(ids),
                params,
                stream=self.stream,
                cache_salt=self.cache_salt,
                priority=priority if isinstance(priority, int) else None,
            )
            made = (body, params.get("max_tokens"))
        self._made = (replica, made)
        return made

    def answer(self, max_tokens: int | None) -> tp.Answer:
        """A new writer of one try's answer in the client's API."""
        prefix = {"chat": "chatcmpl-", "messages": "msg_", "responses": "resp_"}[self.api]
        ids = tp.AnswerIds(
            prefix + os.urandom(8).hex(), int(time.time()), item_id="msg_" + os.urandom(8).hex()
        )
        api = self.api
        return tp.Answer(
            api,
            self.fields,
            ids,
            prompt_tokens=len(self.ids),
            max_tokens=max_tokens,
            error_event=lambda message, seq: sse_error(message, api=api, sequence_number=seq),
        )


class TokenPathMetrics:
    """kvroute_send_tokens_requests_total (a ``RouterMetrics`` part)."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str], int] = {}  # (api, path) -> requests

    def count(self, api: str, path: str) -> None:
        key = (api, path)
        self.requests[key] = self.requests.get(key, 0) + 1

    def snapshot(self) -> Any:
        return {"requests": [[*k, v] for k, v in self.requests.items()]}

    def families(self, peers: list[Any]) -> Iterable[Metric]:
        family = CounterMetricFamily(
            "kvroute_send_tokens_requests",
            "With routing.send_tokens: requests by the way they went to the replica, "
            f"{TOKENS} (as token ids to vLLM's /inference/v1/generate) or why as text "
            f"({NEEDS_TEXT}: a field only the replica's own API layer answers, such as tools; "
            f"{NOT_TOKENIZED}: the router had no token ids for it; {REPLICA_TAKES_TEXT}: the "
            "replica serves no /inference/v1/generate, renders otherwise, parses reasoning, or "
            "is not probed yet). Counted only once some replica of the request's pool takes "
            "token ids.",
            labels=["api", "path"],
        )
        merged = dict(self.requests)
        for peer in peers:
            for api, path, count in peer.get("requests", []):
                merged[(api, path)] = merged.get((api, path), 0) + count
        for (api, path), count in sorted(merged.items()):
            family.add_metric([api, path], count)
        yield family


# (replica, model) -> where that replica takes the model's requests as token ids, else None.
TokenPaths = Callable[[str, str], tp.ReplicaTokenPath | None]
