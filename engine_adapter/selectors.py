"""Reads of the fleet: the engines the router may use, and which regions form each data zone."""

from __future__ import annotations

from dataclasses import dataclass

from engine_adapter.choices import EngineStatus
from engine_adapter.models import EngineInstance, Pool
from engine_adapter.types import EngineInfo, EngineLoad


@dataclass(frozen=True)
class FleetSnapshot:
    engines: list[EngineInfo]
    healthy: set[str]
    loads: dict[str, EngineLoad]
    offered: dict[str, set[str]]  # model -> regions of its pools in the spec, engines or not


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
    return FleetSnapshot(engines, healthy, loads, served_models())


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
