"""Celery tasks of the accounts app (thin: call a service)."""

from __future__ import annotations

import logging

from celery import shared_task

from billing_platform.accounts import services

log = logging.getLogger(__name__)


@shared_task(name="accounts.flush_api_key_last_used")
def flush_api_key_last_used() -> int:
    """Copy API keys' last-used times from Redis to PostgreSQL."""
    count = services.api_key_last_used_flush()
    log.info("flushed last-used time of %d API key(s)", count)
    return count
