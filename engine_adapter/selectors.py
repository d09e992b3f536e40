"""Reads of the fleet: the engines the router may use, which regions form each data zone, and
for cost-to-serve and reconciliation (``metering.costs``, ``metering.reconciliation``) each
engine's GPUs and their price and the engine's own counters as scraped."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

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


def fleet_snapshot() -> FleetSnapshot:
    """Return every non-stopped engine, which are healthy, their last scraped load, and where
    each model is offered (a pool whose engines are all stopped still offers its model)."""
    engines, healthy, loads = [], set(), {}
    instances = (EngineInstance.objects.select_related("pool")
                 .exclude(status=EngineStatus.STOPPED).filter(pool__in_spec=True))
    for inst in instances:
        pool = inst.pool
        engines.append(EngineInfo(
            engine_id=inst.engine_id, pool=pool.name, model=pool.model, region=pool.region,
            url=inst.url, gpu_hourly_cost=pool.gpu_hourly_cost, gpus=pool.gpus_per_replica,
            max_total_tokens=pool.max_total_tokens,
        ))
        if inst.status == EngineStatus.HEALTHY:
            healthy.add(inst.engine_id)
        loads[inst.engine_id] = EngineLoad.from_metrics(inst.load or {})
    return FleetSnapshot(engines, healthy, loads, served_models(), model_traits())


def zone_regions(*, in_spec_only: bool = True) -> dict[str, set[str]]:
    """Return each data zone's regions, from the pools in the spec (or every pool ever known,
    where past usage is judged: a pool that left the spec still served its zone)."""
    pools = Pool.objects.filter(in_spec=True) if in_spec_only else Pool.objects.all()
    zones: dict[str, set[str]] = {}
    for zone, region in pools.values_list("zone", "region"):
        zones.setdefault(zone, set()).add(region)
    return zones


def served_models() -> dict[str, set[str]]:
    """Return each served model's regions."""
    models: dict[str, set[str]] = {}
    for model, region in Pool.objects.filter(in_spec=True).values_list("model", "region"):
        models.setdefault(model, set()).add(region)
    return models


def model_traits() -> dict[str, ModelTraits]:
    """Return what each served model is, from its pools in the spec: an embedding model when
    its pools launch with ``--is-embedding`` (the spec keeps a model's pools alike), and the
    smallest vocabulary its pools declare (None when one declares none)."""
    rows: dict[str, list[tuple[bool, int | None]]] = {}
    for model, extra_args, vocab in Pool.objects.filter(in_spec=True).values_list(
            "model", "extra_args", "vocab_size"):
        rows.setdefault(model, []).append(("--is-embedding" in (extra_args or ()), vocab))
    traits = {}
    for model, pools in rows.items():
        vocabs = [vocab for _, vocab in pools]
        traits[model] = ModelTraits(
            embedding=any(embedding for embedding, _ in pools),
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
