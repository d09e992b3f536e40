"""Rating: turn usage events into exact amounts under what each customer bought.

This module is the contract metering codes against: ``UsageFacts`` in, ``Rating`` out, through
``rate_usage_batch`` (stateful for token plans, called inside the ingest transaction) and
``quote`` (reads prices and plan state, writes nothing).

Per request (DESIGN.md): ``amount = tier x zone x (uncached x p_in + cached x p_cached +
out x p_out) / 1e6``, prices from the price-book version in force at the event time, the price
set chosen by prompt size (context bands). Each token class's line is computed exactly and
rounded once, half-even, to 10 places; ``amount`` is the sum of the lines, so rollups that sum
lines and rollups that sum amounts agree to the last digit.

One small rater per kind, chosen from ``RATERS`` (STYLE.md): ``rate_on_demand``,
``rate_token_plan``, ``rate_provisioned``. Which one applies is decided by the event's capacity
source and the organization's subscription at the event time:

- ``provisioned`` -> ``rate_provisioned`` (amount 0, normalized tokens recorded) when the org
  holds a reservation for the model and region at that time, else on-demand;
- ``spillover`` -> ``rate_on_demand``, marked ``spillover``;
- anything else -> ``rate_token_plan`` when the subscription is a token plan covering the model,
  else ``rate_on_demand``.

Token-plan state, exactly once
------------------------------
Credits are stateful (a rolling window and a period cap), so ``rate_usage_batch`` keeps them in
PostgreSQL, in the caller's transaction:

1. ``SELECT ... FOR UPDATE`` on the batch's token-plan subscriptions, in id order (no
   deadlocks). Concurrent batches touching the same subscription are serialized here; under
   READ COMMITTED every statement after the lock sees what the previous holder committed.
2. Request ids already in the ``TokenPlanUsage`` ledger (unique per subscription and request
   id; request ids are unique per organization, like metering's idempotency key) are not
   consumed again: their rating is rebuilt from the stored split (plan / pack / overage
   credits), so re-rating an event, or a batch replayed after a crash, returns the same
   answer and moves no counter.
3. New events consume credits in batch order; the ledger rows, the period totals
   (``TokenPlanPeriod``) and the credit packs' ``credits_used`` are written before returning.
   If the caller's transaction rolls back, all of it rolls back with the events: the ledger and
   the usage events commit together or not at all.

The rolling window sums ledger rows with event time in (t - window, t]; the period total is the
``TokenPlanPeriod`` row of the period (anchored at the subscription's billing anchor) holding t.
A late event is rated against the ledger as it stands when it arrives; events already rated are
never re-priced.
"""

from __future__ import annotations

import uuid
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import ROUND_CEILING, ROUND_HALF_EVEN, Context, Decimal, localcontext

from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from billing_platform.accounts.models import Organization
from billing_platform.errors import InvalidRequest
from plans.choices import (
    ANY_MODEL,
    CapacitySource,
    CapPolicy,
    MultiplierDimension,
    PlanKind,
    RatingKind,
    ServiceTier,
    TokenClass,
)
from plans.models import (
    ContextBand,
    CreditCoefficient,
    CreditPackPurchase,
    ModelPrice,
    PriceBook,
    PriceMultiplier,
    PriceVersion,
    Reservation,
    Subscription,
    TokenPlanPeriod,
    TokenPlanUsage,
)
from plans.periods import period_bounds


@dataclass(frozen=True, slots=True)
class UsageFacts:
    """One usage event as metering sees it. Token counts are the engine's."""

    request_id: str
    org_id: int
    project_id: int | None
    api_key_id: int | None
    model: str
    region: str  # engine region the request ran in, e.g. "us-east"
    data_zone: str  # "global" | "us" | "eu" (the org's zone)
    service_tier: str  # "default" | "priority" | "flex" | "batch"
    capacity_source: str  # "on_demand" | "provisioned" | "spillover" | "plan"
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    event_time: datetime  # aware UTC
    cache_write_tokens: int = 0  # part of the uncached prompt written to a priced cache


@dataclass(frozen=True, slots=True)
class Rating:
    """The rated outcome of one event. ``amount`` is the sum of ``breakdown``'s lines."""

    amount: Decimal  # quantized to 10 places, in `currency`
    currency: str
    price_version_id: int | None  # the price-book version in force at event_time
    breakdown: dict[str, Decimal]  # token class -> amount
    credits_consumed: Decimal  # token-plan credits, 0 otherwise
    normalized_tokens: int  # provisioned burndown tokens, 0 otherwise
    capacity_source: str  # final source: e.g. "plan" -> "overage" when past the cap
    rating_kind: str = RatingKind.ON_DEMAND  # which rater priced it (a key of RATERS)
    subscription_id: int | None = None
    reservation_id: int | None = None
    pack_credits: Decimal = Decimal("0")  # the part of credits_consumed taken from credit packs
    overage_credits: Decimal = Decimal("0")  # credits past the cap, billed at on-demand prices


class UnpricedModel(InvalidRequest):
    """No price-book version in force prices this model at the event time."""

    code = "model_not_priced"


AMOUNT_QUANTUM = Decimal("1E-10")
CREDIT_QUANTUM = Decimal("1E-6")
ZERO = Decimal("0")
ONE = Decimal("1")
_CLASSES = (TokenClass.INPUT.value, TokenClass.CACHED_INPUT.value, TokenClass.OUTPUT.value)
_TIERS = frozenset(ServiceTier.values)
# Plain-str copies of the enum values used per event (enum attribute access is slow in loops).
_ON_DEMAND, _TOKEN_PLAN, _PROVISIONED_KIND = (
    str(RatingKind.ON_DEMAND.value), str(RatingKind.TOKEN_PLAN.value),
    str(RatingKind.PROVISIONED.value))
_PROVISIONED, _SPILLOVER, _ON_DEMAND_SOURCE = (
    str(CapacitySource.PROVISIONED.value), str(CapacitySource.SPILLOVER.value),
    str(CapacitySource.ON_DEMAND.value))
# Wide enough that no product of tokens (< 2^63), prices and factors is ever rounded before the
# one explicit quantize; InvalidOperation and friends stay trapped (the default).
_EXACT = Context(prec=100, rounding=ROUND_HALF_EVEN)


def quantize_amount(value: Decimal) -> Decimal:
    """Round an exact amount once, half-even, to the 10 places events keep."""
    return value.quantize(AMOUNT_QUANTUM, rounding=ROUND_HALF_EVEN, context=_EXACT)


def normalized_tokens(*, prompt_tokens: int, cached_tokens: int, completion_tokens: int,
                      cache_burndown: Decimal, output_burndown: Decimal) -> int:
    """Return provisioned burndown tokens: uncached + cached x cache_bd + out x output_bd.

    Rounded up to a whole token: a reservation is never credited with capacity it did not use.
    """
    with localcontext(_EXACT):
        exact = ((prompt_tokens - cached_tokens) + cached_tokens * cache_burndown
                 + completion_tokens * output_burndown)
    return int(exact.to_integral_value(rounding=ROUND_CEILING))


# --- prices ----------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class PriceSet:
    """Per-1M-token prices of one model in one band."""

    input: Decimal
    cached_input: Decimal
    output: Decimal
    cache_write: Decimal

    @classmethod
    def of(cls, row: ModelPrice | ContextBand) -> PriceSet:
        cached = row.cached_input if row.cached_input is not None else row.input * Decimal("0.1")
        write = row.cache_write if row.cache_write is not None else row.input
        return cls(row.input, cached, row.output, write)


@dataclass(frozen=True, slots=True)
class ModelPricing:
    """A model's prices in one price version, with that version's multipliers."""

    version_id: int
    currency: str
    model: str
    base: PriceSet
    bands: tuple[tuple[int, PriceSet], ...]  # ascending thresholds
    tier: Mapping[str, Decimal]
    zone: Mapping[str, Decimal]

    def prices_for(self, prompt_tokens: int) -> PriceSet:
        """Return the band's prices when the prompt exceeds its threshold, else the base."""
        chosen = self.base
        for above, prices in self.bands:
            if prompt_tokens > above:
                chosen = prices
            else:
                break
        return chosen

    def multiplier(self, tier: str, zone: str) -> Decimal:
        return self.tier.get(tier, ONE) * self.zone.get(zone, ONE)


def exact_lines(pricing: ModelPricing, f: UsageFacts) -> dict[str, Decimal]:
    """Return the on-demand amount of each token class, exact (not yet rounded)."""
    prices = pricing.prices_for(f.prompt_tokens)
    with localcontext(_EXACT):
        mult = pricing.multiplier(f.service_tier, f.data_zone)
        uncached = f.prompt_tokens - f.cached_tokens
        lines = {
            TokenClass.INPUT.value:
                ((uncached - f.cache_write_tokens) * prices.input * mult).scaleb(-6),
            TokenClass.CACHED_INPUT.value:
                (f.cached_tokens * prices.cached_input * mult).scaleb(-6),
            TokenClass.OUTPUT.value: (f.completion_tokens * prices.output * mult).scaleb(-6),
        }
        if f.cache_write_tokens:
            lines[TokenClass.CACHE_WRITE.value] = (
                f.cache_write_tokens * prices.cache_write * mult).scaleb(-6)
    return lines


def _rounded(lines: Mapping[str, Decimal], fraction: Decimal | None = None
             ) -> tuple[dict[str, Decimal], Decimal]:
    """Round each line once (after scaling by ``fraction``); return the lines and their sum."""
    with localcontext(_EXACT):
        if fraction is not None:
            out = {k: quantize_amount(v * fraction) for k, v in lines.items()}
        else:
            out = {k: quantize_amount(v) for k, v in lines.items()}
        return out, sum(out.values(), ZERO)


class _PriceIndex:
    """Price versions of the books a batch needs, loaded once; looked up per (book, model)."""

    def __init__(self, book_ids: set[int], models: set[str], min_t: datetime, max_t: datetime):
        self.currency = dict(PriceBook.objects.filter(id__in=book_ids)
                             .values_list("id", "currency"))
        versions = list(PriceVersion.objects.filter(price_book_id__in=book_ids,
                                                    effective_from__lte=max_t)
                        .order_by("price_book_id", "effective_from")
                        .values_list("id", "price_book_id", "effective_from"))
        by_book: dict[int, list[tuple[int, datetime]]] = defaultdict(list)
        for vid, book_id, eff in versions:
            by_book[book_id].append((vid, eff))
        relevant: dict[int, list[tuple[int, datetime]]] = {}
        for book_id, rows in by_book.items():
            first = max(bisect_right([eff for _, eff in rows], min_t) - 1, 0)
            relevant[book_id] = rows[first:]
        version_ids = [vid for rows in relevant.values() for vid, _ in rows]
        mults: dict[int, dict[str, dict[str, Decimal]]] = defaultdict(
            lambda: {MultiplierDimension.TIER: {}, MultiplierDimension.ZONE: {}})
        for vid, dim, key, factor in PriceMultiplier.objects.filter(
                version_id__in=version_ids).values_list("version_id", "dimension", "key",
                                                        "factor"):
            mults[vid][dim][key] = factor
        prices = (ModelPrice.objects.filter(version_id__in=version_ids, model__in=models)
                  .select_related("version").prefetch_related("bands"))
        by_version_model: dict[tuple[int, str], ModelPricing] = {}
        for row in prices:
            book_id = row.version.price_book_id
            m = mults[row.version_id]
            by_version_model[(row.version_id, row.model)] = ModelPricing(
                version_id=row.version_id, currency=self.currency[book_id], model=row.model,
                base=PriceSet.of(row),
                bands=tuple((b.above_prompt_tokens, PriceSet.of(b))
                            for b in sorted(row.bands.all(), key=lambda b: b.above_prompt_tokens)),
                tier=m[MultiplierDimension.TIER], zone=m[MultiplierDimension.ZONE],
            )
        # (book, model) -> (effective_from list, pricing-or-None list), for bisect per event.
        self._series: dict[tuple[int, str], tuple[list[datetime], list[ModelPricing | None]]] = {}
        for book_id, rows in relevant.items():
            times = [eff for _, eff in rows]
            for model in models:
                self._series[(book_id, model)] = (
                    times, [by_version_model.get((vid, model)) for vid, _ in rows])

    def series(self, book_id: int | None, model: str
               ) -> tuple[list[datetime], list[ModelPricing | None]]:
        """Return (effective_from list, pricing-or-None list) of a model in a book."""
        return self._series.get((book_id, model), ([], [])) if book_id else ([], [])


# --- token-plan state --------------------------------------------------------------------------

class _Window:
    """Credits by event time for one subscription: sum over (lo, hi] in O(log n)."""

    __slots__ = ("cums", "times")

    def __init__(self) -> None:
        self.times: list[datetime] = []
        self.cums: list[Decimal] = [ZERO]  # cums[i] = credits of the first i entries

    def add(self, t: datetime, credits: Decimal) -> None:
        i = bisect_right(self.times, t)
        self.times.insert(i, t)
        if i == len(self.times) - 1:
            self.cums.append(self.cums[-1] + credits)
            return
        self.cums.insert(i + 1, self.cums[i] + credits)
        for k in range(i + 2, len(self.cums)):
            self.cums[k] += credits

    def between(self, lo: datetime, hi: datetime) -> Decimal:
        return self.cums[bisect_right(self.times, hi)] - self.cums[bisect_right(self.times, lo)]


@dataclass(slots=True)
class _Split:
    plan: Decimal
    pack: Decimal
    overage: Decimal

    @property
    def total(self) -> Decimal:
        return self.plan + self.pack + self.overage


class _PlanState:
    """Token-plan counters for the batch's subscriptions, loaded once, written back once."""

    def __init__(self, facts: list[tuple[UsageFacts, Subscription]], *, record: bool):
        self.record = record
        subs = {sub.id: sub for _, sub in facts}
        ids = sorted(subs)
        if record:
            # Serialize with every other batch touching these subscriptions (see module doc).
            list(Subscription.objects.select_for_update().filter(id__in=ids).order_by("id")
                 .values_list("id", flat=True))
        min_t = min(f.event_time for f, _ in facts)
        max_t = max(f.event_time for f, _ in facts)
        longest = max(timedelta(hours=s.plan.window_hours) for s in subs.values())
        self.stored: dict[tuple[int, str], _Split] = {}
        if record:
            for sub_id, rid, plan, pack, over in TokenPlanUsage.objects.filter(
                    subscription_id__in=ids,
                    request_id__in={f.request_id for f, _ in facts}).values_list(
                    "subscription_id", "request_id", "plan_credits", "pack_credits",
                    "overage_credits"):
                self.stored[(sub_id, rid)] = _Split(plan, pack, over)
        self.windows: dict[int, _Window] = defaultdict(_Window)
        for sub_id, t, credits in (TokenPlanUsage.objects
                                   .filter(subscription_id__in=ids, event_time__gt=min_t - longest,
                                           event_time__lte=max_t)
                                   .order_by("event_time").values_list(
                                       "subscription_id", "event_time", "plan_credits")):
            self.windows[sub_id].add(t, credits)
        starts = {period_bounds(sub.billing_anchor, f.event_time)[0] for f, sub in facts}
        self.periods: dict[tuple[int, datetime], TokenPlanPeriod] = {
            (p.subscription_id, p.period_start): p
            for p in TokenPlanPeriod.objects.filter(subscription_id__in=ids,
                                                    period_start__in=starts)}
        self.packs: dict[int, list[CreditPackPurchase]] = defaultdict(list)
        for purchase in (CreditPackPurchase.objects
                         .filter(subscription_id__in=ids, credits_used__lt=F("credits"))
                         .order_by(F("expires_at").asc(nulls_last=True), "purchased_at", "id")):
            self.packs[purchase.subscription_id].append(purchase)
        self.new_usage: list[TokenPlanUsage] = []
        self.dirty_periods: set[tuple[int, datetime]] = set()
        self.dirty_packs: dict[int, CreditPackPurchase] = {}

    def period(self, sub: Subscription, t: datetime) -> TokenPlanPeriod:
        start, end = period_bounds(sub.billing_anchor, t)
        row = self.periods.get((sub.id, start))
        if row is None:
            row = TokenPlanPeriod(subscription_id=sub.id, period_start=start, period_end=end,
                                  plan_credits=ZERO, pack_credits=ZERO, overage_credits=ZERO)
            self.periods[(sub.id, start)] = row
        return row

    def take_packs(self, sub: Subscription, need: Decimal, t: datetime) -> Decimal:
        taken = ZERO
        for purchase in self.packs.get(sub.id, ()):
            if need <= 0:
                break
            if purchase.purchased_at > t or (purchase.expires_at and purchase.expires_at <= t):
                continue
            part = min(purchase.credits_left, need)
            if part > 0:
                purchase.credits_used += part
                self.dirty_packs[purchase.id] = purchase
                taken += part
                need -= part
        return taken

    def consume(self, sub: Subscription, f: UsageFacts, credits: Decimal) -> _Split:
        """Split ``credits`` into plan / pack / overage and book it (once per request id)."""
        stored = self.stored.get((sub.id, f.request_id))
        if stored is not None:
            return stored
        plan = sub.plan
        t = f.event_time
        period = self.period(sub, t)
        room = plan.credits_per_period - period.plan_credits
        window = self.windows[sub.id]
        if plan.window_credits is not None:
            used = window.between(t - timedelta(hours=plan.window_hours), t)
            room = min(room, plan.window_credits - used)
        room = max(room, ZERO)
        in_plan = min(credits, room)
        rest = credits - in_plan
        pack = self.take_packs(sub, rest, t) if rest > 0 else ZERO
        rest -= pack
        overage = ZERO
        if rest > 0:
            if plan.cap_policy == CapPolicy.OVERAGE:
                overage = rest
            else:
                # Block: admission refuses past the cap; what it let through (at most the last
                # request's excess) is covered by the plan and counted, so the next one is
                # refused.
                in_plan += rest
        split = _Split(in_plan, pack, overage)
        window.add(t, in_plan)
        period.plan_credits += in_plan
        period.pack_credits += pack
        period.overage_credits += overage
        self.dirty_periods.add((sub.id, period.period_start))
        self.stored[(sub.id, f.request_id)] = split
        if self.record:
            self.new_usage.append(TokenPlanUsage(
                subscription_id=sub.id, request_id=f.request_id, event_time=t,
                period_start=period.period_start, plan_credits=in_plan, pack_credits=pack,
                overage_credits=overage))
        return split

    def flush(self) -> None:
        if not self.record:
            return
        now = timezone.now()
        if self.new_usage:
            TokenPlanUsage.objects.bulk_create(self.new_usage, batch_size=5000)
        if self.dirty_periods:
            rows = [self.periods[key] for key in sorted(self.dirty_periods)]
            for row in rows:
                row.updated_at = now
            TokenPlanPeriod.objects.bulk_create(
                rows, update_conflicts=True, unique_fields=["subscription", "period_start"],
                update_fields=["plan_credits", "pack_credits", "overage_credits", "updated_at"])
        if self.dirty_packs:
            CreditPackPurchase.objects.bulk_update(list(self.dirty_packs.values()),
                                                   ["credits_used"])


# --- the batch ---------------------------------------------------------------------------------

def _validate(f: UsageFacts) -> None:
    if f.event_time.tzinfo is None:
        raise InvalidRequest(f"{f.request_id}: event_time must be timezone-aware",
                             param="event_time")
    if min(f.prompt_tokens, f.cached_tokens, f.completion_tokens, f.cache_write_tokens) < 0:
        raise InvalidRequest(f"{f.request_id}: token counts must be >= 0", param="tokens")
    if f.cached_tokens + f.cache_write_tokens > f.prompt_tokens:
        raise InvalidRequest(f"{f.request_id}: cached + cache-write tokens exceed the prompt",
                             param="cached_tokens")
    if f.service_tier not in _TIERS:
        raise InvalidRequest(f"{f.request_id}: unknown service tier {f.service_tier!r}",
                             param="service_tier")


class _Batch:
    """Everything rating a batch needs, loaded with a fixed number of queries."""

    def __init__(self, facts: list[UsageFacts], *, record: bool):
        self.facts = facts
        org_ids = {f.org_id for f in facts}
        models = {f.model for f in facts}
        times = [f.event_time for f in facts]
        min_t, max_t = min(times), max(times)
        self.org_currency: dict[int, str] = dict(
            Organization.objects.filter(id__in=org_ids).values_list("id", "currency"))
        missing = org_ids - self.org_currency.keys()
        if missing:
            raise InvalidRequest(f"Unknown organization id(s): {sorted(missing)}", param="org_id")
        self.subs: dict[int, list[Subscription]] = defaultdict(list)
        for sub in (Subscription.objects.select_related("plan")
                    .filter(organization_id__in=org_ids, starts_at__lte=max_t)
                    .filter(Q(ends_at__isnull=True) | Q(ends_at__gt=min_t))
                    .order_by("starts_at")):
            self.subs[sub.organization_id].append(sub)
        token_plan_ids = {s.plan_id for subs in self.subs.values() for s in subs
                          if s.plan.kind == PlanKind.TOKEN_PLAN}
        self.coefficients: dict[int, dict[str, dict[str, Decimal]]] = defaultdict(
            lambda: defaultdict(dict))
        for plan_id, model, cls, coef in CreditCoefficient.objects.filter(
                plan_id__in=token_plan_ids).values_list("plan_id", "model", "token_class",
                                                        "coefficient"):
            self.coefficients[plan_id][model][cls] = coef
        self.reservations: dict[int, list[Reservation]] = defaultdict(list)
        if any(f.capacity_source in (CapacitySource.PROVISIONED, CapacitySource.SPILLOVER)
               for f in facts):
            for r in Reservation.objects.filter(organization_id__in=org_ids, model__in=models,
                                                starts_at__lte=max_t, ends_at__gt=min_t):
                self.reservations[r.organization_id].append(r)
        self.default_book: dict[str, int] = dict(
            PriceBook.objects.filter(is_default=True).values_list("currency", "id"))
        book_ids = set(self.default_book.values()) | {
            s.plan.price_book_id for subs in self.subs.values() for s in subs
            if s.plan.price_book_id}
        self.prices = _PriceIndex(book_ids, models, min_t, max_t)
        self._memo: dict[tuple, tuple[dict[str, Decimal], Decimal]] = {}
        self._series: dict[tuple, tuple[list[datetime], list[ModelPricing | None]]] = {}
        # (kind, subscription) per event, resolved once
        self.plan: list[tuple[str, Subscription | None]] = [self.kind_of(f) for f in facts]
        plan_facts = [(f, sub) for f, (kind, sub) in zip(facts, self.plan, strict=True)
                      if kind == _TOKEN_PLAN and sub is not None]
        self.plan_state: _PlanState | None = None
        if plan_facts:
            self.plan_state = _PlanState(plan_facts, record=record)

    def subscription(self, org_id: int, t: datetime) -> Subscription | None:
        for sub in self.subs.get(org_id, ()):
            if sub.covers(t):
                return sub
        return None

    def reservation(self, f: UsageFacts) -> Reservation | None:
        for r in self.reservations.get(f.org_id, ()):
            if r.model == f.model and r.region == f.region and r.covers(f.event_time):
                return r
        return None

    def coefficients_for(self, sub: Subscription, model: str) -> dict[str, Decimal] | None:
        per_model = self.coefficients.get(sub.plan_id)
        if not per_model:
            return None
        return per_model.get(model) or per_model.get(ANY_MODEL)

    def kind_of(self, f: UsageFacts) -> tuple[str, Subscription | None]:
        """Return which rater prices ``f`` and the subscription in force at its time."""
        sub = self.subscription(f.org_id, f.event_time) if self.subs else None
        source = f.capacity_source
        if source == _PROVISIONED:
            return _PROVISIONED_KIND, sub
        if source == _SPILLOVER:
            return _ON_DEMAND, sub
        if (sub is not None and sub.plan.kind == PlanKind.TOKEN_PLAN
                and self.coefficients_for(sub, f.model) is not None):
            return _TOKEN_PLAN, sub
        return _ON_DEMAND, sub

    def book_of(self, org_id: int, sub: Subscription | None) -> tuple[int | None, str]:
        """Return the price book (and currency) an org is rated with: its plan's, else default."""
        if sub is not None and sub.plan.price_book_id:
            book_id = sub.plan.price_book_id
            return book_id, self.prices.currency.get(book_id, sub.plan.currency)
        currency = sub.plan.currency if sub is not None else self.org_currency[org_id]
        return self.default_book.get(currency), currency

    def pricing(self, f: UsageFacts, sub: Subscription | None) -> ModelPricing:
        """Return the prices in force for ``f`` at its event time (bisect over versions)."""
        key = (f.org_id, sub.id if sub is not None else None, f.model)
        series = self._series.get(key)
        if series is None:
            book_id, _ = self.book_of(f.org_id, sub)
            series = self.prices.series(book_id, f.model)
            self._series[key] = series
        i = bisect_right(series[0], f.event_time) - 1
        pricing = series[1][i] if i >= 0 else None
        if pricing is None:
            _, currency = self.book_of(f.org_id, sub)
            raise UnpricedModel(
                f"{f.request_id}: no {currency} price for model {f.model!r} at "
                f"{f.event_time.isoformat()}", param="model")
        return pricing

    def on_demand(self, f: UsageFacts, sub: Subscription | None
                  ) -> tuple[ModelPricing, dict[str, Decimal], Decimal]:
        """Return the pricing, rounded lines and amount of ``f`` at on-demand prices."""
        pricing = self.pricing(f, sub)
        key = (id(pricing), f.prompt_tokens, f.cached_tokens, f.completion_tokens,
               f.cache_write_tokens, f.service_tier, f.data_zone)
        hit = self._memo.get(key)
        if hit is None:
            hit = _rounded(exact_lines(pricing, f))
            self._memo[key] = hit
        return pricing, hit[0], hit[1]

    def rate_all(self) -> list[Rating]:
        """Rate the batch's events in order; token-plan state changes as it goes."""
        raters = RATERS
        return [raters[kind](self, f, sub)
                for (kind, sub), f in zip(self.plan, self.facts, strict=True)]


# --- the raters (one per kind) -------------------------------------------------------------

def rate_on_demand(batch: _Batch, f: UsageFacts, sub: Subscription | None) -> Rating:
    """Return the price book's amount (x tier x zone); spillover keeps its mark."""
    pricing, lines, amount = batch.on_demand(f, sub)
    spill = f.capacity_source == _SPILLOVER
    return Rating(
        amount, pricing.currency, pricing.version_id, dict(lines), ZERO, 0,
        _SPILLOVER if spill else _ON_DEMAND_SOURCE, _ON_DEMAND,
        sub.id if sub is not None else None,
        r.id if spill and (r := batch.reservation(f)) is not None else None,
    )


def rate_token_plan(batch: _Batch, f: UsageFacts, sub: Subscription | None) -> Rating:
    """Return 0 inside the plan's credits (packs next), on-demand prices for the overage part."""
    if sub is None or batch.plan_state is None:  # kind_of only sends us covered events
        return rate_on_demand(batch, f, sub)
    coef = batch.coefficients_for(sub, f.model) or {}
    uncached = f.prompt_tokens - f.cached_tokens - f.cache_write_tokens
    with localcontext(_EXACT):
        credits = (uncached * coef.get(TokenClass.INPUT, ZERO)
                   + f.cached_tokens * coef.get(TokenClass.CACHED_INPUT, ZERO)
                   + f.completion_tokens * coef.get(TokenClass.OUTPUT, ZERO)
                   + f.cache_write_tokens * coef.get(TokenClass.CACHE_WRITE,
                                                     coef.get(TokenClass.INPUT, ZERO)))
        credits = credits.quantize(CREDIT_QUANTUM, rounding=ROUND_CEILING)
    split = batch.plan_state.consume(sub, f, credits)
    pricing = batch.pricing(f, sub)
    if split.overage > 0:
        with localcontext(_EXACT):
            lines, amount = _rounded(exact_lines(pricing, f), split.overage / split.total)
        source = CapacitySource.OVERAGE
    else:
        lines, amount = dict.fromkeys(_CLASSES, ZERO), ZERO
        source = CapacitySource.PLAN
    return Rating(
        amount=amount, currency=pricing.currency, price_version_id=pricing.version_id,
        breakdown=lines, credits_consumed=split.plan + split.pack, normalized_tokens=0,
        capacity_source=source, rating_kind=RatingKind.TOKEN_PLAN, subscription_id=sub.id,
        pack_credits=split.pack, overage_credits=split.overage,
    )


def rate_provisioned(batch: _Batch, f: UsageFacts, sub: Subscription | None) -> Rating:
    """Return 0 per token inside a reservation, with its normalized (burndown) tokens."""
    reservation = batch.reservation(f)
    if reservation is None:
        # No reservation covers it: never serve free tokens; price it as on-demand.
        return rate_on_demand(batch, f, sub)
    pricing = batch.pricing(f, sub)
    return Rating(
        amount=ZERO, currency=pricing.currency, price_version_id=pricing.version_id,
        breakdown=dict.fromkeys(_CLASSES, ZERO), credits_consumed=ZERO,
        normalized_tokens=normalized_tokens(
            prompt_tokens=f.prompt_tokens, cached_tokens=f.cached_tokens,
            completion_tokens=f.completion_tokens, cache_burndown=reservation.cache_burndown,
            output_burndown=reservation.output_burndown),
        capacity_source=CapacitySource.PROVISIONED, rating_kind=RatingKind.PROVISIONED,
        subscription_id=sub.id if sub is not None else None, reservation_id=reservation.id,
    )


RATERS: dict[str, Callable[[_Batch, UsageFacts, Subscription | None], Rating]] = {
    RatingKind.ON_DEMAND: rate_on_demand,
    RatingKind.TOKEN_PLAN: rate_token_plan,
    RatingKind.PROVISIONED: rate_provisioned,
}


# --- entry points ------------------------------------------------------------------------------

def rate_usage_batch(facts: Sequence[UsageFacts]) -> list[Rating]:
    """Rate a batch of events in order (bulk: one price-book lookup per (currency, model)).

    Call it inside the transaction that stores the events: token-plan credits are booked in
    the same transaction (see the module docstring). A fixed number of queries per batch,
    whatever its size. Raises ``InvalidRequest`` (``UnpricedModel`` for a model with no price
    at its event time) and rates nothing when any event is invalid.
    """
    facts = list(facts)
    if not facts:
        return []
    for f in facts:
        _validate(f)
    with transaction.atomic():
        batch = _Batch(facts, record=True)
        ratings = batch.rate_all()
        if batch.plan_state is not None:
            batch.plan_state.flush()
    return ratings


def quote(
    *,
    org_id: int,
    model: str,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int = 0,
    service_tier: str = "default",
    data_zone: str | None = None,
    capacity_source: str = "on_demand",
    region: str = "",
    cache_write_tokens: int = 0,
    at: datetime | None = None,
) -> Rating:
    """Return what these hypothetical token counts would cost ``org_id`` now; write nothing.

    Under a token plan the answer reflects the credits left right now (read, not reserved).
    """
    if data_zone is None:
        data_zone = (Organization.objects.filter(id=org_id)
                     .values_list("data_zone", flat=True).first() or "global")
    f = UsageFacts(
        request_id=f"quote:{uuid.uuid4()}", org_id=org_id, project_id=None, api_key_id=None,
        model=model, region=region, data_zone=data_zone, service_tier=service_tier,
        capacity_source=capacity_source, prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens, completion_tokens=completion_tokens,
        event_time=at or timezone.now(), cache_write_tokens=cache_write_tokens,
    )
    _validate(f)
    return _Batch([f], record=False).rate_all()[0]
