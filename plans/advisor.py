"""The plan advisor: what an organization's past period would have cost on every plan kind.

For one organization and a past period it reads the period's usage events in time order
(``metering.selectors.usage_events_streamed``: one query, one server-side cursor, one chunk in
memory) and prices them, in one pass, under every plan kind the catalog offers, with the
rating code's own rules: per-token amounts of the price book in force at each event's time
(``plans.pricing.class_units``, as ``rate_on_demand`` prices), a token plan's caps
(``plans.credits.CreditReplay``: ``plan_room`` and ``past_cap``, as ``rate_token_plan`` books),
provisioned burndown (``plans.pricing.normalizer``), plan and reservation fees
(``plans.selectors``). Alternatives (``Alternative.kind``):

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

Speed: a month of 1,000,000 events is one query and one pass in Python; the per-event work is
integer arithmetic (amounts in 1e-10, credits in micro-credits, times in microseconds) and each
kind's replay takes the stream a chunk at a time (``bench/plan_advisor.py`` measures it).

Length: the one pass over the events feeds every alternative at once, and the per-kind replays
(token plans, provisioned units) share its private line and price types; split it into a
package by kind when another plan kind is added.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.db.models import Q

from billing_platform.accounts.models import Organization
from metering.selectors import PeriodUsage, usage_events_streamed, usage_sums_for_periods
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


# --- usage lines -------------------------------------------------------------------------------

class _Lines:
    """Per (model, region, tier, source): requests, tokens and amounts (1e-10) per class."""

    __slots__ = ("rows",)

    def __init__(self) -> None:
        self.rows: dict[_Key, list[int]] = {}

    def add(self, key: _Key, n_in: int, n_cached: int, n_out: int, a_in: int, a_cached: int,
            a_out: int) -> None:
        """Add one request."""
        row = self.rows.get(key)
        if row is None:
            self.rows[key] = [1, n_in, n_cached, n_out, a_in, a_cached, a_out]
            return
        row[0] += 1
        row[1] += n_in
        row[2] += n_cached
        row[3] += n_out
        row[4] += a_in
        row[5] += a_cached
        row[6] += a_out

    def add_tokens(self, key: _Key, n_in: int, n_cached: int, n_out: int) -> None:
        """Add one request that costs nothing (inside a plan or a reservation)."""
        row = self.rows.get(key)
        if row is None:
            self.rows[key] = [1, n_in, n_cached, n_out, 0, 0, 0]
            return
        row[0] += 1
        row[1] += n_in
        row[2] += n_cached
        row[3] += n_out

    def add_row(self, key: _Key, values: Iterable[int]) -> None:
        """Add (requests, 3 token counts, 3 amounts) to the key's row."""
        row = self.rows.get(key)
        if row is None:
            self.rows[key] = list(values)
            return
        for i, v in enumerate(values):
            row[i] += v

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
    """One price book's per-token amounts, for events that come in time order."""

    def __init__(self, index: PriceIndex, book_id: int | None, currency: str):
        self.index = index
        self.book_id = book_id
        self.currency = currency
        # (model, tier, zone) -> (from, to, pricing, units): what holds in [from, to) (us)
        self.current: dict[tuple[str, str, str], tuple[int, int, ModelPricing, Any]] = {}
        self.units: dict[tuple[int, int, str, str], tuple[int, ...] | None] = {}
        self.memo: dict[tuple[Any, ...], tuple[int, int, int]] = {}

    def pricing(self, model: str, t: int) -> tuple[int, int, ModelPricing]:
        """Return the model's prices in force at ``t`` (us; ``rate_on_demand``'s choice of
        version) and the [from, to) they hold for."""
        times, pricings = self.index.series(self.book_id, model)
        i = bisect_right(times, from_epoch_us(t)) - 1
        if i < 0 or pricings[i] is None:
            raise UnpricedModel(f"No {self.currency} price for model {model!r} at "
                                f"{from_epoch_us(t).isoformat()}.", param="model")
        hi = epoch_us(times[i + 1]) if i + 1 < len(times) else _FOREVER
        return epoch_us(times[i]), hi, pricings[i]  # type: ignore[return-value]

    def lines(self, model: str, t: int, prompt: int, cached: int, completion: int,
              tier: str, zone: str) -> tuple[int, int, int]:
        """Return an event's on-demand amount per class (input, cached, output) in 1e-10."""
        entry = self.current.get((model, tier, zone))
        if entry is None or not entry[0] <= t < entry[1]:
            lo, hi, pricing = self.pricing(model, t)
            # a model with context bands: units per band (the prompt picks it), else one set
            entry = self.current[(model, tier, zone)] = (
                lo, hi, pricing, None if pricing.bands else self.units_of(pricing, 0, tier, zone))
        units = entry[3]
        if units is None:
            units = self.units_of(entry[2], prompt, tier, zone)
            if units is None:
                return self.rated_lines(entry[2], prompt, cached, completion, tier, zone)
        return (prompt - cached) * units[0], cached * units[1], completion * units[2]

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

    def part_lines(self, model: str, t: int, prompt: int, cached: int, completion: int,
                   tier: str, zone: str, fraction: Decimal) -> tuple[int, int, int]:
        return self.rated_lines(self.pricing(model, t)[2], prompt, cached, completion, tier,
                                zone, fraction)


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
        coef = coefficients_of(self.coefficients, model)
        if coef is None:
            return None
        c_in, c_cached, c_out, _write = credit_units(coef)
        units = (int(c_in * MICRO), int(c_cached * MICRO), int(c_out * MICRO))
        if any(u != c * MICRO for u, c in zip(units, (c_in, c_cached, c_out), strict=True)):
            raise ValueError(f"plan {self.plan.code}: a coefficient has over 6 places")
        return units

    def add_rows(self, rows: list[tuple[Any, ...]],
                 amounts: list[tuple[int, int, int]] | None) -> None:
        """Book a chunk of streamed events in order; ``amounts`` are their on-demand lines
        when the plan's book is the one they were priced with (None: price them here)."""
        consume, add, free, book = (self.replay.consume, self.lines.add,
                                    self.lines.add_tokens, self.book)
        credit_micro = self.credit_micro
        refused = plan_credits = overage_credits = 0
        for i, (t, model, region, zone, tier, prompt, cached, completion, _status, _ms,
                _batch) in enumerate(rows):
            try:
                units = credit_micro[model]
            except KeyError:
                units = credit_micro[model] = self.micro_units(model)
            n_in = prompt - cached
            if units is None:  # not covered: rated on-demand at the plan book's prices
                a = (amounts[i] if amounts is not None
                     else book.lines(model, t, prompt, cached, completion, tier, zone))
                add((model, region, tier, _ON_DEMAND), n_in, cached, completion, *a)
                continue
            split = consume(t, n_in * units[0] + cached * units[1] + completion * units[2])
            if split is None:
                refused += 1
                continue
            in_plan, overage = split
            plan_credits += in_plan
            if not overage:
                free((model, region, tier, _PLAN), n_in, cached, completion)
                continue
            overage_credits += overage
            if not in_plan:
                a = (amounts[i] if amounts is not None
                     else book.lines(model, t, prompt, cached, completion, tier, zone))
            else:
                fraction = EXACT.divide(Decimal(overage), Decimal(in_plan + overage))
                a = book.part_lines(model, t, prompt, cached, completion, tier, zone, fraction)
            add((model, region, tier, _OVERAGE), n_in, cached, completion, *a)
        self.refused += refused
        self.plan_credits += plan_credits
        self.overage_credits += overage_credits


# --- provisioned units -------------------------------------------------------------------------

_STRIDE = 10  # per event: minute, need, amount, tier, 3 token counts, 3 class amounts


class _OfferingRun:
    """One provisioned offering: the period's events of its model and region, in time order
    (``_STRIDE`` integers each in one array)."""

    def __init__(self, offering: ProvisionedOffering, period_start: datetime):
        self.offering = offering
        self.start = epoch_us(period_start)
        self.norm = normalizer(cache_burndown=offering.cache_burndown,
                               output_burndown=offering.output_burndown)
        self.events = array("q")
        self.tiers: list[str] = []
        self.key_index: dict[str, int] = {}

    def add_rows(self, rows: list[tuple[Any, ...]], amounts: list[tuple[int, int, int]]
                 ) -> None:
        """Keep the chunk's events of the offering's model and region."""
        o, start, norm, extend = self.offering, self.start, self.norm, self.events.extend
        key_index = self.key_index
        for (t, model, region, _zone, tier, prompt, cached, completion, _status, _ms,
             _batch), a in zip(rows, amounts, strict=True):
            if model != o.model or region != o.region:
                continue
            i = key_index.get(tier)
            if i is None:
                i = key_index[tier] = len(self.tiers)
                self.tiers.append(tier)
            extend(((t - start) // 60_000_000, norm(prompt, cached, completion),
                    a[0] + a[1] + a[2], i, prompt - cached, cached, completion, *a))

    def minutes(self) -> list[tuple[int, int, int]]:
        """Return (normalized load, first event, end) of every minute with events, the
        busiest first (events are offsets into ``events``, a multiple of ``_STRIDE``)."""
        ev, out = self.events, []
        lo, n = 0, len(self.events)
        while lo < n:
            hi, load, minute = lo, 0, ev[lo]
            while hi < n and ev[hi] == minute:
                load += ev[hi + 1]
                hi += _STRIDE
            out.append((load, lo, hi))
            lo = hi
        out.sort(key=lambda m: -m[0])
        return out

    def spill(self, minutes: list[tuple[int, int, int]], capacity: int, spilled: list[int]
              ) -> int:
        """Return the on-demand amount (1e-10) of the requests that would have spilled over
        at ``capacity`` normalized tokens a minute; list their offsets in ``spilled``.

        In each minute, requests in time order take what is left while they fit (a request
        that does not fit spills and takes nothing, as admission's bucket does).
        """
        ev = self.events
        total = 0
        for load, lo, hi in minutes:
            if load <= capacity:
                break  # this minute and every quieter one fit whole
            level = capacity
            for i in range(lo, hi, _STRIDE):
                if ev[i + 1] <= level:
                    level -= ev[i + 1]
                else:
                    total += ev[i + 2]
                    spilled.append(i)
        return total


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
    peak = minutes[0][0] if minutes else 0
    tpm = o.tokens_per_minute_per_unit
    lowest = max(o.min_units, 1)
    most = max(lowest, -(-peak // tpm))
    spilled: list[int] = []
    best_units, best_cost = lowest, fee_e10 * lowest + run.spill(minutes, lowest * tpm, spilled)
    for units in range(lowest + 1, most + 1):
        if fee_e10 * units >= best_cost:
            break  # the fee alone costs more than the best so far
        these: list[int] = []
        cost = fee_e10 * units + run.spill(minutes, units * tpm, these)
        if cost < best_cost:
            best_units, best_cost, spilled = units, cost, these
    # The on-demand rows of the offering's model and region hold its events and no others:
    # they become provisioned rows (no per-token charge) less what spilled over.
    lines, mine = _Lines(), (o.model, o.region)
    for key, row in od_lines.rows.items():
        if key[:2] == mine:
            lines.rows[(*mine, key[2], _PROVISIONED)] = [*row[:4], 0, 0, 0]
        else:
            lines.rows[key] = list(row)
    ev = run.events
    for i in spilled:
        tier = run.tiers[ev[i + 3]]
        counts = (ev[i + 4], ev[i + 5], ev[i + 6])
        lines.add((*mine, tier, _SPILLOVER), *counts, ev[i + 7], ev[i + 8], ev[i + 9])
        row = lines.rows[(*mine, tier, _PROVISIONED)]
        row[0] -= 1
        for k in (1, 2, 3):
            row[k] -= counts[k - 1]
    lines.rows = {k: r for k, r in lines.rows.items() if r[0]}
    total_need = sum(m[0] for m in minutes)
    span_minutes = max(1, int((end - start).total_seconds()) // 60)
    return _alternative(
        "provisioned", o.code, o.name, lines, [unit_fee * best_units], currency=currency,
        round_money=round_money, requests=lines.requests,
        detail={"model": o.model, "region": o.region, "units": best_units, "term": term,
                "unit_fee": unit_fee, "tokens_per_minute_per_unit": tpm,
                "peak_minute_normalized_tokens": peak,
                "mean_minute_normalized_tokens": total_need // span_minutes,
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

    def at(self, t: int) -> _Book:
        for lo, hi, book in self.segments:
            if lo <= t < hi:
                return book
        return self.default


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
    od_add = od.add
    events = 0
    for rows in usage_events_streamed(org_id=org.id, start=start, end=end):
        events += len(rows)
        amounts = []
        for (t, model, region, zone, tier, prompt, cached, completion, status, total_ms,
             in_batch) in rows:
            book = on_demand_book.at(t) if on_demand_book.segments else default
            a = book.lines(model, t, prompt, cached, completion, tier, zone)
            amounts.append(a)
            key = (model, region, tier, _ON_DEMAND)
            od_add(key, prompt - cached, cached, completion, *a)
            if (tier == _DEFAULT and status == "ok" and not in_batch and total_ms is not None
                    and total_ms >= NON_INTERACTIVE_MS):
                eligible_od.add(key, prompt - cached, cached, completion, *a)
                eligible_batch.add((model, region, _BATCH, _ON_DEMAND), prompt - cached,
                                   cached, completion, *book.lines(
                                       model, t, prompt, cached, completion, _BATCH, zone))
        for run in runs:
            if not run.failed:
                try:  # the plan's book priced like the events' own: reuse their amounts
                    run.add_rows(rows, amounts if run.book is default
                                 and not on_demand_book.segments else None)
                except UnpricedModel as e:
                    run.failed = str(e)
        for o_run in offering_runs:
            o_run.add_rows(rows, amounts)

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
        if o_run.events:
            alternatives.append(_provisioned(o_run, od, start=start, end=end,
                                             currency=currency, round_money=round_money))
    cheapest = min([current, *(a for a in alternatives
                               if a.available and not a.refused_requests)],
                   key=lambda a: a.total)
    return PlanAdvice(organization=org.public_id, period_start=start, period_end=end,
                      currency=currency, events=events, current=current,
                      alternatives=tuple(alternatives), cheapest=cheapest,
                      saving=current.total - cheapest.total)
