"""Tokenization and hashing parity between the router and its replicas: the pure part.

The silent failure of cache-aware routing: a chat template, block size, hash seed or LoRA key
that differs between router and engine makes every prefix lookup miss, and precise routing
degrades to round robin with no error. The router therefore checks a sample of requests (the
first few per replica, then one in ``sample_every``) three ways:

* **tokens**: its token ids against the engine's own (``/tokenize`` with the same chat template
  arguments); a difference is deterministic, so one raises the alarm, naming the first position;
* **blocks**: the request's block keys against what the engine's KV events then store (the
  index confirms the request's first block on that replica); events can lag or a tiny cache can
  evict within seconds, so only ``blocks_to_alarm`` misses in a row raise it;
* **blind**: a replica whose own prefix-cache hits grow while the router predicted no reuse
  there for ``blind_min_requests`` requests.

The alarm stays raised until ``clear_after`` checks in a row agree (a restart with the fixed
config clears it at once). No I/O here: ``router/parity.py`` runs the checks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

TOKENS, BLOCKS, BLIND = "tokens", "blocks", "blind"
AGREE, MISMATCH, SKIPPED, ERROR = "agree", "mismatch", "skipped", "error"


def first_difference(ours: Sequence[int], theirs: Sequence[int]) -> int | None:
    """The first position where two token sequences differ (a length difference counts at the
    shorter one's end); None when equal."""
    for position, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            return position
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


class Sampler:
    """Which requests to check: the first ``first_per_replica`` each replica serves (a
    misconfiguration shows at once), then one in ``sample_every``."""

    __slots__ = ("_seen", "first_per_replica", "sample_every")

    def __init__(self, first_per_replica: int, sample_every: int) -> None:
        self.first_per_replica = first_per_replica
        self.sample_every = sample_every
        self._seen: dict[str, int] = {}

    def wants(self, replica: str) -> bool:
        seen = self._seen.get(replica, 0) + 1
        self._seen[replica] = seen
        if seen <= self.first_per_replica:
            return True
        return self.sample_every > 0 and (seen - self.first_per_replica) % self.sample_every == 0


@dataclass(frozen=True)
class Finding:
    """What one failed check found, for the log line, /status and /admin."""

    replica: str
    check: str
    detail: str
    position: int | None = None  # tokens: the first differing token position


@dataclass
class ParityVerdicts:
    """Check results in, the alarm out (see the module doc for when it rises and clears)."""

    blocks_to_alarm: int = 3
    clear_after: int = 50
    alarm: bool = False
    finding: Finding | None = None  # what raised the alarm
    checks: dict[tuple[str, str, str], int] = field(
        default_factory=dict
    )  # (replica, check, result)
    # Each replica's last check: (check, result, what it found: a mismatch's detail, else "").
    last: dict[str, tuple[str, str, str]] = field(default_factory=dict)
    _block_misses: dict[str, int] = field(default_factory=dict)
    _agreeing: int = 0

    def record(self, replica: str, check: str, result: str, finding: Finding | None = None) -> bool:
        """Count one check; True when it raised the alarm (it was down before)."""
        key = (replica, check, result)
        self.checks[key] = self.checks.get(key, 0) + 1
        self.last[replica] = (check, result, finding.detail if finding is not None else "")
        if result == AGREE:
            if check == BLOCKS:
                self._block_misses[replica] = 0
            self._agreeing += 1
            if self.alarm and self._agreeing >= self.clear_after:
                self.alarm, self.finding = False, None
            return False
        if result != MISMATCH:
            return False  # skipped or errored: says nothing either way
        self._agreeing = 0
        if check == BLOCKS:
            misses = self._block_misses.get(replica, 0) + 1
            self._block_misses[replica] = misses
            if misses < self.blocks_to_alarm:
                return False
        if self.alarm:
            return False
        self.alarm, self.finding = True, finding
        return True


@dataclass
class _Window:
    hits: float
    captured: int
    requests: int


class BlindWatch:
    """Per replica: did its prefix-cache hits grow while the router predicted no reuse there?

    ``observe`` takes the replica's cumulative hit tokens (its /metrics) and the router's
    cumulative predicted (captured) tokens and requests sent there. A window opens at the first
    observation and closes once ``min_requests`` requests were sent: blind when the engine hit at
    least ``min_hit_tokens`` in it and the router predicted none. A replica restart (its
    counters going back) opens a new window.
    """

    def __init__(self, min_requests: int = 20, min_hit_tokens: int = 256) -> None:
        self.min_requests = min_requests
        self.min_hit_tokens = min_hit_tokens
        self._windows: dict[str, _Window] = {}

    def observe(self, replica: str, hits: float, captured: int, requests: int) -> bool | None:
        """True: blind; False: a window closed with the router seeing reuse (or none to see);
        None: still collecting."""
        window = self._windows.get(replica)
        if window is None or hits < window.hits:
            self._windows[replica] = _Window(hits, captured, requests)
            return None
        if requests - window.requests < self.min_requests:
            return None
        hit = hits - window.hits
        predicted = captured - window.captured
        self._windows[replica] = _Window(hits, captured, requests)
        return hit >= self.min_hit_tokens and predicted == 0
