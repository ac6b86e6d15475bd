"""Live sessions: conversations and agents whose next turn is likely to come back soon.

A request that carries a session key (``X-Session-ID``, or the body's ``user``) leaves its prompt
cached on the replica that served it. In the Claude Code traces most agent turns return within
seconds, so those blocks are worth more than the LRU order of the engine says: the policy sends
the session's next turn back to that replica, and counts the tokens of live sessions on a replica
as taken, not free, when a new prompt would need room there.

A session's claim is a schedule of stages, each ``(end, weight)``: from its last turn until
``end`` seconds after it, its tokens count ``weight`` times. By default one stage, ``ttl_s`` at
weight 1; kv_aware with learnt gaps (policies/gaps.py) passes a claim that weakens as the
session's expected return passes and ends at its horizon. Past its last stage a session has
released its claim and is forgotten.

Pure: ``now`` comes from ``FleetView.now``. Memory is bounded by the sessions seen within the
longest claim (plus stale heap entries, compacted when they outnumber the live ones).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

Stages = Sequence[tuple[float, float]]  # (seconds after the turn it ends, weight), ends rising


class _Claim:
    __slots__ = ("replica", "seen", "stage", "stages", "tokens", "version")

    def __init__(
        self, replica: str, tokens: int, seen: float, stages: Stages, version: int
    ) -> None:
        self.replica = replica
        self.tokens = tokens
        self.seen = seen
        self.stages = stages
        self.stage = 0
        self.version = version

    @property
    def weight(self) -> float:
        return self.stages[self.stage][1]

    @property
    def due(self) -> float:
        return self.seen + self.stages[self.stage][0]


class LiveSessions:
    """Per session key: the replica it last went to, the tokens it left there, its claim."""

    __slots__ = ("_by_key", "_claims_on", "_due", "_tokens", "_version", "ttl_s")

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._by_key: dict[str, _Claim] = {}
        self._tokens: dict[str, float] = {}  # per replica: live sessions' weighted tokens
        self._claims_on: dict[str, int] = {}  # per replica: live sessions there
        self._due: list[tuple[float, int, str]] = []  # (next stage change, version, key)
        self._version = 0

    def __len__(self) -> int:
        return len(self._by_key)

    def home(self, key: str, now: float) -> tuple[str, float] | None:
        """The replica the session last went to and its weighted tokens there, if still live."""
        self.expire(now)
        claim = self._by_key.get(key)
        return (claim.replica, claim.tokens * claim.weight) if claim is not None else None

    def touch(
        self, key: str, replica: str, tokens: int, now: float, stages: Stages | None = None
    ) -> None:
        """The session's turn went to ``replica`` and leaves ``tokens`` cached there, claimed
        as ``stages`` say (default: ``ttl_s`` at full weight)."""
        old = self._by_key.pop(key, None)
        if old is not None:
            self._take(old.replica, old.tokens * old.weight)
            self._release(old.replica)
        if not stages:
            stages = ((self.ttl_s, 1.0),)
        self._version += 1
        claim = _Claim(replica, tokens, now, stages, self._version)
        self._by_key[key] = claim
        self._tokens[replica] = self._tokens.get(replica, 0) + tokens * claim.weight
        self._claims_on[replica] = self._claims_on.get(replica, 0) + 1
        heapq.heappush(self._due, (claim.due, claim.version, key))
        if len(self._due) > 4 * len(self._by_key) + 64:
            self._compact()

    def tokens_on(self, replica: str) -> float:
        """Weighted tokens of live sessions cached on ``replica`` (as of the last ``expire``)."""
        return self._tokens.get(replica, 0)

    def expire(self, now: float) -> None:
        """Move every claim whose stage ended by ``now`` to its next one, or release it."""
        due = self._due
        while due and due[0][0] <= now:
            _, version, key = heapq.heappop(due)
            claim = self._by_key.get(key)
            if claim is None or claim.version != version:
                continue  # stale: the session came back since (or was released)
            before = claim.tokens * claim.weight
            stage = claim.stage + 1
            while stage < len(claim.stages) and claim.seen + claim.stages[stage][0] <= now:
                stage += 1  # several stages passed at once (a quiet spell)
            if stage >= len(claim.stages):
                del self._by_key[key]
                self._take(claim.replica, before)
                self._release(claim.replica)
                continue
            claim.stage = stage
            self._tokens[claim.replica] += claim.tokens * claim.weight - before
            heapq.heappush(due, (claim.due, version, key))

    def _take(self, replica: str, tokens: float) -> None:
        left = self._tokens.get(replica, 0) - tokens
        if left > 0:
            self._tokens[replica] = left
        else:
            self._tokens.pop(replica, None)

    def _release(self, replica: str) -> None:
        left = self._claims_on.get(replica, 0) - 1
        if left > 0:
            self._claims_on[replica] = left
        else:  # none left there: drop any rounding the weights left behind
            self._claims_on.pop(replica, None)
            self._tokens.pop(replica, None)

    def _compact(self) -> None:
        self._due = [(c.due, c.version, k) for k, c in self._by_key.items()]
        heapq.heapify(self._due)
