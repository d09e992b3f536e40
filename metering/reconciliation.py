"""Reconciliation, engine against gateway: per engine and hour, the engine's own counters against
the usage metered from it, kept in a ledger (``UsageEngineHour``); drift raises an alert.

The engine's side. The fleet's health check scrapes every engine's cumulative counters
(requests, prompt, cached and generated tokens: SGLang counts a request when it finishes) into
``engine_counter_sample``, numbering the engine's process lives (``epoch``): a relaunch or a
counter going down starts a new one. Between two consecutive scrapes ``(p, q]`` of one life the
engine counted ``q - p``; a window belongs to the hour its later scrape ``q`` fell in, so every
window, and every event, belongs to exactly one hour. A window that spans a restart (its two
scrapes are of different lives) shows nothing: what the old process counted after ``p`` died
with it, and a restart never counts as drift.

The metered side. The events from that engine (gateway and batch lines alike: batch lines go to
the same engines; engine errors left out, the engine finished nothing) that ended in the hour's
windows; an event's end is its ``event_time`` plus ``total_ms``. Events that ended in a window
across a restart are ``unverified``. An event can end within moments of a scrape and have been
counted by the engine on the scrape's other side (the scrape's own latency, the gateway's last
steps): events within ``TOLLGATE_RECONCILE_BOUNDARY_S`` of the hour's outer window edges are the
``slack`` the comparison allows on top of the relative ``TOLLGATE_RECONCILE_TOLERANCE``.

Capture rate = metered / engine (requests; tokens separately). An engine-hour differing by more
than slack plus tolerance on any counter is in drift; once closed (ended
``TOLLGATE_RECONCILE_SETTLE_S`` ago) it is audited once (``usage.engine_drift``, naming the
engine and the hour) and shown by ``tollgate_engine_reconcile_drift`` on ``/metrics``.

Not reconcilable: engines outside the fleet (events reported through the usage API name
engines Tollgate never scraped), and fleet engines whose ``/metrics`` declares no counters (an
external engine whose operator does not export them), or that no scrape covered in the hour.

Runs from ``metering.reconcile`` (beat): each run recomputes the hours of the last
``TOLLGATE_RECONCILE_LOOKBACK_S`` (late events and late scrapes land in them), so running it
twice changes nothing; a drift is audited once, its resolution once.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from django.db import connection, transaction
from django.utils import timezone

from billing_platform.audit.services import audit_record
from engine_adapter.selectors import CounterSample, engine_cost_basis, engine_counter_samples
from metering import conf
from metering.choices import ReconcileStatus
from metering.models import UsageEngineHour

HOUR = timedelta(hours=1)
LOCK = int.from_bytes(hashlib.blake2b(b"metering.reconciliation", digest_size=8).digest(),
                      "big", signed=True)
COUNTERS = ("requests", "prompt", "cached", "generated")
SIX = Decimal("0.000001")

EVENTS = """
SELECT engine, event_time + make_interval(secs => coalesce(total_ms, 0) / 1000.0),
       prompt_tokens, cached_tokens, completion_tokens, batch_id IS NOT NULL
FROM usage_event
WHERE event_time >= %s AND event_time < %s AND engine <> '' AND status <> 'engine_error'
"""


def _hour(when: datetime) -> datetime:
    return when.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


@dataclass(frozen=True)
class _Ended:
    """A metered event, by when it ended."""

    end: datetime
    counts: tuple[int, int, int, int]  # requests (1), prompt, cached, completion tokens
    batch: bool


@dataclass
class _Hour:
    """One engine-hour being added up."""

    engine_counts: list[int] = field(default_factory=lambda: [0, 0, 0, 0])
    metered: list[int] = field(default_factory=lambda: [0, 0, 0, 0])
    slack: list[int] = field(default_factory=lambda: [0, 0, 0, 0])
    batch: int = 0
    unverified_requests: int = 0
    unverified_tokens: int = 0
    verified_windows: int = 0
    epochs: set[int] = field(default_factory=set)
    covered_from: datetime | None = None
    covered_to: datetime | None = None
    edges: list[datetime] = field(default_factory=list)

    def add_unverified(self, event: _Ended) -> None:
        self.unverified_requests += 1
        self.unverified_tokens += event.counts[1] + event.counts[3]

    def add_metered(self, event: _Ended) -> None:
        for i, value in enumerate(event.counts):
            self.metered[i] += value
        self.batch += event.batch


@dataclass
class ReconcileRun:
    """What one reconciliation run wrote."""

    rows: int = 0
    drift: list[tuple[str, datetime]] = field(default_factory=list)
    alerted: list[tuple[str, datetime]] = field(default_factory=list)


def _events(start: datetime, end: datetime) -> dict[str, list[_Ended]]:
    """Return each engine's metered events that ended in ``(start, end]``, by end time."""
    earliest = start - timedelta(seconds=conf.cost_max_request_s())
    out: dict[str, list[_Ended]] = {}
    with connection.cursor() as cur:
        cur.execute(EVENTS, (earliest, end))
        for engine, ended, prompt, cached, completion, batch in cur.fetchall():
            if start < ended <= end:
                out.setdefault(engine, []).append(
                    _Ended(ended, (1, prompt, cached, completion), batch))
    for events in out.values():
        events.sort(key=lambda e: e.end)
    return out


def _deltas(p: CounterSample, q: CounterSample) -> tuple[int, int, int, int]:
    a, b = p.counters, q.counters
    return (b.requests - a.requests, b.prompt_tokens - a.prompt_tokens,
            b.cached_tokens - a.cached_tokens, b.generation_tokens - a.generation_tokens)


def _engine_hours(samples: Sequence[CounterSample], events: Sequence[_Ended], *,
                  start: datetime, end: datetime, now: datetime, boundary: timedelta
                  ) -> dict[datetime, _Hour]:
    """Add up one scraped engine's hours in ``[start, end)``; see the module docstring."""
    hours: dict[datetime, _Hour] = {}
    times = [s.at for s in samples]
    settle = timedelta(seconds=conf.reconcile_settle_s())
    windows = list(itertools.pairwise(samples))
    counted = [start <= q.at < end for _, q in windows]
    verified = [p.epoch == q.epoch for p, q in windows]
    for i, (p, q) in enumerate(windows):
        if not counted[i]:
            continue
        hour = hours.setdefault(_hour(q.at), _Hour())
        if not verified[i]:
            continue
        hour.verified_windows += 1
        hour.epochs.add(q.epoch)
        for j, value in enumerate(_deltas(p, q)):
            hour.engine_counts[j] += value
        hour.covered_from = p.at if hour.covered_from is None else min(hour.covered_from, p.at)
        hour.covered_to = q.at if hour.covered_to is None else max(hour.covered_to, q.at)
        # an edge of this hour's covered stretch: a scrape next to a window of another hour
        # or across a restart
        same = _hour(q.at)
        if i == 0 or not verified[i - 1] or _hour(windows[i - 1][1].at) != same:
            hour.edges.append(p.at)
        if i + 1 == len(windows) or not verified[i + 1] or _hour(windows[i + 1][1].at) != same:
            hour.edges.append(q.at)
    for event in events:
        i = bisect.bisect_left(times, event.end)  # the first scrape at or after its end
        if i == 0:
            continue  # before the first scrape we read: an earlier hour's
        if i == len(times):
            # after the last scrape: a later one takes it, unless none will (hour closed)
            tail = _hour(event.end)
            if start <= tail < end and tail + HOUR + settle <= now:
                hours.setdefault(tail, _Hour()).add_unverified(event)
            continue
        w = i - 1
        if not counted[w]:
            continue
        hour = hours[_hour(windows[w][1].at)]
        if verified[w]:
            hour.add_metered(event)
        else:
            hour.add_unverified(event)
    for hour in hours.values():
        for edge in hour.edges:
            lo = bisect.bisect_left(events, edge - boundary, key=lambda e: e.end)
            hi = bisect.bisect_right(events, edge + boundary, key=lambda e: e.end)
            for event in events[lo:hi]:
                for j, value in enumerate(event.counts):
                    hour.slack[j] += value
    return hours


def _ratio(metered: int, engine: int) -> Decimal | None:
    return (Decimal(metered) / Decimal(engine)).quantize(SIX) if engine else None


def _row_values(hour: _Hour, *, tolerance: Decimal) -> dict[str, Any]:
    engine, metered, slack = hour.engine_counts, hour.metered, hour.slack
    off = [name for j, name in enumerate(COUNTERS)
           if abs(metered[j] - engine[j]) > slack[j] + tolerance * engine[j]]
    status = ReconcileStatus.DRIFT if off else ReconcileStatus.RECONCILED
    reason = ""
    if off:
        reason = "; ".join(f"{name}: metered {metered[j]}, engine {engine[j]}"
                           for j, name in enumerate(COUNTERS) if name in off)
    return {
        "status": status, "reason": reason,
        "engine_requests": engine[0], "engine_prompt_tokens": engine[1],
        "engine_cached_tokens": engine[2], "engine_generation_tokens": engine[3],
        "capture_rate": _ratio(metered[0], engine[0]),
        "token_capture_rate": _ratio(metered[1] + metered[3], engine[1] + engine[3]),
        "slack_requests": slack[0], "slack_tokens": slack[1] + slack[3],
        "epochs": len(hour.epochs), "covered_from": hour.covered_from,
        "covered_to": hour.covered_to,
    }


def _not_reconcilable(reason: str) -> dict[str, Any]:
    return {"status": ReconcileStatus.NOT_RECONCILABLE, "reason": reason,
            "engine_requests": None, "engine_prompt_tokens": None, "engine_cached_tokens": None,
            "engine_generation_tokens": None, "capture_rate": None, "token_capture_rate": None,
            "slack_requests": 0, "slack_tokens": 0, "epochs": 0, "covered_from": None,
            "covered_to": None}


def usage_engine_hours_reconcile(*, start: datetime | None = None, end: datetime | None = None,
                                 now: datetime | None = None) -> ReconcileRun:
    """Reconcile every engine's hours in ``[start, end)`` (rounded to hours) and write the
    ledger; see the module. Defaults: the last ``TOLLGATE_RECONCILE_LOOKBACK_S``, up to the
    current hour (partly, up to its last scrape: it is not closed yet)."""
    now = now or timezone.now()
    start = _hour(start or now - timedelta(seconds=conf.reconcile_lookback_s()))
    end = end or now
    end = end if _hour(end) == end else _hour(end) + HOUR
    boundary = timedelta(seconds=conf.reconcile_boundary_s())
    tolerance = conf.reconcile_tolerance()
    settle = timedelta(seconds=conf.reconcile_settle_s())
    bases = engine_cost_basis()
    # and the scrapes of the hour after: the last window of the range ends at one of them
    samples = engine_counter_samples(start=start, end=end + HOUR)
    # events up to the first scrape after the range end belong to its last hour
    events = _events(start - HOUR, end + HOUR)
    rows: dict[tuple[str, datetime], dict[str, Any]] = {}
    for engine in sorted(set(events) | set(samples)):
        mine = events.get(engine, [])
        if engine in samples:
            hours = _engine_hours(samples[engine], mine, start=start, end=end, now=now,
                                  boundary=boundary)
            for when, hour in hours.items():
                if not hour.verified_windows:
                    values = _not_reconcilable(
                        "no two scrapes of one process life of the engine cover this hour")
                else:
                    values = _row_values(hour, tolerance=tolerance)
                has_traffic = (hour.metered[0] or hour.engine_counts[0]
                               or hour.unverified_requests)
                if has_traffic:
                    rows[(engine, when)] = {**values, **_metered(hour), "closed":
                                            when + HOUR + settle <= now}
            continue
        reason = ("the engine is not in the fleet: its operator reports no counters"
                  if engine not in bases else "no scrape of the engine's usage counters (its "
                  "/metrics declares none, or could not be read)")
        by_hour: dict[datetime, _Hour] = {}
        for event in mine:
            when = _hour(event.end)
            if start <= when < end:
                by_hour.setdefault(when, _Hour()).add_metered(event)
        for when, hour in by_hour.items():
            rows[(engine, when)] = {**_not_reconcilable(reason), **_metered(hour),
                                    "closed": when + HOUR + settle <= now}
    with transaction.atomic():
        with connection.cursor() as cur:
            cur.execute("SELECT pg_advisory_xact_lock(%s)", [LOCK])
        return _write(rows, bases, now)


def _metered(hour: _Hour) -> dict[str, Any]:
    return {"metered_requests": hour.metered[0], "metered_prompt_tokens": hour.metered[1],
            "metered_cached_tokens": hour.metered[2],
            "metered_completion_tokens": hour.metered[3], "metered_batch_requests": hour.batch,
            "unverified_requests": hour.unverified_requests,
            "unverified_tokens": hour.unverified_tokens}


def _write(rows: dict[tuple[str, datetime], dict[str, Any]], bases: dict[str, Any],
           now: datetime) -> ReconcileRun:
    run = ReconcileRun()
    existing = {(r.engine, r.hour): r for r in UsageEngineHour.objects.select_for_update()
                .filter(engine__in={e for e, _ in rows}, hour__in={h for _, h in rows})}
    for (engine, hour), values in sorted(rows.items()):
        basis = bases.get(engine)
        row = existing.get((engine, hour)) or UsageEngineHour(engine=engine, hour=hour)
        for name, value in values.items():
            setattr(row, name, value)
        row.pool = basis.pool if basis else ""
        row.computed_at = now
        drift = row.status == ReconcileStatus.DRIFT
        if drift:
            run.drift.append((engine, hour))
        label = f"{engine} {hour:%Y-%m-%dT%H}:00Z"
        if drift and row.closed and row.alerted_at is None:
            audit_record(acting_user=None, organization=None, action="usage.engine_drift",
                         target=label, after=_audit_after(row))
            row.alerted_at = now
            run.alerted.append((engine, hour))
        elif not drift and row.alerted_at is not None:
            audit_record(acting_user=None, organization=None,
                         action="usage.engine_drift_resolved", target=label,
                         after=_audit_after(row))
            row.alerted_at = None
        row.save()
        run.rows += 1
    return run


def _audit_after(row: UsageEngineHour) -> dict[str, Any]:
    return {"engine": row.engine, "hour": row.hour.isoformat(), "status": row.status,
            "reason": row.reason,
            "capture_rate": None if row.capture_rate is None else str(row.capture_rate),
            "engine_requests": row.engine_requests, "metered_requests": row.metered_requests}
