"""Token budgets (kvcore/budgets.py) on a fake clock."""

from __future__ import annotations

import pytest

from kvroute.kvcore.budgets import TenantBudget, TokenBucket


def test_a_bucket_refills_at_its_rate_up_to_a_minutes_worth() -> None:
    b = TokenBucket(600, now=0.0)  # 10 tokens a second
    assert b.refill(0.0) == 600
    b.take(600, 0.0)
    assert b.refill(0.0) == 0
    assert b.refill(3.0) == pytest.approx(30)
    assert b.wait_s(50, 3.0) == pytest.approx(2.0)
    assert b.refill(1000.0) == 600  # never more than its capacity
    b.take(-100, 1000.0)
    assert b.level == 600


def test_input_over_budget_is_refused_with_the_wait_until_it_fits() -> None:
    budget = TenantBudget(input_per_minute=1200, output_per_minute=None, now=0.0)  # 20/s
    assert budget.check(1000, 0.0) is None
    budget.reserve(1000, 0.0)
    refusal = budget.check(400, 0.0)  # 200 left: 200 short, 10 s at 20 tokens/s
    assert refusal is not None and refusal.kind == "input"
    assert refusal.wait_s == pytest.approx(10.0)
    assert budget.check(400, 10.0) is None


def test_a_prompt_bigger_than_the_bucket_passes_once_it_is_full() -> None:
    budget = TenantBudget(input_per_minute=100, output_per_minute=None, now=0.0)
    assert budget.check(5000, 0.0) is None  # else it could never pass
    budget.reserve(5000, 0.0)
    refusal = budget.check(1, 0.0)
    assert refusal is not None and refusal.wait_s > 60  # the debt is repaid first


def test_output_is_charged_after_the_answer_and_a_debt_holds_the_next_request() -> None:
    budget = TenantBudget(input_per_minute=None, output_per_minute=60, now=0.0)  # 1/s
    assert budget.check(10, 0.0) is None
    budget.reserve(10, 0.0)
    budget.settle(10, 12, 90, now=0.0)  # a longer answer than the minute's budget
    refusal = budget.check(10, 0.0)
    assert refusal is not None and refusal.kind == "output"
    assert refusal.wait_s == pytest.approx(31.0)  # 30 tokens of debt, then one to spare
    assert budget.check(10, 31.0) is None


def test_settle_corrects_the_estimate_and_refund_gives_it_back() -> None:
    budget = TenantBudget(input_per_minute=1000, output_per_minute=None, now=0.0)
    budget.reserve(300, 0.0)
    budget.settle(300, 250, 0, 0.0)  # the replica counted fewer
    assert budget.input is not None and budget.input.level == pytest.approx(750)
    budget.reserve(100, 0.0)
    budget.refund(100, 0.0)  # shed from the queue: nothing served
    assert budget.input.level == pytest.approx(750)
    described = budget.describe(0.0)
    assert described["output"] is None
    assert described["input"] == {"per_minute": 1000.0, "available": 750.0, "exhausted": False}
