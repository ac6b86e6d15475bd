"""What the NATS buses between routers do, on /metrics (a ``RouterMetrics`` part).

Routers share dispatches (router/ledger_bus.py) and tenants' charges (router/budget_bus.py)
over NATS, and start alone when NATS does not answer. Without these an operator could tell a
router sharing nothing from one sharing everything only from its logs:

* ``kvroute_bus_connected{bus}``: buses of that kind whose NATS connection is up (a router has
  one budget bus and a dispatch bus per model pool; summed over worker processes).
* ``kvroute_bus_updates_total{bus, direction}``: updates this router sent (``sent``) and the
  others' it applied here (``applied``): on the dispatch bus its events (a dispatch, first token,
  finish sent; the others' dispatches applied), on the budget bus its charge messages (one an
  interval).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

KINDS = ("dispatch", "budget")


class Bus(Protocol):
    @property
    def connected(self) -> bool: ...

    published: int
    applied: int


class BusMetrics:
    """``buses()``: the (kind, bus) pairs this process runs now."""

    def __init__(self, buses: Callable[[], Iterable[tuple[str, Bus]]]) -> None:
        self._buses = buses

    def snapshot(self) -> dict[str, list[int]]:
        """Per kind: [connected, sent, applied], summed over this process's buses."""
        out = {kind: [0, 0, 0] for kind in KINDS}
        for kind, bus in self._buses():
            row = out[kind]
            row[0] += int(bus.connected)
            row[1] += bus.published
            row[2] += bus.applied
        return out

    def families(self, peers: list[Any]) -> Iterable[Metric]:
        totals = self.snapshot()
        for peer in peers:
            for kind, row in peer.items():
                if kind in totals and isinstance(row, list) and len(row) == 3:
                    totals[kind] = [a + b for a, b in zip(totals[kind], row, strict=True)]
        connected = GaugeMetricFamily(
            "kvroute_bus_connected",
            "Buses between routers whose NATS connection is up, by bus: dispatch "
            "(routing.ledger_bus, epp.ledger_bus: in-flight load, predictions, sessions' "
            "claims) and budget (tenants.budget_bus: budget charges, fair shares).",
            labels=["bus"],
        )
        events = CounterMetricFamily(
            "kvroute_bus_updates",
            "Updates on the buses between routers, sent by this router or another's applied "
            "here: dispatch events on the dispatch bus, charge messages on the budget bus.",
            labels=["bus", "direction"],
        )
        for kind in KINDS:
            up, sent, applied = totals[kind]
            connected.add_metric([kind], up)
            events.add_metric([kind, "sent"], sent)
            events.add_metric([kind, "applied"], applied)
        yield connected
        yield events
