"""Data-parallel replicas as routing endpoints: one per rank.

A vLLM server with ``--data-parallel-size N`` runs N engine cores behind one HTTP port, each with
its own KV cache, KV-event publisher (the configured endpoint offset by the rank) and metrics
(``engine="k"`` labels); it sends a request to the rank named in its ``X-data-parallel-rank``
header. The router expands such a replica into N endpoints, ``NAME@dpK``, that share its URL:
the prefix index, the ledger, load and latency lines are then kept per rank by the same code
that keeps them per replica, and the policies pick a rank as they pick a replica.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from kvroute.kvcore.kv_events import rank_endpoint

from .config import ReplicaConfig, replica_name_from_url

RANK_HEADER = "X-data-parallel-rank"  # vLLM's (OpenAIServing._get_data_parallel_rank)
_SEPARATOR = "@dp"


def rank_name(replica: str, rank: int) -> str:
    return f"{replica}{_SEPARATOR}{rank}"


def replica_of(name: str) -> str:
    """The replica an endpoint belongs to: ``NAME`` for ``NAME@dpK``, else the name itself."""
    base, sep, rank = name.rpartition(_SEPARATOR)
    return base if sep and rank.isdigit() else name


def expand_ranks(replicas: Iterable[ReplicaConfig]) -> list[ReplicaConfig]:
    """Each data-parallel replica as one endpoint per rank (others as they are)."""
    out: list[ReplicaConfig] = []
    for replica in replicas:
        if replica.data_parallel_size == 1 or replica.data_parallel_rank is not None:
            out.append(replica)
            continue
        name = replica.name or replica_name_from_url(replica.url)
        for rank in range(replica.data_parallel_size):
            out.append(
                msgspec.structs.replace(
                    replica,
                    name=rank_name(name, rank),
                    data_parallel_rank=rank,
                    kv_events=_at_rank(replica.kv_events, rank),
                    kv_replay=_at_rank(replica.kv_replay, rank),
                )
            )
    return out


def _at_rank(endpoint: str | None, rank: int) -> str | None:
    return None if endpoint is None else rank_endpoint(endpoint, rank)
