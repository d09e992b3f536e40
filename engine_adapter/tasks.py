"""Celery tasks of the fleet (queue ``fleet``). Delivery options are the Celery app's
defaults (late ack, requeued on worker loss), so nothing here imports the platform."""

from __future__ import annotations

import logging
from datetime import timedelta

from celery import shared_task
from django.utils import timezone

from engine_adapter import conf, services

log = logging.getLogger(__name__)


@shared_task(name="fleet.health_check")
def fleet_health_check() -> dict[str, str]:
    """Probe engines, record load and counters, restart crashed engines Tollgate launched."""
    states = services.fleet_health_check()
    restarted = [e for e, s in states.items() if s == "restarted"]
    if restarted:
        log.warning("restarted crashed engines: %s", ", ".join(restarted))
    services.engine_counter_samples_prune(
        before=timezone.now() - timedelta(seconds=conf.engine_sample_retention_s()))
    return states
