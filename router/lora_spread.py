"""Spreading hot LoRA adapters: the async shell around ``kvcore.lora_spread``.

Every ``lora.interval_s`` (``lora.spread: true`` in the config) the planner looks at each model
pool's replicas and says which adapter to load where (vLLM's ``POST /v1/load_lora_adapter``,
which needs ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` on the replica) and which adapter it
loaded earlier may leave (``/v1/unload_lora_adapter``). After a change the replicas are probed
again, so their /v1/models (and with it who may serve the adapter) is current at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence

import httpx

from kvroute.kvcore.lora_spread import LoraSpreadPlanner, SpreadAction, SpreadSettings
from kvroute.policies import ReplicaState

log = logging.getLogger(__name__)


class LoraSpreader:
    def __init__(
        self,
        settings: SpreadSettings,
        pools: Callable[[], Iterable[Sequence[ReplicaState]]],
        base_url: Callable[[str], str | None],
        changed: Callable[[], Awaitable[None]],
        *,
        interval_s: float = 2.0,
        timeout_s: float = 30.0,
    ) -> None:
        self.planner = LoraSpreadPlanner(settings)
        self._pools = pools
        self._base_url = base_url
        self._changed = changed
        self._interval_s = interval_s
        self._client = httpx.AsyncClient(timeout=timeout_s, trust_env=False)
        self._task: asyncio.Task[None] | None = None
        # What was done, for /admin and tests: (action, ok), newest last.
        self.history: list[tuple[SpreadAction, bool]] = []

    async def run_once(self, now: float | None = None) -> list[tuple[SpreadAction, bool]]:
        """One round: plan over every pool, carry the actions out, probe after a change."""
        now = time.monotonic() if now is None else now
        actions = [a for replicas in self._pools() for a in self.planner.plan(replicas, now)]
        if not actions:
            return []
        done = await asyncio.gather(*(self._act(a, now) for a in actions))
        results = list(zip(actions, done, strict=True))
        self.history = [*self.history, *results][-100:]
        if any(done):
            await self._changed()
        return results

    async def _act(self, action: SpreadAction, now: float) -> bool:
        url = self._base_url(action.replica)
        if url is None:
            return False
        if action.kind == "load":
            path, body = (
                "/v1/load_lora_adapter",
                {
                    "lora_name": action.adapter,
                    "lora_path": action.path,
                },
            )
        else:
            path, body = "/v1/unload_lora_adapter", {"lora_name": action.adapter}
        try:
            response = await self._client.post(url + path, json=body)
            ok = response.status_code == 200
            why = f"{response.status_code}: {' '.join(response.text.split())[:200]}"
        except (httpx.HTTPError, OSError) as exc:
            ok, why = False, str(exc) or type(exc).__name__
        if ok:
            log.info("LoRA adapter %s: %sed on replica %s", action.adapter, action.kind,
                     action.replica)  # fmt: skip
        else:
            log.warning(
                "LoRA adapter %s: %s on replica %s failed (%s)%s",
                action.adapter,
                action.kind,
                action.replica,
                why,
                "; is VLLM_ALLOW_RUNTIME_LORA_UPDATING=True set there?"
                if action.kind == "load"
                else "",
            )
            if action.kind == "load":
                self.planner.load_failed(action.replica, action.adapter, now)
        return ok

    def forget(self, replica: str) -> None:
        self.planner.forget(replica)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kvroute-lora-spread")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.run_once()
            except Exception:  # one bad round must not end spreading for good
                log.exception("LoRA spread round failed")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._client.aclose()
