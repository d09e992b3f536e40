"""Celery tasks of the metering app: spool replay and partitions ahead, both on beat.

The beat entries are registered here (``setdefault``: an entry of the same name in the Celery
config wins) so the schedule lives next to the tasks it runs.
"""

from __future__ import annotations

from billing_platform.celery import app
from metering import conf, services


@app.task(name="metering.replay_spool", acks_late=True, reject_on_worker_lost=True)
def replay_spool() -> int:
    """Replay this host's usage spool; return how many event lines were replayed."""
    return services.usage_spool_replay().lines


@app.task(name="metering.ensure_partitions", acks_late=True, reject_on_worker_lost=True)
def ensure_partitions() -> list[str]:
    """Create this and the next two months' usage_event partitions."""
    return services.usage_partitions_ensure(months_ahead=2)


app.conf.beat_schedule.setdefault(
    "metering-replay-spool", {"task": "metering.replay_spool", "schedule": conf.spool_replay_s()}
)
app.conf.beat_schedule.setdefault(
    "metering-ensure-partitions", {"task": "metering.ensure_partitions", "schedule": 3600.0}
)
