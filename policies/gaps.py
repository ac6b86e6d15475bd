"""Gaps between a session's turns, learnt online: when is it expected back, and when is it gone.

An agent's turns come back after a tool call (seconds), a user's after reading and typing
(minutes), and a session that ended never does. Each session's gaps (arrival to arrival of its
turns, as the router sees them) go into a small histogram of decaying counts over doubling
buckets (under 1 s, 1-2 s, 2-4 s, ... past 18 h): a quantile sketch of ``BUCKETS`` floats that
follows a session whose rhythm changes (``alpha`` per gap). A fleet-wide histogram of every
session's gaps, decaying slower, is the prior: a session's quantiles read its own counts plus
``prior_weight`` gaps' worth of the prior, so a new session starts from what sessions do and
becomes itself as its gaps come in.

Memory is bounded: at most ``max_sessions`` sessions' histograms, the least recently seen
forgotten first (one that returns starts again from the prior). Pure: times are passed in.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

BUCKETS = 18  # bucket 0: under 1 s; bucket i: [2^(i-1), 2^i) s; the last one open-ended
_FLOOR_S = 0.5  # where bucket 0 is read to start, for interpolation


def bucket_of(gap_s: float) -> int:
    """The histogram bucket of a gap of ``gap_s`` seconds."""
    if gap_s < 1.0:
        return 0
    return min(BUCKETS - 1, int(math.log2(gap_s)) + 1)


def _edges(i: int) -> tuple[float, float]:
    return (_FLOOR_S, 1.0) if i == 0 else (2.0 ** (i - 1), 2.0**i)


def quantile(counts: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0 < q < 1) of a histogram, in seconds: geometric interpolation inside
    the bucket where the cumulative count crosses it (gaps spread over orders of magnitude)."""
    total = sum(counts)
    if total <= 0:
        return math.nan
    target = q * total
    seen = 0.0
    for i, c in enumerate(counts):
        if c > 0 and seen + c >= target:
            low, high = _edges(i)
            return float(low * (high / low) ** ((target - seen) / c))
        seen += c
    return _edges(len(counts) - 1)[1]


class _Session:
    __slots__ = ("counts", "last_s", "n")

    def __init__(self, now: float) -> None:
        self.counts = [0.0] * BUCKETS
        self.last_s = now
        self.n = 0.0  # the counts' sum (decayed)


class GapLearner:
    """Per session and fleet-wide: decaying histograms of the gaps between turns."""

    __slots__ = (
        "_prior",
        "_prior_n",
        "_returns",
        "_sessions",
        "_turns",
        "alpha",
        "max_sessions",
        "prior_alpha",
        "prior_weight",
    )

    def __init__(
        self,
        *,
        alpha: float = 0.1,
        prior_alpha: float = 0.002,
        prior_weight: float = 4.0,
        max_sessions: int = 16384,
    ) -> None:
        if not (0 < alpha <= 1 and 0 < prior_alpha <= 1):
            raise ValueError("alpha and prior_alpha must be in (0, 1]")
        if prior_weight < 0 or max_sessions < 1:
            raise ValueError("prior_weight must be >= 0 and max_sessions >= 1")
        self.alpha = alpha
        self.prior_alpha = prior_alpha
        self.prior_weight = prior_weight
        self.max_sessions = max_sessions
        self._prior = [0.0] * BUCKETS
        self._prior_n = 0.0
        self._turns = 0.0  # turns seen, and of them, turns that came back (decayed alike)
        self._returns = 0.0
        self._sessions: OrderedDict[str, _Session] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def observe(self, key: str, now: float) -> float | None:
        """A turn of session ``key`` arrived at ``now``: learn the gap since its last turn
        (returned; None for a session not seen, or forgotten)."""
        keep = 1.0 - self.prior_alpha
        self._turns = self._turns * keep + 1.0
        self._returns *= keep
        sessions = self._sessions
        session = sessions.get(key)
        if session is None:
            sessions[key] = _Session(now)
            if len(sessions) > self.max_sessions:
                sessions.popitem(last=False)  # the least recently seen
            return None
        sessions.move_to_end(key)
        gap = now - session.last_s
        session.last_s = now
        if gap < 0:
            return None  # out of order (a clock the caller reset): nothing to learn
        b = bucket_of(gap)
        self._returns += 1.0  # counted at its return: the turn before it came back
        session.n = _add(session.counts, b, session.n, self.alpha)
        self._prior_n = _add(self._prior, b, self._prior_n, self.prior_alpha)
        return gap

    def continues(self) -> float:
        """The share of turns followed by another turn of their session: the fleet's chance
        that a session goes on (its last turn is the one that never comes back). Sessions
        still running count as ended until they return, so it errs low; 1 before any turn."""
        return self._returns / self._turns if self._turns > 0 else 1.0

    def quantiles(self, key: str, qs: Sequence[float]) -> list[float] | None:
        """Session ``key``'s gap quantiles (seconds), its own counts blended with the prior;
        None when neither has seen a gap yet."""
        session = self._sessions.get(key)
        own = session.counts if session is not None and session.n > 0 else None
        if self._prior_n <= 0 or self.prior_weight == 0:
            if own is None:
                return None
            return [quantile(own, q) for q in qs]
        scale = self.prior_weight / self._prior_n
        blend = [p * scale for p in self._prior]
        if own is not None:
            blend = [b + c for b, c in zip(blend, own, strict=True)]
        return [quantile(blend, q) for q in qs]


def _add(counts: list[float], bucket: int, n: float, alpha: float) -> float:
    """Decay ``counts`` by ``1 - alpha`` and count one gap in ``bucket``; the new sum.
    The counts are an exponentially weighted histogram: about ``1 / alpha`` recent gaps."""
    keep = 1.0 - alpha
    for i in range(BUCKETS):
        counts[i] *= keep
    counts[bucket] += 1.0
    return n * keep + 1.0
