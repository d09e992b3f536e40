"""Enumerations of the metering app.

Service tiers and capacity sources are pricing dimensions: they are defined once, in
``plans.choices``, and re-exported here for metering's models and serializers.
"""

from django.db import models

from plans.choices import CapacitySource, ServiceTier

__all__ = ["CapacitySource", "EventSource", "EventStatus", "ReconcileStatus", "ServiceTier",
           "ThroughputSource"]


class EventStatus(models.TextChoices):
    OK = "ok", "OK"
    CLIENT_ABORTED = "client_aborted", "Client aborted"
    ENGINE_ERROR = "engine_error", "Engine error"


class EventSource(models.TextChoices):
    GATEWAY = "gateway", "Gateway"
    EXTERNAL = "external", "External ingest API"


class ReconcileStatus(models.TextChoices):
    """How an engine-hour's metered usage compares with the engine's own counters."""

    RECONCILED = "reconciled", "Reconciled (within tolerance)"
    DRIFT = "drift", "Drift (outside tolerance)"
    NOT_RECONCILABLE = "not_reconcilable", "Not reconcilable (no counters from the engine)"


class ThroughputSource(models.TextChoices):
    """Where the prefill and decode rates that weighed an interval's requests came from."""

    MEASURED = "measured", "Measured by the engine"
    DEFAULT = "default", "Default (the engine had measured nothing yet)"
