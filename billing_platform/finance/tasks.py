"""Celery tasks of the finance workspace: thin, safe to run twice (delivery options are the
Celery app's, ``billing_platform.celery``)."""

from __future__ import annotations

from celery import shared_task

from billing_platform.finance import exports


@shared_task(name="finance.export")
def export_task() -> list[str]:
    """Export every ended day not exported yet to the warehouse directory; return those
    written (a day already there is left as it is, so a second run writes nothing)."""
    return [r.day.isoformat() for r in exports.export_due() if r.written]
