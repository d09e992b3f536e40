"""Celery tasks of the metering app: spool replay, partitions ahead, cost-to-serve attribution
and engine-vs-gateway reconciliation, all on beat (their entries are in
``billing_platform.celery.beat_schedule``, with every other one)."""

from __future__ import annotations

from celery import shared_task

from metering import costs, reconciliation, services


@shared_task(name="metering.replay_spool")
def replay_spool() -> int:
    """Replay this host's usage spool; return how many event lines were replayed."""
    return services.usage_spool_replay().lines


@shared_task(name="metering.ensure_partitions")
def ensure_partitions() -> list[str]:
    """Create this and the next two months' usage_event partitions."""
    return services.usage_partitions_ensure(months_ahead=2)


@shared_task(name="metering.cost_attribute")
def cost_attribute() -> dict[str, int]:
    """Split the engines' GPU time of the settled intervals over the requests they served."""
    run = costs.usage_costs_attribute()
    return {"attributed": run.attributed, "unchanged": run.unchanged, "shares": run.shares}


@shared_task(name="metering.reconcile")
def reconcile() -> dict[str, int]:
    """Reconcile the recent engine-hours: the engines' own counters against metered usage."""
    run = reconciliation.usage_engine_hours_reconcile()
    return {"rows": run.rows, "drift": len(run.drift), "alerted": len(run.alerted)}
