"""Celery tasks of the idempotency app (thin: call a service)."""

from __future__ import annotations

from celery import shared_task

from billing_platform.idempotency import services


@shared_task(name="idempotency.prune")
def prune() -> int:
    """Forget idempotency keys older than 24 hours."""
    return services.idempotent_requests_prune()
