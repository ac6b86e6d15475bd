"""Where one replica's KV blocks live (GPU, CPU, disk, remote) and how much each tier holds.

The prefix index (kvcore/prefix_index.py) answers which replicas hold a prompt's leading blocks
on any medium. This answers, for one replica, how vLLM would serve that prefix there: its GPU
prefix cache first (the leading run held on GPU), then its offloading connector's lookup from
that block on, each next block loaded from a lower tier that holds it, until one holds it on no
tier (``OffloadingConnectorScheduler.get_num_new_matched_tokens``; the tiering manager's lookup
tries the CPU primary, then promotes from the secondaries). A removal on one medium concerns
that medium only: vLLM offloads on store (write-through), so the GPU evicting a block leaves
its CPU copy, and the CPU evicting it leaves the GPU's.

Capacity is learnt from the same events, never configured: the most blocks a tier held at once
is a lower bound of its size, and its size once the tier has evicted (an LRU evicts only when
full). Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import takewhile
from typing import NamedTuple

GPU = "GPU"
# Fastest first: a block held on several lower tiers loads from the first (vLLM's tiering
# manager reads the CPU primary before it promotes from a secondary). Unknown tiers come last.
TIER_ORDER = ("GPU", "CPU", "STORAGE", "CPU:REMOTE", "STORAGE:REMOTE")


def tier_rank(tier: str) -> int:
    try:
        return TIER_ORDER.index(tier)
    except ValueError:
        return len(TIER_ORDER)


class TierRun(NamedTuple):
    """How a replica would serve a prompt's leading blocks: ``gpu`` blocks from its GPU prefix
    cache, then ``lower`` ((tier, blocks), fastest tier first) loaded from offload tiers."""

    gpu: int
    lower: tuple[tuple[str, int], ...] = ()

    @property
    def blocks(self) -> int:
        """Blocks it need not compute."""
        return self.gpu + sum(n for _, n in self.lower)


class TierHoldings:
    """One replica's blocks per tier (router hash -> references on that tier)."""

    __slots__ = ("_order", "held")

    def __init__(self) -> None:
        self.held: dict[str, dict[int, int]] = {}
        self._order: list[tuple[str, dict[int, int]]] = []  # lower tiers, fastest first

    def add(self, tier: str, hashes: Iterable[int]) -> None:
        refs = self.held.get(tier)
        if refs is None:
            refs = self.held[tier] = {}
            if tier != GPU:
                self._order.append((tier, refs))
                self._order.sort(key=lambda item: tier_rank(item[0]))
        get = refs.get
        for rh in hashes:
            refs[rh] = get(rh, 0) + 1

    def drop(self, tier: str, hashes: Iterable[int]) -> None:
        refs = self.held.get(tier)
        if refs is None:
            return
        for rh in hashes:
            n = refs.get(rh, 0)
            if n > 1:
                refs[rh] = n - 1
            elif n == 1:
                del refs[rh]

    def run(self, hashes: Sequence[int], confirmed: int, blocks: int) -> TierRun:
        """How the replica serves the first ``confirmed`` of ``hashes`` (held there by events,
        on some tier) and the ``blocks - confirmed`` after them it is predicted to hold (just
        sent there: computed on its GPU)."""
        gpu_refs = self.held.get(GPU, {})
        head = hashes[:confirmed]
        g = sum(1 for _ in takewhile(gpu_refs.__contains__, head))
        if g == confirmed:
            return TierRun(blocks)
        order = self._order
        tail = head[g:]
        if len(order) == 1:  # one tier below the GPU (the common case): counted in C
            tier, refs = order[0]
            n = sum(1 for _ in takewhile(refs.__contains__, tail))
            return TierRun(g, ((tier, n),) if n else ())
        # Several: each block from the fastest tier holding it, until one holds it on none.
        held = [list(map(refs.__contains__, tail)) for _, refs in order]
        counts = [0] * len(order)
        for flags in zip(*held, strict=True):
            for k, flag in enumerate(flags):
                if flag:
                    counts[k] += 1
                    break
            else:
                break  # on no lower tier: the connector's lookup ends here
        return TierRun(g, tuple((order[k][0], n) for k, n in enumerate(counts) if n))


class TierCapacity:
    """One replica's blocks held per tier now, the most held at once, and whether the tier has
    evicted (then that peak is its size)."""

    __slots__ = ("evicted", "held", "peak")

    def __init__(self) -> None:
        self.held: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.evicted: set[str] = set()

    def update(self, tier: str, held: int, removed: bool = False) -> None:
        self.held[tier] = held
        if held > self.peak.get(tier, 0):
            self.peak[tier] = held
        if removed:
            self.evicted.add(tier)

    def clear(self) -> None:
        """The replica's cache was reset: what it holds is gone, what it can hold is not."""
        self.held = dict.fromkeys(self.held, 0)

    def describe(self) -> dict[str, dict[str, int | bool]]:
        """Per tier: blocks held now, the capacity learnt (the peak) and whether it is known
        (the tier has evicted) or only a lower bound."""
        return {
            tier: {
                "held_blocks": self.held.get(tier, 0),
                "capacity_blocks": peak,
                "capacity_known": tier in self.evicted,
            }
            for tier, peak in sorted(self.peak.items(), key=lambda item: tier_rank(item[0]))
        }
