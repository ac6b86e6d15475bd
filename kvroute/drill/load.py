"""Open-loop load for drills: requests at a fixed rate, each judged as a client would judge it.

A request is *lost* when its client did not get a whole, successful answer: an error status,
a connection error, an SSE error event, or a stream that ended without its finish and [DONE]
(``kvroute.simulator.loadgen``, which sends them, judges them so).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import aiohttp

from kvroute.simulator.loadgen import Outcome, Planned, request_body, run_open_loop

# Tenants with their own long system prompt, so cache-aware routing has prefixes to follow;
# enough of them that every replica is home to some (and has streams in flight when it fails).
_TENANT_PROMPTS = [
    f"You are assistant {t} of a drill. Answer briefly. " + f"Context {t}: " + "lorem ipsum " * 40
    for t in range(16)
]


@dataclass
class LoadResult:
    outcomes: list[Outcome] = field(default_factory=list)  # in the order they were sent


async def run_load(
    url: str,
    model: str,
    rate: float,
    duration_s: float,
    max_tokens: int,
    started: float,
    api_key: str | None = None,
    api: str = "completions",
) -> LoadResult:
    """Send ``rate`` requests per second for ``duration_s`` from ``started`` (a
    ``time.monotonic()``), alternating streamed and not, in ``api`` (completions, chat,
    messages or responses)."""
    n = int(rate * duration_s)
    plan = _plan(url, model, rate, max_tokens, n, None, api)
    return await _send(url, plan, started, api_key)


async def run_load_until(
    url: str,
    model: str,
    rate: float,
    max_tokens: int,
    started: float,
    stop: Callable[[], bool],
    api_key: str | None = None,
) -> LoadResult:
    """``run_load`` without a set length: requests keep coming until ``stop()`` (a rollout
    drill lasts as long as its rollout)."""
    return await _send(url, _plan(url, model, rate, max_tokens, None, stop), started, api_key)


def _plan(
    url: str,
    model: str,
    rate: float,
    max_tokens: int,
    n: int | None,
    stop: Callable[[], bool] | None,
    api: str = "completions",
) -> Iterator[Planned]:
    for i in itertools.count():
        if (n is not None and i >= n) or (stop is not None and stop()):
            return
        system = _TENANT_PROMPTS[i % len(_TENANT_PROMPTS)]
        question = f" Question {i}: why?"
        stream = i % 2 == 0
        if api == "completions":
            path = "/v1/completions"
            body = {"model": model, "prompt": system + question, "max_tokens": max_tokens}
        else:
            turns = [{"role": "user", "content": question.strip()}]
            path, body = request_body(api, model, system, turns, max_tokens)
        body["stream"] = stream
        yield Planned(i / rate, url + path, body)


async def _send(
    url: str, plan: Iterator[Planned], started: float, api_key: str | None
) -> LoadResult:
    outcomes: dict[int, Outcome] = {}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, headers=headers) as http:
        await run_open_loop(http, plan, started=started, on_done=outcomes.__setitem__)
    return LoadResult([outcomes[i] for i in sorted(outcomes)])
