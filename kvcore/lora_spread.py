"""Where a hot LoRA adapter should be loaded next, and where a cold one may leave (pure).

Routing sends an adapter's requests only to replicas that serve it (policies/lora.py). When
every replica serving an adapter in use (reported running there, or the router's own requests
for it in flight there: a scrape seconds late must not hide a burst) is busy (the router's own requests in flight there at
``hot_in_flight`` or more), the adapter is hot: it is loaded (vLLM's ``/v1/load_lora_adapter``,
with runtime updating enabled there) on one more replica: the least loaded that reports a free
adapter slot (``vllm:lora_requests_info``: fewer adapters in use than ``max_lora``), else the
least loaded that does not report the gauge yet (vLLM shows it only after its first request;
with LoRA off there the load is refused, and that replica is not asked again for
``retry_after_s``). Then nothing more for that adapter
for ``cooldown_s``, so the new home's first requests show whether it was enough.

Only adapters this planner loaded ever leave, and only once they have stayed
``min_residency_s``, have not been in use there for ``idle_unload_s``, are not hot, and another
replica still serves them: slots do not thrash between adapters that take turns being hot.

Pure: ``now`` is passed in, no I/O; the caller (router/lora_spread.py) does the HTTP calls and
reports how they went (``load_failed``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvroute.policies import ReplicaState


@dataclass(frozen=True)
class SpreadSettings:
    # The adapters the router may load: name -> path (as vLLM's lora_path, on the replica).
    adapters: Mapping[str, str] = field(default_factory=dict)
    # An adapter in use is hot when every replica serving it has this many requests in flight.
    hot_in_flight: int = 4
    cooldown_s: float = 30.0  # between two loads of one adapter
    min_residency_s: float = 300.0  # a loaded adapter stays at least this long
    idle_unload_s: float = 120.0  # ... and leaves once unused there this long
    max_replicas: int = 0  # an adapter is loaded on at most this many replicas (0: no limit)
    retry_after_s: float = 300.0  # a replica that refused a load is not asked again before

    def problems(self, prefix: str = "lora") -> list[str]:
        """One line per unusable setting, naming the key."""
        out = []
        if self.hot_in_flight < 1:
            out.append(f"{prefix}.hot_in_flight: must be >= 1, got {self.hot_in_flight}")
        if self.max_replicas < 0:
            out.append(f"{prefix}.max_replicas: must be >= 0 (0: no limit)")
        for key in ("cooldown_s", "min_residency_s", "idle_unload_s", "retry_after_s"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value >= 0):
                out.append(f"{prefix}.{key}: must be a finite number >= 0, got {value}")
        for name, path in self.adapters.items():
            if not name or any(c.isspace() for c in name):
                out.append(f"{prefix}.adapters: {name!r} is not an adapter name")
            if not path:
                out.append(f"{prefix}.adapters.{name}: needs the adapter's path on the replicas")
        return out


@dataclass(frozen=True, slots=True)
class SpreadAction:
    kind: Literal["load", "unload"]
    replica: str
    adapter: str
    path: str = ""  # for a load


class LoraSpreadPlanner:
    """Remembers what it loaded, when each adapter was last in use where, and which replicas
    refused; ``plan`` says what to do now."""

    def __init__(self, settings: SpreadSettings) -> None:
        self.settings = settings
        self.loaded: dict[tuple[str, str], float] = {}  # (replica, adapter) -> loaded at
        self._last_spread: dict[str, float] = {}
        self._last_used: dict[tuple[str, str], float] = {}
        self._refused_until: dict[str, float] = {}

    def plan(self, replicas: Sequence[ReplicaState], now: float) -> list[SpreadAction]:
        """What to load and unload among ``replicas`` (one model pool) now."""
        s = self.settings
        for r in replicas:
            for adapter in {*r.lora_running, *r.lora_in_flight}:
                self._last_used[(r.replica_id, adapter)] = now
        live = [
            r
            for r in replicas
            if r.healthy and not r.ejected and not r.quarantined and not r.draining
        ]
        actions: list[SpreadAction] = []
        taken: set[str] = set()  # replicas given an adapter in this round
        for adapter, path in s.adapters.items():
            homes = [r for r in live if adapter in r.lora_adapters]
            if not homes:
                continue  # no replica of this pool serves it: not this pool's adapter
            in_use = any(adapter in r.lora_running or adapter in r.lora_in_flight for r in homes)
            hot = in_use and all(r.in_flight >= s.hot_in_flight for r in homes)
            if hot:
                target = self._target(live, adapter, homes, now, taken)
                if target is not None:
                    actions.append(SpreadAction("load", target.replica_id, adapter, path))
                    taken.add(target.replica_id)
                    self._last_spread[adapter] = now
                    self.loaded[(target.replica_id, adapter)] = now
                continue
            if len(homes) < 2:
                continue
            for r in homes:
                key = (r.replica_id, adapter)
                loaded_at = self.loaded.get(key)
                if loaded_at is None or adapter in r.lora_running or adapter in r.lora_in_flight:
                    continue
                idle = now - max(loaded_at, self._last_used.get(key, loaded_at))
                if now - loaded_at >= s.min_residency_s and idle >= s.idle_unload_s:
                    actions.append(SpreadAction("unload", r.replica_id, adapter))
                    self.unloaded(r.replica_id, adapter)
                    break  # one home less per round
        return actions

    def _target(
        self,
        live: list[ReplicaState],
        adapter: str,
        homes: list[ReplicaState],
        now: float,
        taken: set[str],
    ) -> ReplicaState | None:
        s = self.settings
        if now - self._last_spread.get(adapter, -math.inf) < s.cooldown_s:
            return None
        if s.max_replicas and len(homes) >= s.max_replicas:
            return None
        candidates = [
            r
            for r in live
            if adapter not in r.lora_adapters
            and r.replica_id not in taken
            and (r.max_loras is None or len(r.lora_running) < r.max_loras)
            and now >= self._refused_until.get(r.replica_id, -math.inf)
        ]
        if not candidates:
            return None
        return min(
            candidates,
            key=lambda r: (r.max_loras is None, r.in_flight, r.in_flight_tokens, r.replica_id),
        )

    def load_failed(self, replica: str, adapter: str, now: float) -> None:
        """The replica refused the load (runtime updating off, a bad path): ask it again only
        after ``retry_after_s``, and let another replica take the adapter at once."""
        self.loaded.pop((replica, adapter), None)
        self._last_spread.pop(adapter, None)
        self._refused_until[replica] = now + self.settings.retry_after_s

    def unloaded(self, replica: str, adapter: str) -> None:
        self.loaded.pop((replica, adapter), None)
        self._last_used.pop((replica, adapter), None)

    def forget(self, replica: str) -> None:
        """The replica left the fleet."""
        for key in [k for k in self.loaded if k[0] == replica]:
            del self.loaded[key]
        for key in [k for k in self._last_used if k[0] == replica]:
            del self._last_used[key]
        self._refused_until.pop(replica, None)
