"""Celery tasks of the metering app: spool replay and partitions ahead, both on beat
(their entries are in ``billing_platform.celery.beat_schedule``, with every other one)."""

from __future__ import annotations

from celery import shared_task

from metering import services


@shared_task(name="metering.replay_spool")
def replay_spool() -> int:
    """Replay this host's usage spool; return how many event lines were replayed."""
    return services.usage_spool_replay().lines


@shared_task(name="metering.ensure_partitions")
def ensure_partitions() -> list[str]:
    """Create this and the next two months' usage_event partitions."""
    return services.usage_partitions_ensure(months_ahead=2)
