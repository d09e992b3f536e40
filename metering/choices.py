"""Enumerations of the metering app."""

from django.db import models


class ServiceTier(models.TextChoices):
    DEFAULT = "default", "Default (standard)"
    PRIORITY = "priority", "Priority"
    FLEX = "flex", "Flex"
    BATCH = "batch", "Batch"


class CapacitySource(models.TextChoices):
    ON_DEMAND = "on_demand", "On demand"
    PROVISIONED = "provisioned", "Provisioned units"
    SPILLOVER = "spillover", "Spillover from provisioned"
    PLAN = "plan", "Subscription token plan"
    OVERAGE = "overage", "Plan overage"


class EventStatus(models.TextChoices):
    OK = "ok", "OK"
    CLIENT_ABORTED = "client_aborted", "Client aborted"
    ENGINE_ERROR = "engine_error", "Engine error"


class EventSource(models.TextChoices):
    GATEWAY = "gateway", "Gateway"
    EXTERNAL = "external", "External ingest API"
