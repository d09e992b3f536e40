"""The Celery app: Redis broker, the platform's queues, and the beat schedule."""

from __future__ import annotations

import os

from celery import Celery
from kombu import Exchange, Queue

from billing_platform import env

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "billing_platform.settings")

app = Celery("tollgate")
app.config_from_object("django.conf:settings", namespace="CELERY")
QUEUES = ("metering", "billing", "quota", "batch", "fleet")
app.conf.task_queues = [Queue(name, Exchange(name), routing_key=name) for name in QUEUES]
app.conf.task_routes = {
    "accounts.*": {"queue": "quota"},
    "idempotency.*": {"queue": "quota"},
    "metering.*": {"queue": "metering"},
    "plans.*": {"queue": "quota"},
    "invoicing.*": {"queue": "billing"},
    "batch.*": {"queue": "batch"},
    "fleet.*": {"queue": "fleet"},
}
app.conf.beat_schedule = {
    "flush-api-key-last-used": {
        "task": "accounts.flush_api_key_last_used",
        "schedule": float(os.environ.get("TOLLGATE_LAST_USED_FLUSH_S", "30")),
    },
    "batch-sweep": {
        "task": "batch.sweep",
        "schedule": env.BATCH_SWEEP_S,
    },
    "budget-sweep": {
        "task": "plans.budget_sweep",
        "schedule": float(os.environ.get("TOLLGATE_BUDGET_SWEEP_S", "60")),
    },
    "fleet-health-check": {
        "task": "fleet.health_check",
        "schedule": float(os.environ.get("TOLLGATE_FLEET_HEALTH_S", "5")),
    },
    "invoicing-period-close": {
        "task": "invoicing.period_close",
        "schedule": float(os.environ.get("TOLLGATE_PERIOD_CLOSE_S", "900")),
    },
    "invoicing-dunning": {"task": "invoicing.dunning", "schedule": 3600.0},
    "idempotency-prune": {"task": "idempotency.prune", "schedule": 3600.0},
    "invoicing-payments-sync": {"task": "invoicing.payments_sync", "schedule": 900.0},
    # rated = billed for every org; a run that outlives its slot is dropped, not queued up
    "invoicing-billing-invariant": {"task": "invoicing.billing_invariant", "schedule": 21600.0,
                                    "options": {"expires": 21000.0}},
}
app.autodiscover_tasks()
# every task's outcome and duration on /metrics (signal receivers, connected on import)
import billing_platform.metrics  # noqa: E402, F401
