"""Requests refused with a 429, counted per organization, UTC hour and reason, for the console.

A refused request never ran, so it has no usage event, yet a customer wants to see how often
and why it was turned away (the dashboard's "429s by reason"). The gateway counts each refusal
of a known caller in one Redis hash per organization and hour,
``tg:q:{o<id>}:refused:<YYYYMMDDHH>`` (the organization's hash tag: one slot on a cluster),
field = reason, kept ``KEEP_DAYS``: one pipelined HINCRBY and EXPIRE per refusal. Redis
failing loses a count, never the response. Counts are approximate in that sense and say so on
the page; Prometheus keeps the platform-wide totals.
"""

from __future__ import annotations

import logging
from collections import Counter
from datetime import UTC, datetime, timedelta

import redis

from billing_platform.redis_conn import get_aredis, get_redis

log = logging.getLogger(__name__)

KEEP_DAYS = 40  # a month's dashboard and the start of the next
HOUR = timedelta(hours=1)

# reason -> what the console calls it (QuotaExceeded.reason, or a 429's error code)
REASONS = {
    "rpm": "Requests per minute limit",
    "tpm": "Tokens per minute limit",
    "request_too_large": "Request larger than the tokens-per-minute limit",
    "organization_budget": "Organization's hard budget",
    "project_budget": "Project's hard budget",
    "end_user_budget": "End user's spend limit",
    "plan_credits": "Token plan's credits for the period",
    "plan_window": "Token plan's rolling window",
    "provisioned": "Provisioned capacity full (overflow rejected)",
    "too_many_concurrent_requests": "Concurrent requests limit",
    "resource_unavailable": "No spare flex capacity",
    "pool_at_capacity": "On-demand share of a pool with reservations in use",
    "rate_limit_exceeded": "Rate limit",
}


def refusal_key(org_id: int, hour: datetime) -> str:
    return f"tg:q:{{o{org_id}}}:refused:{hour.astimezone(UTC):%Y%m%d%H}"


async def arecord(*, org_id: int, reason: str, at: datetime | None = None) -> None:
    """Count one refused request of ``org_id`` (from the gateway's event loop)."""
    key = refusal_key(org_id, at or datetime.now(UTC))
    try:
        pipe = get_aredis().pipeline(transaction=False)
        pipe.hincrby(key, reason[:64], 1)
        pipe.expire(key, KEEP_DAYS * 86400)
        await pipe.execute()
    except redis.RedisError as exc:
        log.warning("refusal of org %s not counted (%s): Redis unavailable (%r)", org_id,
                    reason, exc)


def refusals_by_reason(*, org_id: int, start: datetime, end: datetime) -> list[tuple[str, int]]:
    """Return ``[(reason, count)]`` of the refusals in the hours of [start, end), most first
    (hours older than ``KEEP_DAYS`` are gone)."""
    floor = datetime.now(UTC) - timedelta(days=KEEP_DAYS)
    hour = max(start, floor).astimezone(UTC).replace(minute=0, second=0, microsecond=0)
    keys = []
    while hour < end:
        keys.append(refusal_key(org_id, hour))
        hour += HOUR
    total: Counter[str] = Counter()
    if not keys:
        return []
    try:
        pipe = get_redis().pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(key)
        for counts in pipe.execute():
            total.update({reason: int(n) for reason, n in counts.items()})
    except redis.RedisError as exc:
        log.warning("refusals of org %s not read: Redis unavailable (%r)", org_id, exc)
    return total.most_common()


def reason_label(reason: str) -> str:
    return REASONS.get(reason, reason.replace("_", " "))
