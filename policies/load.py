"""How loaded a replica is, as one comparable number.

The router's own in-flight accounting is always fresh (principle 5), so it leads; the
replica's reported queue depth only breaks ties, since a scrape can be seconds old.
"""

from __future__ import annotations

from .types import ReplicaState


def load_key(replica: ReplicaState) -> tuple[int, int, int]:
    return (replica.in_flight_tokens, replica.in_flight, replica.reported_waiting or 0)
