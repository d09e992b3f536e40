"""Reads of the metering app: usage summaries from the hourly rollups, events by request id."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal

from django.db import connection
from django.db.models import QuerySet, Sum
from django.db.models.functions import TruncDay

from metering.models import UsageEvent, UsageEventId, UsageRollupHourly

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
}
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
    extra: dict = field(default_factory=dict)

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
    return qs


def usage_summary(*, usage_filter: UsageFilter, group_by: tuple[str, ...] = ()
                  ) -> list[UsageBucket]:
    """Return usage sums per group (and currency), ordered by the grouped values.

    Numbers come from the hourly rollups, which the ingest transaction keeps equal to the sums
    of ``usage_event``; the range is whole UTC hours.
    """
    qs = _rollups(usage_filter)
    names = {g: GROUPS[g] for g in group_by}
    if "day" in names:
        qs = qs.annotate(day=TruncDay("hour", tzinfo=UTC))
    values = [*names.values(), "currency"]
    rows = qs.values(*values).annotate(**{f"s_{s}": Sum(s) for s in SUMS}).order_by(*values)
    out = []
    for row in rows:
        group = {}
        for name, expr in names.items():
            value = row[expr]
            if name == "day" and value is not None:
                value = value.date()
            group[name] = value
        out.append(UsageBucket(
            group=group, currency=row["currency"],
            **{s: row[f"s_{s}"] or (Decimal("0") if s in ("amount", "credits_consumed") else 0)
               for s in SUMS},
        ))
    return out


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
    with connection.cursor() as cur:
        cur.execute(_RATED_SQL, [orgs, [until[o] for o in orgs]])
        return {(org, currency): amount for org, currency, amount in cur}
