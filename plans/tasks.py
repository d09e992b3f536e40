"""Celery tasks of the plans app (thin: call a service). Safe to run twice: alerts are unique
per threshold and period, drift fixes only raise Redis to PostgreSQL, suspensions check state,
an alert's webhook is posted only while its row says it was not delivered.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Task, shared_task

from billing_platform import env
from plans import quotas, webhooks

log = logging.getLogger(__name__)


@shared_task(name="plans.budget_sweep")
def budget_sweep() -> dict[str, Any]:
    """Reconcile budgets' Redis counters with PostgreSQL, fire alerts, suspend or reinstate."""
    results = quotas.budget_sweep()
    fired = {k: v["fired"] for k, v in results.items() if v["fired"] or v["change"]}
    if fired:
        log.info("budget sweep: %s", fired)
    return results


@shared_task(name="plans.budget_reconcile")
def budget_reconcile(budget_id: int) -> dict[str, Any] | None:
    """Reconcile one budget now (enqueued after a budget changes)."""
    from plans.models import Budget

    budget = Budget.objects.select_related("organization", "project").filter(
        pk=budget_id).first()
    return None if budget is None else quotas.budget_reconcile(budget=budget)


# Only a failed delivery is retried (an answer other than 2xx, or none), with exponential
# backoff and full jitter; a refused address or a programming error is not.
@shared_task(name="plans.budget_alert_webhook", bind=True,
             autoretry_for=(webhooks.WebhookNotDelivered,),
             retry_backoff=env.BUDGET_WEBHOOK_BACKOFF_S, retry_backoff_max=3600,
             retry_jitter=True, max_retries=env.BUDGET_WEBHOOK_MAX_RETRIES)
def budget_alert_webhook(self: Task[[int], str], alert_id: int) -> str:
    """Post one budget alert's webhook (at most once: ``budget_alert_webhook_deliver``)."""
    return webhooks.budget_alert_webhook_deliver(
        alert_id=alert_id, last_attempt=self.request.retries >= (self.max_retries or 0))


@shared_task(name="plans.webhook_delivery", bind=True,
             autoretry_for=(webhooks.WebhookNotDelivered,),
             retry_backoff=env.BUDGET_WEBHOOK_BACKOFF_S, retry_backoff_max=3600,
             retry_jitter=True, max_retries=env.BUDGET_WEBHOOK_MAX_RETRIES)
def webhook_delivery(self: Task[[int], str], delivery_id: int) -> str:
    """Post one delivery to an organization's endpoint (logged per attempt, at most once)."""
    return webhooks.webhook_delivery_attempt(
        delivery_id=delivery_id, last_attempt=self.request.retries >= (self.max_retries or 0))
