"""Reads of the fleet: the engines the router may use, which regions form each data zone, and
for cost-to-serve and reconciliation (``metering.costs``, ``metering.reconciliation``) each
engine's GPUs and their price and the engine's own counters as scraped."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any, NamedTuple

from django.db import connection

from engine_adapter.choices import EngineStatus
from engine_adapter.models import EngineCounterSample, EngineInstance, Pool
from engine_adapter.types import (
    COUNTER_FIELDS,
    EngineCounters,
    EngineInfo,
    EngineLoad,
    ModelTraits,
)


@dataclass(frozen=True)
class FleetSnapshot:
    engines: list[EngineInfo]
    healthy: set[str]
    loads: dict[str, EngineLoad]
    offered: dict[str, set[str]]  # model -> regions of its pools in the spec, engines or not
    traits: dict[str, ModelTraits]  # model -> what it is (embedding, vocabulary)
    zones: dict[str, set[str]]  # data zone -> regions of its pools in the spec


class _PoolRow(NamedTuple):
    """What the fleet view reads of a pool (``values_list`` of these fields, in this order)."""

    id: int
    name: str
    model: str
    region: str
    zone: str
    gpu_hourly_cost: Decimal
    gpus_per_replica: int
    max_total_tokens: int | None
    extra_args: list[str]
    vocab_size: int | None


def fleet_snapshot() -> FleetSnapshot:
    """Return every non-stopped engine, which are healthy, their last scraped load, where each
    model is offered (a pool whose engines are all stopped still offers its model) and each
    data zone's regions.

    Every gateway process reads this about once a second (``registry.Fleet``) in a thread,
    and a request on the event loop that meets the read waits about as long as the read's CPU
    (bench/gateway.py's concurrency-1 requests that overlapped one: ~1 ms later). So the two
    queries are the ORM's SQL, compiled once (``_fleet_sql``), run on a plain cursor and read
    as rows: ~0.20 ms of CPU a read here, where four ORM queries building model instances took
    ~1.5 ms and two ORM queries of rows ~0.9 ms."""
    pools_sql, engines_sql = _fleet_sql()
    pools = [_PoolRow._make(row)._replace(extra_args=_json(row[8]))
             for row in _rows(pools_sql)]
    by_id = {pool.id: pool for pool in pools}
    engines, healthy, loads = [], set(), {}
    for pool_id, engine_id, url, status, load in _rows(engines_sql):
        pool = by_id.get(pool_id)
        if pool is None:  # its pool left the spec between the two reads
            continue
        engines.append(EngineInfo(
            engine_id=engine_id, pool=pool.name, model=pool.model, region=pool.region, url=url,
            gpu_hourly_cost=pool.gpu_hourly_cost, gpus=pool.gpus_per_replica,
            max_total_tokens=pool.max_total_tokens))
        if status == EngineStatus.HEALTHY:
            healthy.add(engine_id)
        loads[engine_id] = EngineLoad.from_metrics(_json(load) or {})
    return FleetSnapshot(engines, healthy, loads, _offered(pools), _traits(pools),
                         _zones((pool.zone, pool.region) for pool in pools))


@functools.cache
def _fleet_sql() -> tuple[tuple[str, tuple[Any, ...]], tuple[str, tuple[Any, ...]]]:
    """The fleet view's two queries as SQL with parameters, compiled by the ORM once."""
    pools = Pool.objects.filter(in_spec=True).values_list(*_PoolRow._fields)
    engines = (EngineInstance.objects.exclude(status=EngineStatus.STOPPED)
               .filter(pool__in_spec=True).order_by("pool_id", "replica", "id")
               .values_list("pool_id", "engine_id", "url", "status", "load"))
    return pools.query.sql_with_params(), engines.query.sql_with_params()


def _rows(sql: tuple[str, tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    with connection.cursor() as cursor:
        cursor.execute(*sql)
        return cursor.fetchall()


def _json(value: Any) -> Any:
    """A JSON column as read by a plain cursor: text (Django's psycopg setup leaves decoding
    to the field), or already decoded by another driver setup."""
    return json.loads(value) if isinstance(value, str) else value


def zone_regions(*, in_spec_only: bool = True) -> dict[str, set[str]]:
    """Return each data zone's regions, from the pools in the spec (or every pool ever known,
    where past usage is judged: a pool that left the spec still served its zone)."""
    pools = Pool.objects.filter(in_spec=True) if in_spec_only else Pool.objects.all()
    return _zones(pools.values_list("zone", "region"))


def _zones(pairs: Iterable[tuple[str, str]]) -> dict[str, set[str]]:
    """Return each zone's regions from (zone, region) pairs."""
    zones: dict[str, set[str]] = {}
    for zone, region in pairs:
        zones.setdefault(zone, set()).add(region)
    return zones


def _offered(pools: Iterable[_PoolRow]) -> dict[str, set[str]]:
    """Return each served model's regions."""
    models: dict[str, set[str]] = {}
    for pool in pools:
        models.setdefault(pool.model, set()).add(pool.region)
    return models


def _traits(pools: Iterable[_PoolRow]) -> dict[str, ModelTraits]:
    """Return what each served model is, from its pools in the spec: an embedding model when
    its pools launch with ``--is-embedding`` (the spec keeps a model's pools alike), and the
    smallest vocabulary its pools declare (None when one declares none)."""
    found: dict[str, list[tuple[bool, int | None]]] = {}
    for pool in pools:
        found.setdefault(pool.model, []).append(
            ("--is-embedding" in (pool.extra_args or ()), pool.vocab_size))
    traits = {}
    for model, rows in found.items():
        vocabs = [vocab for _, vocab in rows]
        traits[model] = ModelTraits(
            embedding=any(embedding for embedding, _ in rows),
            vocab_size=None if None in vocabs else min(v for v in vocabs if v is not None))
    return traits


@dataclass(frozen=True)
class EngineCostBasis:
    """What one engine's time costs: its pool's GPUs per replica and their hourly price (USD
    per GPU-hour), and how it was launched (``external`` ones run elsewhere)."""

    engine_id: str
    pool: str
    gpus: int
    gpu_hourly_cost: Decimal
    launch: str


def engine_cost_basis() -> dict[str, EngineCostBasis]:
    """Return every engine the fleet has known (stopped and out-of-spec ones too: their past
    usage is still priced), by engine id."""
    return {
        inst.engine_id: EngineCostBasis(
            engine_id=inst.engine_id, pool=inst.pool.name, gpus=inst.pool.gpus_per_replica,
            gpu_hourly_cost=inst.pool.gpu_hourly_cost, launch=inst.pool.launch)
        for inst in EngineInstance.objects.select_related("pool")
    }


@dataclass(frozen=True)
class CounterSample:
    """One scrape of an engine's counters: when, in which process life (epoch), the values."""

    engine_id: str
    at: datetime
    epoch: int
    counters: EngineCounters


def sample_counters(sample: EngineCounterSample) -> EngineCounters:
    """Return a stored sample's counters."""
    return EngineCounters(**{name: getattr(sample, name) for name in COUNTER_FIELDS})


_SAMPLE_COLUMNS = ("engine_id", "at", "epoch", *COUNTER_FIELDS)


def engine_counter_samples(*, start: datetime, end: datetime,
                           engine_ids: Iterable[str] | None = None
                           ) -> dict[str, list[CounterSample]]:
    """Return each engine's samples taken in ``(start, end]``, oldest first, each list led by
    the engine's last sample at or before ``start`` (the base of the first delta) if any."""
    since = EngineCounterSample.objects.filter(at__gt=start, at__lte=end)
    before = (EngineCounterSample.objects.filter(at__lte=start)
              .order_by("engine_id", "-at", "-id").distinct("engine_id"))
    if engine_ids is not None:
        ids = list(engine_ids)
        since, before = since.filter(engine_id__in=ids), before.filter(engine_id__in=ids)
    out: dict[str, list[CounterSample]] = {}
    rows = [*before.values_list(*_SAMPLE_COLUMNS),
            *since.order_by("at", "id").values_list(*_SAMPLE_COLUMNS)]
    for engine_id, at, epoch, *values in rows:
        counters = EngineCounters(**dict(zip(COUNTER_FIELDS, values, strict=True)))
        out.setdefault(engine_id, []).append(CounterSample(engine_id, at, epoch, counters))
    return out
