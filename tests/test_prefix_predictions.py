"""Predictions in the prefix index: recorded at dispatch, withdrawn when the request fails."""

from __future__ import annotations

from kvroute.kvcore.prefix_index import PrefixIndex


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
