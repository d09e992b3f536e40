"""Metering's knobs, read at call time so tests can override them with Django settings.

Each value comes from the Django setting of the same name when one is set, else from the
environment through ``billing_platform.env`` (``TOLLGATE_*``), else a default that works on one
machine. A value is read once and kept until a Django setting changes.
"""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Any, TypeVar, overload

from django.conf import settings
from django.core.signals import setting_changed
from django.dispatch import receiver

from billing_platform.env import STATE_DIR, env

_T = TypeVar("_T", str, int, float, bool)


@overload
def _setting(name: str, env_name: str, default: str) -> str: ...
@overload
def _setting(name: str, env_name: str, default: _T, cast: type[_T]) -> _T: ...
def _setting(name: str, env_name: str, default: Any, cast: type = str) -> Any:
    key = (name, env_name, default, cast)
    try:
        return _values[key]
    except KeyError:
        pass
    value = getattr(settings, name, None)
    if value is None:
        value = getattr(env, cast.__name__)(env_name, default=default)
    _values[key] = value
    return value


# Each knob read once, until a setting changes (``override_settings`` and pytest-django's
# ``settings`` fixture send ``setting_changed``): the gateway reads about eight of them per
# usage event appended, a third of the append's CPU when each went through Django's settings
# and the environment.
_values: dict[tuple[Any, ...], Any] = {}


def reread() -> None:
    """Forget the knobs read, so the next reads see the settings and environment as they are
    now (a process that changes its own environment, as bench/ingest.py does per phase)."""
    _values.clear()


@receiver(setting_changed)
def _forget(**_kwargs: Any) -> None:
    reread()


def stream_key() -> str:
    """Return the Redis stream the gateway appends usage events to."""
    return _setting("METERING_STREAM_KEY", "TOLLGATE_USAGE_STREAM", "tg:usage:events")


def stream_shards() -> int:
    """Return how many streams the usage stream is sharded into, by organization (1: one)."""
    return max(1, int(_setting("METERING_STREAM_SHARDS", "TOLLGATE_USAGE_STREAM_SHARDS", 1,
                               int)))


def stream_keys() -> list[str]:
    """Return the usage streams, shard by shard: ``stream_key()`` itself when there is one,
    else ``<stream_key()>:{s<i>}`` (each its own hash tag, so a cluster spreads them)."""
    shards = stream_shards()
    if shards == 1:
        return [stream_key()]
    return [f"{stream_key()}:{{s{i}}}" for i in range(shards)]


def stream_key_of(org_id: int) -> str:
    """Return the stream an organization's usage events are appended to (org id mod K)."""
    keys = stream_keys()
    return keys[org_id % len(keys)]


def consumer_group() -> str:
    """Return the consumer group that drains the stream into PostgreSQL."""
    return _setting("METERING_CONSUMER_GROUP", "TOLLGATE_USAGE_GROUP", "ingest")


def redis_url() -> str:
    """Return the Redis of the usage stream (the platform's Redis or cluster unless set
    apart)."""
    return _setting("METERING_REDIS_URL", "TOLLGATE_USAGE_REDIS_URL",
                    settings.REDIS_CLUSTER_URL or settings.REDIS_URL)


def redis_is_cluster() -> bool:
    """Return whether the usage stream's Redis is the platform's Redis Cluster."""
    return bool(settings.REDIS_CLUSTER_URL) and redis_url() == settings.REDIS_CLUSTER_URL


def spool_dir() -> Path:
    """Return the directory of the local spool used when Redis and PostgreSQL are both down."""
    return Path(_setting("METERING_SPOOL_DIR", "TOLLGATE_SPOOL_DIR", str(STATE_DIR / "spool")))


def wait_aof() -> bool:
    """Return whether an append waits for Redis to fsync its AOF (``WAITAOF``, Redis >= 7.2)."""
    return bool(_setting("METERING_WAIT_AOF", "TOLLGATE_USAGE_WAITAOF", False, bool))


def wait_replicas() -> int:
    """Return how many replicas must acknowledge an append before it counts (``WAIT``; 0: do
    not wait). Redis replicates asynchronously: an event a master acknowledged and lost in a
    failover before its replica had it would be lost; with this set, an append its replicas
    did not acknowledge within ``wait_replicas_ms`` is written to PostgreSQL directly instead
    (if the stream's copy survives too, ingest records the event once: its id is its key)."""
    return max(0, int(_setting("METERING_WAIT_REPLICAS", "TOLLGATE_USAGE_WAIT_REPLICAS", 0,
                               int)))


def wait_replicas_ms() -> int:
    """Return how long an append waits for its replicas (``TOLLGATE_USAGE_WAIT_REPLICAS_MS``)."""
    return max(1, int(_setting("METERING_WAIT_REPLICAS_MS", "TOLLGATE_USAGE_WAIT_REPLICAS_MS",
                               200, int)))


def stream_max_length() -> int:
    """Return the cap of the usage stream (entries): at it, appends go to PostgreSQL directly.

    Far above any backlog a running consumer has (it records thousands of events a second and
    trims what it recorded every few seconds): a stream near the cap means the consumer has
    been down a long time, and the cap keeps Redis's memory bounded meanwhile (about 400 bytes
    an entry: 1,000,000 is some 400 MB).
    """
    return int(_setting("METERING_STREAM_MAX_LENGTH", "TOLLGATE_USAGE_STREAM_MAX_LENGTH",
                        1_000_000, int))


def stream_alarm_length() -> int:
    """Return the stream length at which appends log a warning (default: half the cap)."""
    value = _setting("METERING_STREAM_ALARM_LENGTH", "TOLLGATE_USAGE_STREAM_ALARM_LENGTH", 0,
                     int)
    return int(value) or stream_max_length() // 2


def batch_size() -> int:
    """Return how many stream entries the consumer reads and records per transaction."""
    return int(_setting("METERING_BATCH_SIZE", "TOLLGATE_INGEST_BATCH", 5000, int))


def claim_idle_ms() -> int:
    """Return how long an unacknowledged entry waits before another consumer reclaims it."""
    return int(_setting("METERING_CLAIM_IDLE_MS", "TOLLGATE_INGEST_CLAIM_IDLE_MS", 60_000, int))


def spool_replay_s() -> float:
    """Return the beat interval of the spool replay task."""
    return float(_setting("METERING_SPOOL_REPLAY_S", "TOLLGATE_SPOOL_REPLAY_S", 30.0, float))


def usage_retention_months() -> int:
    """Return how many whole months before the current one usage is kept (0: forever).

    See ``metering.retention``: older months' partitions are archived and dropped once
    billing no longer needs them, their idempotency keys deleted, and events dated before
    the horizon refused.
    """
    return max(0, int(_setting("METERING_USAGE_RETENTION_MONTHS",
                               "TOLLGATE_USAGE_RETENTION_MONTHS", 0, int)))


def usage_archive_dir() -> Path:
    """Return the directory retired usage partitions are archived to (CSV.gz + manifest)."""
    return Path(_setting("METERING_USAGE_ARCHIVE_DIR", "TOLLGATE_USAGE_ARCHIVE_DIR",
                         str(STATE_DIR / "usage-archive")))


def usage_api_max_range_days() -> int:
    """Return the longest range ``GET /api/v1/usage`` sums in one request (days)."""
    return int(_setting("METERING_USAGE_MAX_RANGE_DAYS", "TOLLGATE_USAGE_MAX_RANGE_DAYS", 366,
                        int))


def usage_api_max_event_range_days() -> int:
    """Return the longest range ``GET /api/v1/usage`` sums from the events themselves (days):
    a grouping the hourly rollups do not keep (``user``) reads every event of the range."""
    return int(_setting("METERING_USAGE_MAX_EVENT_RANGE_DAYS",
                        "TOLLGATE_USAGE_MAX_EVENT_RANGE_DAYS", 31, int))


def usage_api_max_groups() -> int:
    """Return the most groups (rows of ``data``) ``GET /api/v1/usage`` answers in one request."""
    return int(_setting("METERING_USAGE_MAX_GROUPS", "TOLLGATE_USAGE_MAX_GROUPS", 10_000, int))


def usage_api_max_filter_values() -> int:
    """Return the most values one ``GET /api/v1/usage`` filter (project, key, ...) may list."""
    return int(_setting("METERING_USAGE_MAX_FILTER_VALUES", "TOLLGATE_USAGE_MAX_FILTER_VALUES",
                        100, int))


# --- cost-to-serve (metering.costs) and reconciliation (metering.reconciliation) ------------

def cost_interval_s() -> int:
    """Return the length of the intervals an engine's GPU time is split over (seconds; a
    divisor of 3600 keeps them inside hours)."""
    return max(1, int(_setting("METERING_COST_INTERVAL_S", "TOLLGATE_COST_INTERVAL_S", 60, int)))


def cost_settle_s() -> float:
    """Return how long after an interval ends it is first attributed: its events must have
    been recorded (requests end, then their events land within seconds)."""
    return float(_setting("METERING_COST_SETTLE_S", "TOLLGATE_COST_SETTLE_S", 300.0, float))


def cost_lookback_s() -> float:
    """Return how far back intervals are attributed again when their events changed (a late
    event); older ones are final."""
    return float(_setting("METERING_COST_LOOKBACK_S", "TOLLGATE_COST_LOOKBACK_S", 7200.0, float))


def cost_max_request_s() -> float:
    """Return the longest a request is looked for before the interval it ran in (seconds)."""
    return float(_setting("METERING_COST_MAX_REQUEST_S", "TOLLGATE_COST_MAX_REQUEST_S", 3600.0,
                          float))


def cost_throughput_window_s() -> float:
    """Return the window around an interval over which an engine's throughput is measured."""
    return float(_setting("METERING_COST_THROUGHPUT_WINDOW_S",
                          "TOLLGATE_COST_THROUGHPUT_WINDOW_S", 900.0, float))


def cost_default_rates() -> tuple[Decimal, Decimal]:
    """Return the (prefill, decode) tokens per second used for an engine that has measured
    neither yet (only their ratio matters: it weighs a prefill token against a decode one)."""
    return (Decimal(_setting("METERING_COST_DEFAULT_PREFILL_TPS",
                             "TOLLGATE_COST_DEFAULT_PREFILL_TPS", "10000")),
            Decimal(_setting("METERING_COST_DEFAULT_DECODE_TPS",
                             "TOLLGATE_COST_DEFAULT_DECODE_TPS", "100")))


def cost_attribute_every_s() -> float:
    """Return the beat interval of the cost attribution task."""
    return float(_setting("METERING_COST_ATTRIBUTE_EVERY_S", "TOLLGATE_COST_ATTRIBUTE_EVERY_S",
                          60.0, float))


def reconcile_every_s() -> float:
    """Return the beat interval of the engine-vs-gateway reconciliation task."""
    return float(_setting("METERING_RECONCILE_EVERY_S", "TOLLGATE_RECONCILE_EVERY_S", 300.0,
                          float))


def reconcile_settle_s() -> float:
    """Return how long after an hour ends it is closed: reconciled for good, alerted on."""
    return float(_setting("METERING_RECONCILE_SETTLE_S", "TOLLGATE_RECONCILE_SETTLE_S", 300.0,
                          float))


def reconcile_lookback_s() -> float:
    """Return how far back engine-hours are reconciled again (late events, late scrapes)."""
    return float(_setting("METERING_RECONCILE_LOOKBACK_S", "TOLLGATE_RECONCILE_LOOKBACK_S",
                          10800.0, float))


def reconcile_tolerance() -> Decimal:
    """Return the relative difference between metered and engine counts that is drift."""
    return Decimal(_setting("METERING_RECONCILE_TOLERANCE", "TOLLGATE_RECONCILE_TOLERANCE",
                            "0.001"))


def reconcile_boundary_s() -> float:
    """Return how close to a scrape an event may end and still have been counted by the
    engine on the scrape's other side (scrape latency plus the gateway's last steps)."""
    return float(_setting("METERING_RECONCILE_BOUNDARY_S", "TOLLGATE_RECONCILE_BOUNDARY_S", 0.5,
                          float))
