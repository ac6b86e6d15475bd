"""Live sessions: conversations and agents whose next turn is likely to come back soon.

A request that carries a session key (``X-Session-ID``, or the body's ``user``) leaves its prompt
cached on the replica that served it. In the Claude Code traces most agent turns return within
seconds, so those blocks are worth more than the LRU order of the engine says: the policy sends
the session's next turn back to that replica, and counts the tokens of live sessions on a replica
as taken, not free, when a new prompt would need room there.

Pure: ``now`` comes from ``FleetView.now``. Entries expire ``ttl_s`` after their last turn;
memory is bounded by the sessions seen within ``ttl_s``.
"""

from __future__ import annotations

from collections import OrderedDict


class LiveSessions:
    """Per session key: the replica it last went to, the tokens it left there, when."""

    __slots__ = ("_by_key", "_tokens", "ttl_s")

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._by_key: OrderedDict[str, tuple[str, int, float]] = OrderedDict()
        self._tokens: dict[str, int] = {}  # per replica: live sessions' tokens

    def __len__(self) -> int:
        return len(self._by_key)

    def home(self, key: str, now: float) -> tuple[str, int] | None:
        """The replica the session last went to and its tokens there, if still live."""
        self.expire(now)
        entry = self._by_key.get(key)
        return (entry[0], entry[1]) if entry is not None else None

    def touch(self, key: str, replica: str, tokens: int, now: float) -> None:
        """The session's turn went to ``replica`` and leaves ``tokens`` cached there."""
        old = self._by_key.pop(key, None)
        if old is not None:
            self._take(old[0], old[1])
        self._by_key[key] = (replica, tokens, now)  # newest last: expiry pops from the front
        self._tokens[replica] = self._tokens.get(replica, 0) + tokens

    def tokens_on(self, replica: str) -> int:
        """Tokens of live sessions cached on ``replica`` (as of the last ``expire``)."""
        return self._tokens.get(replica, 0)

    def expire(self, now: float) -> None:
        deadline = now - self.ttl_s
        entries = self._by_key
        while entries:
            key, (replica, tokens, seen) = next(iter(entries.items()))
            if seen > deadline:
                break
            del entries[key]
            self._take(replica, tokens)

    def _take(self, replica: str, tokens: int) -> None:
        left = self._tokens.get(replica, 0) - tokens
        if left > 0:
            self._tokens[replica] = left
        else:
            self._tokens.pop(replica, None)
