"""The batch lane put together for the router: its store, its runner and its endpoints
(OpenAI's Files and Batches, Anthropic's Message Batches)."""

from __future__ import annotations

from aiohttp import web

from kvroute.policies import FleetView

from ..admission import Admission
from ..auth import Auth
from ..config import BatchConfig, ConfigError
from ..pipeline import RequestPipeline
from ..tenants import Tenants
from .api import BatchApi
from .messages_api import MessageBatchApi
from .metrics import BatchMetrics
from .runner import BatchRunner
from .store import default_store_url, open_store, redacted


class BatchLane:
    def __init__(
        self,
        config: BatchConfig,
        pipeline: RequestPipeline,
        admission: Admission,
        fleet: FleetView,
        auth: Auth,
        tenants: Tenants | None,
        metrics: BatchMetrics,
    ) -> None:
        self.url = config.store or default_store_url()
        self.store = open_store(self.url)
        self.runner = BatchRunner(config, self.store, pipeline, admission, fleet, metrics)
        parts = (config, self.store, self.runner, auth, tenants, pipeline.catalog)
        self.api = BatchApi(*parts)
        # Anthropic's Message Batches: jobs of the same lane, shown as Anthropic shows them.
        self.messages = MessageBatchApi(*parts)

    def add_routes(self, routes: web.UrlDispatcher) -> None:
        self.api.add_routes(routes)
        self.messages.add_routes(routes)

    async def start(self) -> None:
        """Open the store (creating its tables) and resume whatever jobs it holds."""
        try:
            await self.store.open()
        except Exception as exc:  # sqlite3, psycopg or OS errors: one line, no traceback
            why = " ".join(str(exc).split())  # psycopg's messages span lines
            raise ConfigError(f"batch.store: cannot open {redacted(self.url)}: {why}") from None
        self.runner.start()

    async def close(self) -> None:
        await self.runner.close()
        await self.store.close()
