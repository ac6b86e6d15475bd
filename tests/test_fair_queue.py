"""The fair queue's rules (kvcore/fair_queue.py), on plain tickets: no clock, no event loop."""

from __future__ import annotations

import pytest

from kvroute.kvcore.fair_queue import (
    FairnessParams,
    FairQueue,
    Priority,
    QueueFull,
    TenantLimits,
    Ticket,
    priority_of,
)

STANDARD, CRITICAL, SHEDDABLE = Priority.STANDARD, Priority.CRITICAL, Priority.SHEDDABLE


def make(
    capacity: int = 100,
    limits: dict[str, TenantLimits] | None = None,
    **params: float,
) -> FairQueue:
    table = limits or {}
    return FairQueue(
        FairnessParams(**params),  # type: ignore[arg-type]
        lambda name: table.get(name, TenantLimits()),
        capacity,
    )


def serve(queue: FairQueue, ticket: Ticket, output: int = 0) -> None:
    """Admit and finish at once: what the tenant's counter sees of a request."""
    queue.started(ticket)
    queue.finished(ticket, ticket.input_tokens, output)


def test_lowest_counter_goes_first_and_weights_divide_service() -> None:
    q = make(output_weight=2.0)
    for name in ("a", "a", "b", "b"):
        q.offer(Ticket(name, STANDARD, 100))
    first = q.pick()  # level: the first to arrive
    assert first is not None and first.tenant == "a"
    serve(q, first, output=50)  # a: 100 + 2 x 50 = 200
    second = q.pick()
    assert second is not None and second.tenant == "b"
    serve(q, second)
    assert q.counters() == {"a": 200.0, "b": 100.0}
    third = q.pick()
    assert third is not None and third.tenant == "b"  # still the lowest
    # A weight of 2 halves what the same tokens count for.
    heavy = make(limits={"w": TenantLimits(weight=2.0)})
    serve(heavy, Ticket("w", STANDARD, 100))
    assert heavy.counters()["w"] == 50.0


def test_a_returning_tenant_does_not_bank_its_idle_time() -> None:
    """b was idle while a was served alone for a long time: when b comes back it is lifted to
    the level of those waiting, so it cannot lock a out by spending credit it never earned."""
    q = make()
    serve(q, Ticket("b", STANDARD, 10))  # b was here once, long ago
    for _ in range(100):
        serve(q, Ticket("a", STANDARD, 100))  # a alone: 10,000 tokens of service
    for _ in range(10):
        q.offer(Ticket("a", STANDARD, 100))
    for _ in range(10):
        q.offer(Ticket("b", STANDARD, 100))
    assert q.counters()["b"] >= q.counters()["a"] - 1e-9  # lifted, not 10 tokens
    order = []
    for _ in range(10):
        t = q.pick()
        assert t is not None
        order.append(t.tenant)
        serve(q, t)
    # Turns alternate (within a request's worth), instead of ten b's in a row.
    assert order.count("a") >= 4 and order.count("b") >= 4, order


def test_a_newcomer_starts_level_with_the_last_admitted() -> None:
    q = make()
    for _ in range(5):
        serve(q, Ticket("a", STANDARD, 100))
    q.offer(Ticket("new", STANDARD, 1))
    assert q.counters()["new"] >= 400


def test_a_higher_class_is_always_admitted_first() -> None:
    q = make()
    serve(q, Ticket("vip", STANDARD, 10_000))  # far ahead in service: no matter
    q.offer(Ticket("batch", SHEDDABLE, 1))
    q.offer(Ticket("web", STANDARD, 1))
    q.offer(Ticket("vip", CRITICAL, 1))
    picked = [q.pick() for _ in range(3)]
    assert [(t.tenant, t.priority) for t in picked if t] == [
        ("vip", CRITICAL),
        ("web", STANDARD),
        ("batch", SHEDDABLE),
    ]
    assert q.pick() is None


def test_a_full_queue_sheds_sheddable_first_and_never_critical_for_lower_work() -> None:
    q = make(capacity=3)
    serve(q, Ticket("x", STANDARD, 500))  # x is further ahead than y
    old_x = Ticket("x", SHEDDABLE, 1)
    new_x = Ticket("x", SHEDDABLE, 1)
    y = Ticket("y", SHEDDABLE, 1)
    for t in (old_x, y, new_x):
        q.offer(t)
    # A sheddable arrival finds nothing lower to displace: refused itself.
    with pytest.raises(QueueFull):
        q.offer(Ticket("z", SHEDDABLE, 1))
    # A standard one displaces the newest sheddable of the tenant furthest ahead.
    assert q.offer(Ticket("z", STANDARD, 1)) is new_x
    assert q.offer(Ticket("z", CRITICAL, 1)) in (old_x, y)
    # Now one standard, one critical and one sheddable wait: a critical arrival sheds the
    # sheddable first, then the standard; with only critical work queued it is refused.
    left = q.offer(Ticket("c", CRITICAL, 1))
    assert left is not None and left.priority == SHEDDABLE
    shed = q.offer(Ticket("c", CRITICAL, 1))
    assert shed is not None and shed.priority == STANDARD
    with pytest.raises(QueueFull):
        q.offer(Ticket("c", CRITICAL, 1))
    assert q.would_refuse(CRITICAL) and q.queued == 3
    assert q.waiting("c") == {"critical": 2, "standard": 0, "sheddable": 0}


def test_sheddable_work_waits_less() -> None:
    q = make(sheddable_max_wait_s=2.0)
    assert q.max_wait_s(SHEDDABLE, 30.0) == 2.0
    assert q.max_wait_s(STANDARD, 30.0) == 30.0
    assert q.max_wait_s(CRITICAL, 30.0) == 30.0


def test_locality_bends_fair_order_only_within_the_bound() -> None:
    def locality(t: Ticket) -> int:
        return 1000 if t.block_hashes == (7,) else 0  # the freed replica holds block 7

    for behind, expected in ((500, "b"), (5000, "a")):
        q = make(locality_bound_tokens=1000)
        serve(q, Ticket("b", STANDARD, behind))  # b has had more service than a
        serve(q, Ticket("a", STANDARD, 0))
        q.offer(Ticket("a", STANDARD, 1))
        q.offer(Ticket("b", STANDARD, 1, block_hashes=(7,)))
        picked = q.pick(locality)
        assert picked is not None and picked.tenant == expected, (behind, picked)


def test_locality_scan_from_the_config_bounds_how_deep_locality_looks() -> None:
    """fairness.locality_scan: the queued request whose prefix the freed replica holds is
    fourth in line; a scan of 3 does not reach it (fair order stands), the default does."""
    from kvroute.router.config import config_from_dict
    from kvroute.router.tenants import fairness_params

    def locality(t: Ticket) -> int:
        return 1000 if t.block_hashes == (7,) else 0

    for scan, local_picked in ((3, False), (None, True)):
        fairness = {} if scan is None else {"locality_scan": scan}
        config = config_from_dict({"replicas": [{"url": "http://r:1"}], "fairness": fairness})
        q = FairQueue(fairness_params(config), lambda name: TenantLimits(), 100)
        for _ in range(3):
            q.offer(Ticket("a", STANDARD, 1))
        q.offer(Ticket("a", STANDARD, 1, block_hashes=(7,)))
        picked = q.pick(locality)
        assert picked is not None and (picked.block_hashes == (7,)) is local_picked, scan


def test_locality_never_jumps_a_priority_class() -> None:
    q = make(locality_bound_tokens=10**9)
    q.offer(Ticket("a", CRITICAL, 1))
    q.offer(Ticket("b", STANDARD, 1))
    picked = q.pick(lambda t: 1000 if t.tenant == "b" else 0)
    assert picked is not None and picked.tenant == "a"


def test_a_tenant_at_its_own_cap_waits_while_others_go() -> None:
    q = make(limits={"capped": TenantLimits(max_concurrent=1)})
    running = Ticket("capped", STANDARD, 1)
    assert q.may_start(running)
    q.started(running)
    assert not q.may_start(Ticket("capped", STANDARD, 1))
    q.offer(Ticket("capped", STANDARD, 1))
    q.offer(Ticket("other", STANDARD, 1))
    first = q.pick()
    assert first is not None and first.tenant == "other"
    q.started(first)
    assert q.pick() is None  # only the capped tenant waits
    q.finished(running, 1, 0)
    nxt = q.pick()
    assert nxt is not None and nxt.tenant == "capped"


def test_removed_tickets_leave_the_queue() -> None:
    q = make()
    t = Ticket("a", STANDARD, 1)
    q.offer(t)
    q.remove(t)
    q.remove(t)  # twice is harmless
    assert q.queued == 0 and q.pick() is None


def test_ten_to_one_load_gets_equal_service_under_saturation() -> None:
    """A saturated server with 4 slots, a heavy tenant offering 10x the light one's requests:
    over the window both are backlogged, weighted service comes out about 1:1."""
    q = make(capacity=10**6, output_weight=2.0)
    served = {"heavy": 0.0, "light": 0.0}
    running: list[Ticket] = []
    for step in range(2000):
        for _ in range(10):
            q.offer(Ticket("heavy", STANDARD, 200))
        q.offer(Ticket("light", STANDARD, 200))  # more than half a slot: light stays backlogged
        while len(running) < 4:
            t = q.pick()
            if t is None:
                break
            q.started(t)
            running.append(t)
        done = running.pop(0)
        q.finished(done, 200, 50)
        if step >= 200:
            served[done.tenant] += 200 + 2.0 * 50
    ratio = served["heavy"] / served["light"]
    assert 0.9 <= ratio <= 1.1, served


def test_a_tie_goes_to_the_lighter_tenant_not_the_flood() -> None:
    """Level counters (what the lift makes): the tenant with fewer requests in service and
    waiting goes first, though the flood has fewer of them in service."""
    q = make()
    for name, running in (("heavy", 1), ("light", 2)):
        for _ in range(running):
            q.started(Ticket(name, STANDARD, 0))
    for _ in range(10):
        q.offer(Ticket("heavy", STANDARD, 1))
    q.offer(Ticket("light", STANDARD, 1))
    assert q.counters()["light"] == q.counters()["heavy"]
    first = q.pick()
    assert first is not None and first.tenant == "light"


def flooded(reserved_slots: int = FairnessParams().reserved_slots) -> FairQueue:
    """Every slot held by the heavy tenant, ten more of its requests waiting."""
    q = make(limits={"capped": TenantLimits(max_concurrent=1)}, reserved_slots=reserved_slots)
    for _ in range(4):
        q.started(Ticket("heavy", STANDARD, 300))
    for _ in range(10):
        q.offer(Ticket("heavy", STANDARD, 300))
    return q


def test_a_request_next_in_fair_order_is_sparse_and_skips_the_wait_for_a_slot() -> None:
    q = flooded()
    light = Ticket("light", STANDARD, 300)
    assert q.sparse(light)  # next anyway: lifted level with the flood, and lighter
    q.started(light)
    assert q.sparse(Ticket("light", STANDARD, 300))  # still behind the flood in service
    # Never for sheddable work, nor past a tenant's own cap, nor with reserved_slots 0.
    assert not q.sparse(Ticket("other", SHEDDABLE, 1))
    q.started(Ticket("capped", STANDARD, 1))
    assert not q.sparse(Ticket("capped", STANDARD, 1))
    assert not flooded(reserved_slots=0).sparse(Ticket("light", STANDARD, 300))


def test_a_request_not_next_in_fair_order_waits_for_a_slot() -> None:
    # A lone tenant holding every slot: nobody waits, nobody to go ahead of.
    alone = make()
    for _ in range(4):
        alone.started(Ticket("heavy", STANDARD, 300))
    assert not alone.sparse(Ticket("heavy", STANDARD, 300))
    q = flooded()
    # The flood's own new request: its older ones go first.
    assert not q.sparse(Ticket("heavy", STANDARD, 300))
    # A tenant with a request of its own waiting.
    q.offer(Ticket("queued", STANDARD, 1))
    assert not q.sparse(Ticket("queued", STANDARD, 1))
    # A tenant ahead of the flood in service (as the flood is charged, it falls behind).
    ahead = flooded()
    for _ in range(5):
        ahead.started(Ticket("light", STANDARD, 300))
    assert not ahead.sparse(Ticket("light", STANDARD, 300))
    # Fairness within a class: a higher class waiting goes first, and a flood of a lower
    # class is priority's business (a critical arrival waits only for the next slot).
    higher = flooded()
    higher.offer(Ticket("vip", CRITICAL, 1))
    assert not higher.sparse(Ticket("light", STANDARD, 300))
    assert not higher.sparse(Ticket("ops", CRITICAL, 1))


def test_reserved_slots_keep_a_light_tenant_from_waiting_and_service_fair() -> None:
    """The slot counting of router/admission.py over the pure queue: 4 slots and 2 reserved.
    A heavy tenant floods, a light one sends a request every third completion: every light
    request starts on arrival, never more than 6 run, never fewer than 4 while requests wait
    (work-conserving). With both tenants backlogged, weighted service still comes out 1:1."""
    limit, reserved = 4, 2
    q = make(capacity=10**6, output_weight=2.0, reserved_slots=reserved)
    running: list[Ticket] = []

    def fill() -> None:
        while len(running) < limit and (t := q.pick()) is not None:
            q.started(t)
            running.append(t)

    def arrive(t: Ticket) -> None:
        if (len(running) < limit and q.may_start(t)) or (
            len(running) < limit + reserved and q.sparse(t)
        ):
            q.started(t)
            running.append(t)
        else:
            q.offer(t)

    for step in range(600):
        while q.waiting("heavy")["standard"] < 10:
            arrive(Ticket("heavy", STANDARD, 200))
        if step % 3 == 0:
            arrive(Ticket("light", STANDARD, 200))
            assert q.waiting("light")["standard"] == 0, step  # it did not wait
        fill()
        assert limit <= len(running) <= limit + reserved
        q.finished(running.pop(0), 200, 50)
        fill()
    # Both backlogged (the light tenant's queue never empties): VTC's shares, as before.
    served = {"heavy": 0.0, "light": 0.0}
    for step in range(1500):
        arrive(Ticket("heavy", STANDARD, 200))
        arrive(Ticket("light", STANDARD, 200))
        fill()
        done = running.pop(0)
        q.finished(done, 200, 50)
        if step >= 200:
            served[done.tenant] += 200 + 2.0 * 50
    ratio = served["heavy"] / served["light"]
    assert 0.9 <= ratio <= 1.1, served


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("critical", CRITICAL),
        (" Sheddable ", SHEDDABLE),
        ("standard", STANDARD),
        ("5", CRITICAL),
        ("0", STANDARD),
        ("-1", SHEDDABLE),
        ("gold-tier", None),
    ],
)
def test_priority_names_and_objective_integers(value: str, expected: Priority | None) -> None:
    assert priority_of(value) == expected
