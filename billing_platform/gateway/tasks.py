"""Celery tasks of the gateway: the Batch API's (queue ``batch``), thin wrappers around the
batch services, and the retention of stored Responses API answers (``gateway.*``, queue
``quota``).

Delivery (the Celery app's defaults, ``billing_platform.celery``): ``acks_late`` with
``reject_on_worker_lost`` so a killed worker's task comes back;
every task checks the batch's state first, so running one twice is harmless (line claims are
leased, results conditional). The beat sweep restarts any batch whose runner went silent, so
progress never depends on a message surviving.
"""

from __future__ import annotations

from celery import shared_task

from billing_platform.gateway import response_store
from billing_platform.gateway.batch import runner
from billing_platform.gateway.batch import services as batch_services
from billing_platform.gateway.models import Batch, BatchStatus


@shared_task(name="batch.start")
def batch_start(batch_id: int) -> str | None:
    """Validate a new batch and start running it."""
    batch = batch_services.batch_validate(batch_id=batch_id)
    if batch is not None and batch.status == BatchStatus.IN_PROGRESS:
        batch_run.delay(batch_id)
    return batch.status if batch else None


@shared_task(name="batch.run")
def batch_run(batch_id: int) -> str:
    """Run one time slice of a batch; enqueue the next slice while lines remain."""
    why = runner.batch_run(batch_id=batch_id)
    if why == "slice" and Batch.objects.filter(pk=batch_id,
                                               status=BatchStatus.IN_PROGRESS).exists():
        batch_run.delay(batch_id)
    return why


@shared_task(name="batch.sweep")
def batch_sweep() -> dict[str, int]:
    """Expire, finish and restart batches (beat)."""
    return batch_services.batch_sweep()


@shared_task(name="gateway.responses_expire")
def responses_expire() -> int:
    """Delete the stored responses past their retention (beat); safe to run twice."""
    return response_store.stored_responses_expire()
