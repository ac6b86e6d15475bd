"""Prefill/decode disaggregation: a decode pool's request prefilled on its paired prefill pool.

vLLM's protocol (its NIXL connector's, which its own proxies and the peers' routers speak):
the request goes to a prefill replica with ``kv_transfer_params: {do_remote_decode: true}``,
one output token and no stream; that replica answers with the ``kv_transfer_params`` that tell
a decode replica where the prompt's KV blocks are; the client's request then goes to the decode
replica with those parameters, and the decode replica reads the blocks instead of computing them.

Whether a request is split at all is ``kvcore.pd.decide`` on the decode pool's own ranking
(cache- and load-aware, as its policy is): a short prompt, or one its decode replica mostly
holds already, is prefilled where it decodes. The prefill leg is routed by the prefill pool's
policy, retried within that pool, and accounted in its ledger like any other dispatch. Whatever
goes wrong on it (every prefill replica down, an error answer, an answer without parameters:
replicas running no KV connector), the request is not lost: it goes to its decode replica as an
ordinary request, which prefills it itself.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from typing import Any

import msgspec
from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric

from kvroute.kvcore import pd
from kvroute.kvcore.ledger import Route
from kvroute.policies import RouteRequest

from .attempts import RetryPlan, try_in_order
from .forward import Forwarder, Try
from .openai_request import ParsedRequest
from .pools import PoolRouting
from .proxy import ClientExchange, ClientRequest, Relayed
from .registry import ReplicaRegistry

log = logging.getLogger(__name__)

# What the prefill leg asks for (vLLM's toy proxy sends exactly these keys).
_PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# Not for a one-token prefill: vLLM rejects min_tokens > max_tokens.
_DROPPED_FOR_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens")

# Prefill leg outcomes (kvroute_pd_prefill_legs_total).
OK = "ok"  # the decode leg got the prefill replica's kv_transfer_params
NO_PARAMS = "no_params"  # answered without them: its replicas run no KV connector
FAILED = "failed"  # no prefill replica answered: the decode replica prefilled it


def prefill_body(body: dict[str, Any]) -> bytes:
    """The client's request as its prefill leg: one token, whole, asking to decode elsewhere."""
    leg = {k: v for k, v in body.items() if k not in _DROPPED_FOR_PREFILL}
    leg["kv_transfer_params"] = dict(_PREFILL_PARAMS)
    leg["stream"] = False
    leg["max_tokens"] = 1
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    return msgspec.json.encode(leg)


def decode_body(body: dict[str, Any], params: dict[str, Any]) -> bytes:
    """The client's request as its decode leg: with the prefill replica's transfer parameters."""
    return msgspec.json.encode({**body, "kv_transfer_params": params})


def transfer_params(answer: bytes) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` of a prefill leg's JSON answer (None: it has none)."""
    try:
        decoded = msgspec.json.decode(answer)
    except msgspec.DecodeError:
        return None
    params = decoded.get("kv_transfer_params") if isinstance(decoded, dict) else None
    return params if isinstance(params, dict) and params else None


def transferred(route: Route) -> Route:
    """``route`` as its decode leg: the decode replica computes none of the prompt."""
    return dataclasses.replace(route, transferred=True)


class PdMetrics:
    """kvroute_pd_decisions_total and kvroute_pd_prefill_legs_total (a ``RouterMetrics`` part)."""

    def __init__(self) -> None:
        self.decisions: dict[tuple[str, str], int] = {}  # (pool, decision) -> requests
        self.legs: dict[tuple[str, str], int] = {}  # (pool, outcome) -> prefill legs

    def decided(self, pool: str, decision: str) -> None:
        key = (pool, decision)
        self.decisions[key] = self.decisions.get(key, 0) + 1

    def prefilled(self, pool: str, outcome: str) -> None:
        key = (pool, outcome)
        self.legs[key] = self.legs.get(key, 0) + 1

    def snapshot(self) -> Any:
        return {
            "decisions": [[*k, v] for k, v in self.decisions.items()],
            "legs": [[*k, v] for k, v in self.legs.items()],
        }

    def families(self, peers: list[Any]) -> Iterable[Metric]:
        decisions = CounterMetricFamily(
            "kvroute_pd_decisions",
            "Requests to a decode pool by whether they went through its prefill pool first: "
            f"{pd.SPLIT}, or why not ({pd.SHORT}: a short prompt; {pd.CACHED}: its decode "
            f"replica held most of it; {pd.NO_PREFILL}: no prefill replica could take it; "
            f"{pd.NEVER}: disaggregate.mode never).",
            labels=["pool", "decision"],
        )
        legs = CounterMetricFamily(
            "kvroute_pd_prefill_legs",
            f"Prefill legs of split requests by outcome ({OK}; {NO_PARAMS}: answered without "
            f"kv_transfer_params, no KV connector; {FAILED}: no prefill replica answered). "
            "Either way but ok, the decode replica prefilled the request itself.",
            labels=["pool", "outcome"],
        )
        for family, key in ((decisions, "decisions"), (legs, "legs")):
            merged: dict[tuple[str, str], int] = dict(getattr(self, key))
            for peer in peers:
                for pool, label, count in peer.get(key, []):
                    merged[(pool, label)] = merged.get((pool, label), 0) + count
            for (pool, label), count in sorted(merged.items()):
                family.add_metric([pool, label], count)
            yield family


class Disaggregation:
    """The split of one request: decide, then run its prefill leg (``RequestPipeline`` calls
    it between routing in the decode pool and trying decode replicas)."""

    def __init__(
        self,
        registry: ReplicaRegistry,
        forwarder: Forwarder,
        retry: RetryPlan,
        metrics: PdMetrics,
    ) -> None:
        self.registry = registry
        self.forwarder = forwarder
        self.retry = retry
        self.metrics = metrics
        self._warned_no_params: set[str] = set()

    def decide(self, decode: PoolRouting, prefill: PoolRouting, route: Route) -> str:
        """``kvcore.pd.decide`` for ``route`` (the decode pool's), counted by decision."""
        request = route.request
        top = route.ranked[0]
        cached = request.prefix_tokens.get(top, 0) if request.prefix_tokens else 0
        ready = self.registry.candidate(tuple(prefill.members), set(), prefill.members)
        decision = pd.decide(decode.disaggregate, request.prompt_tokens, cached, ready is not None)
        self.metrics.decided(decode.name, decision)
        return decision

    async def prefill(
        self,
        prefill: PoolRouting,
        client: ClientRequest,
        headers: Iterable[tuple[bytes, bytes]],
        parsed: ParsedRequest,
        body: dict[str, Any],
        request_id: str,
    ) -> dict[str, Any] | None:
        """Run the prefill leg on the prefill pool; the decode leg's ``kv_transfer_params``,
        or None when the decode replica must prefill the request itself."""
        started = time.monotonic()
        blocks = await prefill.keys.blocks(parsed)
        request = RouteRequest(
            blocks.tokens if blocks is not None else parsed.prompt_tokens,
            1,
            parsed.model,
            None,
            blocks.hashes if blocks is not None else [],
        )
        now = time.monotonic()
        self.registry.before_decision(now)
        route = prefill.ledger.route(request, now, prefill.keys.block_size())
        leg = ClientExchange(client, headers, False, None)
        leg.retry_until = started + self.retry.budget_s - self.retry.backoff_max_s
        leg_body = prefill_body(body)
        tried: set[str] = set()

        def pick() -> str | None:
            return self.registry.candidate(route.ranked, tried, prefill.members)

        def try_one(replica: str, attempt: int, last: bool) -> Any:
            tried.add(replica)
            reason = "pd_prefill" if not attempt else "retry"
            # Never relayed to the client: every error answer is a failed try.
            return self.forwarder.forward(
                leg, route, replica, Try(leg_body, request_id, reason, True)
            )

        relayed: Relayed | None = None
        if route.ranked:
            relayed = await try_in_order(self.retry, started, pick, try_one, _no_op)
        if relayed is None or relayed.status >= 400:
            self.metrics.prefilled(prefill.name, FAILED)
            log.warning(
                "prefill leg of %s failed (%s): its decode replica prefills it",
                request_id,
                "no prefill replica answered" if relayed is None else f"HTTP {relayed.status}",
            )
            return None
        params = transfer_params(relayed.response.body)  # type: ignore[attr-defined]
        if params is None:
            self.metrics.prefilled(prefill.name, NO_PARAMS)
            if relayed.replica not in self._warned_no_params:
                self._warned_no_params.add(relayed.replica)
                log.warning(
                    "prefill replica %s answered without kv_transfer_params: is it started "
                    "with --kv-transfer-config? Its requests' decode replicas prefill them",
                    relayed.replica,
                )
            return None
        self.metrics.prefilled(prefill.name, OK)
        return params


def _no_op() -> None:
    pass
