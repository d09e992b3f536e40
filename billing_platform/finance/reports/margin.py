"""The margin report: rated revenue against cost-to-serve, per group, pool and request.

Internal to the operator (finance workspace, ``/api/v1/finance/margin/``); no customer surface
reads it. Cost-to-serve is ``metering.costs``' attribution of the engines' GPU time (an
engine is busy whenever at least one request runs on it; its busy GPU time is split over
those requests, the rest is idle capacity) plus what external engines' operators reported.
Costs are in USD (``COST_CURRENCY``: the pools' GPU prices are); revenue is in the currency
it was rated in, and nothing is ever summed across currencies. A row's margin
(``revenue - cost_to_serve``) and margin ratio are given only where its revenue currency is
the cost currency; other rows show both amounts and leave the margin empty (no exchange rate
is applied). Amounts are exact (10 places, as rated and attributed), not rounded: one
request's cost is a small fraction of a cent.

- ``rows``: one per group of ``by`` (organization, model, plan kind, service tier or pool)
  and revenue currency; ``totals``: one per currency. Organization, model, plan kind and tier
  come from the hourly rollups; pool from the events and their cost shares (the rollups do not
  say which engine served), so a pool row's numbers are its engines' events'.
- ``pools``: each pool's GPU time over the intervals starting in the range: capacity,
  attributed (busy) and idle GPU-seconds and cost, measured utilization (attributed /
  capacity); tokens its engines served; its GPU-hour cost divided by tokens per GPU-hour at
  the measured utilization (cost per 1M tokens, the way the price tables are derived); the
  same at full utilization (busy cost per 1M: attributed cost per token); the list price per
  1M at the pool's own token mix (base prices of the cost currency's default book, in force at
  the range's end, no tier/zone/band multipliers); and the break-even utilization, where the
  cost per 1M meets that list price: ``busy cost per 1M / list price per 1M``, i.e. the
  attributed cost over the tokens' list value. That assumes the engine's throughput while
  busy stays what it was measured at; above 1 means the pool cannot break even at list price.
- ``requests``: the ``limit`` costliest requests of the scope (drill down with the filters).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from billing_platform.finance.reports.revenue import PLAN_KIND_OF_SOURCE
from billing_platform.finance.reports.rows import Row, org_labels
from engine_adapter.selectors import engine_cost_basis
from metering import selectors as metering
from plans.selectors import list_prices

COST_CURRENCY = "USD"
MARGIN_BY = ("organization", "model", "plan_kind", "service_tier", "pool")
_ROLLUP_DIM = {"organization": "organization_id", "model": "model",
               "plan_kind": "capacity_source", "service_tier": "service_tier"}
_ZERO = Decimal("0")
_MILLION = Decimal(1_000_000)
_HOUR = Decimal(3600)
_RATIO = Decimal("0.000001")
_PER_1M = Decimal("0.0000000001")
NO_POOL = ""  # events no known engine served (none reached, or an engine the fleet forgot)


@dataclass(frozen=True)
class MarginFilter:
    """Usage in [start, end) grouped ``by`` one of ``MARGIN_BY``; optional dimensions;
    ``limit``: how many of the costliest requests to list."""

    start: datetime
    end: datetime
    by: str = "organization"
    currency: str | None = None
    org_id: int | None = None
    model: str | None = None
    service_tier: str | None = None
    limit: int = 25


@dataclass(frozen=True)
class MarginRow(Row):
    """Revenue (``currency``) and cost-to-serve (USD) of one group; ``key`` is the group's
    value (an organization's public id, a model, a plan kind, a tier or a pool), ``label``
    what to show. ``margin``/``margin_ratio``: None where revenue is not in USD."""

    key: str
    label: str
    currency: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    gpu_seconds: Decimal
    revenue: Decimal
    cost_to_serve: Decimal
    margin: Decimal | None
    margin_ratio: Decimal | None


@dataclass(frozen=True)
class PoolEconomicsRow(Row):
    """One pool's capacity, idle cost, cost per 1M tokens and break-even utilization (all
    costs USD; None where there is nothing to divide by or no USD list price)."""

    pool: str
    models: str
    engines: int
    capacity_gpu_seconds: Decimal
    attributed_gpu_seconds: Decimal
    idle_gpu_seconds: Decimal
    utilization: Decimal | None
    capacity_cost: Decimal
    attributed_cost: Decimal
    idle_cost: Decimal
    gpu_hour_cost: Decimal | None
    tokens: int
    tokens_per_gpu_hour: Decimal | None
    cost_per_1m_tokens: Decimal | None
    busy_cost_per_1m_tokens: Decimal | None
    list_price_per_1m_tokens: Decimal | None
    break_even_utilization: Decimal | None


@dataclass(frozen=True)
class RequestMarginRow(Row):
    """One request's revenue (``currency``), cost-to-serve (USD), GPU-seconds and margin."""

    request_id: str
    organization: str
    event_time: datetime
    model: str
    pool: str
    service_tier: str
    plan_kind: str
    currency: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    gpu_seconds: Decimal
    revenue: Decimal
    cost_to_serve: Decimal
    margin: Decimal | None


@dataclass(frozen=True)
class MarginReport:
    rows: list[MarginRow]
    totals: list[MarginRow]
    pools: list[PoolEconomicsRow]
    requests: list[RequestMarginRow]


def _z(value: Decimal) -> Decimal:
    """Return ``value``, a zero as plain 0 (a sum of zeros at 10 places prints as 0E-10)."""
    return value if value else _ZERO


def _margin(revenue: Decimal, cost: Decimal, currency: str) -> Decimal | None:
    return _z(revenue - cost) if currency == COST_CURRENCY else None


def _ratio(part: Decimal | None, whole: Decimal) -> Decimal | None:
    return None if part is None or not whole else (part / whole).quantize(_RATIO)


class _Sums:
    """Sums of one group while the rows are merged (several dimension values map to one)."""

    def __init__(self) -> None:
        self.values: list[Decimal] = [_ZERO] * 7  # counts too (exact either way)

    def add(self, s: metering.MarginSums) -> None:
        parts: tuple[int | Decimal, ...] = (
            s.requests, s.prompt_tokens, s.cached_tokens, s.completion_tokens, s.gpu_seconds,
            s.amount, s.cost_to_serve)
        for i, v in enumerate(parts):
            self.values[i] += v

    def row(self, key: str, label: str, currency: str) -> MarginRow:
        n, p, c, o, g, revenue, cost = self.values
        margin = _margin(revenue, cost, currency)
        return MarginRow(key, label, currency, int(n), int(p), int(c), int(o), _z(g),
                         _z(revenue), _z(cost), margin,
                         _ratio(margin, revenue))


def _pool_of(engines: Iterable[str]) -> dict[str, str]:
    basis = engine_cost_basis()
    return {e: basis[e].pool if e in basis else NO_POOL for e in engines}


def _grouped(f: MarginFilter, scope: metering.MarginScope
             ) -> tuple[dict[tuple[str, str], _Sums], dict[str, str]]:
    """Return the sums per (key, currency) and each key's label."""
    groups: dict[tuple[str, str], _Sums] = defaultdict(_Sums)
    labels: dict[str, str] = {}
    if f.by == "pool":
        sums = metering.usage_engine_margin_sums(scope=scope)
        pools = _pool_of({s.key[0] for s in sums})
        for s in sums:
            groups[(pools[s.key[0]], s.currency)].add(s)
        labels = {key: key or "no engine" for key, _ in groups}
        return groups, labels
    sums = metering.usage_margin_sums(scope=scope, group_by=(_ROLLUP_DIM[f.by],))
    if f.by == "organization":
        orgs = org_labels({s.key[0] for s in sums})
        for s in sums:
            public_id, name = orgs[s.key[0]]
            groups[(public_id, s.currency)].add(s)
            labels[public_id] = name
        return groups, labels
    for s in sums:
        key = PLAN_KIND_OF_SOURCE.get(s.key[0], s.key[0]) if f.by == "plan_kind" else s.key[0]
        groups[(key, s.currency)].add(s)
        labels[key] = key
    return groups, labels


def _list_values(sums: list[metering.MarginSums], pools: dict[str, str], at: datetime
                 ) -> dict[str, Decimal | None]:
    """Return each pool's tokens at list price (USD); None where a model has no list price."""
    prices = list_prices(currency=COST_CURRENCY, models={s.key[1] for s in sums}, at=at)
    values: dict[str, Decimal | None] = {}
    for s in sums:
        pool, price = pools[s.key[0]], prices.get(s.key[1])
        if price is None:
            values[pool] = None
        elif (so_far := values.get(pool, _ZERO)) is not None:
            values[pool] = so_far + ((s.prompt_tokens - s.cached_tokens) * price.input
                                     + s.cached_tokens * price.cached_input
                                     + s.completion_tokens * price.output) / _MILLION
    return values


def _pool_rows(f: MarginFilter) -> list[PoolEconomicsRow]:
    """Each pool's economics over the range (the whole fleet's: capacity is not per org)."""
    capacity = {p.pool: p for p in metering.usage_pool_capacity(start=f.start, end=f.end)}
    sums = metering.usage_engine_margin_sums(
        scope=metering.MarginScope(start=f.start, end=f.end))
    pools = _pool_of({s.key[0] for s in sums})
    sums = [s for s in sums if pools[s.key[0]] != NO_POOL]
    served: dict[str, int] = defaultdict(int)
    models: dict[str, set[str]] = defaultdict(set)
    for s in sums:
        served[pools[s.key[0]]] += s.prompt_tokens + s.completion_tokens
        models[pools[s.key[0]]].add(s.key[1])
    list_value = _list_values(sums, pools, f.end)
    out = []
    for pool in sorted(set(capacity) | set(served)):
        cap = capacity.get(pool)
        tokens = served.get(pool, 0)
        cap_s = _z(cap.capacity_gpu_seconds) if cap else _ZERO
        att_s = _z(cap.attributed_gpu_seconds) if cap else _ZERO
        cap_cost = _z(cap.capacity_cost) if cap else _ZERO
        att_cost = _z(cap.attributed_cost) if cap else _ZERO
        gpu_hour = (cap_cost * _HOUR / cap_s).quantize(_PER_1M) if cap_s else None
        per_hour = (tokens * _HOUR / cap_s).quantize(_RATIO) if cap_s else None
        cost_1m = (cap_cost * _MILLION / tokens).quantize(_PER_1M) if tokens and cap else None
        busy_1m = (att_cost * _MILLION / tokens).quantize(_PER_1M) if tokens and cap else None
        value = list_value.get(pool)
        list_1m = (value * _MILLION / tokens).quantize(_PER_1M) if value and tokens else None
        out.append(PoolEconomicsRow(
            pool=pool, models=",".join(sorted(models.get(pool, ()))),
            engines=cap.engines if cap else 0, capacity_gpu_seconds=cap_s,
            attributed_gpu_seconds=att_s,
            idle_gpu_seconds=_z(cap.idle_gpu_seconds) if cap else _ZERO,
            utilization=_ratio(att_s, cap_s), capacity_cost=cap_cost, attributed_cost=att_cost,
            idle_cost=_z(cap.idle_cost) if cap else _ZERO, gpu_hour_cost=gpu_hour, tokens=tokens,
            tokens_per_gpu_hour=per_hour, cost_per_1m_tokens=cost_1m,
            busy_cost_per_1m_tokens=busy_1m, list_price_per_1m_tokens=list_1m,
            break_even_utilization=_ratio(att_cost, value) if value and cap else None))
    return out


def _request_rows(scope: metering.MarginScope, limit: int) -> list[RequestMarginRow]:
    events = metering.usage_request_margins(scope=scope, limit=limit)
    orgs = org_labels({e.organization_id for e in events})
    pools = _pool_of({e.engine for e in events})
    return [RequestMarginRow(
        request_id=e.request_id, organization=orgs[e.organization_id][0],
        event_time=e.event_time, model=e.model, pool=pools[e.engine],
        service_tier=e.service_tier,
        plan_kind=PLAN_KIND_OF_SOURCE.get(e.capacity_source, e.capacity_source),
        currency=e.currency, prompt_tokens=e.prompt_tokens, cached_tokens=e.cached_tokens,
        completion_tokens=e.completion_tokens, gpu_seconds=_z(e.gpu_seconds),
        revenue=_z(e.amount), cost_to_serve=_z(e.cost_to_serve),
        margin=_margin(_z(e.amount), _z(e.cost_to_serve), e.currency))
        for e in events]


def margin_report(*, report_filter: MarginFilter) -> MarginReport:
    """Return the margin report of ``report_filter`` (see the module docstring)."""
    f = report_filter
    if f.by not in MARGIN_BY:
        raise ValueError(f"by must be one of {MARGIN_BY}")
    scope = metering.MarginScope(start=f.start, end=f.end, org_id=f.org_id, model=f.model,
                                 service_tier=f.service_tier, currency=f.currency)
    groups, labels = _grouped(f, scope)
    rows = sorted((sums.row(key, labels[key], currency)
                   for (key, currency), sums in groups.items()),
                  key=lambda r: (r.label, r.key, r.currency))
    per_currency: dict[str, _Sums] = defaultdict(_Sums)
    for (_, currency), sums in groups.items():
        for i, v in enumerate(sums.values):
            per_currency[currency].values[i] += v
    totals = [sums.row("", "total", currency) for currency, sums in sorted(per_currency.items())]
    return MarginReport(rows=rows, totals=totals, pools=_pool_rows(f),
                        requests=_request_rows(scope, f.limit))
