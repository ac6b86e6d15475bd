"""One try of one request on one replica: dispatch in the ledger, relay, record the outcome."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvroute.backends.handle import ReplicaHandle
from kvroute.kvcore.ledger import Route
from kvroute.kvcore.reuse import available_tokens, decompose
from kvroute.kvcore.token_path import Answer

from .dp_ranks import RANK_HEADER
from .metrics import RouterMetrics
from .pools import Pools
from .proxy import (
    ClientExchange,
    Relayed,
    Timeouts,
    UpstreamCall,
    UpstreamUnavailable,
    relay,
    replica_fault,
)
from .registry import ReplicaRegistry
from .status import RecentDispatches
from .upstream_client import UpstreamClient

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Try:
    """What one try sends: the body (a continuation's differs), why this replica, and how."""

    body: bytes
    request_id: str
    reason: str
    retry_status: bool  # a retryable answer raises instead of reaching the client
    resume: bool = False  # write into the client's open stream
    path: str | None = None  # where on the replica (a continuation's); None: the client's
    # Sent as token ids (routing.send_tokens): writes the generate answer in the client's API.
    answer: Answer | None = None


class Forwarder:
    def __init__(
        self,
        pools: Pools,
        registry: ReplicaRegistry,
        metrics: RouterMetrics,
        timeouts: Timeouts,
        decision_headers: bool,
    ) -> None:
        self.pools = pools  # a dispatch goes in the ledger of its replica's pool
        self.registry = registry
        self.metrics = metrics
        self.timeouts = timeouts
        self.decision_headers = decision_headers
        self.client: UpstreamClient | None = None  # opened with the app
        self.recent = RecentDispatches()  # the last few, for /status (read only there)

    async def forward(
        self, exchange: ClientExchange, route: Route, replica_id: str, attempt: Try
    ) -> Relayed | None:
        """Relay to one replica; None when it failed before the first byte."""
        handle = self.registry.handles[replica_id]
        pool = self.pools.owner(replica_id)
        ledger, bus = pool.ledger, pool.bus
        dispatch = ledger.dispatch(route, replica_id, time.monotonic(), attempt.reason)
        if bus is not None:
            bus.dispatched(dispatch)
        self.recent.append(dispatch)  # O(1), bounded: all /status costs the data path
        if route.estimate is not None:
            # Once per decision, not per try: a retry is not a second choice.
            self.metrics.observe_estimate(route.estimate)
            route.estimate = None
        self.registry.dispatched(handle)
        metrics = self.metrics
        transferred = dispatch.transferred

        def answered(status: int) -> None:
            ok = status < 400
            # A decode leg's prompt was routed (and counted) as its prefill leg.
            if ledger.first_token(dispatch, time.monotonic(), ok):
                if bus is not None:
                    bus.first_token(dispatch, ok)
                if ok and not transferred:
                    prompt = dispatch.request.prompt_tokens
                    metrics.observe_routed(replica_id, prompt, dispatch.cached_tokens)

        extra = [("X-Request-Id", attempt.request_id)]
        if self.decision_headers:
            extra += (
                ("X-Kvroute-Replica", replica_id),
                ("X-Kvroute-Reason", dispatch.reason),
                # The prompt tokens the router expects that replica to have cached (index),
                # and the most any eligible replica had: the gap is what load outweighed.
                ("X-Kvroute-Prefix-Hit-Tokens", str(dispatch.cached_tokens)),
                (
                    "X-Kvroute-Prefix-Available-Tokens",
                    str(available_tokens(dispatch.request, dispatch.ranked)),
                ),
            )
        call = UpstreamCall(
            handle.base_url,
            attempt.body,
            self._upstream_headers(attempt, handle),
            extra,
            attempt.retry_status,
            attempt.resume,
            attempt.path,
            attempt.answer,
        )
        started = time.perf_counter()
        assert self.client is not None
        try:
            relayed = await relay(self.client, exchange, call, self.timeouts, answered)
        except UpstreamUnavailable as exc:
            self._unavailable(handle, exc)
            return None
        finally:
            ledger.finish(dispatch, time.monotonic())
            if bus is not None:
                bus.finished(dispatch)
        if relayed.broken is not None and handle.state.draining:
            # Cut by a drain (router/drain.py) to continue elsewhere: not the replica's failure.
            metrics.observe_upstream_error(replica_id, "drained")
        elif relayed.broken is not None:
            metrics.observe_upstream_error(replica_id, "broken_stream")
            self.registry.record(handle, False, "broken_stream")
        elif relayed.status not in (408, 429):
            self.registry.record(handle, not replica_fault(relayed.status))
        elapsed = time.perf_counter() - started
        metrics.observe_request(
            replica_id, relayed.status, dispatch.reason, relayed.ttfb_s, elapsed
        )
        if not attempt.resume and not transferred and relayed.status < 400:
            # A continuation's prompt is not the one routed: only the first answer counts.
            dispatch.confirmed_tokens = relayed.cached_tokens  # /status shows it too
            reuse = decompose(
                dispatch.request,
                dispatch.ranked,
                dispatch.cached_tokens,
                dispatch.confirmed_tokens,
                route.block_tokens,
            )
            metrics.observe_reuse(replica_id, reuse)
        relayed.replica = replica_id
        return relayed

    def _upstream_headers(self, attempt: Try, handle: ReplicaHandle) -> bytes:
        """Header lines added to the client's on the way to the replica (tracing adds its own):
        the request id, and the data-parallel rank picked (router/dp_ranks.py)."""
        lines = b"X-Request-Id: " + attempt.request_id.encode() + b"\r\n"
        if handle.data_parallel_rank is not None:
            lines += f"{RANK_HEADER}: {handle.data_parallel_rank}\r\n".encode()
        return lines

    def _unavailable(self, handle: ReplicaHandle, exc: UpstreamUnavailable) -> None:
        """The replica failed before the first byte: count it, and may take it out of rotation."""
        self.metrics.observe_upstream_error(handle.name, exc.kind)
        if exc.kind == "drained":  # moved off a replica being drained: not its failure
            return
        if exc.kind == "connect":
            self.registry.mark_down(handle)
        if exc.kind != "ejected" and replica_fault(exc.status or 500):
            self.registry.record(handle, False, exc.kind)  # transport errors and 5xx only
        log.warning("replica %s failed before first byte: %s", handle.name, exc)
