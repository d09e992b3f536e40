"""Cost-to-serve: the GPU time a request used, priced at its pool's hourly GPU cost.

An engine serving C requests at once gives each of them 1/C of its GPUs while they run, so a
request busy for T seconds at mean concurrency C used ``T / C x gpus`` GPU-seconds. Priced at the
pool's ``gpu_hourly_cost``, that makes margin per customer, model and plan a report.
"""

from __future__ import annotations

from decimal import Decimal

from engine_adapter.types import EngineInfo

PLACES = Decimal("0.0000000001")


def attribute_cost(*, engine: EngineInfo, busy_seconds: Decimal,
                   concurrency: Decimal) -> tuple[Decimal, Decimal]:
    """Return ``(gpu_seconds, cost)`` for one request, both to 10 decimal places."""
    share = max(concurrency, Decimal(1))
    gpu_seconds = (busy_seconds / share * engine.gpus).quantize(PLACES)
    cost = (gpu_seconds * engine.gpu_hourly_cost / Decimal(3600)).quantize(PLACES)
    return gpu_seconds, cost
