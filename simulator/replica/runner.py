"""Drive the engine model in real time: one step, sleep for the step's modelled duration
(times the time scale), hand each request its new tokens, publish the step's KV events."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from kvroute.kvcore.kv_events import KVEvent
from kvroute.simulator.engine import Engine, EngineRequest, RequestOutput

log = logging.getLogger(__name__)

# When steps make no progress (nothing schedulable), wait this long before trying again.
_IDLE_STEP_S = 0.001


class EngineRunner:
    def __init__(
        self,
        engine: Engine,
        time_scale: float,
        publish: Callable[[list[KVEvent]], None],
        slowdown: Callable[[], float] = lambda: 1.0,
    ) -> None:
        self.engine = engine
        self._time_scale = time_scale
        self._publish = publish
        self._slowdown = slowdown
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="engine-runner")

    def submit(self, request: EngineRequest) -> asyncio.Queue[RequestOutput]:
        """Queue a request; its outputs arrive on the returned queue. Raises ValueError if invalid."""
        self.engine.add_request(request)
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request.request_id] = queue
        self._wake.set()
        return queue

    def abort(self, request_id: str) -> None:
        if self._queues.pop(request_id, None) is not None:
            self.engine.abort_request(request_id)
            self._wake.set()

    def reset_prefix_cache(self) -> bool:
        # Like vLLM, the AllBlocksCleared event goes out with the next engine step's batch.
        return self.engine.reset_prefix_cache()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.engine.has_unfinished_requests():
                self._wake.clear()
                await self._wake.wait()
            out = self.engine.step(loop.time())
            delay = out.duration_s * self._time_scale * self._slowdown()
            await asyncio.sleep(delay if (out.outputs or out.events) else max(delay, _IDLE_STEP_S))
            for output in out.outputs:
                queue = self._queues.get(output.request_id)
                if queue is not None:
                    queue.put_nowait(output)
                    if output.finished:
                        del self._queues[output.request_id]
            if out.events:
                try:
                    self._publish(out.events)
                except Exception:  # never let a publishing problem stop the engine
                    log.exception("publishing KV events failed")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
