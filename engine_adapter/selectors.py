"""Reads of the fleet: the engines the router may use, and which regions form each data zone."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from engine_adapter.choices import EngineStatus
from engine_adapter.models import EngineInstance, Pool
from engine_adapter.types import EngineInfo, EngineLoad


@dataclass(frozen=True)
class FleetSnapshot:
    engines: list[EngineInfo]
    healthy: set[str]
    loads: dict[str, EngineLoad]


def fleet_snapshot() -> FleetSnapshot:
    """Return every non-stopped engine, which are healthy, and their last scraped load."""
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
        raw = inst.load or {}
        loads[inst.engine_id] = EngineLoad(
            running=int(raw.get("running", 0)), queued=int(raw.get("queued", 0)),
            token_usage=float(raw.get("token_usage", 0.0)),
            max_running=int(raw["max_running"]) if raw.get("max_running") else None,
        )
    return FleetSnapshot(engines, healthy, loads)


def zone_regions() -> dict[str, set[str]]:
    """Return each data zone's regions, from the pools in the spec."""
    zones: dict[str, set[str]] = {}
    for zone, region in Pool.objects.filter(in_spec=True).values_list("zone", "region"):
        zones.setdefault(zone, set()).add(region)
    return zones


def served_models() -> dict[str, set[str]]:
    """Return each served model's regions."""
    models: dict[str, set[str]] = {}
    for model, region in Pool.objects.filter(in_spec=True).values_list("model", "region"):
        models.setdefault(model, set()).add(region)
    return models


# -- spare capacity: the signal batch runs on ----------------------------------------------

def low_priority_share(loads: Iterable[EngineLoad | None], *, fraction: float, ours: int,
                       default_max_running: int = 64) -> int:
    """Return how many low-priority requests of one caller may be running at once now.

    Low-priority work (batch) may fill ``fraction`` of each engine's running slots, less
    what interactive traffic uses there; ``ours`` is how many of the caller's requests are
    running now (the engines count them with the rest). An engine with anything in its
    queue, or whose load is unknown (None: it did not answer), offers nothing: there is no
    trough to fill.
    """
    budget = running = 0
    for load in loads:
        if load is None or load.queued > 0:
            continue
        budget += max(1, int((load.max_running or default_max_running) * fraction))
        running += load.running
    return max(0, budget - max(0, running - ours))
