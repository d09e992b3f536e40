"""Reads of the fleet: the engines the router may use, and which regions form each data zone."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import httpx

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


# -- spare capacity: the signal batch (and flex admission) run on ----------------------------

_max_running_cache: dict[str, int] = {}


def _candidates(model: str, regions: set[str] | None) -> tuple[list[EngineInfo], FleetSnapshot]:
    snap = fleet_snapshot()
    engines = [e for e in snap.engines if e.model == model and e.engine_id in snap.healthy
               and (regions is None or e.region in regions)]
    return engines, snap


@functools.cache
def _scraper() -> httpx.Client:
    """The process's client for live scrapes: kept-alive connections, one TLS context.

    A client per scrape built a TLS context (loading the CA bundle) and opened new connections
    every time: over half of a batch worker's CPU, taken from the machine it shares with
    interactive traffic. httpx clients are safe to share between threads.
    """
    return httpx.Client()


def _probe(engines: list[EngineInfo], timeout: float) -> dict[str, EngineLoad | None]:
    """Scrape each engine's /metrics now (and /get_server_info once, for its running cap)."""
    from engine_adapter.metrics import parse_engine_load

    http = _scraper()
    loads: dict[str, EngineLoad | None] = {}
    for engine in engines:
        try:
            raw = parse_engine_load(http.get(f"{engine.url}/metrics", timeout=timeout).text)
            cap = int(raw.get("max_running") or 0) or _max_running_cache.get(engine.url)
            if not cap:
                info = http.get(f"{engine.url}/get_server_info", timeout=timeout).json()
                cap = int(info.get("max_running_requests") or 0) or None
                if cap:
                    _max_running_cache[engine.url] = cap
        except (httpx.HTTPError, ValueError):
            loads[engine.engine_id] = None  # unreachable: no spare capacity there
            continue
        loads[engine.engine_id] = EngineLoad(
            running=int(raw.get("running", 0)), queued=int(raw.get("queued", 0)),
            token_usage=float(raw.get("token_usage", 0.0)), max_running=cap)
    return loads


def spare_slots(*, model: str, regions: set[str] | None = None, fraction: float = 0.5,
                live: bool = False, default_max_running: int = 64,
                timeout: float = 1.0, engines: list[EngineInfo] | None = None) -> int:
    """Return how many more low-priority requests the model's engines can take right now.

    An engine has spare room only while nothing waits in its queue and fewer than
    ``fraction`` of its running slots are busy; the room is what is left below that line.
    ``live`` scrapes the engines now instead of using the health loop's last scrape, for
    callers (batch workers) that act on the answer many times a second; such a caller may
    pass the healthy ``engines`` from its own fleet view, saving a registry read per call.
    """
    if live and engines is not None:
        loads = _probe(engines, timeout)
    else:
        engines, snap = _candidates(model, regions)
        loads = (_probe(engines, timeout) if live
                 else {e.engine_id: snap.loads.get(e.engine_id) for e in engines})
    slots = 0
    for engine in engines:
        load = loads.get(engine.engine_id)
        if load is not None:
            slots += load.spare_room(fraction=fraction, default_max_running=default_max_running)
    return slots


def spare_capacity(*, model: str, regions: set[str] | None = None, fraction: float = 0.5,
                   live: bool = False) -> bool:
    """Return True while the model's pool (in ``regions``) has room for low-priority work."""
    return spare_slots(model=model, regions=regions, fraction=fraction, live=live) > 0
