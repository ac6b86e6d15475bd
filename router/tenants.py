"""Tenants: who a request belongs to, what that tenant may use, and what it used.

A request's tenant is its API key's (``auth.api_keys[].tenant``), else the gateway's
``x-gateway-inference-fairness-id`` header, else ``X-Tenant-Id``, else ``default``. Its
priority class is the objective header's (``x-gateway-inference-objective``: a class name, a
name mapped in ``fairness.objectives``, or an integer priority), else the tenant's default.
Settings come from ``tenants.by_name``, each key falling back to ``tenants.defaults``; a tenant
nobody configured gets the defaults.

Token budgets (kvcore/budgets.py) are checked and reserved before a request may queue, and
settled with the replica's own usage when the answer ends. The admission order itself is
kvcore/fair_queue.py's, driven by router/admission.py. The endpoint picker uses this too.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvroute.kvcore.budgets import ChargeLog, TenantBudget
from kvroute.kvcore.fair_queue import (
    FairnessParams,
    FairQueue,
    Priority,
    TenantLimits,
    Ticket,
    priority_of,
)

from . import errors
from .config import Config
from .tenant_metrics import TenantMetrics

log = logging.getLogger(__name__)

DEFAULT_TENANT = "default"
# The gateway's fairness id first (Gateway API Inference Extension), then a plain header.
TENANT_HEADERS = ("x-gateway-inference-fairness-id", "x-tenant-id")  # lowercase: as h2 sends them
# The InferenceObjective a request is for (llm-d-router's name for the same header second).
OBJECTIVE_HEADERS = ("x-gateway-inference-objective", "x-llm-d-inference-objective")
MAX_TENANT_NAME = 128


@dataclass(frozen=True, slots=True)
class TenantSettings:
    weight: float
    priority: Priority
    input_tokens_per_minute: int
    output_tokens_per_minute: int
    max_concurrent: int


def fairness_params(config: Config) -> FairnessParams:
    f = config.fairness
    return FairnessParams(
        f.output_weight, f.locality_bound_tokens, f.sheddable_max_wait_s, f.locality_scan,
        f.reserved_slots, f.by, f.program_max_wait_s, f.program_attained_weight,
        f.max_programs, f.share_max_lead_tokens,
        # Shares from other routers hold a tenant back here: its wait is bounded, then.
        f.share_max_wait_s if f.share_bus else 0.0,
        f.program_wait_share,
    )  # fmt: skip


class Tenants:
    """Identification, settings and budgets of tenants; ``budget_share`` is this process's
    part of each budget (1 / listen.workers: each worker enforces its share)."""

    def __init__(self, config: Config, metrics: TenantMetrics, budget_share: float = 1.0) -> None:
        d = config.tenants.defaults
        self.defaults = TenantSettings(
            d.weight,
            Priority[d.priority.upper()],
            d.input_tokens_per_minute,
            d.output_tokens_per_minute,
            d.max_concurrent,
        )
        self._settings: dict[str, TenantSettings] = {}
        for name, t in config.tenants.by_name.items():
            self._settings[name] = TenantSettings(
                t.weight if t.weight is not None else d.weight,
                Priority[(t.priority or d.priority).upper()],
                _or(t.input_tokens_per_minute, d.input_tokens_per_minute),
                _or(t.output_tokens_per_minute, d.output_tokens_per_minute),
                _or(t.max_concurrent, d.max_concurrent),
            )
        # Tenants named by keys are configuration, not client input: always tracked.
        self._configured = set(self._settings) | {
            k.tenant for k in config.auth.api_keys if not isinstance(k, str) and k.tenant
        }
        self._objectives = {
            name: Priority[value.upper()] for name, value in config.fairness.objectives.items()
        }
        self._max_tracked = config.tenants.max_tracked
        self._share = budget_share
        self._budgets: dict[str, TenantBudget] = {}
        # With tenants.budget_bus: this process's charges, shared with the other routers, and
        # the tenants whose buckets took a peer's level already (router/budget_bus.py).
        self.shared: ChargeLog | None = None
        self._synced: set[str] = set()
        self.seen: set[str] = set()
        self.metrics = metrics
        self._warned = False

    def settings(self, name: str) -> TenantSettings:
        return self._settings.get(name, self.defaults)

    def limits(self, name: str) -> TenantLimits:
        s = self.settings(name)
        return TenantLimits(s.weight, s.max_concurrent)

    # -- a request arrives -------------------------------------------------------------

    def identify(self, headers: Mapping[str, str], key_tenant: str | None) -> tuple[str, Priority]:
        """The request's tenant and priority class (400 for a tenant header that is unusable)."""
        name = key_tenant
        if name is None:
            for header in TENANT_HEADERS:
                value = headers.get(header)
                if value is not None:
                    name = _checked_name(value, header)
                    break
        name = self._tracked(name or DEFAULT_TENANT)
        priority = None
        for header in OBJECTIVE_HEADERS:
            value = headers.get(header)
            if value is not None:
                mapped = self._objectives.get(value.strip())
                priority = mapped if mapped is not None else priority_of(value)
                break
        return name, priority if priority is not None else self.settings(name).priority

    def _tracked(self, name: str) -> str:
        """``name``, unless it would be one client-chosen name too many to keep counts for."""
        if name in self.seen or name in self._configured or name == DEFAULT_TENANT:
            self.seen.add(name)
            return name
        if len(self.seen) >= self._max_tracked:
            if not self._warned:
                self._warned = True
                log.warning(
                    "more than tenants.max_tracked (%d) tenant names: new ones count as %r",
                    self._max_tracked,
                    DEFAULT_TENANT,
                )
            return DEFAULT_TENANT
        self.seen.add(name)
        return name

    def ticket(self, name: str, priority: Priority, input_tokens: int, now: float) -> Ticket:
        """A ticket to queue with; 429 (rate_limit_exceeded) when the tenant's budget is
        spent. Its input estimate is reserved from the budget until the answer settles it."""
        ticket = Ticket(name, priority, input_tokens, now)
        budget = self._budget(name, now)
        if budget is not None:
            refusal = budget.check(input_tokens, now)
            if refusal is not None:
                self.metrics.rejected(name, "over_budget")
                self.metrics.request(name, "rejected")
                s = self.settings(name)
                limit = (
                    s.input_tokens_per_minute
                    if refusal.kind == "input"
                    else s.output_tokens_per_minute
                )
                wait = max(1, math.ceil(refusal.wait_s))
                raise errors.over_budget(name, refusal.kind, limit, wait)
            budget.reserve(input_tokens, now)
            self._charged(name, input_tokens, 0)
        return ticket

    def _budget(self, name: str, now: float) -> TenantBudget | None:
        budget = self._budgets.get(name)
        if budget is None:
            s = self.settings(name)
            if not (s.input_tokens_per_minute or s.output_tokens_per_minute):
                return None
            share = self._share
            budget = self._budgets[name] = TenantBudget(
                s.input_tokens_per_minute * share or None,
                s.output_tokens_per_minute * share or None,
                now,
            )
        return budget

    # -- and leaves --------------------------------------------------------------------

    def admitted(self, ticket: Ticket, now: float) -> None:
        self.metrics.queued(ticket.tenant, max(0.0, now - ticket.arrived))

    def refused(self, ticket: Ticket, reason: str, now: float) -> None:
        """Refused after its reservation (shed, queue full or timed out; ``cancelled``: the
        client left while it queued): nothing was served, the reservation is given back."""
        budget = self._budgets.get(ticket.tenant)
        if budget is not None:
            budget.refund(ticket.input_tokens, now)
            self._charged(ticket.tenant, -ticket.input_tokens, 0)
        if reason == "cancelled":
            self.metrics.request(ticket.tenant, "cancelled")
            return
        self.metrics.rejected(ticket.tenant, reason)
        self.metrics.request(ticket.tenant, "rejected")

    def finished(
        self, ticket: Ticket, input_tokens: int, output_tokens: int, outcome: str, now: float
    ) -> None:
        """Served (or failed): charge the tenant what the replica counted."""
        budget = self._budgets.get(ticket.tenant)
        if budget is not None:
            budget.settle(ticket.input_tokens, input_tokens, output_tokens, now)
            self._charged(ticket.tenant, input_tokens - ticket.input_tokens, output_tokens)
        self.metrics.tokens_used(ticket.tenant, input_tokens, output_tokens)
        self.metrics.request(ticket.tenant, outcome)

    # -- several routers, one budget ----------------------------------------------------

    def _charged(self, tenant: str, input_tokens: float, output_tokens: float) -> None:
        if self.shared is not None:
            self.shared.add(tenant, input_tokens, output_tokens)

    def tracks(self, tenant: str) -> bool:
        """Whether ``tenant`` (named by a peer) has counts of its own here: not one
        client-chosen name too many (router/budget_bus.py drops those)."""
        return tenant == self._tracked(tenant)

    def levels(self, tenant: str, now: float) -> tuple[float | None, float | None]:
        """What ``tenant``'s buckets hold now (None: no such budget), sent with its charges."""
        budget = self._budgets.get(tenant)
        return budget.levels(now) if budget is not None else (None, None)

    def apply_remote(
        self,
        tenant: str,
        charges: tuple[float, float],
        levels: tuple[float | None, float | None] | None,
        now: float,
    ) -> None:
        """Another router's charges to ``tenant``. ``levels``: that router's buckets, from a
        router that ran long before this one started; the first time a bucket hears of such
        a router it takes its level instead (no fuller than it): what was spent before this
        one started is in it, and a router that just (re)started must not grant a whole
        minute again."""
        if tenant != self._tracked(tenant):
            return  # one client-chosen name too many: its budget is the default tenant's
        budget = self._budget(tenant, now)
        if budget is None:
            return
        if levels is not None and tenant not in self._synced:
            self._synced.add(tenant)
            budget.adopt_level(*levels)
            return
        budget.apply_remote(charges[0], charges[1], now)

    # -- reading -------------------------------------------------------------------------

    def snapshot(self, queue: FairQueue | None, now: float) -> dict[str, Any]:
        """Each tenant's settings, usage, queue and budget state: /admin/tenants."""
        m = self.metrics
        names = sorted(
            self.seen | set(self._settings) | {t for t, _ in m.requests} | {DEFAULT_TENANT}
        )
        counters = queue.counters() if queue is not None else {}
        rows = []
        for name in names:
            s = self.settings(name)
            budget = self._budget(name, now)
            state = queue.tenants.get(name) if queue is not None else None
            rows.append(
                {
                    "tenant": name,
                    "configured": name in self._settings,
                    "weight": s.weight,
                    "priority": s.priority.name.lower(),
                    "max_concurrent": s.max_concurrent or None,
                    "tokens": {
                        "input": m.tokens.get((name, "input"), 0),
                        "output": m.tokens.get((name, "output"), 0),
                    },
                    "requests": {o: n for (t, o), n in m.requests.items() if t == name},
                    "rejections": {r: n for (t, r), n in m.rejections.items() if t == name},
                    "active": state.active if state is not None else 0,
                    "queued": queue.waiting(name) if queue is not None else {},
                    # Weighted service so far (tokens / weight): fair order goes lowest first.
                    "virtual_tokens": round(counters.get(name, 0.0), 1),
                    "budget": budget.describe(now) if budget is not None else None,
                    # fairness.share_slots: the slots it may hold here, its part of the fleet's
                    # (null: none set, this router's own limit holds).
                    "fleet_slots": _part(queue, name),
                }
            )
        return {"tenants": rows}

    def summary(self, queue: FairQueue | None, now: float) -> list[dict[str, Any]]:
        """A line per tenant for the /status page: /admin/tenants has the rest."""
        return [
            {
                "tenant": row["tenant"],
                "requests": sum(row["requests"].values()),
                "tokens": row["tokens"],
                "active": row["active"],
                "queued": sum(row["queued"].values()),
                "rejected": sum(row["rejections"].values()),
                "budget_exhausted": bool(row["budget"])
                and any(b and b["exhausted"] for b in row["budget"].values()),
            }
            for row in self.snapshot(queue, now)["tenants"]
        ]


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


def _checked_name(value: str, header: str) -> str:
    name = value.strip()
    if not (0 < len(name) <= MAX_TENANT_NAME and name.isascii() and name.isprintable()):
        raise errors.bad_request(
            f"The {header} header must be 1-{MAX_TENANT_NAME} printable ASCII characters.",
            header,
        )
    return name


def _part(queue: FairQueue | None, name: str) -> int | None:
    """``name``'s part of the fleet's slots here (fairness.share_slots), None when none is set."""
    allowed = queue.allowed if queue is not None else None
    if allowed is None:
        return None
    return allowed.get(name, 1)  # one the last share did not know yet: one slot, as admitted
