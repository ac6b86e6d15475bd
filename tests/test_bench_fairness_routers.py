"""``kvroute bench fairness --routers N``'s report, from made-up results (the bench itself
starts replicas, routers and NATS: BENCHMARKS.md has its runs)."""

from __future__ import annotations

from kvroute.bench.fairness import Options
from kvroute.bench.fairness_routers import LOCAL, SHARED, SPREAD, Result, cases, report


def test_the_report_gives_each_case_its_shares_against_one_router_in_one_table() -> None:
    one, alone, shared, slots = cases(4)
    assert (one.routers, alone.share, shared.share) == (1, False, True)
    assert (shared.slots, slots.share, slots.slots) == (False, True, True)
    results = [
        Result(one, {SPREAD: 500.0, LOCAL: 500.0}, {SPREAD: [0.5], LOCAL: [0.5]}),
        Result(alone, {SPREAD: 875.0, LOCAL: 125.0}, {SPREAD: [0.2], LOCAL: [3.0]}),
        Result(
            shared,
            {SPREAD: 750.0, LOCAL: 250.0},
            {SPREAD: [0.2, 24.0], LOCAL: [1.5], SHARED: [24.0]},
        ),
        Result(slots, {SPREAD: 520.0, LOCAL: 480.0}, {SPREAD: [0.5], LOCAL: [0.5]}),
    ]
    text = report(results, Options(seconds=10.0), 4, "kvroute bench fairness --routers 4")
    assert "`kvroute bench fairness --routers 4`" in text
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert len(table) == 6  # header, rule, four cases: no blank line inside
    assert "| 0.750 | 0.250 | 0.50x | 0.800 | 100 |" in table[4], table[4]
    assert "| 1, 24000 / 24000 ms |" in table[4], table[4]
    assert "| 0.875 | 0.125 | 0.25x |" in table[3], table[3]
    assert "| 4 routers, fairness.share_bus + share_slots | 0.520 | 0.480 | 0.96x |" in table[5]
    assert "fairness.share_slots (share_slots_max_factor 2" in text
