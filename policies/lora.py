"""LoRA adapter residency: which adapters hold a replica's adapter slots, as a policy sees it.

vLLM serves a request for an adapter only from one of its ``max_loras`` GPU slots. An adapter
already in a slot costs nothing more; one that is not must be activated first (from its CPU
cache or disk), evicting the least recently used idle one; and when every slot is taken by
adapters whose requests are running, the request waits until a slot drains. Alternating
adapters over too few slots thrashes: every request pays a swap and waits.

Two sources say what is in a replica's slots: what the replica reports
(``ReplicaState.lora_running``, from ``vllm:lora_requests_info``, seconds old) and what the
policy itself just sent there (``AdapterSlots``, current to the last decision). An adapter is
*resident* when either says it was used there among the last ``max_loras`` adapters (vLLM
evicts slots LRU, not on a timer); it is *busy* when reported running or sent there within
``busy_s``.

Pure: ``now`` comes from ``FleetView.now``; memory is bounded by ``MAX_TRACKED`` adapters per
replica.
"""

from __future__ import annotations

from collections import OrderedDict

from .types import ReplicaState

MAX_TRACKED = 64  # adapters remembered per replica (far above any max_loras)


class AdapterSlots:
    """Per replica: the adapters the policy sent requests for, most recently used last."""

    __slots__ = ("_used", "busy_s")

    def __init__(self, busy_s: float) -> None:
        self.busy_s = busy_s
        self._used: dict[str, OrderedDict[str, float]] = {}

    def touch(self, replica: str, adapter: str, now: float) -> None:
        """A request for ``adapter`` went to ``replica``."""
        used = self._used.setdefault(replica, OrderedDict())
        used.pop(adapter, None)
        used[adapter] = now
        if len(used) > MAX_TRACKED:
            used.popitem(last=False)

    def forget(self, replica: str) -> None:
        self._used.pop(replica, None)

    def resident(self, replica: ReplicaState, adapter: str) -> bool:
        """Whether ``adapter`` is in one of ``replica``'s slots (reported, or among the last
        ``max_loras`` adapters sent there; all of them when its slot count is not known)."""
        if adapter in replica.lora_running:
            return True
        used = self._used.get(replica.replica_id)
        if not used or adapter not in used:
            return False
        slots = replica.max_loras
        if slots is None:
            return True
        for newer, name in enumerate(reversed(used)):  # most recent first
            if newer >= slots:
                return False
            if name == adapter:
                return True
        return False

    def busy(self, replica: ReplicaState, now: float) -> set[str]:
        """Adapters whose requests hold ``replica``'s slots now: reported running there, or
        sent there within ``busy_s``."""
        busy = set(replica.lora_running)
        used = self._used.get(replica.replica_id)
        if used:
            since = now - self.busy_s
            for name in reversed(used):
                if used[name] < since:
                    break
                busy.add(name)
        return busy

    def slots_full(self, replica: ReplicaState, adapter: str, now: float) -> bool:
        """Whether a request for ``adapter`` would wait there for a slot: every one of the
        replica's ``max_loras`` slots is held by another busy adapter."""
        slots = replica.max_loras
        if slots is None:
            return False
        busy = self.busy(replica, now)
        busy.discard(adapter)
        return len(busy) >= slots


def adapter_of(replica: ReplicaState, model: str | None) -> str | None:
    """``model`` when it names one of ``replica``'s LoRA adapters (not its base model)."""
    if model is not None and model in replica.lora_adapters:
        return model
    return None
