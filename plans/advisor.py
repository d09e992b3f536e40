"""The plan advisor: what an organization's past period would have cost on every plan kind.

For one organization and a past period it reads the period's usage events in time order, as
columns (``metering.selectors.usage_event_columns``: numpy arrays, a chunk of up to about two
million events at a time) and prices them, in one pass over the chunks, under every plan kind
the catalog offers, with the rating code's own rules: per-token amounts of the price book in
force at each event's time (``plans.pricing.class_units``, as ``rate_on_demand`` prices), a
token plan's caps (``plans.credits.CreditReplay``: ``plan_room`` and ``past_cap``, as
``rate_token_plan`` books), provisioned burndown (``plans.pricing.normalizer``), plan and
reservation fees (``plans.selectors``). Alternatives (``Alternative.kind``):

- ``current``: what was billed: the period's rated usage as the invoice's usage lines have it
  (the rollups, each line rounded once), plus plan fees, reservation fees and credit packs.
- ``on_demand``: every event at the on-demand price of the price book it is rated with (the
  organization's on-demand plan's, else the currency's default), at the tier and zone it was
  served at. For an organization that was on-demand this equals the period's invoice usage
  lines to the cent: the same per-event amounts, grouped and rounded as the invoice does.
- ``batch_flex``: on-demand, with the eligible share priced at the batch tier. Eligible: a
  request served at the default tier that completed (status ``ok``), was not already part of a
  batch, and took at least ``NON_INTERACTIVE_MS`` end to end. Usage events do not record
  whether the client streamed, so this cannot tell a long streamed chat from a job nobody
  watched; read it as an upper bound of what could move to the Batch API or flex, not as a
  promise.
- ``token_plan``, one per active public plan in the organization's currency: its monthly fee,
  and, as if subscribed at the period's start (empty rolling window, no credit packs), each
  event's credits against the period cap and the rolling window on the real event timestamps.
  Past them the plan's policy applies: ``overage`` bills the excess at the plan book's
  on-demand prices (the rater's split of a request that crosses the cap), ``block`` counts a
  request that arrives with no credit left as "would have been refused" and prices nothing of
  it. That is a lower bound of refusals: admission also refuses a request whose worst case
  (prompt + max_tokens) does not fit, which the events cannot show. Models the plan does not
  cover stay on-demand at the plan book's prices.
- ``provisioned``, one per active offering in the currency whose model and region the
  organization used: the unit count that minimizes fee + spillover. Per UTC minute, requests in
  time order take units x tokens-per-minute of normalized tokens while they fit (admission's
  token bucket, approximated by a fresh bucket each minute); the others spill over at
  on-demand prices. Units run from the offering's minimum to what the peak minute needs, each
  at the cheaper term (monthly or hourly) for the period; other models stay on-demand.

The cheapest is the lowest total among ``current`` and the available alternatives that serve
every request (a blocking plan that would have refused some is shown, never recommended); the
saving is current minus cheapest (0 when nothing is cheaper than what was billed).

Exactness: an event's amount per token class is its token count times a per-token amount; when
those are whole numbers of 1e-10 (the place events keep, ``units_in_last_places``) the amounts
are exact integers and rounding them to 10 places, as rating does, changes nothing; otherwise
that event is rated line by line with ``rounded_lines(exact_lines(...))``. Money is rounded only
where an invoice rounds it, once per line, by the ``round_money`` the caller passes (invoicing's
``quantize_money``; plans cannot import invoicing).

Speed: the per-event work is integer arithmetic on numpy arrays (amounts in 1e-10, credits in
micro-credits, times in microseconds), per group of events with one model x region x zone x
tier and one price version and band; Python touches an event only where its own rules need it
alone: a request that crosses a token plan's cap (``CreditReplay.consume_many`` checks blocks
of events against both caps at once), an event whose per-token amounts are not whole numbers
of 1e-10, and the provisioned search steps through the minutes over capacity a request at a
time across all of them. Sums are exact (int64 in slices that cannot overflow, added as Python
integers). ``bench/plan_advisor.py``: 1,000,000 events in 3.4 s (1.1 s of CPU; 16.8 s, 13.4 s
of CPU, when each event went through Python), every alternative identical line for line.

Length: the one pass over the events feeds every alternative at once, and the per-kind replays
(token plans, provisioned units) share its private line and price types; split it into a
package by kind when another plan kind is added.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from itertools import pairwise
from typing import Any

import numpy as np
from django.db.models import Q

from billing_platform.accounts.models import Organization
from metering.selectors import (
    EventColumns,
    PeriodUsage,
    usage_event_columns,
    usage_sums_for_periods,
)
from plans.choices import CapacitySource, PlanKind, ReservationTerm, ServiceTier, TokenClass
from plans.credits import MICRO, CreditReplay
from plans.models import (
    CreditCoefficient,
    CreditPackPurchase,
    Plan,
    PriceBook,
    ProvisionedOffering,
    Reservation,
    Subscription,
)
from plans.periods import add_months, epoch_us, from_epoch_us
from plans.pricing import (
    EXACT,
    ModelPricing,
    PriceIndex,
    TokenCounts,
    class_units,
    exact_lines,
    normalizer,
    rounded_lines,
    units_in_last_places,
)
from plans.rating import UnpricedModel, coefficients_of, credit_units, price_book_of
from plans.selectors import reservation_fee_for_period, subscription_months_in_period

NON_INTERACTIVE_MS = 10_000  # batch/flex eligibility: at least this long end to end
MAX_PERIOD = timedelta(days=32)  # a billing period is at most a month
_FOREVER = 2**63 - 1  # us: no end
_CLASSES = (TokenClass.INPUT.value, TokenClass.CACHED_INPUT.value, TokenClass.OUTPUT.value)
_ON_DEMAND, _PLAN, _OVERAGE = (str(CapacitySource.ON_DEMAND.value),
                               str(CapacitySource.PLAN.value), str(CapacitySource.OVERAGE.value))
_PROVISIONED, _SPILLOVER = (str(CapacitySource.PROVISIONED.value),
                            str(CapacitySource.SPILLOVER.value))
_DEFAULT, _BATCH = str(ServiceTier.DEFAULT.value), str(ServiceTier.BATCH.value)

RoundMoney = Callable[[Decimal, str], Decimal]
_Key = tuple[str, str, str, str]  # model, region, service tier, capacity source


@dataclass(frozen=True)
class AdviceLine:
    """One usage line as an invoice prints it: a model x region x tier x source x token class."""

    model: str
    region: str
    service_tier: str
    capacity_source: str
    token_class: str
    tokens: int
    amount_precise: Decimal  # exact, 10 places
    amount: Decimal  # rounded once to the currency's minor unit


@dataclass(frozen=True)
class Alternative:
    """What the period would have cost under one plan kind (or what was billed: ``current``).

    ``usage`` is the sum of the usage lines, each rounded once; ``fees`` the plan or
    reservation fees of the period, rounded once each; ``total`` their sum. ``available`` is
    False when the alternative cannot price the usage (``reason`` says why); its totals are 0.
    """

    kind: str  # current | on_demand | batch_flex | token_plan | provisioned
    code: str  # the plan's or offering's code ("" for on-demand and batch/flex)
    name: str
    usage: Decimal
    fees: Decimal
    total: Decimal
    requests: int  # requests it would have served (priced or included)
    refused_requests: int = 0  # a blocking token plan: would have been refused
    detail: Mapping[str, Any] = field(default_factory=dict)
    lines: tuple[AdviceLine, ...] = ()
    available: bool = True
    reason: str = ""


@dataclass(frozen=True)
class PlanAdvice:
    """Every alternative for one organization's period, the cheapest, and the saving."""

    organization: str  # public id
    period_start: datetime
    period_end: datetime
    currency: str
    events: int
    current: Alternative
    alternatives: tuple[Alternative, ...]
    cheapest: Alternative
    saving: Decimal  # current.total - cheapest.total, >= 0


# --- events, exact sums ------------------------------------------------------------------------

_Combo = tuple[str, str, str, str]  # model, region, data zone, service tier
_INT64_SAFE = 2**62


def _sum(values: np.ndarray) -> int:
    """Return the exact sum of non-negative int64 values, whatever their number (in slices
    an int64 sum cannot overflow, added as Python integers)."""
    if not len(values):
        return 0
    top = int(values.max())
    if top * len(values) < _INT64_SAFE:
        return int(values.sum())
    step = max(1, _INT64_SAFE // max(top, 1))
    return sum(int(values[i:i + step].sum()) for i in range(0, len(values), step))


class _Events:
    """One chunk of the period's events as columns, grouped by model x region x zone x tier
    (each group's positions in time order)."""

    def __init__(self, cols: EventColumns):
        self.cols = cols
        self.t = cols.event_us
        self.prompt, self.cached, self.completion = (
            cols.prompt_tokens, cols.cached_tokens, cols.completion_tokens)
        self.n_in = self.prompt - self.cached
        combo = ((cols.model.astype(np.int64) * len(cols.regions) + cols.region)
                 * len(cols.data_zones) + cols.data_zone) * len(cols.service_tiers) \
            + cols.service_tier
        order = np.argsort(combo, kind="stable")
        cuts = [0, *(np.flatnonzero(np.diff(combo[order])) + 1).tolist(), len(order)]
        self.groups: list[tuple[_Combo, np.ndarray]] = []
        for lo, hi in pairwise(cuts if len(order) else []):
            i = int(order[lo])
            self.groups.append(((cols.models[cols.model[i]], cols.regions[cols.region[i]],
                                 cols.data_zones[cols.data_zone[i]],
                                 cols.service_tiers[cols.service_tier[i]]), order[lo:hi]))

    def __len__(self) -> int:
        return len(self.t)

    def combo(self, i: int) -> _Combo:
        c = self.cols
        return (c.models[c.model[i]], c.regions[c.region[i]], c.data_zones[c.data_zone[i]],
                c.service_tiers[c.service_tier[i]])

    def selected(self, want: np.ndarray | None) -> Iterator[tuple[_Combo, np.ndarray]]:
        """Yield each group's positions among ``want`` (a mask; None: every event)."""
        for combo, idx in self.groups:
            sel = idx if want is None else idx[want[idx]]
            if len(sel):
                yield combo, sel


_Amounts = tuple[np.ndarray, np.ndarray, np.ndarray]  # per event: input, cached, output (1e-10)


# --- usage lines -------------------------------------------------------------------------------

class _Lines:
    """Per (model, region, tier, source): requests, tokens and amounts (1e-10) per class."""

    __slots__ = ("rows",)

    def __init__(self) -> None:
        self.rows: dict[_Key, list[int]] = {}

    def add(self, key: _Key, n_in: int, n_cached: int, n_out: int, a_in: int, a_cached: int,
            a_out: int) -> None:
        """Add one request."""
        self.add_row(key, (1, n_in, n_cached, n_out, a_in, a_cached, a_out))

    def add_row(self, key: _Key, values: Iterable[int]) -> None:
        """Add (requests, 3 token counts, 3 amounts) to the key's row."""
        row = self.rows.get(key)
        if row is None:
            self.rows[key] = list(values)
            return
        for i, v in enumerate(values):
            row[i] += v

    def add_events(self, ev: _Events, want: np.ndarray | None, source: str,
                   amounts: _Amounts | None, tier: str | None = None) -> None:
        """Add the events of ``want`` (None: all) under ``source`` (at ``tier`` instead of
        their own when given), with ``amounts`` (None: they cost nothing)."""
        for (model, region, _zone, own_tier), sel in ev.selected(want):
            self.add_row((model, region, tier or own_tier, source), [
                len(sel), _sum(ev.n_in[sel]), _sum(ev.cached[sel]), _sum(ev.completion[sel]),
                *((_sum(a[sel]) for a in amounts) if amounts is not None else (0, 0, 0))])

    def merge(self, other: _Lines, sign: int = 1) -> None:
        for key, row in other.rows.items():
            self.add_row(key, [sign * v for v in row])

    def copy(self) -> _Lines:
        out = _Lines()
        out.rows = {key: list(row) for key, row in self.rows.items()}
        return out

    @property
    def requests(self) -> int:
        return sum(row[0] for row in self.rows.values())

    def advice_lines(self, currency: str, round_money: RoundMoney) -> tuple[AdviceLine, ...]:
        out = []
        for (model, region, tier, source), row in sorted(self.rows.items()):
            for cls, tokens, amount in zip(_CLASSES, row[1:4], row[4:7], strict=True):
                if not tokens and not amount:
                    continue
                exact = Decimal(amount).scaleb(-10, context=EXACT)
                out.append(AdviceLine(model, region, tier, source, cls, tokens, exact,
                                      round_money(exact, currency)))
        return tuple(out)


def _alternative(kind: str, code: str, name: str, lines: _Lines, fees: Iterable[Decimal], *,
                 currency: str, round_money: RoundMoney, **extra: Any) -> Alternative:
    """Return an alternative whose usage is ``lines``, each rounded once, plus ``fees``."""
    advice_lines = lines.advice_lines(currency, round_money)
    usage = sum((ln.amount for ln in advice_lines), Decimal(0))
    fee = sum((round_money(f, currency) for f in fees), Decimal(0))
    return Alternative(kind=kind, code=code, name=name, usage=usage, fees=fee,
                       total=usage + fee, lines=advice_lines, **extra)


def _unavailable(kind: str, code: str, name: str, reason: str) -> Alternative:
    zero = Decimal(0)
    return Alternative(kind=kind, code=code, name=name, usage=zero, fees=zero, total=zero,
                       requests=0, available=False, reason=reason)


# --- prices ------------------------------------------------------------------------------------

class _Book:
    """One price book's per-token amounts, for a period's events."""

    def __init__(self, index: PriceIndex, book_id: int | None, currency: str):
        self.index = index
        self.book_id = book_id
        self.currency = currency
        self.bounds: dict[str, np.ndarray] = {}  # model -> its versions' starts (us)
        self.units: dict[tuple[int, int, str, str], tuple[int, ...] | None] = {}
        self.memo: dict[tuple[Any, ...], tuple[int, int, int]] = {}

    def pricing(self, model: str, t: int) -> ModelPricing:
        """Return the model's prices in force at ``t`` (us; ``rate_on_demand``'s choice of
        version)."""
        times, pricings = self.index.series(self.book_id, model)
        i = bisect_right(times, from_epoch_us(t)) - 1
        if i < 0 or pricings[i] is None:
            raise self.unpriced(model, t)
        return pricings[i]  # type: ignore[return-value]

    def unpriced(self, model: str, t: int) -> UnpricedModel:
        return UnpricedModel(f"No {self.currency} price for model {model!r} at "
                             f"{from_epoch_us(t).isoformat()}.", param="model")

    def amounts(self, ev: _Events, want: np.ndarray | None = None, tier: str | None = None
                ) -> _Amounts:
        """Return each event's on-demand amount per class in 1e-10 (at ``tier`` instead of
        its own when given), for the events of ``want`` (None: all; 0 elsewhere).

        Per group and price version (and context band), every event's amount is its token
        count times the band's per-token amounts, exact; where those are not whole numbers
        of 1e-10, each event is rated as ``rounded_lines(exact_lines(...))`` rates it.
        """
        out = (np.zeros(len(ev), dtype=np.int64), np.zeros(len(ev), dtype=np.int64),
               np.zeros(len(ev), dtype=np.int64))
        for (model, _region, zone, own_tier), sel in ev.selected(want):
            at = tier or own_tier
            times, pricings = self.index.series(self.book_id, model)
            if model not in self.bounds:
                self.bounds[model] = np.array([epoch_us(x) for x in times], dtype=np.int64)
            version = np.searchsorted(self.bounds[model], ev.t[sel], side="right") - 1
            for v in np.unique(version).tolist():
                sub = sel[version == v]
                pricing = pricings[v] if v >= 0 else None
                if pricing is None:
                    raise self.unpriced(model, int(ev.t[sub[0]]))
                parts = [(sub, 0)]
                if pricing.bands:  # the band whose threshold the prompt exceeds, else base
                    above = np.array([a for a, _ in pricing.bands], dtype=np.int64)
                    band = np.searchsorted(above, ev.prompt[sub], side="left")
                    parts = [(sub[band == b], 0 if b == 0 else int(above[b - 1]) + 1)
                             for b in np.unique(band).tolist()]
                for part, prompt in parts:
                    self._fill(out, ev, part, pricing, prompt, at, zone)
        return out

    def _fill(self, out: _Amounts, ev: _Events, part: np.ndarray, pricing: ModelPricing,
              prompt: int, tier: str, zone: str) -> None:
        units = self.units_of(pricing, prompt, tier, zone)
        if units is None:  # some line may round: rate these events one by one
            for i in part.tolist():
                out[0][i], out[1][i], out[2][i] = self.rated_lines(
                    pricing, int(ev.prompt[i]), int(ev.cached[i]), int(ev.completion[i]),
                    tier, zone)
            return
        for column, tokens, unit in zip(out, (ev.n_in, ev.cached, ev.completion), units,
                                        strict=True):
            counts = tokens[part]
            if len(counts) and int(counts.max()) * unit >= _INT64_SAFE:
                raise ValueError(f"{pricing.model}: one event's amount is beyond 2**62 x 1e-10")
            column[part] = counts * unit

    def units_of(self, pricing: ModelPricing, prompt: int, tier: str, zone: str
                 ) -> tuple[int, ...] | None:
        """Return the per-token amounts in 1e-10 for this prompt size, None if not whole."""
        key = (id(pricing), id(pricing.prices_for(prompt)), tier, zone)
        if key not in self.units:
            self.units[key] = units_in_last_places(class_units(pricing, prompt, tier, zone)[:3])
        return self.units[key]

    def rated_lines(self, pricing: ModelPricing, prompt: int, cached: int, completion: int,
                    tier: str, zone: str, fraction: Decimal | None = None
                    ) -> tuple[int, int, int]:
        """Return the lines as ``rounded_lines(exact_lines(...))`` rates them (a ``fraction``
        of them: the overage share of a request that crosses a token plan's cap), in 1e-10."""
        key = (id(pricing), prompt, cached, completion, tier, zone, fraction)
        hit = self.memo.get(key)
        if hit is None:
            lines, _ = rounded_lines(exact_lines(
                pricing, TokenCounts(prompt, cached, completion, 0, tier, zone)), fraction)
            a_in, a_cached, a_out = (int(lines[c].scaleb(10, context=EXACT)) for c in _CLASSES)
            hit = self.memo[key] = (a_in, a_cached, a_out)
        return hit


# --- token plans -------------------------------------------------------------------------------

class _TokenPlanRun:
    """One catalog token plan replayed over the period's events."""

    def __init__(self, plan: Plan, coefficients: Mapping[str, dict[str, Decimal]],
                 book: _Book, period_start: datetime):
        self.plan = plan
        self.book = book
        self.coefficients = coefficients
        self.replay = CreditReplay(plan, anchor=period_start)
        self.credit_micro: dict[str, tuple[int, int, int] | None] = {}
        self.lines = _Lines()
        self.refused = 0
        self.plan_credits = 0
        self.overage_credits = 0
        self.failed = ""

    def micro_units(self, model: str) -> tuple[int, int, int] | None:
        """Return micro-credits per token of each class of ``model``, None if not covered."""
        if model in self.credit_micro:
            return self.credit_micro[model]
        coef = coefficients_of(self.coefficients, model)
        units = None
        if coef is not None:
            c_in, c_cached, c_out, _write = credit_units(coef)
            units = (int(c_in * MICRO), int(c_cached * MICRO), int(c_out * MICRO))
            if any(u != c * MICRO for u, c in zip(units, (c_in, c_cached, c_out), strict=True)):
                raise ValueError(f"plan {self.plan.code}: a coefficient has over 6 places")
        self.credit_micro[model] = units
        return units

    def add_events(self, ev: _Events, amounts: _Amounts | None) -> None:
        """Book a chunk of the period's events in order; ``amounts`` are their on-demand
        lines when the plan's book is the one they were priced with (None: price here)."""
        n = len(ev)
        covered, credits = np.zeros(n, dtype=bool), np.zeros(n, dtype=np.int64)
        for (model, _region, _zone, _tier), idx in ev.groups:
            units = self.micro_units(model)
            if units is not None:
                covered[idx] = True
                credits[idx] = (ev.n_in[idx] * units[0] + ev.cached[idx] * units[1]
                                + ev.completion[idx] * units[2])
        at = np.flatnonzero(covered)
        in_plan, overage, refused = (np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64),
                                     np.zeros(n, dtype=bool))
        in_plan[at], overage[at], refused[at] = self.replay.consume_many(ev.t[at], credits[at])
        self.refused += int(refused.sum())
        self.plan_credits += _sum(in_plan)
        self.overage_credits += _sum(overage)
        served = covered & ~refused
        free, past = served & (overage == 0), served & (overage > 0)
        whole = past & (in_plan == 0)  # all of it past the cap: on-demand prices
        priced = ~covered | whole  # models the plan does not cover stay on-demand
        if amounts is None and priced.any():
            amounts = self.book.amounts(ev, priced)
        self.lines.add_events(ev, ~covered, _ON_DEMAND, amounts)
        self.lines.add_events(ev, free, _PLAN, None)
        self.lines.add_events(ev, whole, _OVERAGE, amounts)
        for i in np.flatnonzero(past & (in_plan > 0)).tolist():  # crosses the cap: split
            model, region, zone, tier = ev.combo(i)
            t, prompt, cached, completion = (int(ev.t[i]), int(ev.prompt[i]),
                                             int(ev.cached[i]), int(ev.completion[i]))
            fraction = EXACT.divide(Decimal(int(overage[i])),
                                    Decimal(int(in_plan[i] + overage[i])))
            self.lines.add((model, region, tier, _OVERAGE), prompt - cached, cached,
                           completion, *self.book.rated_lines(
                               self.book.pricing(model, t), prompt, cached, completion, tier,
                               zone, fraction))


# --- provisioned units -------------------------------------------------------------------------

class _OfferingRun:
    """One provisioned offering: the period's events of its model and region, in time order,
    as columns (minute, normalized need, tier, token counts, on-demand amounts)."""

    _COLUMNS = ("minute", "need", "tier", "n_in", "cached", "completion", "a_in", "a_cached",
                "a_out")

    def __init__(self, offering: ProvisionedOffering, period_start: datetime):
        self.offering = offering
        self.start = epoch_us(period_start)
        self.norm = normalizer(cache_burndown=offering.cache_burndown,
                               output_burndown=offering.output_burndown)
        self.tiers: list[str] = []
        self.parts: dict[str, list[np.ndarray]] = {c: [] for c in self._COLUMNS}
        self.col: dict[str, np.ndarray] = {}

    def add_events(self, ev: _Events, amounts: _Amounts) -> None:
        """Keep the chunk's events of the offering's model and region."""
        o = self.offering
        mine = np.zeros(len(ev), dtype=bool)
        for (model, region, _zone, _tier), idx in ev.groups:
            if model == o.model and region == o.region:
                mine[idx] = True
        sel = np.flatnonzero(mine)
        if not len(sel):
            return
        tier_of = np.array([self._tier(name) for name in ev.cols.service_tiers],
                           dtype=np.int64)
        prompt, cached, completion = ev.prompt[sel], ev.cached[sel], ev.completion[sel]
        for name, values in (
                ("minute", (ev.t[sel] - self.start) // 60_000_000),
                ("need", self.norm(prompt, cached, completion)),
                ("tier", tier_of[ev.cols.service_tier[sel]]), ("n_in", prompt - cached),
                ("cached", cached), ("completion", completion), ("a_in", amounts[0][sel]),
                ("a_cached", amounts[1][sel]), ("a_out", amounts[2][sel])):
            self.parts[name].append(np.asarray(values, dtype=np.int64))

    def _tier(self, name: str) -> int:
        if name not in self.tiers:
            self.tiers.append(name)
        return self.tiers.index(name)

    def __bool__(self) -> bool:
        return bool(self.parts["minute"])

    def minutes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Join the chunks; return (normalized load, first event, event count) of every
        minute with events, in time order."""
        self.col = {name: np.concatenate(parts) for name, parts in self.parts.items()}
        self.col["amount"] = self.col["a_in"] + self.col["a_cached"] + self.col["a_out"]
        minute = self.col["minute"]
        first = np.concatenate(([0], np.flatnonzero(np.diff(minute)) + 1))
        counts = np.diff(np.concatenate((first, [len(minute)])))
        return np.add.reduceat(self.col["need"], first), first, counts

    def spill(self, minutes: tuple[np.ndarray, np.ndarray, np.ndarray], capacity: int
              ) -> tuple[int, np.ndarray]:
        """Return the on-demand amount (1e-10) of the requests that would have spilled over
        at ``capacity`` normalized tokens a minute, and their positions.

        In each minute, requests in time order take what is left while they fit (a request
        that does not fit spills and takes nothing, as admission's bucket does). Every minute
        over capacity at once: step j takes each such minute's j-th request.
        """
        loads, first, counts = minutes
        over = np.flatnonzero(loads > capacity)
        if not len(over):
            return 0, np.zeros(0, dtype=np.int64)
        order = np.argsort(-counts[over], kind="stable")
        starts, lengths = first[over][order], counts[over][order]  # the longest first
        ascending = lengths[::-1]
        level = np.full(len(starts), capacity, dtype=np.int64)
        need, spilled = self.col["need"], []
        for j in range(int(lengths[0])):
            k = len(lengths) - int(np.searchsorted(ascending, j, side="right"))
            at = starts[:k] + j
            fits = need[at] <= level[:k]
            level[:k] -= np.where(fits, need[at], 0)
            spilled.append(at[~fits])
        out = np.sort(np.concatenate(spilled))
        return _sum(self.col["amount"][out]), out


def _unit_fee(offering: ProvisionedOffering, start: datetime, end: datetime
              ) -> tuple[Decimal, str]:
    """Return the fee of one unit for [start, end) at the cheaper term, and that term."""
    months = 1
    while add_months(start, months) < end:
        months += 1
    hours = -(-int((end - start).total_seconds()) // 3600)
    fees = []
    for term, count, price in ((ReservationTerm.MONTHLY, months, offering.monthly_unit_price),
                               (ReservationTerm.HOURLY, hours, offering.hourly_unit_price)):
        unit = Reservation(units=1, term=term, term_count=count, unit_price=price,
                           starts_at=start)
        fees.append((reservation_fee_for_period(reservation=unit, period_start=start,
                                                period_end=end), str(term)))
    return min(fees, key=lambda f: f[0])


def _provisioned(run: _OfferingRun, od_lines: _Lines, *, start: datetime, end: datetime,
                 currency: str, round_money: RoundMoney) -> Alternative:
    """Size the reservation that minimizes fee + spillover; return its alternative."""
    o = run.offering
    unit_fee, term = _unit_fee(o, start, end)
    fee_e10 = int(unit_fee.scaleb(10, context=EXACT))
    minutes = run.minutes()
    peak = int(minutes[0].max())
    tpm = o.tokens_per_minute_per_unit
    lowest = max(o.min_units, 1)
    most = max(lowest, -(-peak // tpm))
    spilled_amount, spilled = run.spill(minutes, lowest * tpm)
    best_units, best_cost = lowest, fee_e10 * lowest + spilled_amount
    for units in range(lowest + 1, most + 1):
        if fee_e10 * units >= best_cost:
            break  # the fee alone costs more than the best so far
        amount, these = run.spill(minutes, units * tpm)
        if fee_e10 * units + amount < best_cost:
            best_units, best_cost, spilled = units, fee_e10 * units + amount, these
    # The on-demand rows of the offering's model and region hold its events and no others:
    # they become provisioned rows (no per-token charge) less what spilled over.
    lines, mine = _Lines(), (o.model, o.region)
    for key, row in od_lines.rows.items():
        if key[:2] == mine:
            lines.rows[(*mine, key[2], _PROVISIONED)] = [*row[:4], 0, 0, 0]
        else:
            lines.rows[key] = list(row)
    col = run.col
    for k, tier in enumerate(run.tiers):
        these = spilled[col["tier"][spilled] == k]
        if not len(these):
            continue
        counts = [_sum(col[c][these]) for c in ("n_in", "cached", "completion")]
        lines.add_row((*mine, tier, _SPILLOVER), [
            len(these), *counts, *(_sum(col[c][these]) for c in ("a_in", "a_cached", "a_out"))])
        lines.add_row((*mine, tier, _PROVISIONED), [-len(these), *(-c for c in counts), 0, 0, 0])
    lines.rows = {k: r for k, r in lines.rows.items() if r[0]}
    span_minutes = max(1, int((end - start).total_seconds()) // 60)
    return _alternative(
        "provisioned", o.code, o.name, lines, [unit_fee * best_units], currency=currency,
        round_money=round_money, requests=lines.requests,
        detail={"model": o.model, "region": o.region, "units": best_units, "term": term,
                "unit_fee": unit_fee, "tokens_per_minute_per_unit": tpm,
                "peak_minute_normalized_tokens": peak,
                "mean_minute_normalized_tokens": _sum(minutes[0]) // span_minutes,
                "spillover_requests": len(spilled)})


# --- what was billed ---------------------------------------------------------------------------

def _current(org: Organization, subs: list[Subscription], usage: list[PeriodUsage], *,
             start: datetime, end: datetime, round_money: RoundMoney) -> Alternative:
    """Return what the period billed: its rated usage (rollups) and its fees."""
    currency = org.currency
    lines = _Lines()
    for u in usage:
        if u.currency != currency:
            continue  # never converted (the invoice leaves it out too)
        amounts = (u.input_amount, u.cached_input_amount, u.output_amount)
        lines.add_row((u.model, u.region, u.service_tier, u.capacity_source), [
            u.requests, u.prompt_tokens - u.cached_tokens, u.cached_tokens, u.completion_tokens,
            *(int(a.scaleb(10, context=EXACT)) for a in amounts)])
    fees = [s.plan.monthly_fee * subscription_months_in_period(
        subscription=s, period_start=start, period_end=end)
        for s in subs if s.plan.currency == currency and s.plan.monthly_fee > 0]
    reservations = list(Reservation.objects.filter(
        organization=org, currency=currency, starts_at__lt=end, ends_at__gt=start))
    fees += [reservation_fee_for_period(reservation=r, period_start=start, period_end=end)
             for r in reservations]
    fees += list(CreditPackPurchase.objects.filter(
        subscription__organization=org, currency=currency, purchased_at__gte=start,
        purchased_at__lt=end).values_list("price", flat=True))
    held = next((s for s in subs if s.covers(start)), subs[0] if subs else None)
    return _alternative(
        "current", held.plan.code if held else "", "What was billed", lines,
        [f for f in fees if f], currency=currency, round_money=round_money,
        requests=lines.requests,
        detail={"plan": held.plan.code if held else None, "plan_kind":
                held.plan.kind if held else PlanKind.ON_DEMAND.value,
                "reservations": [r.public_id for r in reservations]})


# --- the advice --------------------------------------------------------------------------------

class _OnDemandBooks:
    """The book each event is rated with on-demand: an on-demand plan's, else the default."""

    def __init__(self, subs: list[Subscription], books: Mapping[int | None, _Book],
                 default: _Book, currency: str):
        self.segments: list[tuple[int, int, _Book]] = []
        for s in subs:
            if s.plan.kind == PlanKind.ON_DEMAND:
                book_id, _ = price_book_of(s, org_currency=currency, default_books={},
                                           book_currency={})
                if book_id is not None:
                    self.segments.append((epoch_us(s.starts_at),
                                          epoch_us(s.ends_at) if s.ends_at else _FOREVER,
                                          books[book_id]))
        self.default = default

    def amounts(self, ev: _Events, want: np.ndarray | None = None, tier: str | None = None
                ) -> _Amounts:
        """Return the events' on-demand amounts, each from the book in force at its time
        (the first on-demand subscription covering it, else the default)."""
        if not self.segments:
            return self.default.amounts(ev, want, tier)
        left = np.ones(len(ev), dtype=bool) if want is None else want.copy()
        out = tuple(np.zeros(len(ev), dtype=np.int64) for _ in range(3))
        for lo, hi, book in [*self.segments, (0, _FOREVER, self.default)]:
            these = left & (ev.t >= lo) & (ev.t < hi)
            if these.any():
                left &= ~these
                for column, part in zip(out, book.amounts(ev, these, tier), strict=True):
                    column[these] = part[these]
        return out  # type: ignore[return-value]


def plan_advice(*, organization: Organization, period_start: datetime, period_end: datetime,
                round_money: RoundMoney) -> PlanAdvice:
    """Return what ``organization``'s usage in [period_start, period_end) would have cost under
    every plan kind offered, what it cost, the cheapest and the saving (see the module).

    Reads the events once (a fixed number of queries whatever their number) and writes
    nothing. ``round_money`` rounds an exact amount to the currency's minor unit, as invoice
    lines are rounded.
    """
    org, start, end, currency = organization, period_start, period_end, organization.currency
    subs = list(Subscription.objects.select_related("plan").filter(
        organization=org, starts_at__lt=end).filter(
        Q(ends_at__isnull=True) | Q(ends_at__gt=start)).order_by("starts_at"))
    usage = usage_sums_for_periods(periods=[(org.id, start, end)])
    current = _current(org, subs, usage, start=start, end=end, round_money=round_money)
    models = {u.model for u in usage}
    plans = list(Plan.objects.filter(kind=PlanKind.TOKEN_PLAN, is_active=True, is_public=True,
                                     currency=currency).order_by("code"))
    coefficients: dict[int, dict[str, dict[str, Decimal]]] = defaultdict(
        lambda: defaultdict(dict))
    for plan_id, model, cls, coef in CreditCoefficient.objects.filter(
            plan__in=plans).values_list("plan_id", "model", "token_class", "coefficient"):
        coefficients[plan_id][model][cls] = coef
    offerings = list(ProvisionedOffering.objects.filter(
        is_active=True, currency=currency, model__in=models).order_by("code"))
    default_books = dict(PriceBook.objects.filter(is_default=True)
                         .values_list("currency", "id"))
    book_ids = {default_books.get(currency)} | {s.plan.price_book_id for s in subs} | {
        p.price_book_id for p in plans}
    index = PriceIndex({b for b in book_ids if b is not None}, models, start, end)
    books = {b: _Book(index, b, index.currency.get(b, currency) if b else currency)
             for b in book_ids}
    default = books[default_books.get(currency)]  # None: no default book, every event unpriced
    on_demand_book = _OnDemandBooks(subs, books, default, currency)

    runs = []
    for plan in plans:
        hypothetical = Subscription(organization=org, plan=plan, starts_at=start,
                                    billing_anchor=start)
        book_id, _ = price_book_of(hypothetical, org_currency=currency,
                                   default_books=default_books, book_currency=index.currency)
        runs.append(_TokenPlanRun(plan, coefficients[plan.id],
                                  books.get(book_id) or default, start))
    offering_runs = [_OfferingRun(o, start) for o in offerings]

    od, eligible_od, eligible_batch = _Lines(), _Lines(), _Lines()
    events = 0
    for cols in usage_event_columns(org_id=org.id, start=start, end=end):
        ev = _Events(cols)
        events += len(ev)
        amounts = on_demand_book.amounts(ev)
        od.add_events(ev, None, _ON_DEMAND, amounts)
        tiers = cols.service_tiers
        eligible = ((cols.service_tier == (tiers.index(_DEFAULT) if _DEFAULT in tiers else -1))
                    & cols.ok & ~cols.in_batch & (cols.total_ms >= NON_INTERACTIVE_MS))
        if eligible.any():
            eligible_od.add_events(ev, eligible, _ON_DEMAND, amounts)
            eligible_batch.add_events(ev, eligible, _ON_DEMAND,
                                      on_demand_book.amounts(ev, eligible, _BATCH), _BATCH)
        for run in runs:
            if not run.failed:
                try:  # the plan's book priced like the events' own: reuse their amounts
                    run.add_events(ev, amounts if run.book is default
                                   and not on_demand_book.segments else None)
                except UnpricedModel as e:
                    run.failed = str(e)
        for o_run in offering_runs:
            o_run.add_events(ev, amounts)

    alternatives = [_alternative("on_demand", "", "On-demand", od, [], currency=currency,
                                 round_money=round_money, requests=od.requests)]
    batch = od.copy()
    batch.merge(eligible_od, sign=-1)
    batch.merge(eligible_batch)
    batch.rows = {k: r for k, r in batch.rows.items() if r[0]}
    alternatives.append(_alternative(
        "batch_flex", "", "On-demand, eligible requests at the batch tier", batch, [],
        currency=currency, round_money=round_money, requests=batch.requests,
        detail={"eligible_requests": eligible_od.requests, "min_total_ms": NON_INTERACTIVE_MS,
                "rule": "default tier, completed, not in a batch, at least min_total_ms end "
                        "to end (whether the client streamed is not recorded: an upper "
                        "bound)"}))
    for run in runs:
        plan = run.plan
        if run.failed:
            alternatives.append(_unavailable("token_plan", plan.code, plan.name, run.failed))
            continue
        hypothetical = Subscription(organization=org, plan=plan, starts_at=start,
                                    billing_anchor=start)
        months = subscription_months_in_period(subscription=hypothetical, period_start=start,
                                               period_end=end)
        alternatives.append(_alternative(
            "token_plan", plan.code, plan.name, run.lines, [plan.monthly_fee * months],
            currency=currency, round_money=round_money, requests=run.lines.requests,
            refused_requests=run.refused,
            detail={"cap_policy": plan.cap_policy, "credits_per_period": plan.credits_per_period,
                    "window_credits": plan.window_credits, "window_hours": plan.window_hours,
                    "plan_credits": Decimal(run.plan_credits).scaleb(-6, context=EXACT),
                    "overage_credits": Decimal(run.overage_credits).scaleb(-6, context=EXACT),
                    "monthly_fee": plan.monthly_fee}))
    for o_run in offering_runs:
        if o_run:
            alternatives.append(_provisioned(o_run, od, start=start, end=end,
                                             currency=currency, round_money=round_money))
    cheapest = min([current, *(a for a in alternatives
                               if a.available and not a.refused_requests)],
                   key=lambda a: a.total)
    return PlanAdvice(organization=org.public_id, period_start=start, period_end=end,
                      currency=currency, events=events, current=current,
                      alternatives=tuple(alternatives), cheapest=cheapest,
                      saving=current.total - cheapest.total)
