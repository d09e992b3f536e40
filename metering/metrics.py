"""Metering's metrics: what was rated, where appends went, and the pipeline's backlog.

Counters are incremented where the work happens (the gateway's append, the record path of the
consumer and the fallbacks); ``usage_recorded`` runs only once a batch's transaction committed,
so a batch rolled back and retried is counted once. ``MeteringCollector`` reads the stream, the
dead letters, the spool and the reconciliation ledger when ``/metrics`` is scraped (see
``billing_platform.metrics``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from datetime import timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import redis
from django.db import connection, transaction
from django.utils import timezone
from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily, Metric

from metering import conf, spool, stream
from metering.choices import EventSource

if TYPE_CHECKING:
    from metering.recording import RollupKey, RollupSums

log = logging.getLogger(__name__)

USAGE_TOKENS = Counter(
    "tollgate_usage_tokens_total",
    "Tokens of recorded usage events, by token class (input = uncached prompt tokens, "
    "cached_input, output).", ["model", "service_tier", "region", "token_class"])
USAGE_AMOUNT = Counter(
    "tollgate_usage_rated_amount_total",
    "Rated amount of recorded usage events, in the price book's currency (a float: the exact "
    "amounts are in PostgreSQL).", ["model", "service_tier", "region", "currency"])
USAGE_EVENTS = Counter(
    "tollgate_usage_events_total", "Usage events recorded (each once), by request status.",
    ["model", "service_tier", "region", "status"])
APPENDS = Counter(
    "tollgate_usage_appends_total",
    "Usage events appended by the gateway and batch runner, by where they went (redis; "
    "postgres or spool when Redis failed; lost when nothing took them).", ["path"])
STREAM_FULL = Counter(
    "tollgate_usage_stream_full_total",
    "Usage events the stream refused because it was at its cap "
    "(TOLLGATE_USAGE_STREAM_MAX_LENGTH); they were written to PostgreSQL directly.")
ID_CONFLICTS = Counter(
    "tollgate_usage_id_conflicts_total",
    "Usage events refused for claiming another source's request id (see usage_id_conflict).",
    ["source"],
)

# Known label values start at 0, so an alert on increase() sees the first event too.
for _path in ("redis", "postgres", "spool", "lost"):
    APPENDS.labels(_path)
for _source in EventSource.values:
    ID_CONFLICTS.labels(_source)

# How many dead letters are counted at most: beyond this the gauge says "at least".
DEAD_LETTER_COUNT_CAP = 100_000
RECONCILE_SHOWN = timedelta(days=2)  # how far back drifting engine-hours stay on /metrics
_ROLLUP_MODEL, _ROLLUP_REGION, _ROLLUP_TIER, _ROLLUP_CURRENCY = 3, 4, 5, 7


def usage_recorded(sums: Mapping[RollupKey, RollupSums]) -> None:
    """Count a committed batch's events, tokens and amounts from its rollup sums.

    ``sums`` is ``recording._Rollups.sums``: (org, project, key, model, region, tier,
    capacity, currency, hour) -> [requests, errors, aborted, prompt, cached, completion,
    normalized, amount, ...]. Aggregated first, so a batch costs one increment per label set.
    """
    per: dict[tuple[str, str, str, str], list[Any]] = {}
    for key, acc in sums.items():
        labels = (key[_ROLLUP_MODEL], key[_ROLLUP_TIER], key[_ROLLUP_REGION],
                  key[_ROLLUP_CURRENCY])
        total = per.get(labels)
        if total is None:
            total = per[labels] = [0, 0, 0, 0, 0, 0, Decimal(0)]
        for i in range(6):
            total[i] += acc[i]
        total[6] += acc[7]
    for (model, tier, region, currency), (n, errors, aborted, prompt, cached, completion,
                                          amount) in per.items():
        USAGE_EVENTS.labels(model, tier, region, "ok").inc(n - errors - aborted)
        if errors:
            USAGE_EVENTS.labels(model, tier, region, "engine_error").inc(errors)
        if aborted:
            USAGE_EVENTS.labels(model, tier, region, "client_aborted").inc(aborted)
        USAGE_TOKENS.labels(model, tier, region, "input").inc(prompt - cached)
        USAGE_TOKENS.labels(model, tier, region, "cached_input").inc(cached)
        USAGE_TOKENS.labels(model, tier, region, "output").inc(completion)
        if currency:
            USAGE_AMOUNT.labels(model, tier, region, currency).inc(float(amount))


def usage_recorded_on_commit(sums: Mapping[RollupKey, RollupSums]) -> None:
    """Count a batch's usage once the transaction it is recorded in commits (never before)."""
    transaction.on_commit(lambda: usage_recorded(sums))


def _shard_backlog(r: Any, key: str, group: str) -> tuple[int, int, int | None]:
    """Return one usage stream's length, backlog (undelivered plus delivered but not
    acknowledged) and the time (ms) of its oldest unrecorded event (None: none waiting)."""
    length = r.xlen(key)
    info = None
    if length:
        try:
            info = next((g for g in r.xinfo_groups(key)
                         if g["name"] in (group, group.encode())), None)
        except redis.ResponseError:  # the stream vanished between the two calls
            info = None
    if info is None:
        # no consumer has ever joined: everything on the stream waits
        backlog, oldest = length, (r.xrange(key, count=1) if length else [])
    else:
        pending = int(info["pending"])
        lag = info.get("lag")
        backlog = pending + (int(lag) if lag is not None else length)
        if pending:
            oldest = [(r.xpending(key, group)["min"], None)]
        else:
            last = info["last-delivered-id"]
            last = last.decode() if isinstance(last, bytes) else last
            oldest = r.xrange(key, min=f"({last}", count=1)
    return length, backlog, (stream.entry_ms(oldest[0][0]) if oldest else None)


class MeteringCollector:
    """Ingest backlog and lag (Redis), dead letters (PostgreSQL), the spool (this host's disk)."""

    def collect(self) -> Iterator[Metric]:
        yield from self._stream()
        yield from self._dead_letters()
        yield from self._spool()
        yield from self._reconciliation()

    @staticmethod
    def _stream() -> Iterator[Metric]:
        r = stream.client(socket_timeout=1.0)
        group = conf.consumer_group()
        backlog = length = 0
        oldest_ms: int | None = None
        for key in conf.stream_keys():  # every shard: the gauges are totals (age: the oldest)
            shard_length, shard_backlog, shard_oldest = _shard_backlog(r, key, group)
            length += shard_length
            backlog += shard_backlog
            if shard_oldest is not None:
                oldest_ms = shard_oldest if oldest_ms is None else min(oldest_ms, shard_oldest)
        age = 0.0
        if oldest_ms is not None:
            seconds, micros = r.time()
            age = max(0.0, seconds + micros / 1e6 - oldest_ms / 1000)
        yield _gauge("tollgate_ingest_backlog_events",
                     "Usage events on the stream not yet recorded in PostgreSQL (undelivered "
                     "plus delivered but unacknowledged).", backlog)
        yield _gauge("tollgate_ingest_lag_seconds",
                     "Age of the oldest usage event on the stream not yet recorded (0: none "
                     "waiting).", age)
        yield _gauge("tollgate_usage_stream_length_events",
                     "Entries on the usage stream (recorded ones are trimmed every few "
                     "seconds).", length)
        yield _gauge("tollgate_usage_stream_max_length_events",
                     "The usage stream's cap: at it, appends go to PostgreSQL directly (never "
                     "trimming an unrecorded event).", conf.stream_max_length())

    @staticmethod
    def _dead_letters() -> Iterator[Metric]:
        from metering.selectors import usage_dead_letters_unresolved_count

        with transaction.atomic(), connection.cursor() as cur:
            cur.execute("SET LOCAL statement_timeout = 2000")
            count = usage_dead_letters_unresolved_count(cap=DEAD_LETTER_COUNT_CAP)
        yield _gauge("tollgate_usage_dead_letters",
                     f"Unresolved dead-lettered usage events (counted up to "
                     f"{DEAD_LETTER_COUNT_CAP}).", count)

    @staticmethod
    def _reconciliation() -> Iterator[Metric]:
        from metering.selectors import usage_engine_capture_latest, usage_engine_drift_open

        since = timezone.now() - RECONCILE_SHOWN
        with transaction.atomic(), connection.cursor() as cur:
            cur.execute("SET LOCAL statement_timeout = 2000")
            drift = usage_engine_drift_open(since=since)
            capture = usage_engine_capture_latest(since=since)
        gauge = GaugeMetricFamily(
            "tollgate_engine_reconcile_drift",
            "1 for each closed engine-hour (of the last two days) whose metered usage differs "
            "from the engine's own counters by more than the tolerance (usage_engine_hour).",
            labels=["engine", "hour"])
        for engine, hour in drift:
            gauge.add_metric([engine, hour.strftime("%Y-%m-%dT%H:00Z")], 1)
        yield gauge
        ratio = GaugeMetricFamily(
            "tollgate_engine_capture_ratio",
            "Metered requests / the engine's own count, in the engine's latest closed "
            "reconciled hour (1: every request it finished was metered).", labels=["engine"])
        for engine, rate in sorted(capture.items()):
            ratio.add_metric([engine], float(rate))
        yield ratio

    @staticmethod
    def _spool() -> Iterator[Metric]:
        files, size, oldest = 0, 0, None
        directory = conf.spool_dir()
        try:
            entries = list(directory.iterdir())
        except FileNotFoundError:
            entries = []
        for path in entries:
            if path.suffix not in (spool.SUFFIX, spool.CLAIMED):
                continue
            try:
                st = path.stat()
            except FileNotFoundError:  # replayed meanwhile
                continue
            files += 1
            size += st.st_size
            oldest = st.st_mtime if oldest is None else min(oldest, st.st_mtime)
        yield _gauge("tollgate_usage_spool_bytes",
                     "Bytes of usage events spooled on this host's disk, waiting for replay "
                     "(written only while Redis and PostgreSQL were both down).", size)
        yield _gauge("tollgate_usage_spool_files", "Spool files on this host.", files)
        yield _gauge("tollgate_usage_spool_oldest_age_seconds",
                     "Age of the oldest spool file on this host (0: none).",
                     0.0 if oldest is None else max(0.0, time.time() - oldest))


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)
