"""Tollgate's Django project: settings, URLs, the Celery app and the platform-wide apps."""

from billing_platform.celery import app as celery_app

__all__ = ["celery_app"]
