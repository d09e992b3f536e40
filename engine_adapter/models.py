"""The fleet as data: pools loaded from the spec file, and the engine instances running them."""

from __future__ import annotations

from decimal import Decimal

from django.db import models
from django.utils import timezone

from engine_adapter.choices import EngineStatus, Launch


class Pool(models.Model):
    """Replicas of one model in one region. ``gpu_hourly_cost`` is per GPU, in USD."""

    name = models.SlugField(max_length=80, unique=True)
    model = models.CharField(max_length=200)
    model_path = models.CharField(max_length=500, blank=True)
    region = models.CharField(max_length=40)
    zone = models.CharField(max_length=16)
    gpu_type = models.CharField(max_length=40, blank=True)
    gpu_hourly_cost = models.DecimalField(max_digits=12, decimal_places=6, default=Decimal("0"))
    gpus_per_replica = models.PositiveIntegerField(default=1)
    replicas = models.PositiveIntegerField(default=1)
    launch = models.CharField(max_length=16, choices=Launch.choices)
    engine_python = models.CharField(max_length=500, blank=True)
    extra_args = models.JSONField(default=list, blank=True)
    external_urls = models.JSONField(default=list, blank=True)
    max_total_tokens = models.PositiveIntegerField(default=8192)
    vocab_size = models.PositiveIntegerField(
        null=True, blank=True,
        help_text="The model's vocabulary; token-id input is refused when unknown.")
    in_spec = models.BooleanField(default=True, help_text="False once removed from the spec.")
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return self.name


class EngineInstance(models.Model):
    """One engine server: where it listens, whether it is healthy, its last scraped load."""

    pool = models.ForeignKey(Pool, on_delete=models.CASCADE, related_name="instances")
    engine_id = models.CharField(max_length=120, unique=True)
    replica = models.PositiveIntegerField()
    url = models.CharField(max_length=300)
    pid = models.PositiveIntegerField(null=True, blank=True)
    launched = models.BooleanField(default=False, help_text="Started (and restartable) by us.")
    status = models.CharField(max_length=16, choices=EngineStatus.choices,
                              default=EngineStatus.STARTING)
    started_at = models.DateTimeField(default=timezone.now)
    last_seen_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    failures = models.PositiveIntegerField(default=0)
    restarts = models.PositiveIntegerField(default=0)
    load = models.JSONField(default=dict, blank=True)
    log_path = models.CharField(max_length=500, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["pool", "replica"], name="one_instance_per_replica"),
        ]

    def __str__(self) -> str:
        return self.engine_id


_seconds = {"max_digits": 20, "decimal_places": 6, "default": Decimal("0")}


class EngineCounterSample(models.Model):
    """One scrape of an engine's own cumulative counters (``metrics.parse_engine_counters``).

    Written by the health check each time it scrapes an engine that reports them. ``epoch``
    numbers the engine's process lives: it goes up when the fleet manager relaunched the
    engine (``started_at`` changed) or a counter went down (a restart nobody told us of), so
    deltas are taken only between samples of one epoch. Seconds are the engine's own
    measurements (prefill forward time, time per output token), not money.
    """

    engine_id = models.CharField(max_length=120, help_text="EngineInstance.engine_id.")
    at = models.DateTimeField(help_text="When the scrape answered.")
    epoch = models.PositiveIntegerField()
    process_started_at = models.DateTimeField(null=True, blank=True)
    requests = models.PositiveBigIntegerField()
    prompt_tokens = models.PositiveBigIntegerField()
    cached_tokens = models.PositiveBigIntegerField()
    generation_tokens = models.PositiveBigIntegerField()
    uncached_prompt_tokens = models.PositiveBigIntegerField(default=0)
    prefill_seconds = models.DecimalField(**_seconds)
    tpot_seconds = models.DecimalField(**_seconds)
    tpot_requests = models.PositiveBigIntegerField(default=0)

    class Meta:
        db_table = "engine_counter_sample"
        indexes = [
            models.Index(fields=["engine_id", "at"], name="engine_counter_sample_at"),
            models.Index(fields=["at"], name="engine_counter_sample_prune"),
        ]

    def __str__(self) -> str:
        return f"{self.engine_id} @ {self.at:%Y-%m-%d %H:%M:%S} (epoch {self.epoch})"
