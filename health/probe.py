"""Active health probes: GET each replica's health path on an interval.

A replica is taken out of rotation on a failed probe and put back on a passing one; why it is
out (connection refused, timeout, the HTTP status and its text) is kept on the replica as
``down_reason`` for /admin/replicas and the startup line. Each passing probe also reads its
/v1/models, so the router knows which models it can route there, LoRA adapters loaded at
runtime (``/v1/load_lora_adapter``) included.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Sequence
from typing import Any, Protocol
from urllib.parse import urlsplit

import httpx

from kvroute.kvcore.token_path import (
    PROBE_RENDER_PATH,
    ReplicaTokenPath,
    probe_render_body,
    replica_token_path,
)
from kvroute.policies import ReplicaState

log = logging.getLogger(__name__)


class Probeable(Protocol):
    @property
    def base_url(self) -> str: ...

    @property
    def state(self) -> ReplicaState: ...

    # Why the replica is out of rotation (set by the prober, None while healthy).
    down_reason: str | None
    # The data-parallel rank it stands for (its metrics are that engine's), None: all of them.
    data_parallel_rank: int | None


class ActiveProber:
    def __init__(
        self,
        replicas: Callable[[], Sequence[Probeable]],
        *,
        path: str = "/health",
        interval_s: float = 5.0,
        timeout_s: float = 2.0,
        unhealthy_after: int = 3,
        on_change: Callable[[], None] = lambda: None,
        check_generate: bool = False,
        renders_alike: Callable[[str, list[int]], bool | None] | None = None,
        wants_token_path: Callable[[str], bool] = lambda model: True,
    ) -> None:
        self._replicas = replicas
        self._path = path
        self._interval_s = interval_s
        self._on_change = on_change
        # A busy replica can miss one probe: it leaves rotation only after this many misses in a
        # row (a replica never seen healthy joins on its first passing probe).
        self._unhealthy_after = unhealthy_after
        self._misses: dict[str, int] = {}
        # What each replica's /v1/models says its models were loaded from ("root"): for a
        # replica on this machine, the model directory, where the router finds the tokenizer.
        self.model_roots: dict[str, list[str]] = {}
        # LoRA adapters each replica serves (cards with a ``parent``): vLLM keys their KV blocks
        # by adapter name, so the router hashes a request for one the same way.
        self.lora_adapters: dict[str, frozenset[str]] = {}
        # Each model's context length per replica (/v1/models' max_model_len).
        self.max_model_len: dict[str, dict[str, int]] = {}
        # Per replica and model, where it takes token ids (routing.send_tokens): its
        # /inference/v1/generate (--enable-scale-out), context length and sampling defaults;
        # None where it takes text only. Asked once per healthy spell when ``check_generate``.
        self.token_paths: dict[str, dict[str, ReplicaTokenPath | None]] = {}
        self._check_generate = check_generate
        # (model, the replica's ids for PROBE_MESSAGES) -> whether the router's own render
        # and tokenizer give the same ids (None: it has no tokenizer yet): token ids go only
        # where they would be the same.
        self._renders_alike = renders_alike
        # Whether a model's requests may go as token ids at all (its pool has send_tokens and
        # a tokenizer): the others are not asked about.
        self._wants_token_path = wants_token_path
        self._timeout_s = timeout_s
        self._client = httpx.AsyncClient(timeout=timeout_s, trust_env=False)
        self._task: asyncio.Task[None] | None = None

    def forget(self, replica_id: str) -> None:
        """The replica left the fleet."""
        self._misses.pop(replica_id, None)
        self.model_roots.pop(replica_id, None)
        self.lora_adapters.pop(replica_id, None)
        self.max_model_len.pop(replica_id, None)
        self.token_paths.pop(replica_id, None)

    async def probe_all(self) -> None:
        """One round over every replica, concurrently."""
        replicas = list(self._replicas())
        results = await asyncio.gather(*(self._probe(r) for r in replicas))
        if any(results):
            self._on_change()

    async def _probe(self, replica: Probeable) -> bool:
        """Probe one replica; True when what the router knows about it changed."""
        state = replica.state
        failure = await self._check(replica.base_url + self._path)
        passed = failure is None
        misses = 0 if passed else self._misses.get(state.replica_id, 0) + 1
        self._misses[state.replica_id] = misses
        healthy = passed or (state.healthy and misses < self._unhealthy_after)
        changed = healthy != state.healthy
        replica.down_reason = None if healthy else failure
        if not passed:
            # A replica that restarts may come back with other flags.
            self.token_paths.pop(state.replica_id, None)
        if healthy:
            listed = await self._fetch_models(replica.base_url)
            if listed is not None:
                models, roots, adapters, lengths = listed
                self.model_roots[state.replica_id] = roots
                self.max_model_len[state.replica_id] = lengths
                if adapters != self.lora_adapters.get(state.replica_id, frozenset()):
                    self.lora_adapters[state.replica_id] = adapters
                    changed = True
                state.lora_adapters = adapters
                if models != state.models:
                    state.models = models
                    changed = True
            if self._check_generate:
                learnt = await self._probe_token_paths(replica.base_url, state.replica_id, state)
                changed = changed or learnt
        if healthy != state.healthy:
            log.info(
                "replica %s is now %s", state.replica_id, "healthy" if healthy else "unhealthy"
            )
            state.healthy = healthy
        return changed

    async def responds(self, base_url: str) -> bool:
        """Whether the replica answers its health path now (within the probe timeout)."""
        return await self._check(base_url + self._path) is None

    async def _check(self, url: str) -> str | None:
        """None when ``GET url`` answers 200, else why not, in words a user can act on."""
        try:
            response = await self._client.get(url)
        except (httpx.HTTPError, OSError) as exc:
            return describe_failure(url, exc, self._timeout_s)
        if response.status_code == 200:
            return None
        text = " ".join(response.text.split())[:200]
        return f"GET {url} answered {response.status_code}" + (f": {text}" if text else "")

    async def _fetch_models(
        self, base_url: str
    ) -> tuple[frozenset[str], list[str], frozenset[str], dict[str, int]] | None:
        try:
            response = await self._client.get(base_url + "/v1/models")
            data = response.json()["data"]
            models = frozenset(str(m["id"]) for m in data)
            roots = [str(m["root"]) for m in data if isinstance(m.get("root"), str)]
            adapters = frozenset(str(m["id"]) for m in data if isinstance(m.get("parent"), str))
            lengths = {
                str(m["id"]): m["max_model_len"]
                for m in data
                if isinstance(m.get("max_model_len"), int) and m["max_model_len"] > 0
            }
            return models, roots, adapters, lengths
        except (httpx.HTTPError, OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def _alike(self, model: str, render: dict[str, Any], replica_id: str) -> bool | None:
        check = self._renders_alike
        alike = check(model, list(render.get("token_ids") or ())) if check is not None else True
        if alike is not False:
            return alike
        log.warning(
            "replica %s renders a chat for %s differently from the router's tokenizer (a chat "
            "template of its own, or another tokenizer): requests go to it as text, not as "
            "token ids (routing.send_tokens)",
            replica_id,
            model,
        )
        return False

    async def _probe_token_paths(self, base_url: str, replica_id: str, state: ReplicaState) -> bool:
        """For each model not asked yet: whether the replica takes token ids for it. vLLM
        serves its render endpoints exactly where it serves /inference/v1/generate; a render
        of a request that sets no sampling value shows the replica's own defaults, and whether
        it parses reasoning (kvcore/token_path.py). True when it learnt something."""
        known = self.token_paths.setdefault(replica_id, {})
        before = dict(known)
        lengths = self.max_model_len.get(replica_id, {})
        adapters = self.lora_adapters.get(replica_id, frozenset())
        for model in sorted((state.models or frozenset()) - adapters - known.keys()):
            length = lengths.get(model)
            if length is None or not self._wants_token_path(model):
                continue
            try:
                response = await self._client.post(
                    base_url + PROBE_RENDER_PATH, json=probe_render_body(model)
                )
            except (httpx.HTTPError, OSError):
                continue  # asked again next round
            if response.status_code == 200:
                try:
                    render = response.json()
                except ValueError:
                    render = None
                found = replica_token_path(render, length) if isinstance(render, dict) else None
                if found is not None:
                    alike = self._alike(model, render, replica_id)
                    if alike is None:
                        continue  # asked again once the router has its tokenizer
                    found = found if alike else None
                known[model] = found
            elif response.status_code in (400, 404, 405, 422):
                known[model] = None  # no render endpoint (no --enable-scale-out), or no template
        return known != before  # the router's parts are told (on_change)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kvroute-health-probes")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.probe_all()
            except Exception:  # a bug in one round must not end probing for good
                log.exception("health probe round failed")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._client.aclose()


def describe_failure(url: str, exc: BaseException, timeout_s: float) -> str:
    """A failed request to a replica as one line naming its address: refused, timed out, ..."""
    parts = urlsplit(url)
    where = parts.netloc
    if isinstance(exc, httpx.ConnectTimeout):
        return f"timeout: no connection to {where} within {timeout_s:g}s"
    if isinstance(exc, httpx.TimeoutException):
        return f"timeout: GET {url} got no answer within {timeout_s:g}s"
    cause: BaseException | None = exc
    while cause is not None:  # httpx wraps the OS error, sometimes twice
        if isinstance(cause, ConnectionRefusedError):
            return f"connection refused to {where}"
        if isinstance(cause, socket.gaierror):
            return f"cannot resolve {parts.hostname}: {cause.strerror}"
        if isinstance(cause, OSError) and cause.strerror:
            return f"cannot connect to {where}: {cause.strerror}"
        cause = cause.__cause__ or cause.__context__
    return f"GET {url} failed: {exc or type(exc).__name__}"
