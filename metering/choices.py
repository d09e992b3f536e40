"""Enumerations of the metering app.

Service tiers and capacity sources are pricing dimensions: they are defined once, in
``plans.choices``, and re-exported here for metering's models and serializers.
"""

from django.db import models

from plans.choices import CapacitySource, ServiceTier

__all__ = ["CapacitySource", "EventSource", "EventStatus", "ServiceTier"]


class EventStatus(models.TextChoices):
    OK = "ok", "OK"
    CLIENT_ABORTED = "client_aborted", "Client aborted"
    ENGINE_ERROR = "engine_error", "Engine error"


class EventSource(models.TextChoices):
    GATEWAY = "gateway", "Gateway"
    EXTERNAL = "external", "External ingest API"
