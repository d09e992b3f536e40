"""Engines' metrics both ways: parse an engine's Prometheus /metrics into the load figures the
router uses and the cumulative counters that reconciliation and cost-to-serve read, and export
each engine's health and load (as the health task last recorded them) on the platform's
``/metrics`` (``EngineCollector``, read at scrape time); plus how fresh each web process's view
of the fleet is.
"""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal, InvalidOperation
from typing import Any

from prometheus_client import Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from engine_adapter.types import COUNTER_FIELDS, EngineCounters

# The web process's fleet view (``registry.Fleet``): alert on ``time() - this`` growing past
# TOLLGATE_FLEET_REFRESH_S (PostgreSQL unreadable; the last good view is being served).
FLEET_VIEW_REFRESHED = Gauge(
    "tollgate_fleet_view_refreshed_timestamp_seconds",
    "When this process last read the fleet from PostgreSQL (Unix time); the oldest of the "
    "live processes.", multiprocess_mode="livemin")
FLEET_VIEW_REFRESH_FAILURES = Counter(
    "tollgate_fleet_view_refresh_failures",
    "Reads of the fleet from PostgreSQL that failed (the last good view was kept).")

NAMES = {
    "sglang:num_running_reqs": "running",
    "sglang:num_queue_reqs": "queued",
    "sglang:token_usage": "token_usage",
    "sglang:cache_hit_rate": "cache_hit_rate",
    "sglang:max_running_requests": "max_running",
}


def parse_engine_load(text: str) -> dict[str, float]:
    """Return {running, queued, token_usage, cache_hit_rate} summed over label sets."""
    load: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        key = NAMES.get(name)
        if key is None:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        load[key] = load.get(key, 0.0) + value
    return load


# An engine's cumulative counters (``EngineCounters``): reconciled against the metered usage
# and read for its measured prefill and decode throughput. Sums over label sets
# (``is_streaming``, ``priority``, ``cache_source``, ...).
COUNTER_NAMES = {
    "sglang:num_requests_total": "requests",
    "sglang:prompt_tokens_total": "prompt_tokens",
    "sglang:cached_tokens_total": "cached_tokens",
    "sglang:generation_tokens_total": "generation_tokens",
    "sglang:uncached_prompt_tokens_histogram_sum": "uncached_prompt_tokens",
    "sglang:request_time_per_output_token_seconds_sum": "tpot_seconds",
    "sglang:request_time_per_output_token_seconds_count": "tpot_requests",
}
PREFILL_STAGE = ("sglang:per_stage_req_latency_seconds_sum", 'stage="prefill_forward"')
# Without these an engine reports no usage of its own (an external one that exports other
# metrics): it cannot be reconciled.
REQUIRED_COUNTERS = ("sglang:num_requests", "sglang:prompt_tokens", "sglang:generation_tokens")
_SECONDS = frozenset({"prefill_seconds", "tpot_seconds"})
MICRO = Decimal("0.000001")


def parse_engine_counters(text: str) -> EngineCounters | None:
    """Return the engine's cumulative counters, or None when its /metrics does not declare them.

    A declared counter without samples is 0: prometheus_client prints a labelled counter's
    ``# TYPE`` line before its first increment (SGLang's before its first finished request).
    """
    declared: set[str] = set()
    values: dict[str, Decimal] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            parts = line.split()
            if len(parts) >= 3:
                declared.add(parts[2].removesuffix("_total"))
            continue
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition("{")
        if not rest:
            name = line.split(" ", 1)[0]
        key = COUNTER_NAMES.get(name)
        if key is None and name == PREFILL_STAGE[0] and PREFILL_STAGE[1] in rest:
            key = "prefill_seconds"
        if key is None:
            continue
        try:
            value = Decimal(line.rsplit(" ", 1)[1])
        except (IndexError, InvalidOperation):
            continue
        if value.is_finite():
            values[key] = values.get(key, Decimal(0)) + value
    if not all(name in declared for name in REQUIRED_COUNTERS):
        return None
    fields: dict[str, Any] = {}
    for key in COUNTER_FIELDS:
        value = values.get(key, Decimal(0))
        fields[key] = value.quantize(MICRO) if key in _SECONDS else int(value)
    return EngineCounters(**fields)

_LABELS = ["engine", "pool", "model", "region"]


class EngineCollector:
    """Health and last scraped load of every engine in the fleet (one query, small table)."""

    def collect(self) -> Iterator[Metric]:
        from django.db import connection, transaction

        from engine_adapter.choices import EngineStatus
        from engine_adapter.models import EngineInstance

        families = {
            "healthy": GaugeMetricFamily(
                "tollgate_engine_healthy", "1 if the engine passed its last health check and "
                "is routed to, else 0 (starting, unhealthy or crashed).", labels=_LABELS),
            "failures": GaugeMetricFamily(
                "tollgate_engine_health_failures",
                "Consecutive failed health checks of the engine.", labels=_LABELS),
            "seen": GaugeMetricFamily(
                "tollgate_engine_last_seen_timestamp_seconds",
                "When the engine last passed a health check (Unix time).", labels=_LABELS),
            "running": GaugeMetricFamily(
                "tollgate_engine_running_requests", "Requests the engine is running, as last "
                "scraped from its /metrics.", labels=_LABELS),
            "queued": GaugeMetricFamily(
                "tollgate_engine_queued_requests", "Requests waiting in the engine's queue, as "
                "last scraped.", labels=_LABELS),
            "token_usage": GaugeMetricFamily(
                "tollgate_engine_kv_cache_usage_ratio", "Fraction of the engine's KV cache in "
                "use, as last scraped.", labels=_LABELS),
            "unmanaged": GaugeMetricFamily(
                "tollgate_engine_unhealthy_unmanaged", "1 if the engine failed its health "
                "check TOLLGATE_ENGINE_UNHEALTHY_AFTER times in a row and is out of routing, "
                "but Tollgate did not launch it and cannot restart it: someone must.",
                labels=_LABELS),
            "restarts": CounterMetricFamily(
                "tollgate_engine_restarts", "Times the fleet manager restarted the engine "
                "(its process exited, or it failed its health checks).",
                labels=_LABELS),
        }
        with transaction.atomic(), connection.cursor() as cur:
            cur.execute("SET LOCAL statement_timeout = 2000")
            instances = list(EngineInstance.objects.select_related("pool")
                             .exclude(status=EngineStatus.STOPPED).filter(pool__in_spec=True)
                             .order_by("engine_id"))
        for inst in instances:
            labels = [inst.engine_id, inst.pool.name, inst.pool.model, inst.pool.region]
            load = inst.load or {}
            families["healthy"].add_metric(labels, int(inst.status == EngineStatus.HEALTHY))
            families["failures"].add_metric(labels, inst.failures)
            if inst.last_seen_at is not None:
                families["seen"].add_metric(labels, inst.last_seen_at.timestamp())
            for key in ("running", "queued", "token_usage"):
                families[key].add_metric(labels, float(load.get(key, 0.0)))
            families["unmanaged"].add_metric(
                labels, int(inst.status == EngineStatus.UNHEALTHY and not inst.launched))
            families["restarts"].add_metric(labels, inst.restarts)
        yield from families.values()
