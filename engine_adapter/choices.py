"""Enumerations of the engine adapter."""

from django.db import models


class Launch(models.TextChoices):
    SGLANG = "sglang", "SGLang server"
    SIM = "sim", "Simulator (not a product engine)"
    EXTERNAL = "external", "External (started elsewhere)"


class EngineStatus(models.TextChoices):
    STARTING = "starting", "Starting"
    HEALTHY = "healthy", "Healthy"
    UNHEALTHY = "unhealthy", "Unhealthy"
    CRASHED = "crashed", "Crashed"
    STOPPED = "stopped", "Stopped"
