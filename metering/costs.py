"""Cost-to-serve from the engines' GPU time: every engine-interval split exactly between the
requests it served and idle capacity, stored per interval and per event, and added to the
hourly rollups.

``engine_adapter.cost`` does the arithmetic (work weighted by the engine's own measured
prefill and decode throughput, GPU-microseconds split by largest remainder); this module feeds
it each engine's usage events of an interval and the engine's scraped counters
(``engine_adapter.selectors``), and stores the result:

- ``UsageCostInterval``: per engine and interval, capacity = attributed + idle (GPU-µs and
  USD), both exact and held by CHECK constraints;
- ``UsageCostShare``: per event and interval, its GPU-µs and cost; an event's GPU-seconds and
  cost-to-serve are the sums of its shares (``metering.selectors.usage_event_costs``);
- ``usage_rollup_hourly.gpu_seconds`` and ``cost_to_serve``: the shares' sums, added to the
  rollup row of each event (its hour and dimensions).

Why a table keyed by event rather than a late UPDATE of ``usage_event``: the event is the
append-only record of what was served and billed, written once at ingest. An attribution is
worked out after the fact from other rows (the event's neighbours on the engine, the engine's
counters) and changes when a late event lands in an interval already split; an UPDATE would
rewrite rows of the largest table (partitioned, COPY-fed, vacuumed by the month) while ingest
writes it. A share row per (interval, event) is recomputed with its interval as a whole and
the rollups get the difference.

Runs from ``metering.cost_attribute`` (beat). A run covers the intervals that ended between
``TOLLGATE_COST_LOOKBACK_S`` and ``TOLLGATE_COST_SETTLE_S`` ago, of every engine that was up
in them (scraped, or serving): an interval not attributed yet, or whose set of events changed
since (its fingerprint), is attributed in one transaction under an advisory lock; the others
are left as they are. Running it twice, or two at once, changes nothing the second time.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any, TypeAlias

from django.db import OperationalError, connection, transaction
from django.utils import timezone

from engine_adapter.cost import US, IntervalSplit, Throughput, Work, measured_rates, split_interval
from engine_adapter.selectors import (
    CounterSample,
    EngineCostBasis,
    engine_cost_basis,
    engine_counter_samples,
)
from engine_adapter.types import EngineCounters
from metering import conf
from metering.choices import ThroughputSource
from metering.models import UsageCostInterval, UsageCostShare

log = logging.getLogger(__name__)

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
LOCK = int.from_bytes(hashlib.blake2b(b"metering.costs", digest_size=8).digest(), "big",
                      signed=True)
RETRY_SQLSTATES = frozenset({"40001", "40P01"})  # serialization failure, deadlock
_ZERO = EngineCounters(requests=0, prompt_tokens=0, cached_tokens=0, generation_tokens=0)
# (org, project, key, model, region, tier, capacity, currency, "YYYY-MM-DDTHH"): the rollup
# row of an event, in the shape and order metering.recording upserts rollups
RollupKey: TypeAlias = tuple[Any, ...]

EVENTS = """
SELECT id, engine, event_time, coalesce(queue_ms, 0), coalesce(total_ms, 0), prompt_tokens,
       cached_tokens, completion_tokens, organization_id, project_id, api_key_id, model, region,
       service_tier, capacity_source, currency
FROM usage_event
WHERE event_time >= %s AND event_time < %s AND engine = ANY(%s)
"""
ROLLUP_ROWS = """
SELECT id, organization_id, project_id, api_key_id, model, region, service_tier,
       capacity_source, currency, hour
FROM usage_rollup_hourly
WHERE (organization_id, hour) IN (SELECT * FROM unnest(%s::bigint[], %s::timestamptz[]))
"""
LOCK_ROLLUPS = """
SELECT id FROM usage_rollup_hourly WHERE id = ANY(%s::bigint[])
ORDER BY array_position(%s::bigint[], id) FOR UPDATE
"""
ADD_TO_ROLLUPS = """
UPDATE usage_rollup_hourly r
SET gpu_seconds = r.gpu_seconds + d.gpu_seconds, cost_to_serve = r.cost_to_serve + d.cost
FROM unnest(%s::bigint[], %s::numeric[], %s::numeric[]) AS d(id, gpu_seconds, cost)
WHERE r.id = d.id
"""


def to_us(when: datetime) -> int:
    """Return microseconds since the Unix epoch, exactly."""
    return (when - EPOCH) // timedelta(microseconds=1)


def from_us(us: int) -> datetime:
    """Return the aware UTC datetime of microseconds since the Unix epoch."""
    return EPOCH + timedelta(microseconds=us)


def gpu_seconds(gpu_us: int) -> Decimal:
    """Return GPU-microseconds as GPU-seconds, exactly (6 places)."""
    return Decimal(gpu_us).scaleb(-6)


@dataclass(frozen=True)
class _Event:
    id: int
    engine: str
    event_time: datetime
    organization_id: int
    work: Work
    rollup: RollupKey


@dataclass
class CostRun:
    """What one attribution run did."""

    attributed: int = 0  # engine-intervals written (new, or again because their events changed)
    unchanged: int = 0
    shares: int = 0
    intervals: list[tuple[str, datetime]] = field(default_factory=list)


def _events(start: datetime, end: datetime, engines: Sequence[str]) -> list[_Event]:
    """Return the events of ``engines`` that were active in ``[start, end)``."""
    earliest = start - timedelta(seconds=conf.cost_max_request_s())
    with connection.cursor() as cur:
        cur.execute(EVENTS, (earliest, end, list(engines)))
        rows = cur.fetchall()
    out, start_us = [], to_us(start)
    for (event_id, engine, when, queue_ms, total_ms, prompt, cached, completion, org, project,
         key, model, region, tier, capacity, currency) in rows:
        t = to_us(when)
        # the engine's queue time is waiting, not work: the request is active after it
        work = Work(key=event_id, start_us=t + min(queue_ms, total_ms) * 1000,
                    end_us=t + total_ms * 1000, uncached_tokens=prompt - cached,
                    decode_tokens=completion)
        if work.end_us < start_us:
            continue
        hour = when.astimezone(UTC).strftime("%Y-%m-%dT%H")
        out.append(_Event(event_id, engine, when, org, work,
                          (org, project, key, model, region, tier, capacity, currency, hour)))
    return out


def _rates(samples: Sequence[CounterSample], a: datetime, b: datetime
           ) -> tuple[Throughput, str]:
    """Return the engine's measured throughput around ``[a, b)``, and where it came from.

    Measured over the scrapes within the throughput window around the interval (deltas
    within each process life); a rate nothing was measured for there comes from the counters
    of the engine's last process life up to then (from its start), then from the defaults.
    """
    window = timedelta(seconds=conf.cost_throughput_window_s())
    lo, hi = a - window, b + window
    lives: dict[int, list[CounterSample]] = {}
    for sample in samples:
        if lo <= sample.at <= hi:
            lives.setdefault(sample.epoch, []).append(sample)
    prefill, decode = measured_rates((s[0].counters, s[-1].counters) for s in lives.values())
    if prefill is None or decode is None:
        latest = [s for s in samples if s.at <= hi]
        if latest:
            since_start = measured_rates([(_ZERO, latest[-1].counters)])
            prefill = prefill or since_start[0]
            decode = decode or since_start[1]
    source = ThroughputSource.MEASURED
    if prefill is None or decode is None:
        default_prefill, default_decode = conf.cost_default_rates()
        prefill, decode = prefill or default_prefill, decode or default_decode
        source = ThroughputSource.DEFAULT
    return Throughput(prefill, decode), source


def _up_intervals(samples: Sequence[CounterSample], first: int, last: int, step: int
                  ) -> set[int]:
    """Return the interval numbers in ``[first, last)`` during which the engine was up: a
    scrape fell in them, or two scrapes of one process life bracket them."""
    up: set[int] = set()
    previous: CounterSample | None = None
    for sample in samples:
        at = to_us(sample.at)
        if first <= at // step < last:
            up.add(at // step)
        if previous is not None and previous.epoch == sample.epoch:
            lo = max(first, -(-to_us(previous.at) // step))
            hi = min(last, at // step)
            up.update(range(lo, hi))
        previous = sample
    return up


def _fingerprint(basis: EngineCostBasis, seconds: int, event_ids: Iterable[int]) -> str:
    text = f"{seconds}|{basis.gpus}|{basis.gpu_hourly_cost}|" + ",".join(
        map(str, sorted(event_ids)))
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class _Planned:
    engine: str
    start: datetime
    basis: EngineCostBasis
    events: list[_Event]
    fingerprint: str


def usage_costs_attribute(*, start: datetime | None = None, end: datetime | None = None,
                          now: datetime | None = None) -> CostRun:
    """Attribute every engine's GPU time over the intervals of ``[start, end)``; see the module.

    Defaults: the intervals that ended between ``TOLLGATE_COST_LOOKBACK_S`` and
    ``TOLLGATE_COST_SETTLE_S`` ago. Both ends are rounded down to the interval grid.
    """
    seconds = conf.cost_interval_s()
    step = seconds * US
    now = now or timezone.now()
    if end is None:
        end = now - timedelta(seconds=conf.cost_settle_s())
    if start is None:
        start = now - timedelta(seconds=conf.cost_lookback_s())
    first, last = to_us(start) // step, to_us(end) // step
    run = CostRun()
    if last <= first:
        return run
    start, end = from_us(first * step), from_us(last * step)
    bases = engine_cost_basis()
    events = _events(start, end, sorted(bases))
    window = timedelta(seconds=conf.cost_throughput_window_s())
    samples = engine_counter_samples(start=start - window, end=end + window,
                                     engine_ids=sorted(bases))
    planned: list[_Planned] = []
    by_engine: dict[str, dict[int, list[_Event]]] = {}
    for event in events:
        w = event.work
        lo = w.start_us // step
        hi = (w.end_us - 1) // step if w.end_us > w.start_us else lo
        slots = by_engine.setdefault(event.engine, {})
        for k in range(max(lo, first), min(hi, last - 1) + 1):
            slots.setdefault(k, []).append(event)
    for engine, basis in sorted(bases.items()):
        if basis.gpus < 1:
            continue
        slots = by_engine.get(engine, {})
        up = _up_intervals(samples.get(engine, []), first, last, step) | set(slots)
        for k in sorted(up):
            in_k = slots.get(k, [])
            planned.append(_Planned(engine, from_us(k * step), basis, in_k,
                                    _fingerprint(basis, seconds, (e.id for e in in_k))))
    for attempt in range(1, 4):
        try:
            with transaction.atomic():
                return _write(planned, samples, seconds, now)
        except OperationalError as exc:
            if getattr(exc.__cause__, "sqlstate", None) not in RETRY_SQLSTATES or attempt == 3:
                raise
            time.sleep(0.1 * attempt)
    raise AssertionError("unreachable")


def _write(planned: list[_Planned], samples: dict[str, list[CounterSample]], seconds: int,
           now: datetime) -> CostRun:
    """Write the intervals whose events changed, their shares and the rollups' difference."""
    run = CostRun()
    with connection.cursor() as cur:
        cur.execute("SELECT pg_advisory_xact_lock(%s)", [LOCK])
    existing = {
        (engine, start): (pk, fingerprint)
        for pk, engine, start, fingerprint in UsageCostInterval.objects.filter(
            engine__in={p.engine for p in planned},
            start__in={p.start for p in planned}).values_list("id", "engine", "start",
                                                              "fingerprint")
    }
    deltas: dict[RollupKey, list[Any]] = {}
    stale: list[int] = []
    rows: list[tuple[_Planned, IntervalSplit, Throughput, str]] = []
    for plan in planned:
        pk, fingerprint = existing.get((plan.engine, plan.start), (None, None))
        if fingerprint == plan.fingerprint:
            run.unchanged += 1
            continue
        if pk is not None:
            stale.append(pk)
        a = plan.start
        throughput, source = _rates(samples.get(plan.engine, []), a, a + timedelta(
            seconds=seconds))
        split = split_interval(
            start_us=to_us(a), end_us=to_us(a) + seconds * US, gpus=plan.basis.gpus,
            gpu_hourly_cost=plan.basis.gpu_hourly_cost, works=[e.work for e in plan.events],
            throughput=throughput)
        rows.append((plan, split, throughput, source))
    if stale:
        _take_back(stale, deltas)
    for plan, split, throughput, source in rows:
        _store(plan, split, throughput, source, seconds, now, existing, deltas, run)
    _add_to_rollups(deltas)
    return run


def _take_back(interval_ids: list[int], deltas: dict[RollupKey, list[Any]]) -> None:
    """Remove the shares of intervals about to be split again, and their rollup sums."""
    old = list(UsageCostShare.objects.filter(interval_id__in=interval_ids)
               .values_list("event_id", "gpu_us", "cost"))
    keys = _rollup_keys_of([event_id for event_id, _, _ in old])
    for event_id, gpu_us, cost in old:
        acc = deltas.setdefault(keys[event_id], [0, Decimal(0)])
        acc[0] -= gpu_us
        acc[1] -= cost
    UsageCostShare.objects.filter(interval_id__in=interval_ids).delete()


def _rollup_keys_of(event_ids: list[int]) -> dict[int, RollupKey]:
    if not event_ids:
        return {}
    with connection.cursor() as cur:
        cur.execute(
            "SELECT id, organization_id, project_id, api_key_id, model, region, service_tier, "
            "capacity_source, currency, to_char(event_time AT TIME ZONE 'UTC', "
            "'YYYY-MM-DD\"T\"HH24') FROM usage_event WHERE id = ANY(%s)", [event_ids])
        return {row[0]: tuple(row[1:]) for row in cur.fetchall()}


def _store(plan: _Planned, split: IntervalSplit, throughput: Throughput, source: str,
           seconds: int, now: datetime, existing: dict[tuple[str, datetime], Any],
           deltas: dict[RollupKey, list[Any]], run: CostRun) -> None:
    values = {
        "pool": plan.basis.pool, "seconds": seconds, "gpus": plan.basis.gpus,
        "gpu_hourly_cost": plan.basis.gpu_hourly_cost, "capacity_us": split.capacity_us,
        "attributed_us": split.attributed_us, "idle_us": split.idle_us,
        "capacity_cost": split.capacity_cost, "idle_cost": split.idle_cost,
        "attributed_cost": split.capacity_cost - split.idle_cost,
        "requests": sum(1 for us in split.shares.values() if us),
        "prefill_tokens_per_s": throughput.prefill_tokens_per_s.quantize(Decimal("0.000001")),
        "decode_tokens_per_s": throughput.decode_tokens_per_s.quantize(Decimal("0.000001")),
        "throughput_source": source, "fingerprint": plan.fingerprint, "computed_at": now,
    }
    pk = existing.get((plan.engine, plan.start), (None, None))[0]
    if pk is None:
        pk = UsageCostInterval.objects.create(engine=plan.engine, start=plan.start, **values).pk
    else:
        UsageCostInterval.objects.filter(pk=pk).update(**values)
    events = {e.id: e for e in plan.events}
    shares = []
    for event_id, gpu_us in split.shares.items():
        cost = split.share_costs[event_id]
        if not gpu_us and not cost:
            continue
        event = events[event_id]
        shares.append(UsageCostShare(interval_id=pk, event_id=event_id,
                                     event_time=event.event_time,
                                     organization_id=event.organization_id, gpu_us=gpu_us,
                                     cost=cost))
        acc = deltas.setdefault(event.rollup, [0, Decimal(0)])
        acc[0] += gpu_us
        acc[1] += cost
    UsageCostShare.objects.bulk_create(shares, batch_size=5000)
    run.attributed += 1
    run.shares += len(shares)
    run.intervals.append((plan.engine, plan.start))


def _sort_key(key: RollupKey) -> tuple[Any, ...]:
    return (key[0], key[1], key[2] or 0, *key[3:])  # metering.recording's order


def _add_to_rollups(deltas: dict[RollupKey, list[Any]]) -> None:
    """Add GPU-seconds and cost to the events' rollup rows, locking them in ingest's order."""
    deltas = {k: v for k, v in deltas.items() if v[0] or v[1]}
    if not deltas:
        return
    hours = sorted({(k[0], f"{k[8]}:00:00+00:00") for k in deltas})
    with connection.cursor() as cur:
        cur.execute(ROLLUP_ROWS, ([o for o, _ in hours], [h for _, h in hours]))
        ids = {(*row[1:9], row[9].astimezone(UTC).strftime("%Y-%m-%dT%H")): row[0]
               for row in cur.fetchall()}
        keys = sorted(deltas, key=_sort_key)
        missing = [k for k in keys if k not in ids]
        if missing:
            log.error("cost attribution: %d rollup rows missing (first: %r); their costs stay "
                      "on the shares only", len(missing), missing[0])
        ordered = [ids[k] for k in keys if k in ids]
        cur.execute(LOCK_ROLLUPS, (ordered, ordered))
        cur.execute(ADD_TO_ROLLUPS, (
            ordered, [gpu_seconds(deltas[k][0]) for k in keys if k in ids],
            [deltas[k][1] for k in keys if k in ids]))
