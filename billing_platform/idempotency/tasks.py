"""Celery tasks of the idempotency app (thin: call a service)."""

from __future__ import annotations

from celery import shared_task

from billing_platform.idempotency import services


@shared_task(name="idempotency.prune", acks_late=True, reject_on_worker_lost=True,
             ignore_result=True, expires=3600)
def prune() -> int:
    """Forget idempotency keys older than 24 hours."""
    return services.idempotent_requests_prune()
