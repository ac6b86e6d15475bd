"""Predictions in the prefix index: recorded at dispatch, withdrawn when the request fails."""

from __future__ import annotations

import time

from kvroute.backends.handle import ReplicaHandle
from kvroute.kvcore.ledger import Route
from kvroute.kvcore.prefix_index import PrefixIndex
from kvroute.policies import RouteRequest
from kvroute.router.config import config_from_dict
from kvroute.router.core import RoutingCore

from .helpers import wait_until


def test_unpredict_withdraws_only_predictions_of_that_replica() -> None:
    index = PrefixIndex()
    hashes = [11, 12, 13]
    index.predict("a", hashes, now=0.0, ttl_s=10.0)
    index.predict("b", hashes[:2], now=0.0, ttl_s=10.0)
    assert index.match(hashes, now=1.0)["a"].blocks == 3

    assert index.unpredict("a", hashes) == 3
    matches = index.match(hashes, now=1.0)
    assert "a" not in matches
    assert matches["b"].blocks == 2  # b's own predictions stay
    assert index.unpredict("a", hashes) == 0  # nothing left to withdraw
    assert index.unpredict("never-seen", hashes) == 0
    # The withdrawn entries' expiry comes and goes without effect.
    assert index.expire(now=20.0) == 2  # only b's two
    assert index.match(hashes, now=20.0) == {}


async def test_a_live_router_lets_predictions_go_as_they_come_due() -> None:
    """Not all at once on the first request after a quiet spell (a 70-100 ms stall measured
    at 430 requests/s): the routing core expires them on a timer."""
    config = config_from_dict(
        {"replicas": [{"url": "http://127.0.0.1:9"}], "routing": {"prediction_ttl_s": 0.2}}
    )
    core = RoutingCore(config, _NoHooks())
    await core.start()
    try:
        request = RouteRequest(48, 1, block_hashes=[1, 2, 3])
        route = Route(request, ("127.0.0.1:9",), "test")
        core.ledger.dispatch(route, "127.0.0.1:9", time.monotonic())
        assert core.index.predicted_entries == 3
        # No request comes: the predictions go anyway.
        await wait_until(lambda: core.index.predicted_entries == 0, what="predictions expired")
    finally:
        await core.close()


async def test_only_a_policy_that_reads_prefixes_pays_for_tokenization() -> None:
    """Round robin routes at round robin's price: the configured tokenizer is not run."""
    from kvroute.backends.launcher import ensure_tiny_model
    from kvroute.router.openai_request import parse_completion

    tokenizer = str(ensure_tiny_model())
    body = b'{"model": "m", "prompt": "' + b"word " * 200 + b'", "max_tokens": 1}'
    tokens = {}
    for policy in ("kv_aware", "round_robin"):
        config = config_from_dict(
            {
                "replicas": [{"url": "http://127.0.0.1:9"}],
                "policy": {"name": policy},
                "routing": {"tokenizer": tokenizer, "block_size": 16},
            }
        )
        core = RoutingCore(config, _NoHooks())
        blocks = await core.keys.blocks(parse_completion(body))
        tokens[policy] = None if blocks is None else (blocks.tokens, len(blocks.hashes))
    kv_tokens, kv_blocks = tokens["kv_aware"] or (0, 0)
    assert kv_tokens >= 200 and kv_blocks == kv_tokens // 16  # exact, block by block
    assert tokens["round_robin"] is None


class _NoHooks:
    def ejected(self, handle: ReplicaHandle, kind: str) -> None: ...

    def abandon_waiting(self, handle: ReplicaHandle, why: str) -> int:
        return 0

    async def responds(self, handle: ReplicaHandle) -> bool:
        return False
