"""Celery tasks of the fleet (queue ``fleet``)."""

from __future__ import annotations

import logging

from celery import shared_task

from engine_adapter import services

log = logging.getLogger(__name__)


@shared_task(name="fleet.health_check", acks_late=True, reject_on_worker_lost=True,
             ignore_result=True, expires=30)
def fleet_health_check() -> dict[str, str]:
    """Probe engines, record load, restart crashed engines Tollgate launched."""
    states = services.fleet_health_check()
    restarted = [e for e, s in states.items() if s == "restarted"]
    if restarted:
        log.warning("restarted crashed engines: %s", ", ".join(restarted))
    return states
