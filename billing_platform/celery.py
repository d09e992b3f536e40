"""The Celery app, where every task-wide decision is declared once: queues and routes, the
delivery options of every task, and the beat schedule.

Delivery (STYLE.md, as PostHog declares its task options once): every task is acknowledged
late and put back on its queue when the worker running it dies, because every task checks state
before acting and so is safe to run twice; no task keeps a result (none has a result backend to
keep it in). They are the app's defaults rather than decorator arguments, so a task written with
none gets them, ``engine_adapter``'s too (it may not import the platform). A task adds only what
it alone needs, such as retries narrowed to its own transient errors (``autoretry_for``); it
never overrides these, and ``tests/test_celery_declarations.py`` fails on one that does.

The beat schedule: every periodic task runs from :func:`beat_schedule`, and every entry
expires, so beats that pile up while a worker is busy or down are dropped, not run back to back
(the next beat does the same work).
"""

from __future__ import annotations

import os
from enum import StrEnum
from typing import Any

from celery import Celery
from kombu import Exchange, Queue

from billing_platform import env
from metering import conf as metering_conf

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "billing_platform.settings")


class Queues(StrEnum):
    """The worker queues (DESIGN.md, processes); a worker's ``-Q`` names some of them."""

    METERING = "metering"
    BILLING = "billing"
    QUOTA = "quota"
    BATCH = "batch"
    FLEET = "fleet"


# Every task's delivery options, as task attributes (each is also the app setting ``task_<name>``).
DELIVERY: dict[str, bool] = {"acks_late": True, "reject_on_worker_lost": True,
                             "ignore_result": True}

app = Celery("tollgate")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.conf.update({f"task_{option}": value for option, value in DELIVERY.items()})
app.conf.task_queues = [Queue(q.value, Exchange(q.value), routing_key=q.value) for q in Queues]
app.conf.task_default_queue = Queues.METERING.value
# Tasks are routed by the prefix of their name (``<app>.<task>``).
app.conf.task_routes = {
    "accounts.*": {"queue": Queues.QUOTA.value},
    "idempotency.*": {"queue": Queues.QUOTA.value},
    "metering.*": {"queue": Queues.METERING.value},
    "plans.*": {"queue": Queues.QUOTA.value},
    "invoicing.*": {"queue": Queues.BILLING.value},
    "finance.*": {"queue": Queues.BILLING.value},
    "batch.*": {"queue": Queues.BATCH.value},
    "fleet.*": {"queue": Queues.FLEET.value},
    "gateway.*": {"queue": Queues.QUOTA.value},
}


def _every(seconds: float, task: str, *, expires: float | None = None) -> dict[str, Any]:
    """Return a beat entry running ``task`` every ``seconds``, dropped if not started within
    ``expires`` seconds of being sent (default: one period, when the next one is due)."""
    return {"task": task, "schedule": seconds,
            "options": {"expires": seconds if expires is None else expires}}


def beat_schedule() -> dict[str, dict[str, Any]]:
    """Return every periodic task of the platform: the one place one is declared."""
    return {
        "flush-api-key-last-used": _every(env.LAST_USED_FLUSH_S,
                                          "accounts.flush_api_key_last_used"),
        "batch-sweep": _every(env.BATCH_SWEEP_S, "batch.sweep", expires=60.0),
        "budget-sweep": _every(env.BUDGET_SWEEP_S, "plans.budget_sweep"),
        # stored Responses API answers past their retention (a dropped beat: the next one)
        "responses-expire": _every(env.RESPONSES_EXPIRE_S, "gateway.responses_expire"),
        "fleet-health-check": _every(env.FLEET_HEALTH_S, "fleet.health_check", expires=30.0),
        "invoicing-period-close": _every(env.PERIOD_CLOSE_S, "invoicing.period_close"),
        "invoicing-dunning": _every(3600.0, "invoicing.dunning"),
        "idempotency-prune": _every(3600.0, "idempotency.prune"),
        "invoicing-payments-sync": _every(900.0, "invoicing.payments_sync"),
        # rated = billed for every org; a run that outlives its slot is dropped, not queued up
        "invoicing-billing-invariant": _every(21600.0, "invoicing.billing_invariant",
                                              expires=21000.0),
        # a day not exported yet is exported; one that is, left as it is (finance/exports.py)
        "finance-export": _every(env.FINANCE_EXPORT_S, "finance.export", expires=3600.0),
        "metering-replay-spool": _every(metering_conf.spool_replay_s(), "metering.replay_spool"),
        "metering-ensure-partitions": _every(3600.0, "metering.ensure_partitions"),
        # TOLLGATE_USAGE_RETENTION_MONTHS: old months archived and dropped once billed, the
        # idempotency keys before the horizon deleted (a no-op while it is 0)
        "usage-retire": _every(86400.0, "invoicing.usage_retire", expires=3600.0),
        # both recompute a recent window each run: a dropped beat is made up by the next
        "metering-cost-attribute": _every(metering_conf.cost_attribute_every_s(),
                                          "metering.cost_attribute"),
        "metering-reconcile": _every(metering_conf.reconcile_every_s(), "metering.reconcile"),
    }


@app.on_after_configure.connect
def _install_beat_schedule(sender: Celery, **kwargs: object) -> None:
    # Installed once the app is configured, not at import: metering's period may be a Django
    # setting, which is readable only then.
    sender.conf.beat_schedule = beat_schedule()


app.autodiscover_tasks()
# every task's outcome and duration on /metrics (signal receivers, connected on import)
import billing_platform.metrics  # noqa: E402, F401
