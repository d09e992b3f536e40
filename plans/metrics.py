"""Metrics of quotas: how long admission takes and how it ends, and budget-alert webhooks."""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

from prometheus_client import Counter, Histogram

from billing_platform.errors import DomainError

P = ParamSpec("P")
T = TypeVar("T")

ADMISSION_SECONDS = Histogram(
    "tollgate_admission_seconds",
    "Time to admit a request (rate limits, budget reservation, capacity, plan: one Redis "
    "step, or none from a lease), by outcome: admitted (in Redis), leased (from the process's "
    "quota lease), rejected (429), error (Redis failed).", ["outcome"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
POLICY_RELOAD_FAILURES = Counter(
    "tollgate_quota_policy_reload_failures",
    "Reloads of a cached quota policy from PostgreSQL that failed (the cached one was kept).")
BUDGET_WEBHOOKS = Counter(
    "tollgate_budget_alert_webhooks_total",
    "Budget-alert webhook delivery attempts, by outcome: delivered (2xx), failed (another "
    "status, a redirect, or no answer: retried), refused (the URL leads to a non-public "
    "address: not retried); abandoned counts alerts whose last retry failed too.", ["outcome"])
WEBHOOK_DELIVERIES = Counter(
    "tollgate_webhook_deliveries_total",
    "Attempts to post an event to an organization's webhook endpoints, by outcome: delivered, "
    "failed (retried), refused (non-public address); abandoned counts deliveries whose last "
    "retry failed too.", ["outcome"])
WEBHOOK_OUTCOMES = ("delivered", "failed", "refused", "abandoned")


# Known label values start at 0, so an alert on increase() sees the first event too. The
# admission's children are looked up once: labels() per decision was ~5 % of its CPU.
_ADMISSION_BY_OUTCOME = {o: ADMISSION_SECONDS.labels(o)
                         for o in ("admitted", "leased", "rejected", "error")}
for _outcome in WEBHOOK_OUTCOMES:
    BUDGET_WEBHOOKS.labels(_outcome)
    WEBHOOK_DELIVERIES.labels(_outcome)


def timed_admission(func: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
    """Observe an async admission's duration in ``ADMISSION_SECONDS`` under its outcome."""

    @functools.wraps(func)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        started = time.perf_counter()
        outcome = "error"
        try:
            result = await func(*args, **kwargs)
            outcome = "admitted"
            return result
        except DomainError:  # QuotaExceeded: refused with a 429
            outcome = "rejected"
            raise
        finally:
            admission_observed(outcome, time.perf_counter() - started)

    return wrapper


def admission_observed(outcome: str, seconds: float) -> None:
    """Observe one admission's duration under its outcome (admitted, leased, rejected,
    error)."""
    _ADMISSION_BY_OUTCOME[outcome].observe(seconds)


def budget_webhook_counted(outcome: str) -> None:
    """Count one budget-alert webhook attempt (or an abandoned alert) under its outcome."""
    if outcome not in WEBHOOK_OUTCOMES:
        raise ValueError(f"unknown webhook outcome {outcome!r}")
    BUDGET_WEBHOOKS.labels(outcome).inc()


def webhook_delivery_counted(outcome: str) -> None:
    """Count one attempt to an organization's endpoint (or an abandoned delivery)."""
    if outcome not in WEBHOOK_OUTCOMES:
        raise ValueError(f"unknown webhook outcome {outcome!r}")
    WEBHOOK_DELIVERIES.labels(outcome).inc()
