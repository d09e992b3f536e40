"""Celery tasks of the plans app (thin: call a service). Safe to run twice: alerts are unique
per threshold and period, drift fixes only raise Redis to PostgreSQL, suspensions check state.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import shared_task

from plans import quotas

log = logging.getLogger(__name__)


@shared_task(name="plans.budget_sweep", acks_late=True, reject_on_worker_lost=True,
             ignore_result=True)
def budget_sweep() -> dict[str, Any]:
    """Reconcile budgets' Redis counters with PostgreSQL, fire alerts, suspend or reinstate."""
    results = quotas.budget_sweep()
    fired = {k: v["fired"] for k, v in results.items() if v["fired"] or v["change"]}
    if fired:
        log.info("budget sweep: %s", fired)
    return results


@shared_task(name="plans.budget_reconcile", acks_late=True, reject_on_worker_lost=True,
             ignore_result=True)
def budget_reconcile(budget_id: int) -> dict[str, Any] | None:
    """Reconcile one budget now (enqueued after a budget changes)."""
    from plans.models import Budget

    budget = Budget.objects.select_related("organization", "project").filter(
        pk=budget_id).first()
    return None if budget is None else quotas.budget_reconcile(budget=budget)
