"""Usage events, their idempotency keys, hourly rollups and dead letters.

``usage_event`` is append-only and partitioned by month on ``event_time`` (the table and its
partitions are created by SQL in the migrations and by ``metering.partitions``; Django's model
below describes the columns). A unique constraint on a partitioned table must include the
partition key, so exact idempotency lives in ``usage_event_id``: one row per (organization,
request id), inserted with ``ON CONFLICT DO NOTHING`` in the same transaction as the event.
Each source has its own id space: the platform's ids (gateway requests, batch lines) are its
own unguessable ``req_...``, and ids reported through the usage API are stored as
``ext:<id>`` (``metering.events``), so an external event can never take a platform event's key.
An external event that tries to is refused and kept in ``usage_id_conflict``.

Token counts are tokens; ``amount`` and ``cost_to_serve`` keep 10 decimal places in the rated
currency (cost-to-serve in the platform's currency, USD). An event's own ``cost_to_serve`` is
what an external engine's operator reported with it (0 for the fleet's engines): the GPU time
of the fleet is attributed afterwards, in ``UsageCostShare`` (``metering.costs``). Timings are
milliseconds.

Foreign keys on the event and rollup tables are not enforced by the database (``db_constraint``
off) and never cascade: usage is a financial record that outlives keys and projects, and per-row
RI checks would cost ingest throughput; the ids are checked where events enter (the gateway's
authenticated principal, the external API's lookups).
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any, Literal, TypeVar, overload

from django.db import models
from django.db.models.functions import Now

from billing_platform.accounts.models import ApiKey, Organization, Project
from billing_platform.model_fields import decimal_field_maker
from metering.choices import (
    CapacitySource,
    EventSource,
    EventStatus,
    ReconcileStatus,
    ServiceTier,
    ThroughputSource,
)
from metering.events import MAX_KEY

_amount = decimal_field_maker(max_digits=28, decimal_places=10)
# a month of an organization's hourly amounts: room for 10,000 x an hour's largest
_month_amount = decimal_field_maker(max_digits=32, decimal_places=10)
_gpu_seconds = decimal_field_maker(max_digits=24, decimal_places=6)  # exact to the microsecond
_rate = decimal_field_maker(max_digits=24, decimal_places=6)
_M = TypeVar("_M", bound=models.Model)


@overload
def _fk(model: type[_M], *, null: Literal[True], blank: bool) -> models.ForeignKey[_M | None]: ...
@overload
def _fk(model: type[_M]) -> models.ForeignKey[_M]: ...
def _fk(model: type[models.Model], **kwargs: Any) -> models.ForeignKey[Any]:
    return models.ForeignKey(
        model, on_delete=models.DO_NOTHING, db_constraint=False, db_index=False,
        related_name="+", **kwargs,
    )


class UsageEvent(models.Model):
    """One served request (or one externally reported one), rated. Append-only.

    The database primary key is (id, event_time) because the table is partitioned by month;
    ``id`` alone is unique in practice (one identity sequence) and is what Django uses.
    """

    id = models.BigAutoField(primary_key=True)
    request_id = models.CharField(
        max_length=MAX_KEY,
        help_text="Idempotency key, unique per org; external events' ids are stored as ext:<id>.")
    organization = _fk(Organization)
    project = _fk(Project)
    api_key = _fk(ApiKey, null=True, blank=True)
    model = models.CharField(max_length=200)
    region = models.CharField(max_length=64, blank=True, help_text="Empty: no engine reached.")
    data_zone = models.CharField(max_length=16)
    engine = models.CharField(max_length=200, blank=True, default="")
    service_tier = models.CharField(max_length=16, choices=ServiceTier.choices)
    capacity_source = models.CharField(max_length=16, choices=CapacitySource.choices)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    cached_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    # of the completion tokens, those the engine's reasoning parser counted as thinking
    reasoning_tokens = models.PositiveBigIntegerField(default=0)
    queue_ms = models.PositiveIntegerField(null=True, blank=True)
    ttft_ms = models.PositiveIntegerField(null=True, blank=True)
    total_ms = models.PositiveIntegerField(null=True, blank=True)
    status = models.CharField(max_length=16, choices=EventStatus.choices, default=EventStatus.OK)
    cost_to_serve = _amount(default=Decimal("0"))
    event_time = models.DateTimeField()
    # NULL, not "": the Batch API's batch id, and most events belong to no batch
    batch_id = models.CharField(max_length=128, null=True, blank=True)  # noqa: DJ001
    source = models.CharField(
        max_length=16, choices=EventSource.choices, default=EventSource.GATEWAY
    )
    # NULL, not "": the client's end user (OpenAI's ``user``), and most requests name none
    end_user = models.CharField(max_length=256, null=True, blank=True)  # noqa: DJ001
    # rating, filled by plans.rating inside the ingest transaction
    amount = _amount(default=Decimal("0"))
    currency = models.CharField(max_length=3)
    price_version_id = models.BigIntegerField(null=True, blank=True)
    rating_breakdown = models.JSONField(default=dict, help_text="token class -> decimal string")
    credits_consumed = _amount(default=Decimal("0"))
    normalized_tokens = models.PositiveBigIntegerField(default=0)
    recorded_at = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "usage_event"
        indexes = [
            models.Index(fields=["organization", "event_time"], name="usage_event_org_time"),
            # an end user's spend this month (per-end-user budgets); most events name none
            models.Index(fields=["organization", "end_user", "event_time"],
                         name="usage_event_org_end_user",
                         condition=models.Q(end_user__isnull=False)),
        ]

    def __str__(self) -> str:
        return f"{self.request_id} ({self.model}, {self.event_time:%Y-%m-%d %H:%M})"

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class UsageEventId(models.Model):
    """The idempotency key of a recorded event: exactly one row per (org, request id)."""

    pk = models.CompositePrimaryKey("organization_id", "request_id")
    organization_id = models.BigIntegerField()
    # byte order: ids are opaque, and the key is compared on every insert of every event
    request_id = models.CharField(max_length=MAX_KEY, db_collation="C")
    event_time = models.DateTimeField(help_text="Locates the event's partition.")

    class Meta:
        db_table = "usage_event_id"
        # retention deletes the keys before its horizon (metering.retention)
        indexes = [models.Index(fields=["event_time"], name="usage_event_id_time")]

    def __str__(self) -> str:
        return self.request_id


class UsageRollupHourly(models.Model):
    """Sums of rated events per hour and dimension; kept in the ingest transaction.

    Amounts are in ``currency`` (10 places); cost-to-serve is internal (never shown to
    customers). Every number equals the sum over the matching ``usage_event`` rows, except
    ``gpu_seconds`` and the attributed part of ``cost_to_serve``: those are the sums of the
    events' ``UsageCostShare`` rows, added when ``metering.costs`` attributes an interval (USD).
    """

    organization = _fk(Organization)
    project = _fk(Project)
    api_key = _fk(ApiKey, null=True, blank=True)
    model = models.CharField(max_length=200)
    region = models.CharField(max_length=64)
    service_tier = models.CharField(max_length=16, choices=ServiceTier.choices)
    capacity_source = models.CharField(max_length=16, choices=CapacitySource.choices)
    currency = models.CharField(max_length=3)
    hour = models.DateTimeField(help_text="Start of the UTC hour.")
    requests = models.PositiveBigIntegerField(default=0)
    error_requests = models.PositiveBigIntegerField(default=0)
    aborted_requests = models.PositiveBigIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    cached_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    normalized_tokens = models.PositiveBigIntegerField(default=0)
    amount = _amount(default=Decimal("0"))
    # ``amount`` split by token class (sums of the events' ``rating_breakdown``), so invoices
    # can show a line per token class with its quantity and unit price.
    input_amount = _amount(default=Decimal("0"))
    cached_input_amount = _amount(default=Decimal("0"))
    output_amount = _amount(default=Decimal("0"))
    credits_consumed = _amount(default=Decimal("0"))
    # reported by external engines at ingest, plus the GPU time attributed afterwards
    cost_to_serve = _amount(default=Decimal("0"))
    gpu_seconds = _gpu_seconds(
        db_default=Decimal("0"),
        help_text="GPU-seconds attributed to the hour's events (metering.costs).")

    class Meta:
        db_table = "usage_rollup_hourly"
        constraints = [
            models.UniqueConstraint(
                fields=["organization", "project", "api_key", "model", "region",
                        "service_tier", "capacity_source", "currency", "hour"],
                name="usage_rollup_hourly_key", nulls_distinct=False,
            ),
        ]
        indexes = [models.Index(fields=["organization", "hour"], name="usage_rollup_org_hour")]

    def __str__(self) -> str:
        return f"{self.organization_id} {self.model} {self.hour:%Y-%m-%d %H}:00"


class UsageRollupMonthly(models.Model):
    """The hourly rollups of one calendar month (UTC) summed per organization and dimension.

    Kept by the database, not by Python: statement triggers on ``usage_rollup_hourly``
    (metering migration 0009) add every INSERT's, UPDATE's (ingest's ``ON CONFLICT DO
    UPDATE`` included) and DELETE's change in the statement itself, and a TRUNCATE empties
    it, so every writer of rollups keeps it equal to them. ``rollups`` counts the hourly rows
    summed: a key whose rollups were all deleted is no row to its readers
    (``rollups > 0``), as it is none of the rollups'. Amounts keep 10 places in ``currency``;
    what the rollups also carry (errors, normalized tokens, cost-to-serve) is not summed here.
    """

    organization = _fk(Organization)
    month = models.DateTimeField(help_text="Start of the UTC calendar month.")
    model = models.CharField(max_length=200)
    region = models.CharField(max_length=64)
    service_tier = models.CharField(max_length=16, choices=ServiceTier.choices)
    capacity_source = models.CharField(max_length=16, choices=CapacitySource.choices)
    currency = models.CharField(max_length=3)
    rollups = models.BigIntegerField(default=0)
    requests = models.BigIntegerField(default=0)
    prompt_tokens = models.BigIntegerField(default=0)
    cached_tokens = models.BigIntegerField(default=0)
    completion_tokens = models.BigIntegerField(default=0)
    input_amount = _month_amount(default=Decimal("0"))
    cached_input_amount = _month_amount(default=Decimal("0"))
    output_amount = _month_amount(default=Decimal("0"))

    class Meta:
        db_table = "usage_rollup_monthly"
        constraints = [
            models.UniqueConstraint(
                fields=["organization", "month", "model", "region", "service_tier",
                        "capacity_source", "currency"],
                name="usage_rollup_monthly_key"),
        ]
        # every org's months from one on (accrued revenue), without reading older months
        indexes = [models.Index(fields=["month"], name="usage_rollup_monthly_month")]

    def __str__(self) -> str:
        return f"{self.organization_id} {self.model} {self.month:%Y-%m}"


class UsageLateHour(models.Model):
    """An hour of an organization's usage that received events over an hour after it ended.

    Usage normally arrives within seconds; events replayed from a spool, or imported through
    the usage API, can arrive months late. Readers of the rollups that have already summed an
    hour (invoicing) find the hours to look at again here instead of rescanning all history.
    """

    organization = _fk(Organization)
    hour = models.DateTimeField(help_text="Start of the UTC hour.")
    recorded_at = models.DateTimeField(db_default=Now(),
                                       help_text="When a late event last arrived for it.")

    class Meta:
        db_table = "usage_late_hour"
        constraints = [models.UniqueConstraint(fields=["organization", "hour"],
                                               name="usage_late_hour_key")]

    def __str__(self) -> str:
        return f"{self.organization_id} {self.hour:%Y-%m-%d %H}:00 (late)"


class UsageDeadLetter(models.Model):
    """An event that could not be recorded (unreadable, or rating refused it), kept verbatim.

    Staff retry them (``metering.services.usage_dead_letter_retry``: the API, the admin action)
    once the cause is fixed; they go back through the normal record path, and the request id
    makes that safe to repeat. ``resolved_at`` is set once the event is recorded.
    """

    payload = models.TextField(help_text="The event as it was appended (JSON).")
    error = models.TextField()
    origin = models.CharField(max_length=32, help_text="stream | spool | api | fallback")
    created_at = models.DateTimeField(db_default=Now())
    resolved_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "usage_deadletter"
        # the letters waiting for a retry: what /metrics counts and staff list, newest first;
        # resolved ones pile up and are never in it
        indexes = [models.Index(fields=["-id"], condition=models.Q(resolved_at__isnull=True),
                                name="usage_deadletter_unresolved")]

    def __str__(self) -> str:
        return f"dead letter {self.pk} ({self.origin})"


class UsageIdConflict(models.Model):
    """An event that claimed the request id of another source's event; it was not recorded.

    The usage API refuses an external event whose id is a platform request id (one that was
    metered, or one of the platform's form: it was read off a response before its usage
    landed). The platform's event keeps its key either way; this row is what an operator (or
    finance) sees of the attempt: who tried which id, how often, and the event as reported.
    """

    organization = _fk(Organization)
    request_id = models.CharField(max_length=MAX_KEY, help_text="The id the event claimed.")
    source = models.CharField(max_length=16, choices=EventSource.choices,
                              help_text="The source that claimed it.")
    reason = models.TextField()
    reported_by = models.CharField(max_length=254, blank=True,
                                   help_text="The API key or user that reported the event.")
    payload = models.JSONField(help_text="The last conflicting event, as reported.")
    attempts = models.PositiveIntegerField(default=1)
    first_seen_at = models.DateTimeField(db_default=Now())
    last_seen_at = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "usage_id_conflict"
        constraints = [models.UniqueConstraint(fields=["organization", "request_id", "source"],
                                               name="usage_id_conflict_key")]
        indexes = [models.Index(fields=["-last_seen_at"], name="usage_id_conflict_recent")]

    def __str__(self) -> str:
        return f"{self.request_id} claimed by {self.source} ({self.attempts}x)"


class UsageCostInterval(models.Model):
    """One engine's GPU time over one interval: what its requests used, and what stood idle.

    ``capacity_us`` (interval x GPUs, in GPU-microseconds) is ``attributed_us + idle_us``
    exactly, and ``capacity_cost`` is ``attributed_cost + idle_cost`` exactly (both CHECKs);
    the attributed part is split over the interval's events in ``UsageCostShare``
    (``engine_adapter.cost`` says how). Written by ``metering.costs.usage_costs_attribute``,
    and written again while the events it split change (a late event) within
    ``TOLLGATE_COST_LOOKBACK_S``. Costs are USD, as the pools' GPU prices are. The GPUs and
    their price are the pool's when the interval was attributed.
    """

    engine = models.CharField(max_length=200)
    pool = models.CharField(max_length=80)
    start = models.DateTimeField(help_text="Start of the interval (UTC).")
    seconds = models.PositiveIntegerField(help_text="Length of the interval.")
    gpus = models.PositiveIntegerField()
    gpu_hourly_cost = models.DecimalField(max_digits=12, decimal_places=6,
                                          help_text="USD per GPU-hour.")
    capacity_us = models.PositiveBigIntegerField(help_text="seconds x GPUs x 1e6.")
    attributed_us = models.PositiveBigIntegerField()
    idle_us = models.PositiveBigIntegerField()
    capacity_cost = _amount()
    attributed_cost = _amount()
    idle_cost = _amount()
    requests = models.PositiveIntegerField(help_text="Events with a share of the interval.")
    prefill_tokens_per_s = _rate()
    decode_tokens_per_s = _rate()
    throughput_source = models.CharField(max_length=16, choices=ThroughputSource.choices)
    fingerprint = models.CharField(max_length=64, help_text="Of the events it split.")
    computed_at = models.DateTimeField()

    class Meta:
        db_table = "usage_cost_interval"
        constraints = [
            models.UniqueConstraint(fields=["engine", "start"], name="usage_cost_interval_key"),
            models.CheckConstraint(
                condition=models.Q(capacity_us=models.F("attributed_us") + models.F("idle_us")),
                name="usage_cost_interval_gpu_time_conserved"),
            models.CheckConstraint(
                condition=models.Q(
                    capacity_cost=models.F("attributed_cost") + models.F("idle_cost")),
                name="usage_cost_interval_cost_conserved"),
        ]
        indexes = [models.Index(fields=["start"], name="usage_cost_interval_start")]

    def __str__(self) -> str:
        return f"{self.engine} {self.start:%Y-%m-%d %H:%M:%S} +{self.seconds}s"


class UsageCostShare(models.Model):
    """What one usage event used of one engine-interval: GPU-microseconds and their cost (USD).

    An event's ``gpu_seconds`` and cost-to-serve are the sums of its shares (a request spanning
    intervals has one per interval). Kept apart from the append-only ``usage_event``: an
    attribution is worked out after the fact and may be worked out again.
    """

    interval = models.ForeignKey(UsageCostInterval, on_delete=models.CASCADE,
                                 related_name="shares")
    event_id = models.BigIntegerField(help_text="usage_event.id")
    event_time = models.DateTimeField(help_text="The event's (locates its partition).")
    organization_id = models.BigIntegerField()
    gpu_us = models.PositiveBigIntegerField()
    cost = _amount()

    class Meta:
        db_table = "usage_cost_share"
        constraints = [models.UniqueConstraint(fields=["interval", "event_id"],
                                               name="usage_cost_share_key")]
        indexes = [
            models.Index(fields=["event_id"], name="usage_cost_share_event"),
            models.Index(fields=["organization_id", "event_time"], name="usage_cost_share_org"),
        ]

    def __str__(self) -> str:
        return f"event {self.event_id}: {self.gpu_us} GPU-us"


class UsageEngineHour(models.Model):
    """One engine-hour reconciled: the engine's own counters against the usage metered from it.

    The engine's side is the sum of its counters' deltas over the scrape windows that end in
    the hour (only windows between two scrapes of one process life: a restart starts a new
    one); the metered side is the events from that engine (batch lines included, engine
    errors not: the engine counts a request when it finishes) that ended inside those windows.
    Events that ended where no window covers the engine (after its last scrape before a
    restart) are ``unverified``: neither side can show them. ``capture_rate`` is metered /
    engine requests, ``token_capture_rate`` the same for prompt plus generated tokens.
    ``slack_*``: metered events that ended within ``TOLLGATE_RECONCILE_BOUNDARY_S`` of the
    windows' outer edges, which a scrape may have counted on either side. Written by
    ``metering.reconciliation``; an hour is ``closed`` once it ended
    ``TOLLGATE_RECONCILE_SETTLE_S`` ago, and only a closed hour in drift raises an alert.
    """

    engine = models.CharField(max_length=200)
    pool = models.CharField(max_length=80, blank=True)
    hour = models.DateTimeField(help_text="Start of the UTC hour.")
    status = models.CharField(max_length=20, choices=ReconcileStatus.choices)
    reason = models.TextField(blank=True)
    engine_requests = models.PositiveBigIntegerField(null=True, blank=True)
    engine_prompt_tokens = models.PositiveBigIntegerField(null=True, blank=True)
    engine_cached_tokens = models.PositiveBigIntegerField(null=True, blank=True)
    engine_generation_tokens = models.PositiveBigIntegerField(null=True, blank=True)
    metered_requests = models.PositiveBigIntegerField(default=0)
    metered_prompt_tokens = models.PositiveBigIntegerField(default=0)
    metered_cached_tokens = models.PositiveBigIntegerField(default=0)
    metered_completion_tokens = models.PositiveBigIntegerField(default=0)
    metered_batch_requests = models.PositiveBigIntegerField(default=0)
    unverified_requests = models.PositiveBigIntegerField(default=0)
    unverified_tokens = models.PositiveBigIntegerField(default=0)
    slack_requests = models.PositiveBigIntegerField(default=0)
    slack_tokens = models.PositiveBigIntegerField(default=0)
    capture_rate = models.DecimalField(max_digits=14, decimal_places=6, null=True, blank=True)
    token_capture_rate = models.DecimalField(max_digits=14, decimal_places=6, null=True,
                                             blank=True)
    epochs = models.PositiveIntegerField(default=0, help_text="Process lives seen in the hour.")
    covered_from = models.DateTimeField(null=True, blank=True)
    covered_to = models.DateTimeField(null=True, blank=True)
    closed = models.BooleanField(default=False)
    computed_at = models.DateTimeField()
    alerted_at = models.DateTimeField(null=True, blank=True,
                                      help_text="When its drift was audited (once).")

    class Meta:
        db_table = "usage_engine_hour"
        constraints = [models.UniqueConstraint(fields=["engine", "hour"],
                                               name="usage_engine_hour_key")]
        indexes = [models.Index(fields=["hour"], name="usage_engine_hour_hour"),
                   models.Index(fields=["-hour"], condition=models.Q(status="drift"),
                                name="usage_engine_hour_drift")]

    def __str__(self) -> str:
        return f"{self.engine} {self.hour:%Y-%m-%d %H}:00 {self.status}"
