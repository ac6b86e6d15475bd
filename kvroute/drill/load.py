"""Open-loop load for drills: requests at a fixed rate, each judged as a client would judge it.

A request is *lost* when its client did not get a whole, successful answer: an error status,
a connection error, an SSE error event, or a stream that ended without its finish and [DONE].
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp

# Tenants with their own long system prompt, so cache-aware routing has prefixes to follow;
# enough of them that every replica is home to some (and has streams in flight when it fails).
_TENANT_PROMPTS = [
    f"You are assistant {t} of a drill. Answer briefly. " + f"Context {t}: " + "lorem ipsum " * 40
    for t in range(16)
]


@dataclass(slots=True)
class Outcome:
    sent_at: float  # seconds since the drill started
    stream: bool
    ok: bool = False
    status: int = 0
    error: str = ""
    ttft_s: float | None = None  # streams: first content; non-streamed: the whole answer
    replica: str = ""


@dataclass
class LoadResult:
    outcomes: list[Outcome] = field(default_factory=list)


async def run_load(
    url: str,
    model: str,
    rate: float,
    duration_s: float,
    max_tokens: int,
    started: float,
    api_key: str | None = None,
) -> LoadResult:
    """Send ``rate`` requests per second for ``duration_s``, alternating streamed and not."""
    result = LoadResult()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, headers=headers) as http:
        tasks = []
        n = int(rate * duration_s)
        for i in range(n):
            due = started + i / rate
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            outcome = Outcome(time.monotonic() - started, stream=i % 2 == 0)
            result.outcomes.append(outcome)
            prompt = _TENANT_PROMPTS[i % len(_TENANT_PROMPTS)] + f" Question {i}: why?"
            tasks.append(asyncio.create_task(_one(http, url, model, prompt, max_tokens, outcome)))
        await asyncio.gather(*tasks)
    return result


async def _one(
    http: aiohttp.ClientSession,
    url: str,
    model: str,
    prompt: str,
    max_tokens: int,
    outcome: Outcome,
) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": outcome.stream}
    sent = time.monotonic()
    try:
        async with http.post(url + "/v1/completions", json=body) as resp:
            outcome.status = resp.status
            outcome.replica = resp.headers.get("X-Kvroute-Replica", "")
            if resp.status != 200:
                outcome.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            if not outcome.stream:
                data = await resp.json()
                outcome.ttft_s = time.monotonic() - sent
                outcome.ok = bool(data.get("choices")) and data["choices"][0].get("finish_reason")
                if not outcome.ok:
                    outcome.error = "answer without a finish_reason"
                return
            finished = done = False
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    done = True
                    continue
                event = json.loads(payload)
                if "error" in event:
                    outcome.error = f"SSE error: {event['error'].get('message', '')[:200]}"
                    return
                for choice in event.get("choices", []):
                    if outcome.ttft_s is None and choice.get("text"):
                        outcome.ttft_s = time.monotonic() - sent
                    if choice.get("finish_reason"):
                        finished = True
            outcome.ok = finished and done
            if not outcome.ok:
                outcome.error = "stream ended without finish_reason and [DONE]"
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
