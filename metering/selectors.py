"""Reads of the metering app: usage summaries from the hourly rollups, events by request id,
dead letters, cost-to-serve (per event, per pool's GPU time), the engine-hour ledger, and one
organization's events streamed in time order.

Length: every read of metering's tables is here (STYLE.md: each app owns its tables), so
``grep metering.selectors`` shows every reader in the platform; the sections follow the
tables they read. Split it into a package by table when another family of reads lands.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, NamedTuple

import numpy as np
from django.db import models
from django.db.models import Count, Q, QuerySet, Sum
from django.db.models.functions import TruncDay, TruncHour

from billing_platform.accounts.choices import DataZone
from billing_platform.db import reading_connection, reading_db
from metering.events import WIRE_VERSION
from metering.models import (
    UsageCostInterval,
    UsageDeadLetter,
    UsageEngineHour,
    UsageEvent,
    UsageEventId,
    UsageRollupHourly,
)

# group_by name -> rollup expression, and how it is shown
GROUPS = {
    "day": "day",
    "hour": "hour",
    "model": "model",
    "project": "project__public_id",
    "key": "api_key__public_id",
    "service_tier": "service_tier",
    "capacity_source": "capacity_source",
    "region": "region",
    "user": "end_user",
}
# Dimensions the hourly rollups do not keep: a read grouped by one sums the events themselves
# (``_event_summary``), over a range bounded by ``conf.usage_api_max_event_range_days``.
EVENT_GROUPS = frozenset({"user"})
SUMS = ("requests", "error_requests", "aborted_requests", "prompt_tokens", "cached_tokens",
        "completion_tokens", "normalized_tokens", "amount", "credits_consumed")


@dataclass(frozen=True)
class UsageFilter:
    """What to sum: an organization, a UTC hour range [start, end), optional dimensions."""

    org_id: int
    start: datetime
    end: datetime
    project_ids: tuple[int, ...] = ()
    api_key_ids: tuple[int, ...] = ()
    models: tuple[str, ...] = ()
    service_tiers: tuple[str, ...] = ()
    regions: tuple[str, ...] = ()
    statuses: tuple[str, ...] = ()  # the events' outcome: read from the events (not rolled up)


@dataclass
class UsageBucket:
    """Sums for one combination of the grouped dimensions (and one currency)."""

    group: dict[str, object]
    currency: str
    requests: int = 0
    error_requests: int = 0
    aborted_requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    normalized_tokens: int = 0
    amount: Decimal = Decimal("0")
    credits_consumed: Decimal = Decimal("0")
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def _rollups(f: UsageFilter) -> QuerySet[UsageRollupHourly]:
    qs = UsageRollupHourly.objects.filter(organization_id=f.org_id, hour__gte=f.start,
                                          hour__lt=f.end)
    if f.project_ids:
        qs = qs.filter(project_id__in=f.project_ids)
    if f.api_key_ids:
        qs = qs.filter(api_key_id__in=f.api_key_ids)
    if f.models:
        qs = qs.filter(model__in=f.models)
    if f.service_tiers:
        qs = qs.filter(service_tier__in=f.service_tiers)
    if f.regions:
        qs = qs.filter(region__in=f.regions)
    return qs


def usage_summary(*, usage_filter: UsageFilter, group_by: tuple[str, ...] = (),
                  limit: int | None = None) -> list[UsageBucket]:
    """Return usage sums per group (and currency), ordered by the grouped values.

    Numbers come from the hourly rollups, which the ingest transaction keeps equal to the sums
    of ``usage_event``; the range is whole UTC hours. ``limit``: at most that many groups (the
    first ones in order), for callers that bound what one request may read.
    """
    if EVENT_GROUPS & set(group_by) or usage_filter.statuses:
        return _event_summary(usage_filter, group_by, limit)
    qs = _rollups(usage_filter)
    names = {g: GROUPS[g] for g in group_by}
    if "day" in names:
        qs = qs.annotate(day=TruncDay("hour", tzinfo=UTC))
    values = [*names.values(), "currency"]
    rows = qs.values(*values).annotate(**{f"s_{s}": Sum(s) for s in SUMS}).order_by(*values)
    return _buckets(rows if limit is None else rows[:limit], names)


def _buckets(rows: Iterable[dict[str, Any]], names: Mapping[str, str]) -> list[UsageBucket]:
    """Return summed rows (``s_<sum>`` per SUMS, the group's expressions) as buckets: the
    group named as asked (a day as a date), int counts and Decimal amounts (0 for none)."""
    out = []
    for row in rows:
        group = {}
        for name, expr in names.items():
            value = row[expr]
            if name == "day" and value is not None:
                value = value.date()
            group[name] = value
        sums: dict[str, Any] = {
            s: row[f"s_{s}"] or (Decimal("0") if s in ("amount", "credits_consumed") else 0)
            for s in SUMS}
        out.append(UsageBucket(group=group, currency=row["currency"], **sums))
    return out


def _event_summary(f: UsageFilter, group_by: tuple[str, ...], limit: int | None
                   ) -> list[UsageBucket]:
    """``usage_summary`` off ``usage_event`` (through its (organization, event_time) index):
    the same sums the ingest transaction adds to the rollups, per group of event columns.

    The end user is not a rollup dimension: a reseller's end users can be millions, and each
    would multiply the hourly rows every other read sums. Nor is the outcome (``status``): the
    rollups count failed and aborted requests, not their tokens and amounts apart. Reading the
    events is exact and costs one index range of the organization, which the range bound keeps
    to a month.
    """
    qs = UsageEvent.objects.filter(organization_id=f.org_id, event_time__gte=f.start,
                                   event_time__lt=f.end)
    filters: tuple[tuple[str, tuple[object, ...]], ...] = (
        ("project_id", f.project_ids), ("api_key_id", f.api_key_ids), ("model", f.models),
        ("service_tier", f.service_tiers), ("region", f.regions), ("status", f.statuses))
    for column, wanted in filters:
        if wanted:
            qs = qs.filter(**{f"{column}__in": wanted})
    names = {g: GROUPS[g] for g in group_by}
    if "day" in names:
        qs = qs.annotate(day=TruncDay("event_time", tzinfo=UTC))
    if "hour" in names:
        qs = qs.annotate(hour=TruncHour("event_time", tzinfo=UTC))
    values = [*names.values(), "currency"]
    rows = qs.values(*values).annotate(
        s_requests=Count("id"),
        s_error_requests=Count("id", filter=Q(status="engine_error")),
        s_aborted_requests=Count("id", filter=~Q(status__in=("ok", "engine_error"))),
        **{f"s_{s}": Sum(s) for s in SUMS if not s.endswith("requests")},
    ).order_by(*values)
    return _buckets(rows if limit is None else rows[:limit], names)


def usage_event_get(*, org_id: int, request_id: str) -> UsageEvent | None:
    """Return the recorded event of a request, or None if it is not recorded (yet)."""
    key = UsageEventId.objects.filter(organization_id=org_id, request_id=request_id).first()
    if key is None:
        return None
    return UsageEvent.objects.filter(organization_id=org_id, request_id=request_id,
                                     event_time=key.event_time).first()


# Whole hours from the rollups (their ``amount`` is the sum of their events' rated amounts, kept
# in the ingest transaction), the hour an instant cuts from the events themselves.
_RATED_SQL = """
SELECT t.org, s.currency, SUM(s.amount)
  FROM unnest(%s::bigint[], %s::timestamptz[]) AS t(org, until)
 CROSS JOIN LATERAL (
        SELECT r.currency, r.amount FROM usage_rollup_hourly r
         WHERE r.organization_id = t.org AND r.hour < date_trunc('hour', t.until, 'UTC')
        UNION ALL
        SELECT e.currency, e.amount FROM usage_event e
         WHERE e.organization_id = t.org AND e.event_time >= date_trunc('hour', t.until, 'UTC')
           AND e.event_time < t.until) s
 GROUP BY 1, 2
"""


def rated_amounts_before(*, until: Mapping[int, datetime]) -> dict[tuple[int, str], Decimal]:
    """Return the rated amount of each org's events before its instant, per (org, currency).

    ``until`` maps organization ids to an instant (to the microsecond, not only whole hours).
    """
    if not until:
        return {}
    orgs = list(until)
    with reading_connection().cursor() as cur:
        cur.execute(_RATED_SQL, [orgs, [until[o] for o in orgs]])
        return {(org, currency): amount for org, currency, amount in cur}


# --- Billing periods: usage sums and late hours, read by invoicing's builder -----------------
# (invoicing owns the invoices; the SQL on metering's tables lives here, with its owner)

class PeriodUsage(NamedTuple):
    """Usage of one period [period_start, period_end) of an org, per dimensions and currency.

    Amounts are exact (10 places), split by token class; their sum is the rated amount.
    """

    org_id: int
    period_start: datetime
    period_end: datetime
    model: str
    region: str
    service_tier: str
    capacity_source: str
    currency: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    input_amount: Decimal
    cached_input_amount: Decimal
    output_amount: Decimal


# A rollup's amount is the sum of its class amounts, so SUM(amount) is not read: numeric sums
# are the dearest part of the usage query (about 0.3 us a row each, measured by
# bench/invoice_run.py).
_PERIOD_SUMS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens",
                "input_amount", "cached_input_amount", "output_amount")
_ROLLUP_SUM_SQL = ", ".join(f"SUM(r.{c})" for c in _PERIOD_SUMS)
# The first whole hour at or after a period's start, and the start of the hour its end cuts
# (UTC, whatever the session's time zone; timestamps have microsecond resolution).
_HOUR_CEIL = "date_trunc('hour', {} + interval '1 hour' - interval '1 microsecond', 'UTC')"
_HOUR_FLOOR = "date_trunc('hour', {}, 'UTC')"
# An event's class amounts, as its rollup sums them (``metering.recording``).
_EVENT_CLASS_SQL = ", ".join(
    f"COALESCE((e.rating_breakdown ->> '{c}')::numeric, 0) AS {c}_amount"
    for c in ("input", "cached_input", "output"))
_EVENT_SUM_SQL = "COUNT(*), " + ", ".join(f"SUM(e.{c})" for c in _PERIOD_SUMS[1:])
_DIMS = "model, region, service_tier, capacity_source, currency"
# The usage sums of period ``p`` (ps, pe; hs = its first whole hour, he = the hour its end
# cuts; ms = the first calendar month start at or after hs, me = the month start at or before
# he) per dimensions and currency: the month rows of ``usage_rollup_monthly`` for the whole
# UTC months of [ms, me) (kept by the database from the hourly rollups, migration 0009: one
# row per dimension a month instead of ~720 hourly ones; a calendar-month period is only
# that), the hourly rollups of the whole hours outside them ([hs, h1) and [h2, he), where h1
# = ms and h2 = me when there are whole months, else h1 = h2 = he: the whole hours alone),
# summed straight off their index range, plus its events before the first whole hour and
# from the cut hour on (one index range each, skipped outright where the period starts or ends
# on the hour), then all added up. Each part is skipped by a one-time filter on p where its
# range is empty. When the period starts and ends within one hour (hs > he) there are no whole
# hours and the first event range is the whole period. So every event lies in exactly one
# period, to the microsecond, while rollups are whole UTC hours.
_ROLLUP_DIMS = f"r.{_DIMS.replace(', ', ', r.')}"
_ONE_PERIOD_SUMS = f"""
        SELECT {_DIMS}, {", ".join(f"SUM({c})" for c in _PERIOD_SUMS)}
          FROM (SELECT {_ROLLUP_DIMS}, {_ROLLUP_SUM_SQL}
                  FROM usage_rollup_monthly r
                 WHERE p.ms < p.me AND r.organization_id = p.org AND r.month >= p.ms
                   AND r.month < p.me AND r.rollups > 0
                 GROUP BY 1, 2, 3, 4, 5
                UNION ALL
                SELECT {_ROLLUP_DIMS}, {_ROLLUP_SUM_SQL}
                  FROM usage_rollup_hourly r
                 WHERE p.hs < p.h1 AND r.organization_id = p.org AND r.hour >= p.hs
                   AND r.hour < p.h1
                 GROUP BY 1, 2, 3, 4, 5
                UNION ALL
                SELECT {_ROLLUP_DIMS}, {_ROLLUP_SUM_SQL}
                  FROM usage_rollup_hourly r
                 WHERE p.h2 < p.he AND r.organization_id = p.org AND r.hour >= p.h2
                   AND r.hour < p.he
                 GROUP BY 1, 2, 3, 4, 5
                UNION ALL
                SELECT e.{_DIMS.replace(", ", ", e.")}, {_EVENT_SUM_SQL}
                  FROM (SELECT e.{_DIMS.replace(", ", ", e.")}, e.prompt_tokens,
                               e.cached_tokens, e.completion_tokens, {_EVENT_CLASS_SQL}
                          FROM usage_event e
                         WHERE p.ps < p.hs AND e.organization_id = p.org
                           AND e.event_time >= p.ps AND e.event_time < LEAST(p.hs, p.pe)
                        UNION ALL
                        SELECT e.{_DIMS.replace(", ", ", e.")}, e.prompt_tokens,
                               e.cached_tokens, e.completion_tokens, {_EVENT_CLASS_SQL}
                          FROM usage_event e
                         WHERE p.he < p.pe AND e.organization_id = p.org
                           AND e.event_time >= GREATEST(p.he, p.hs) AND e.event_time < p.pe
                       ) e
                 GROUP BY 1, 2, 3, 4, 5
               ) x (model, region, service_tier, capacity_source, currency,
                    {", ".join(_PERIOD_SUMS)})
         GROUP BY 1, 2, 3, 4, 5
"""  # noqa: S608 (only our own column names are interpolated)
# The first calendar month start at or after an instant (UTC, whatever the session's zone).
_MONTH_CEIL = ("CASE WHEN date_trunc('month', {0}, 'UTC') = {0} THEN {0} "
               "ELSE (date_trunc('month', {0} AT TIME ZONE 'UTC') + interval '1 month') "
               "AT TIME ZONE 'UTC' END")

# One aggregate per period (LATERAL): each is a small in-memory hash over one org's index
# range, where one big GROUP BY over the whole chunk spilled a sort of millions of rows to
# disk (measured 2x slower at 500 orgs x 3,600 rollup rows).
_PERIODS_SQL = f"""
WITH b AS (
    SELECT org, ps, pe, {_HOUR_CEIL.format("ps")} AS hs, {_HOUR_FLOOR.format("pe")} AS he
      FROM unnest(%s::bigint[], %s::timestamptz[], %s::timestamptz[]) AS t(org, ps, pe)
), m AS (
    SELECT b.*, {_MONTH_CEIL.format("b.hs")} AS ms, date_trunc('month', b.he, 'UTC') AS me
      FROM b
), p AS (
    SELECT m.*, CASE WHEN m.ms < m.me THEN m.ms ELSE m.he END AS h1,
           CASE WHEN m.ms < m.me THEN m.me ELSE m.he END AS h2
      FROM m
)
SELECT p.org, p.ps, p.pe, a.*
  FROM p CROSS JOIN LATERAL ({_ONE_PERIOD_SUMS} ORDER BY 1, 3, 2, 4) a
"""  # noqa: S608


def usage_sums_for_periods(*, periods: Sequence[tuple[int, datetime, datetime]]
                           ) -> list[PeriodUsage]:
    """Return the usage of each (org id, start, end) period, per dimensions and currency.

    Events count to the microsecond (whole hours from the rollups, the cut hours from the
    events), so adjacent periods share no event. Rows come period by period, in the order
    given, each period's by model, tier, region and capacity source. One query.
    """
    if not periods:
        return []
    with reading_connection().cursor() as cur:
        cur.execute(_PERIODS_SQL, [[p[0] for p in periods], [p[1] for p in periods],
                                   [p[2] for p in periods]])
        return [PeriodUsage._make(row) for row in cur]


# Many organizations' instants go in as text: psycopg quotes array elements one by one (with
# 10,000 orgs that cost more than the queries), and most orgs share their instants (calendar
# months, one period close's time), so each distinct instant is sent once with every org's
# index into them.
def _joined(values: Iterable[int]) -> str:
    """Return ints comma-joined (SQL: ``string_to_array(%s, ',')::bigint[]``)."""
    return ",".join(map(str, values))


def _instants(*columns: Iterable[datetime]) -> tuple[list[datetime], list[str]]:
    """Return the distinct instants of ``columns`` and, per column, its values' 1-based
    indexes into them, comma-joined (SQL: ``(%s::timestamptz[])[i]``)."""
    lists = [list(column) for column in columns]
    labels: dict[datetime, str] = {}
    for values in lists:
        for at in dict.fromkeys(values):
            labels.setdefault(at, str(len(labels) + 1))
    return list(labels), [",".join(map(labels.__getitem__, values)) for values in lists]


_LATE_HOURS_SQL = """
SELECT m.organization_id, m.hour
  FROM (SELECT %s::timestamptz[] AS at) a,
       unnest(string_to_array(%s, ',')::bigint[], string_to_array(%s, ',')::int[])
       AS t(org, since)
  JOIN usage_late_hour m ON m.organization_id = t.org
 WHERE m.recorded_at >= a.at[t.since]
 ORDER BY 1, 2
"""


def usage_late_hours(*, since: Mapping[int, datetime]) -> dict[int, list[datetime]]:
    """Return, per org, the hours (sorted) that received late events at or after its instant.

    ``since`` maps organization ids to an instant. A late event is one recorded over an hour
    after its hour ended (``UsageLateHour``): a spool replayed, usage imported months later.
    """
    if not since:
        return {}
    instants, (index,) = _instants(since.values())
    out: dict[int, list[datetime]] = {}
    with reading_connection().cursor() as cur:
        cur.execute(_LATE_HOURS_SQL, [instants, _joined(since), index])
        for org, hour in cur:
            out.setdefault(org, []).append(hour)
    return out


# --- Rated spend and residency, read by plans (budgets, admission's policy, the zone audit) ---
# (plans owns budgets, quotas and data zones; the queries on metering's tables live here)

def rated_spend(*, organization_id: int, project_id: int | None, start: datetime,
                end: datetime) -> Decimal:
    """Return the rated amount of an org's usage in [start, end), or of one of its projects.

    From the hourly rollups, so whole hours: ``start`` and ``end`` are on the hour (a month).
    """
    qs = _rollups_of(organization_id, start, end)
    if project_id is not None:
        qs = qs.filter(project_id=project_id)
    return qs.aggregate(s=Sum("amount"))["s"] or Decimal("0")


def rated_spend_query(*, organization_id: int, project_id: int, start: datetime,
                      end: datetime) -> QuerySet[Any, tuple[Any, Any]]:
    """``rated_spend`` of the organization and of its project ``project_id`` at once, as a
    query: one row (org amount, project amount), none where there is no usage."""
    return (_rollups_of(organization_id, start, end).values("organization_id")
            .annotate(org=Sum("amount"), project=Sum("amount", filter=Q(project_id=project_id)))
            .values_list("org", "project"))


def _rollups_of(organization_id: int, start: datetime, end: datetime
                ) -> QuerySet[UsageRollupHourly]:
    return UsageRollupHourly.objects.filter(organization_id=organization_id, hour__gte=start,
                                            hour__lt=end)


def end_user_spend(*, organization_id: int, end_user: str, start: datetime, end: datetime
                   ) -> Decimal:
    """Return the rated amount of the requests naming ``end_user`` in [start, end), across
    the organization's projects (from the events: the rollups keep no end user; the partial
    index on (organization, end user, time) makes it one range of that end user's events)."""
    return UsageEvent.objects.filter(
        organization_id=organization_id, end_user=end_user, event_time__gte=start,
        event_time__lt=end).aggregate(s=Sum("amount"))["s"] or Decimal("0")


def usage_events_outside_regions(*, zone_regions: Mapping[str, set[str]], limit: int = 1000
                                 ) -> list[dict[str, object]]:
    """Return events of orgs in each data zone that ran in a region not among its regions.

    ``zone_regions`` maps a data zone to its regions; at most ``limit`` events per zone. An
    event without a region (not served by an engine) is never outside.
    """
    out: list[dict[str, object]] = []
    for zone, regions in zone_regions.items():
        rows = (UsageEvent.objects.filter(organization__data_zone=zone)
                .exclude(region__in=regions).exclude(region="")
                .values("request_id", "organization_id", "region", "event_time")[:limit])
        out += [{**r, "data_zone": zone, "event_time": r["event_time"].isoformat()}
                for r in rows]
    return out


class RegionZoneCount(NamedTuple):
    """An organization's events in one region under one recorded data zone: how many, and
    their input (prompt, cached included) and output tokens. ``region`` "" is no engine."""

    region: str
    data_zone: str
    events: int
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def usage_residency_counts(*, org_id: int, start: datetime, end: datetime
                           ) -> list[RegionZoneCount]:
    """Return an organization's events in [start, end) per region and recorded zone.

    From ``usage_event`` itself (the zone is stored on each event at record time; the rollups
    keep no zone), through its (organization, event_time) index; ordered by region, zone.
    """
    rows = (UsageEvent.objects.filter(organization_id=org_id, event_time__gte=start,
                                      event_time__lt=end)
            .values("region", "data_zone")
            .annotate(n=Count("id"), p=Sum("prompt_tokens"), c=Sum("completion_tokens"))
            .order_by("region", "data_zone"))
    return [RegionZoneCount(r["region"], r["data_zone"], r["n"], r["p"] or 0, r["c"] or 0)
            for r in rows]


def usage_residency_outside(*, org_id: int, start: datetime, end: datetime,
                            zone_regions: Mapping[str, set[str]]
                            ) -> Iterator[Mapping[str, Any]]:
    """Return an organization's events in [start, end) that ran outside the zone recorded on
    them, in time order (request_id, event_time, region, data_zone), read in chunks.

    An event is inside when it reached no engine (region ""), when its zone is ``global``, or
    when its region is among ``zone_regions[its zone]``; a zone missing from the mapping has no
    regions (fail closed). The read is bound to the reading database now, so a caller may
    stream it after the view's ``replica_report`` block has ended.
    """
    inside = Q(region="") | Q(data_zone=DataZone.GLOBAL)
    for zone, regions in zone_regions.items():
        if regions:
            inside |= Q(data_zone=zone, region__in=sorted(regions))
    return (UsageEvent.objects.using(reading_db())
            .filter(organization_id=org_id, event_time__gte=start, event_time__lt=end)
            .exclude(inside)
            .order_by("event_time", "request_id")
            .values("request_id", "event_time", "region", "data_zone")
            .iterator(chunk_size=2000))


# --- Dead letters (staff: list, then retry through ``metering.services``) --------------------

@dataclass(frozen=True)
class DeadLetterFilter:
    """Which dead letters to list: unresolved (the default), resolved, or all (``None``)."""

    resolved: bool | None = False
    origin: str | None = None
    organization_id: int | None = None
    created_after: datetime | None = None
    created_before: datetime | None = None
    before_id: int | None = None  # page cursors: letters older (newer) than this one
    after_id: int | None = None
    oldest_first: bool = False


def usage_dead_letters(*, letter_filter: DeadLetterFilter) -> QuerySet[UsageDeadLetter]:
    """Return the dead letters that match, newest first (or oldest first).

    Unresolved letters are read through the partial index on them
    (``usage_deadletter_unresolved``). An organization is matched on the payload's prefix: a
    readable payload is ``row_wire``'s JSON array, version then organization id first.
    """
    f = letter_filter
    qs = UsageDeadLetter.objects.all()
    if f.resolved is not None:
        qs = qs.filter(resolved_at__isnull=not f.resolved)
    if f.origin:
        qs = qs.filter(origin=f.origin)
    if f.organization_id is not None:
        qs = qs.filter(payload__startswith=f"[{WIRE_VERSION},{f.organization_id},")
    if f.created_after is not None:
        qs = qs.filter(created_at__gte=f.created_after)
    if f.created_before is not None:
        qs = qs.filter(created_at__lt=f.created_before)
    if f.before_id is not None:
        qs = qs.filter(id__lt=f.before_id)
    if f.after_id is not None:
        qs = qs.filter(id__gt=f.after_id)
    return qs.order_by("id" if f.oldest_first else "-id")


def usage_dead_letters_unresolved_count(*, cap: int) -> int:
    """Return how many dead letters wait for a retry, counted up to ``cap``."""
    return UsageDeadLetter.objects.filter(resolved_at__isnull=True)[:cap].count()


# --- Usage from an instant on, summed across organizations (finance's accrued revenue) -------
# (finance reports what is rated but not invoiced yet; invoicing knows each org's instant)

class UsageSince(NamedTuple):
    """Usage from some organizations' instants on, per bucket x dimensions x currency.

    ``bucket`` is the instant truncated (``date_trunc``, UTC) to the caller's unit: the
    organizations whose instants share a bucket are summed together. Token counts are per
    token class (input = uncached prompt tokens); amounts are exact (10 places) per class.
    """

    bucket: datetime
    model: str
    region: str
    service_tier: str
    capacity_source: str
    currency: str
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    input_amount: Decimal
    cached_input_amount: Decimal
    output_amount: Decimal


# Three sources for each org's usage from its instant ``since`` on, where ``hs`` is its first
# whole hour and ``ms`` its first calendar month start at or after ``hs``: the month rows of
# ``usage_rollup_monthly`` from ``ms`` on (kept by the database from the hourly rollups,
# migration 0009: a few rows per org and dimension a month instead of ~60 hourly ones), the
# hourly rollups of [hs, ms) (a non-calendar anchor's first partial month; none for a period
# that starts on the 1st at 00:00), and the events of [since, hs) (none when it starts on the
# hour). Every event lies in exactly one of them, to the microsecond.
#
# The bounds and bucket of each distinct instant come first (most orgs share one: calendar
# months). The month rows are then read per group of orgs sharing (ms, bucket): a range of
# the month index filtered by the group's ids as one constant array (hashed), or, for a small
# group, the org index probed per id; that is 2x cheaper at 10,000 orgs than a hash join of
# every org's (ms, bucket) with the month rows. The hours and events read each org's own
# index range (LATERAL), only for the orgs whose instant needs them (none in a month of
# calendar periods).
_SINCE_BOUNDS_SQL = f"""
SELECT since, hs,
       CASE WHEN date_trunc('month', hs, 'UTC') = hs THEN hs
            ELSE (date_trunc('month', hs AT TIME ZONE 'UTC') + interval '1 month')
                 AT TIME ZONE 'UTC' END,
       date_trunc(%s, since, 'UTC')
  FROM (SELECT since, {_HOUR_CEIL.format("since")} AS hs
          FROM unnest(%s::timestamptz[]) AS s(since)) s
"""  # noqa: S608 (only our own SQL fragments are interpolated)
_SINCE_MONTHS_SQL = f"""
SELECT %s::timestamptz, m.{_DIMS.replace(", ", ", m.")}, m.prompt_tokens, m.cached_tokens,
       m.completion_tokens, m.input_amount, m.cached_input_amount, m.output_amount
  FROM usage_rollup_monthly m
 WHERE m.rollups > 0 AND m.month >= %s
   AND m.organization_id = ANY(string_to_array(%s, ',')::bigint[])
"""  # noqa: S608
# orgs (t.org) with their instant's bounds: (%s::timestamptz[])[i] for since, hs, ms, bucket
_SINCE_ORGS = """
(SELECT u.org, a.since[u.i] AS since, a.hs[u.i] AS hs, a.ms[u.i] AS ms,
        a.bucket[u.i] AS bucket
   FROM (SELECT %s::timestamptz[] AS since, %s::timestamptz[] AS hs, %s::timestamptz[] AS ms,
                %s::timestamptz[] AS bucket) a,
        unnest(string_to_array(%s, ',')::bigint[], string_to_array(%s, ',')::int[])
        AS u(org, i)) t"""
_SINCE_HOURS_SQL = f"""
SELECT t.bucket, r.{_DIMS.replace(", ", ", r.")}, r.prompt_tokens, r.cached_tokens,
       r.completion_tokens, r.input_amount, r.cached_input_amount, r.output_amount
  FROM {_SINCE_ORGS}
 CROSS JOIN LATERAL (SELECT * FROM usage_rollup_hourly r
                      WHERE r.organization_id = t.org AND r.hour >= t.hs AND r.hour < t.ms) r
"""  # noqa: S608
_SINCE_EVENTS_SQL = f"""
SELECT t.bucket, e.{_DIMS.replace(", ", ", e.")}, e.prompt_tokens, e.cached_tokens,
       e.completion_tokens, {_EVENT_CLASS_SQL}
  FROM {_SINCE_ORGS}
 CROSS JOIN LATERAL (SELECT * FROM usage_event e
                      WHERE e.organization_id = t.org AND e.event_time >= t.since
                        AND e.event_time < t.hs) e
"""  # noqa: S608
_SINCE_SUM_SQL = """
SELECT a.bucket, a.model, a.region, a.service_tier, a.capacity_source, a.currency,
       SUM(a.prompt_tokens - a.cached_tokens), SUM(a.cached_tokens),
       SUM(a.completion_tokens), SUM(a.input_amount), SUM(a.cached_input_amount),
       SUM(a.output_amount)
  FROM ({parts}) a (bucket, model, region, service_tier, capacity_source, currency,
                   prompt_tokens, cached_tokens, completion_tokens, input_amount,
                   cached_input_amount, output_amount)
 WHERE %s::text IS NULL OR a.currency = %s::text
 GROUP BY 1, 2, 3, 4, 5, 6
"""

BUCKET_UNITS = frozenset({"day", "month", "quarter", "year"})


def usage_sums_since(*, since: Mapping[int, datetime], unit: str = "month",
                     currency: str | None = None) -> list[UsageSince]:
    """Return the usage of each org from its instant on, summed per bucket x dimensions.

    ``since`` maps organization ids to an instant (to the microsecond); every event at or
    after it counts, however late it arrives. ``unit`` is ``date_trunc``'s (one of
    ``BUCKET_UNITS``); ``currency`` keeps only usage rated in it. Two queries (the second
    one's size grows with the distinct month starts and buckets of the instants, not with
    the orgs); rows in no particular order.
    """
    if unit not in BUCKET_UNITS:
        raise ValueError(f"unit must be one of {sorted(BUCKET_UNITS)}")
    if not since:
        return []
    instants, (index,) = _instants(since.values())
    with reading_connection().cursor() as cur:
        cur.execute(_SINCE_BOUNDS_SQL, [unit, instants])
        bounds = {at: (hs, ms, bucket) for at, hs, ms, bucket in cur}
        columns = list(zip(*[(at, *bounds[at]) for at in instants], strict=True))
        groups: dict[tuple[datetime, datetime], list[int]] = {}
        hours: list[tuple[int, str]] = []
        events: list[tuple[int, str]] = []
        for org, i in zip(since, index.split(","), strict=True):
            at = instants[int(i) - 1]
            hs, ms, bucket = bounds[at]
            groups.setdefault((ms, bucket), []).append(org)
            if hs < ms:
                hours.append((org, i))
            if at < hs:
                events.append((org, i))
        parts: list[str] = []
        params: list[Any] = []
        for (ms, bucket), orgs in groups.items():
            parts.append(_SINCE_MONTHS_SQL)
            params += [bucket, ms, _joined(orgs)]
        for sql, some in ((_SINCE_HOURS_SQL, hours), (_SINCE_EVENTS_SQL, events)):
            if some:
                parts.append(sql)
                params += [*map(list, columns), _joined(o for o, _ in some),
                           ",".join(i for _, i in some)]
        cur.execute(_SINCE_SUM_SQL.format(parts=" UNION ALL ".join(parts)),
                    [*params, currency, currency])
        return [UsageSince._make(row) for row in cur]


_RECORDED_AFTER_SQL = """
SELECT t.org
  FROM (SELECT %s::timestamptz[] AS lo, %s::timestamptz[] AS hi, %s::timestamptz[] AS since) a,
       unnest(string_to_array(%s, ',')::bigint[], string_to_array(%s, ',')::int[]) AS t(org, w)
 WHERE EXISTS (SELECT 1 FROM usage_event e
                WHERE e.organization_id = t.org AND e.event_time >= a.lo[t.w]
                  AND e.event_time < a.hi[t.w] AND e.recorded_at >= a.since[t.w])
"""


def usage_recorded_after(*, windows: Sequence[tuple[Sequence[int], datetime, datetime, datetime]]
                         ) -> set[int]:
    """Return the orgs of ``windows`` (orgs, start, end, since) that have an event with an
    event time in [start, end) recorded at or after ``since``. One query (one index probe per
    org)."""
    windows = [w for w in windows if w[1] < w[2] and w[0]]  # an empty range holds no event
    if not windows:
        return set()
    orgs = ",".join(_joined(w[0]) for w in windows)
    index = ",".join(",".join([str(n)] * len(w[0])) for n, w in enumerate(windows, start=1))
    with reading_connection().cursor() as cur:
        cur.execute(_RECORDED_AFTER_SQL, [[w[1] for w in windows], [w[2] for w in windows],
                                          [w[3] for w in windows], orgs, index])
        return {org for (org,) in cur}


# --- cost-to-serve (metering.costs) and reconciliation (metering.reconciliation) ----------------
# Rollups carry ``gpu_seconds`` and ``cost_to_serve`` per hour and dimension (read them with
# the usage sums above); these read what rollups cannot: one event's cost, a pool's idle time.


@dataclass(frozen=True)
class EventCost:
    """The GPU time attributed to one event over every interval it ran in, and its cost (USD)."""

    gpu_seconds: Decimal
    cost: Decimal


_EVENT_COSTS_SQL = """
SELECT event_id, SUM(gpu_us), SUM(cost) FROM usage_cost_share
 WHERE event_id = ANY(%s) GROUP BY event_id
"""


def usage_event_costs(*, event_ids: Sequence[int]) -> dict[int, EventCost]:
    """Return the attributed GPU-seconds and cost of each event that has any (one whose
    intervals are not attributed yet is absent). The event's own ``cost_to_serve`` is what an
    external engine's operator reported; add the two for its whole cost."""
    if not event_ids:
        return {}
    with reading_connection().cursor() as cur:
        cur.execute(_EVENT_COSTS_SQL, [list(event_ids)])
        return {event_id: EventCost(Decimal(gpu_us).scaleb(-6), cost)
                for event_id, gpu_us, cost in cur.fetchall()}


@dataclass(frozen=True)
class PoolCapacity:
    """A pool's GPU time over a range: what its requests used, and what stood idle.

    Seconds are GPU-seconds (interval x GPUs), exact; costs are USD at the pool's GPU price.
    ``attributed / capacity`` is its measured utilization; idle cost is the capacity nobody
    used.
    """

    pool: str
    engines: int
    intervals: int
    requests: int
    capacity_gpu_seconds: Decimal
    attributed_gpu_seconds: Decimal
    idle_gpu_seconds: Decimal
    capacity_cost: Decimal
    attributed_cost: Decimal
    idle_cost: Decimal


def usage_pool_capacity(*, start: datetime, end: datetime) -> list[PoolCapacity]:
    """Return each pool's GPU time over the attributed intervals starting in ``[start, end)``."""
    rows = (UsageCostInterval.objects.filter(start__gte=start, start__lt=end).values("pool")
            .annotate(engines=models.Count("engine", distinct=True),
                      intervals=models.Count("id"), requests=Sum("requests"),
                      capacity_us=Sum("capacity_us"), attributed_us=Sum("attributed_us"),
                      idle_us=Sum("idle_us"), capacity_cost=Sum("capacity_cost"),
                      attributed_cost=Sum("attributed_cost"), idle_cost=Sum("idle_cost"))
            .order_by("pool"))
    return [PoolCapacity(
        pool=r["pool"], engines=r["engines"], intervals=r["intervals"], requests=r["requests"],
        capacity_gpu_seconds=Decimal(r["capacity_us"]).scaleb(-6),
        attributed_gpu_seconds=Decimal(r["attributed_us"]).scaleb(-6),
        idle_gpu_seconds=Decimal(r["idle_us"]).scaleb(-6), capacity_cost=r["capacity_cost"],
        attributed_cost=r["attributed_cost"], idle_cost=r["idle_cost"]) for r in rows]


def usage_engine_hours(*, start: datetime, end: datetime, engine: str | None = None,
                       status: str | None = None) -> QuerySet[UsageEngineHour]:
    """Return the reconciliation ledger's engine-hours in ``[start, end)``, oldest first."""
    rows = UsageEngineHour.objects.filter(hour__gte=start, hour__lt=end)
    if engine is not None:
        rows = rows.filter(engine=engine)
    if status is not None:
        rows = rows.filter(status=status)
    return rows.order_by("hour", "engine")


def usage_engine_drift_open(*, since: datetime) -> list[tuple[str, datetime]]:
    """Return the closed engine-hours in drift since ``since`` as (engine, hour)."""
    return list(UsageEngineHour.objects.filter(status="drift", closed=True, hour__gte=since)
                .order_by("-hour", "engine").values_list("engine", "hour")[:1000])


def usage_engine_capture_latest(*, since: datetime) -> dict[str, Decimal]:
    """Return each engine's request capture rate in its latest closed, reconcilable hour."""
    rows = (UsageEngineHour.objects.filter(closed=True, hour__gte=since,
                                           capture_rate__isnull=False)
            .order_by("engine", "-hour").distinct("engine").values_list("engine",
                                                                        "capture_rate"))
    return {engine: rate for engine, rate in rows if rate is not None}


# --- One organization's events over a range, as columns (plans' advisor replays them) --------

@dataclass(frozen=True)
class EventColumns:
    """An organization's events in a time range, oldest first, as numpy arrays of one length.

    Text columns are dictionary-encoded: ``model[i]`` indexes ``models`` (likewise region,
    data zone, service tier). Events of the same microsecond keep the order they were stored.
    ``total_ms`` is -1 where the event has none; ``ok`` is status ``ok``; ``in_batch`` whether
    it was part of a batch.
    """

    event_us: np.ndarray  # int64, microseconds since the Unix epoch
    model: np.ndarray  # int32 codes ...
    region: np.ndarray
    data_zone: np.ndarray
    service_tier: np.ndarray
    prompt_tokens: np.ndarray  # int64
    cached_tokens: np.ndarray
    completion_tokens: np.ndarray
    total_ms: np.ndarray  # int64
    ok: np.ndarray  # bool
    in_batch: np.ndarray  # bool
    models: tuple[str, ...]
    regions: tuple[str, ...]
    data_zones: tuple[str, ...]
    service_tiers: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.event_us)


_CODED = ("model", "region", "data_zone", "service_tier")
# Each column as one bytea of big-endian integers (string_agg of int*send): a million events
# come back in one row, with no Python object per value (fetching them as rows cost 1.2 s of
# CPU per million, COPY ... (FORMAT binary) 3 s: libpq returns a COPY row per call). Codes are
# 1-based positions in the dictionaries passed (0: a value not in them). The ordered subquery
# feeds the aggregates in its order (PostgreSQL's documented behaviour for an ordered
# subquery); the reader checks that the times came sorted all the same.
_COLUMNS_SQL = """
SELECT count(*), string_agg(int8send(us), ''), string_agg(int4send(m), ''),
       string_agg(int4send(r), ''), string_agg(int4send(z), ''), string_agg(int4send(s), ''),
       string_agg(int8send(p), ''), string_agg(int8send(c), ''), string_agg(int8send(o), ''),
       string_agg(int8send(ms), ''), string_agg(int4send(f), '')
  FROM (SELECT (extract(epoch FROM event_time) * 1000000)::bigint AS us,
               coalesce(array_position(%(models)s::text[], model), 0) AS m,
               coalesce(array_position(%(regions)s::text[], region), 0) AS r,
               coalesce(array_position(%(zones)s::text[], data_zone), 0) AS z,
               coalesce(array_position(%(tiers)s::text[], service_tier), 0) AS s,
               prompt_tokens AS p, cached_tokens AS c, completion_tokens AS o,
               coalesce(total_ms, -1)::bigint AS ms,
               (status = 'ok')::int + 2 * (batch_id IS NOT NULL)::int AS f
          FROM usage_event
         WHERE organization_id = %(org)s AND event_time >= %(lo)s AND event_time < %(hi)s
         ORDER BY event_time) e
"""
_DISTINCT_SQL = """
SELECT DISTINCT {column} FROM usage_event
 WHERE organization_id = %s AND event_time >= %s AND event_time < %s
"""
_CHUNK_HOURS_SQL = """
SELECT hour, SUM(requests) FROM usage_rollup_hourly
 WHERE organization_id = %s AND hour >= date_trunc('hour', %s::timestamptz, 'UTC')
   AND hour < %s GROUP BY hour ORDER BY hour
"""
_WIDTHS = (8, 4, 4, 4, 4, 8, 8, 8, 8, 4)  # bytes per value of each bytea, in order
COLUMN_CHUNK_EVENTS = 2_000_000  # about 100 MB of columns at a time


def _dictionaries(org_id: int, start: datetime, end: datetime) -> dict[str, list[str]]:
    """Guess each coded column's values from the rollups (the data zone from its choices):
    a miss costs one DISTINCT scan of that column, never a wrong answer."""
    rows = (UsageRollupHourly.objects.filter(organization_id=org_id, hour__gte=start,
                                             hour__lt=end)
            .values_list("model", "region", "service_tier").distinct())
    seen: dict[str, set[str]] = {"model": set(), "region": set(), "service_tier": set()}
    for model, region, tier in rows:
        seen["model"].add(model)
        seen["region"].add(region)
        seen["service_tier"].add(tier)
    return {"model": sorted(seen["model"]), "region": sorted(seen["region"]),
            "data_zone": sorted(DataZone.values), "service_tier": sorted(seen["service_tier"])}


def _column_chunks(org_id: int, start: datetime, end: datetime) -> list[tuple[datetime, datetime]]:
    """Split [start, end) at whole hours into ranges of about ``COLUMN_CHUNK_EVENTS`` events
    each (by the rollups' request counts; a wrong count only changes a chunk's size)."""
    out, lo, count = [], start, 0
    with reading_connection().cursor() as cur:
        cur.execute(_CHUNK_HOURS_SQL, [org_id, start, end])
        for hour, requests in cur.fetchall():
            if count + requests > COLUMN_CHUNK_EVENTS and count and hour > lo:
                out.append((lo, hour))
                lo, count = hour, 0
            count += requests
    out.append((lo, end))
    return out


def usage_event_columns(*, org_id: int, start: datetime, end: datetime
                        ) -> Iterator[EventColumns]:
    """Yield an organization's events with event time in [start, end), oldest first, as
    columns (``EventColumns``), a chunk of at most about ``COLUMN_CHUNK_EVENTS`` at a time.

    One query per chunk, off the (organization, event_time) index of each month's partition;
    the dictionaries (shared by every chunk) are guessed from the rollups and learnt with a
    DISTINCT scan where an event holds a value they lack.
    """
    words = _dictionaries(org_id, start, end)
    for lo, hi in _column_chunks(org_id, start, end):
        while True:
            with reading_connection().cursor() as cur:
                cur.execute(_COLUMNS_SQL, {
                    "models": words["model"], "regions": words["region"],
                    "zones": words["data_zone"], "tiers": words["service_tier"],
                    "org": org_id, "lo": lo, "hi": hi})
                n, *blobs = cur.fetchone()
                if not n:
                    break
                ints = [np.frombuffer(bytes(b), dtype=f">i{width}").astype(f"i{width}")
                        for b, width in zip(blobs, _WIDTHS, strict=True)]
                missing = [name for name, codes in zip(_CODED, ints[1:5], strict=True)
                           if not codes.all()]
                for name in missing:  # learn the column's values, then read the chunk again
                    cur.execute(_DISTINCT_SQL.format(column=name), [org_id, lo, hi])
                    words[name] = sorted(set(words[name]) | {v for (v,) in cur.fetchall()})
            if missing:
                continue
            us, m, r, z, s, p, c, o, ms, flags = ints
            if n > 1 and not (np.diff(us) >= 0).all():  # never seen; sort, keeping ties
                order = np.argsort(us, kind="stable")
                us, m, r, z, s, p, c, o, ms, flags = (
                    a[order] for a in (us, m, r, z, s, p, c, o, ms, flags))
            yield EventColumns(
                event_us=us, model=m - 1, region=r - 1, data_zone=z - 1, service_tier=s - 1,
                prompt_tokens=p, cached_tokens=c, completion_tokens=o, total_ms=ms,
                ok=(flags & 1).astype(bool), in_batch=(flags & 2).astype(bool),
                models=tuple(words["model"]), regions=tuple(words["region"]),
                data_zones=tuple(words["data_zone"]),
                service_tiers=tuple(words["service_tier"]))
            break


# --- Margin: rated revenue against cost-to-serve, across organizations (finance's margins) ---
# The rollups carry both per org x model x region x tier x capacity source; a pool (its
# engines) and one request need the events with their cost shares.

MARGIN_ROLLUP_DIMS = frozenset({"organization_id", "model", "region", "service_tier",
                                "capacity_source"})


@dataclass(frozen=True)
class MarginScope:
    """Usage with event time (rollup hour) in [start, end); optional dimensions."""

    start: datetime
    end: datetime
    org_id: int | None = None
    model: str | None = None
    service_tier: str | None = None
    currency: str | None = None


@dataclass(frozen=True)
class MarginSums:
    """Revenue (rated ``amount``, in ``currency``) and cost-to-serve (USD, reported plus
    attributed) of one group; ``key``: the grouped values, in the order asked."""

    key: tuple[Any, ...]
    currency: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    amount: Decimal
    cost_to_serve: Decimal
    gpu_seconds: Decimal


def usage_margin_sums(*, scope: MarginScope, group_by: tuple[str, ...]) -> list[MarginSums]:
    """Return revenue and cost-to-serve per group (of ``MARGIN_ROLLUP_DIMS``) and currency,
    summed from the hourly rollups (whole hours)."""
    if not set(group_by) <= MARGIN_ROLLUP_DIMS:
        raise ValueError(f"group_by must be among {sorted(MARGIN_ROLLUP_DIMS)}")
    qs = UsageRollupHourly.objects.filter(hour__gte=scope.start, hour__lt=scope.end)
    for name in ("org_id", "model", "service_tier", "currency"):
        if (value := getattr(scope, name)) is not None:
            qs = qs.filter(**{"organization_id" if name == "org_id" else name: value})
    values = [*group_by, "currency"]
    rows = qs.values(*values).annotate(
        n=Sum("requests"), p=Sum("prompt_tokens"), c=Sum("cached_tokens"),
        o=Sum("completion_tokens"), a=Sum("amount"), k=Sum("cost_to_serve"),
        g=Sum("gpu_seconds")).order_by(*values)
    return [MarginSums(tuple(r[d] for d in group_by), r["currency"], int(r["n"]), int(r["p"]),
                       int(r["c"]), int(r["o"]), r["a"], r["k"], r["g"]) for r in rows]


# an event's own cost (an external engine's report) plus its attributed shares
_EVENT_MARGIN_SQL = """
SELECT {columns}
  FROM usage_event e
  LEFT JOIN (SELECT event_id, SUM(gpu_us) AS gpu_us, SUM(cost) AS cost FROM usage_cost_share
              WHERE event_time >= %(start)s AND event_time < %(end)s GROUP BY event_id) s
         ON s.event_id = e.id
 WHERE e.event_time >= %(start)s AND e.event_time < %(end)s
   AND (%(org)s::bigint IS NULL OR e.organization_id = %(org)s)
   AND (%(model)s::text IS NULL OR e.model = %(model)s)
   AND (%(tier)s::text IS NULL OR e.service_tier = %(tier)s)
   AND (%(currency)s::text IS NULL OR e.currency = %(currency)s)
 {tail}
"""
_EVENT_COST = "e.cost_to_serve + COALESCE(s.cost, 0)"


def _event_margin_rows(scope: MarginScope, columns: str, tail: str,
                       **params: Any) -> list[tuple[Any, ...]]:
    sql = _EVENT_MARGIN_SQL.format(columns=columns, tail=tail)
    with reading_connection().cursor() as cur:
        cur.execute(sql, {"start": scope.start, "end": scope.end, "org": scope.org_id,
                          "model": scope.model, "tier": scope.service_tier,
                          "currency": scope.currency, **params})
        return list(cur.fetchall())


def usage_engine_margin_sums(*, scope: MarginScope) -> list[MarginSums]:
    """Return revenue and cost-to-serve per engine x model (``key``) and currency, from the
    events and their cost shares (the rollups do not say which engine served)."""
    rows = _event_margin_rows(scope, f"""e.engine, e.model, e.currency, COUNT(*),
        SUM(e.prompt_tokens), SUM(e.cached_tokens), SUM(e.completion_tokens), SUM(e.amount),
        SUM({_EVENT_COST}), COALESCE(SUM(s.gpu_us), 0)""", "GROUP BY 1, 2, 3 ORDER BY 1, 2, 3")
    return [MarginSums((engine, model), currency, int(n), int(p), int(c), int(o), a, k,
                       Decimal(g).scaleb(-6))
            for engine, model, currency, n, p, c, o, a, k, g in rows]


class RequestMargin(NamedTuple):
    """One event's revenue (rated, in ``currency``) and cost-to-serve (USD)."""

    request_id: str
    organization_id: int
    event_time: datetime
    model: str
    engine: str
    service_tier: str
    capacity_source: str
    currency: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    amount: Decimal
    cost_to_serve: Decimal
    gpu_seconds: Decimal


def usage_request_margins(*, scope: MarginScope, limit: int) -> list[RequestMargin]:
    """Return the ``limit`` events of the scope that cost the most to serve, costliest first
    (ties: oldest first)."""
    rows = _event_margin_rows(scope, f"""e.request_id, e.organization_id, e.event_time,
        e.model, e.engine, e.service_tier, e.capacity_source, e.currency, e.prompt_tokens,
        e.cached_tokens, e.completion_tokens, e.amount, {_EVENT_COST},
        COALESCE(s.gpu_us, 0)""", f"ORDER BY {_EVENT_COST} DESC, e.event_time, e.id "
        "LIMIT %(limit)s", limit=limit)
    return [RequestMargin._make((*row[:-1], Decimal(row[-1]).scaleb(-6))) for row in rows]
