"""Reads of provisioned usage, per hour: what ran inside a reservation and what spilled over.

Metering owns ``usage_event``, so the SQL over it lives here; ``plans.selectors.
reservation_utilization`` sets it against what the reservation holds. An event that ran inside
a reservation is stored with ``capacity_source = 'provisioned'`` and its burndown in
``normalized_tokens`` (``plans.rating.rate_provisioned``); one that found the reservation full
is ``'spillover'``, rated on-demand, with ``normalized_tokens`` 0, so its normalized size is
computed here with the reservation's burndowns, rounded up per event as the rater rounds.
Events carry no reservation id: they are matched by organization, model and region.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from django.db import connection

from plans.choices import CapacitySource


@dataclass(frozen=True)
class ProvisionedHour:
    """Normalized tokens of one UTC hour: used inside the reservation (in total and in its
    busiest minute) and spilled over to on-demand."""

    hour: datetime
    used: int
    peak_minute_used: int
    spillover: int


_SQL = """
SELECT date_trunc('hour', m.minute, 'UTC') AS hour, SUM(m.used), MAX(m.used), SUM(m.spill)
  FROM (SELECT date_trunc('minute', e.event_time, 'UTC') AS minute,
               COALESCE(SUM(e.normalized_tokens)
                        FILTER (WHERE e.capacity_source = %(provisioned)s), 0) AS used,
               COALESCE(SUM(CEIL((e.prompt_tokens - e.cached_tokens)
                                 + e.cached_tokens * %(cache_burndown)s
                                 + e.completion_tokens * %(output_burndown)s))
                        FILTER (WHERE e.capacity_source = %(spillover)s), 0) AS spill
          FROM usage_event e
         WHERE e.organization_id = %(org_id)s AND e.model = %(model)s
           AND e.region = %(region)s AND e.event_time >= %(start)s AND e.event_time < %(end)s
           AND e.capacity_source IN (%(provisioned)s, %(spillover)s)
         GROUP BY 1) m
 GROUP BY 1
 ORDER BY 1
"""


def provisioned_usage_by_hour(*, org_id: int, model: str, region: str, start: datetime,
                              end: datetime, cache_burndown: Decimal,
                              output_burndown: Decimal) -> list[ProvisionedHour]:
    """Return the hours of [start, end) that have provisioned or spillover usage, in order."""
    with connection.cursor() as cursor:
        cursor.execute(_SQL, {
            "org_id": org_id, "model": model, "region": region, "start": start, "end": end,
            "cache_burndown": cache_burndown, "output_burndown": output_burndown,
            "provisioned": str(CapacitySource.PROVISIONED.value),
            "spillover": str(CapacitySource.SPILLOVER.value)})
        rows = cursor.fetchall()
    return [ProvisionedHour(hour=hour, used=int(used), peak_minute_used=int(peak),
                            spillover=int(spill)) for hour, used, peak, spill in rows]
