"""Writes of the plans app: price books and versions, plans, subscriptions, reservations, credits.

Every function is keyword-only and named ``<entity>_<verb>``. Rules a user would notice live
here: a price version may not take effect in the past (events already rated would no longer be
explainable), one subscription per organization at any instant, grants applied oldest-expiry
first and once per reference.

Length: a little over the house's 500 lines; each use case is one short function, and split by
entity the modules would import each other (a subscription change grants credits and quotes
prices). Split it into a package when a new family of writes arrives.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import ROUND_CEILING, Context, Decimal, localcontext
from typing import Any

from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from billing_platform.accounts.models import Organization, User
from billing_platform.audit.services import audit_record, audit_snapshot
from billing_platform.errors import Conflict, InvalidRequest
from plans.choices import (
    DEFAULT_TIER_MULTIPLIERS,
    DEFAULT_ZONE_MULTIPLIERS,
    MultiplierDimension,
    PlanKind,
    ReservationTerm,
    TokenClass,
)
from plans.models import (
    ContextBand,
    CreditCoefficient,
    CreditGrant,
    CreditGrantApplication,
    CreditPack,
    CreditPackPurchase,
    ModelPrice,
    Plan,
    PriceBook,
    PriceMultiplier,
    PriceVersion,
    ProvisionedOffering,
    Reservation,
    Subscription,
    TokenPlanPeriod,
    TokenPlanUsage,
)
from plans.periods import add_months, period_bounds

PRICE_FIELDS = ("input", "cached_input", "output", "cache_write")


def _aware(value: datetime, param: str) -> datetime:
    if timezone.is_naive(value):
        raise InvalidRequest(f"{param} must be timezone-aware", param=param)
    return value


def _decimal(value: Any, param: str) -> Decimal:
    if isinstance(value, float):
        raise InvalidRequest(f"{param}: give money as a string or Decimal, not a float",
                             param=param)
    try:
        result = Decimal(str(value)) if not isinstance(value, Decimal) else value
    except ArithmeticError as exc:
        raise InvalidRequest(f"{param}: not a number: {value!r}", param=param) from exc
    if not result.is_finite() or result < 0:
        raise InvalidRequest(f"{param} must be a finite number >= 0", param=param)
    return result


# --- price books -------------------------------------------------------------------------------

def price_book_create(*, code: str, name: str, currency: str, is_default: bool = False,
                      acting_user: Any = None) -> PriceBook:
    """Create an empty price book; a default book replaces the currency's previous default."""
    currency = currency.upper()
    with transaction.atomic():
        if is_default:
            PriceBook.objects.filter(currency=currency, is_default=True).update(is_default=False)
        book = PriceBook.objects.create(code=code, name=name, currency=currency,
                                        is_default=is_default)
        audit_record(acting_user=acting_user, organization=None, action="price_book.create",
                     target=book.code, after=audit_snapshot(book))
        return book


@dataclass(frozen=True)
class ModelPriceSpec:
    """Prices of one model in a new version: per 1M tokens, decimals (strings are fine)."""

    model: str
    input: Decimal
    output: Decimal
    cached_input: Decimal | None = None
    cache_write: Decimal | None = None
    bands: tuple[Mapping[str, Any], ...] = ()  # {"above_prompt_tokens": N, "input": ..., ...}


def _spec(raw: ModelPriceSpec | Mapping[str, Any]) -> ModelPriceSpec:
    if isinstance(raw, ModelPriceSpec):
        return raw
    model = str(raw.get("model", "")).strip()
    if not model:
        raise InvalidRequest("every price needs a model", param="prices")
    return ModelPriceSpec(
        model=model, input=_decimal(raw["input"], f"{model}.input"),
        output=_decimal(raw["output"], f"{model}.output"),
        cached_input=(None if raw.get("cached_input") is None
                      else _decimal(raw["cached_input"], f"{model}.cached_input")),
        cache_write=(None if raw.get("cache_write") is None
                     else _decimal(raw["cache_write"], f"{model}.cache_write")),
        bands=tuple(raw.get("bands") or ()),
    )


def price_version_create(
    *,
    price_book: PriceBook,
    effective_from: datetime,
    prices: Iterable[ModelPriceSpec | Mapping[str, Any]] = (),
    tier_multipliers: Mapping[str, Any] | None = None,
    zone_multipliers: Mapping[str, Any] | None = None,
    remove_models: Iterable[str] = (),
    note: str = "",
    allow_backdate: bool = False,
    acting_user: Any = None,
) -> PriceVersion:
    """Create the version of ``price_book`` in force from ``effective_from``.

    It starts as a copy of the version in force just before (prices, bands, multipliers), then
    ``prices`` replace or add models, ``remove_models`` delist models, and the multiplier maps
    replace single factors. A first version starts from the default multipliers. Taking effect
    in the past is refused unless ``allow_backdate`` (seeding, tests): events already rated
    keep the version they were rated with.
    """
    _aware(effective_from, "effective_from")
    if not allow_backdate and effective_from < timezone.now():
        raise InvalidRequest("A price version cannot take effect in the past.",
                             param="effective_from")
    specs = [_spec(p) for p in prices]
    with transaction.atomic():
        PriceBook.objects.select_for_update().get(pk=price_book.pk)
        if PriceVersion.objects.filter(price_book=price_book,
                                       effective_from=effective_from).exists():
            raise Conflict("A version of this book already takes effect at that instant.",
                           param="effective_from")
        previous = (PriceVersion.objects.filter(price_book=price_book,
                                                effective_from__lt=effective_from)
                    .order_by("-effective_from").first())
        version = PriceVersion.objects.create(price_book=price_book,
                                              effective_from=effective_from, note=note)
        tiers = dict(DEFAULT_TIER_MULTIPLIERS)
        zones = dict(DEFAULT_ZONE_MULTIPLIERS)
        replaced = {s.model for s in specs} | set(remove_models)
        if previous is not None:
            tiers = {}
            zones = {}
            for m in previous.multipliers.all():
                (tiers if m.dimension == MultiplierDimension.TIER else zones)[m.key] = m.factor
            for old in previous.prices.exclude(model__in=replaced).prefetch_related("bands"):
                _copy_model_price(old, version)
        tiers.update({k: _decimal(v, f"tier.{k}") for k, v in (tier_multipliers or {}).items()})
        zones.update({k: _decimal(v, f"zone.{k}") for k, v in (zone_multipliers or {}).items()})
        PriceMultiplier.objects.bulk_create(
            [PriceMultiplier(version=version, dimension=MultiplierDimension.TIER, key=k,
                             factor=v) for k, v in sorted(tiers.items())]
            + [PriceMultiplier(version=version, dimension=MultiplierDimension.ZONE, key=k,
                               factor=v) for k, v in sorted(zones.items())])
        for spec in specs:
            row = ModelPrice.objects.create(
                version=version, model=spec.model, input=spec.input, output=spec.output,
                cached_input=spec.cached_input, cache_write=spec.cache_write)
            for band in spec.bands:
                above = int(band["above_prompt_tokens"])
                ContextBand.objects.create(
                    model_price=row, above_prompt_tokens=above,
                    input=_decimal(band["input"], f"{spec.model}.band.input"),
                    output=_decimal(band["output"], f"{spec.model}.band.output"),
                    cached_input=(None if band.get("cached_input") is None else
                                  _decimal(band["cached_input"], f"{spec.model}.band.cached")),
                    cache_write=(None if band.get("cache_write") is None else
                                 _decimal(band["cache_write"], f"{spec.model}.band.write")),
                )
        audit_record(acting_user=acting_user, organization=None, action="price_version.create",
                     target=price_book.code, after={
                         "effective_from": effective_from, "note": note,
                         "prices": {s.model: {"input": s.input, "output": s.output,
                                              "cached_input": s.cached_input} for s in specs},
                         "remove_models": sorted(replaced - {s.model for s in specs}),
                         "tier_multipliers": tier_multipliers,
                         "zone_multipliers": zone_multipliers})
        return version


def _copy_model_price(old: ModelPrice, version: PriceVersion) -> None:
    bands = list(old.bands.all())
    old.pk = None
    old.version = version
    old.save()
    for band in bands:
        band.pk = None
        band.model_price = old
        band.save()


# --- plans -------------------------------------------------------------------------------------

def plan_create(
    *,
    code: str,
    name: str,
    kind: str,
    currency: str = "USD",
    price_book: PriceBook | None = None,
    monthly_fee: Decimal | str = "0",
    credits_per_period: Decimal | str | None = None,
    window_credits: Decimal | str | None = None,
    window_hours: int = 5,
    cap_policy: str = "block",
    coefficients: Iterable[Mapping[str, Any]] = (),
    description: str = "",
    is_public: bool = True,
    acting_user: Any = None,
) -> Plan:
    """Create a plan; a token plan needs credits per period and at least one coefficient."""
    coefficients = list(coefficients)
    if kind == PlanKind.TOKEN_PLAN:
        if credits_per_period is None:
            raise InvalidRequest("A token plan needs credits_per_period.",
                                 param="credits_per_period")
        if not coefficients:
            raise InvalidRequest("A token plan needs credit coefficients.",
                                 param="coefficients")
    if price_book is not None and price_book.currency != currency.upper():
        raise InvalidRequest("The price book's currency differs from the plan's.",
                             param="price_book")
    with transaction.atomic():
        plan = Plan.objects.create(
            code=code, name=name, kind=kind, currency=currency.upper(), price_book=price_book,
            monthly_fee=_decimal(monthly_fee, "monthly_fee"),
            credits_per_period=(None if credits_per_period is None
                                else _decimal(credits_per_period, "credits_per_period")),
            window_credits=(None if window_credits is None
                            else _decimal(window_credits, "window_credits")),
            window_hours=window_hours, cap_policy=cap_policy, description=description,
            is_public=is_public,
        )
        plan_set_coefficients(plan=plan, coefficients=coefficients)
        audit_record(acting_user=acting_user, organization=None, action="plan.create",
                     target=plan.code, after={**audit_snapshot(plan), "coefficients": coefficients})
        return plan


def plan_update(*, plan: Plan, acting_user: Any = None, **fields: Any) -> Plan:
    """Change a plan's editable terms (applies to its subscriptions from now on)."""
    coefficients = fields.pop("coefficients", None)
    allowed = {"name", "description", "monthly_fee", "credits_per_period", "window_credits",
               "window_hours", "cap_policy", "is_public", "is_active"}
    unknown = set(fields) - allowed
    if unknown:
        raise InvalidRequest(f"Not editable: {', '.join(sorted(unknown))}")
    for name in ("monthly_fee", "credits_per_period", "window_credits"):
        if fields.get(name) is not None:
            fields[name] = _decimal(fields[name], name)
    if (plan.kind == PlanKind.TOKEN_PLAN and "credits_per_period" in fields
            and fields["credits_per_period"] is None):
        raise InvalidRequest("A token plan needs credits_per_period.",
                             param="credits_per_period")
    with transaction.atomic():
        before = audit_snapshot(plan)
        for name, value in fields.items():
            setattr(plan, name, value)
        plan.save()
        if coefficients is not None:
            plan_set_coefficients(plan=plan, coefficients=coefficients)
        audit_record(acting_user=acting_user, organization=None, action="plan.update",
                     target=plan.code, before=before,
                     after={**audit_snapshot(plan), "coefficients": coefficients})
    return plan


def plan_set_coefficients(*, plan: Plan, coefficients: Iterable[Mapping[str, Any]]) -> None:
    """Replace a plan's credit coefficients: rows of {model, token_class, coefficient}."""
    rows = []
    for c in coefficients:
        cls = c["token_class"]
        if cls not in TokenClass.values:
            raise InvalidRequest(f"Unknown token class {cls!r}", param="coefficients")
        rows.append(CreditCoefficient(
            plan=plan, model=c.get("model") or "*", token_class=cls,
            coefficient=_decimal(c["coefficient"], f"coefficient.{cls}")))
    plan.coefficients.all().delete()
    CreditCoefficient.objects.bulk_create(rows)


def credit_pack_create(*, plan: Plan, code: str, name: str, credits: Decimal | str,
                       price: Decimal | str, validity_days: int | None = None,
                       acting_user: Any = None) -> CreditPack:
    """Offer a credit pack on a token plan."""
    if plan.kind != PlanKind.TOKEN_PLAN:
        raise InvalidRequest("Credit packs belong to token plans.", param="plan")
    with transaction.atomic():
        pack = CreditPack.objects.create(
            plan=plan, code=code, name=name, credits=_decimal(credits, "credits"),
            price=_decimal(price, "price"), validity_days=validity_days)
        audit_record(acting_user=acting_user, organization=None, action="credit_pack.create",
                     target=f"{plan.code}/{code}", after=audit_snapshot(pack))
    return pack


# --- subscriptions -----------------------------------------------------------------------------

def subscription_create(
    *,
    organization: Organization,
    plan: Plan,
    starts_at: datetime | None = None,
    ends_at: datetime | None = None,
    billing_anchor: datetime | None = None,
    data_zone: str | None = None,
    acting_user: Any = None,
) -> Subscription:
    """Put an organization on a plan from ``starts_at``; the subscription before it ends then.

    A subscription that starts later than ``starts_at`` is a conflict (cancel it first).
    """
    starts_at = _aware(starts_at or timezone.now(), "starts_at")
    if ends_at is not None and _aware(ends_at, "ends_at") <= starts_at:
        raise InvalidRequest("ends_at must be after starts_at", param="ends_at")
    if not plan.is_active:
        raise InvalidRequest("This plan is no longer offered.", param="plan")
    with transaction.atomic():
        Organization.objects.select_for_update().get(pk=organization.pk)
        current = Subscription.objects.filter(organization=organization)
        if current.filter(starts_at__gte=starts_at).exists():
            raise Conflict("A subscription starts at or after that time; cancel it first.",
                           param="starts_at")
        ended = current.filter(starts_at__lt=starts_at).filter(
            Q(ends_at__isnull=True) | Q(ends_at__gt=starts_at))
        before = [audit_snapshot(s) | {"id": s.public_id} for s in ended]
        ended.update(ends_at=starts_at)
        sub = Subscription.objects.create(
            organization=organization, plan=plan, starts_at=starts_at, ends_at=ends_at,
            billing_anchor=billing_anchor or starts_at,
            data_zone=data_zone or organization.data_zone)
        audit_record(acting_user=acting_user, organization=organization,
                     action="subscription.create", target=sub.public_id,
                     before={"ended": before} if before else None,
                     after=audit_snapshot(sub) | {"plan": plan.code})
        return sub


def subscription_cancel(*, subscription: Subscription, at: datetime | None = None,
                        acting_user: Any = None) -> Subscription:
    """End a subscription at ``at`` (default now); the organization is on-demand after it."""
    at = _aware(at or timezone.now(), "at")
    if at <= subscription.starts_at:
        raise InvalidRequest("Cannot end a subscription before it starts.", param="at")
    if subscription.ends_at is not None and subscription.ends_at <= at:
        return subscription
    with transaction.atomic():
        before = {"ends_at": subscription.ends_at}
        subscription.ends_at = at
        subscription.save(update_fields=["ends_at"])
        audit_record(acting_user=acting_user, organization=subscription.organization_id,
                     action="subscription.cancel", target=subscription.public_id,
                     before=before, after={"ends_at": at})
    return subscription


def subscription_change(*, subscription: Subscription, plan: Plan,
                        at: datetime | None = None, acting_user: Any) -> Subscription:
    """Move an organization from ``subscription`` to ``plan`` at ``at`` (default now).

    One transaction: the old subscription ends at ``at``, the new one starts then on the same
    billing anchor (the billing cycle stays, as Stripe keeps it on a plan change; invoices
    prorate both fees by time, ``selectors.subscription_months_in_period``), and unused,
    unexpired credit-pack credits move to it when the new plan is a token plan (credits bought
    are the customer's, not the old plan's). From one token plan to another, the new plan
    starts where the old one stands (``_carry_plan_credits``): a change, or a change back,
    never hands out a fresh period of credits. One audit row, ``subscription.change``.
    """
    at = _aware(at or timezone.now(), "at")
    if plan.pk == subscription.plan_id:
        raise InvalidRequest("The organization is already on this plan.", param="plan")
    if not plan.is_active:
        raise InvalidRequest("This plan is no longer offered.", param="plan")
    with transaction.atomic():
        org = Organization.objects.select_for_update().get(pk=subscription.organization_id)
        subscription.refresh_from_db()  # under the organization's lock
        if plan.currency != org.currency:
            raise InvalidRequest(f"This plan is billed in {plan.currency}; the organization "
                                 f"is invoiced in {org.currency}.", param="plan")
        if not subscription.covers(at) or at <= subscription.starts_at:
            raise InvalidRequest("The subscription is not in force at that time.",
                                 param="subscription")
        if Subscription.objects.filter(organization=org,
                                       starts_at__gt=subscription.starts_at).exists():
            raise Conflict("A later subscription is scheduled; cancel it first.",
                           param="subscription")
        old_plan, old_ends = subscription.plan, subscription.ends_at
        subscription.ends_at = at
        subscription.save(update_fields=["ends_at"])
        new = Subscription.objects.create(
            organization=org, plan=plan, starts_at=at,
            billing_anchor=subscription.billing_anchor, data_zone=subscription.data_zone)
        moved: list[str] = []
        carried: dict[str, Any] = {}
        if plan.kind == PlanKind.TOKEN_PLAN and old_plan.kind == PlanKind.TOKEN_PLAN:
            carried = _carry_plan_credits(old=subscription, new=new, at=at)
        if plan.kind == PlanKind.TOKEN_PLAN:
            packs = (CreditPackPurchase.objects
                     .filter(subscription=subscription, credits_used__lt=F("credits"))
                     .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=at)))
            moved = sorted(packs.values_list("public_id", flat=True))
            packs.update(subscription=new)
        audit_record(acting_user=acting_user, organization=org, action="subscription.change",
                     target=new.public_id,
                     before={"subscription": subscription.public_id, "plan": old_plan.code,
                             "ends_at": old_ends},
                     after=audit_snapshot(new) | {"plan": plan.code,
                                                  "ended": subscription.public_id,
                                                  "credit_packs_moved": moved, **carried})
        return new


def _scaled_up(credits: Decimal, new_cap: Decimal | None, old_cap: Decimal | None) -> Decimal:
    """``credits`` of a cap of ``old_cap`` as the same share of ``new_cap``, rounded up to the
    credits' 6 places (never in the customer's favour); unchanged when either cap is unset."""
    if not new_cap or not old_cap:
        return credits
    with localcontext(Context(prec=60)):
        return (credits * new_cap / old_cap).quantize(Decimal("0.000001"),
                                                      rounding=ROUND_CEILING)


def _carry_plan_credits(*, old: Subscription, new: Subscription, at: datetime
                        ) -> dict[str, Any]:
    """Start ``new`` (a token plan) where ``old`` (one too) stands at ``at``: the same share of
    its period's credits used, and its rolling window's use, so that switching plans back and
    forth (each change prorates only the fee) never hands out a fresh period or window.

    Credits are each plan's own unit (its coefficients price tokens differently), so what was
    used is carried as the share of the cap it took: 800 of Basic's 1,000 is 80 %, 4,000 of
    Pro's 5,000, and back again 800. The window's ledger rows are copied to ``new`` (with
    their event times, so they leave its window when they would have left the old one), each
    scaled the same way by the window caps; they are marked ``carried:`` and bill nothing.
    A late event of the old plan's time rated after the change counts on the old one only.
    """
    start, end = period_bounds(new.billing_anchor, at)  # the old plan's period: same anchor
    period = TokenPlanPeriod.objects.filter(subscription=old, period_start=start).first()
    used = Decimal(0) if period is None else _scaled_up(
        period.plan_credits, new.plan.credits_per_period, old.plan.credits_per_period)
    if used:
        TokenPlanPeriod.objects.create(subscription=new, period_start=start, period_end=end,
                                       plan_credits=used)
    hours = max(old.plan.window_hours, new.plan.window_hours)
    rows = list(TokenPlanUsage.objects.filter(
        subscription=old, event_time__gt=at - timedelta(hours=hours), event_time__lte=at,
        plan_credits__gt=0).order_by("event_time", "id"))
    TokenPlanUsage.objects.bulk_create([TokenPlanUsage(
        subscription=new, request_id=f"carried:{row.request_id}"[:200],
        event_time=row.event_time, period_start=row.period_start,
        plan_credits=_scaled_up(row.plan_credits, new.plan.window_credits,
                                old.plan.window_credits)) for row in rows])
    return {"period_credits_carried": used, "window_rows_carried": len(rows)}


def credit_pack_purchase(*, subscription: Subscription, pack: CreditPack,
                         at: datetime | None = None, acting_user: Any = None
                         ) -> CreditPackPurchase:
    """Record a bought credit pack; its price is charged on the next invoice."""
    at = _aware(at or timezone.now(), "at")
    if pack.plan_id != subscription.plan_id or not pack.is_active:
        raise InvalidRequest("This pack is not offered on the subscription's plan.",
                             param="pack")
    if not subscription.covers(at):
        raise InvalidRequest("The subscription is not active.", param="subscription")
    expires = at + timedelta(days=pack.validity_days) if pack.validity_days else None
    if subscription.ends_at is not None:
        expires = min(expires or subscription.ends_at, subscription.ends_at)
    with transaction.atomic():
        purchase = CreditPackPurchase.objects.create(
            subscription=subscription, pack=pack, credits=pack.credits, price=pack.price,
            currency=subscription.plan.currency, purchased_at=at, expires_at=expires)
        audit_record(acting_user=acting_user, organization=subscription.organization_id,
                     action="credit_pack.purchase", target=purchase.public_id,
                     after={"pack": pack.code, "credits": pack.credits, "price": pack.price,
                            "currency": purchase.currency, "expires_at": expires})
    return purchase


# --- provisioned -------------------------------------------------------------------------------

def provisioned_offering_create(*, acting_user: Any = None, **fields: Any
                                ) -> ProvisionedOffering:
    """Offer provisioned throughput of a model in a region."""
    for name in ("cache_burndown", "output_burndown", "hourly_unit_price", "monthly_unit_price"):
        if name in fields:
            fields[name] = _decimal(fields[name], name)
    with transaction.atomic():
        offering = ProvisionedOffering.objects.create(**fields)
        audit_record(acting_user=acting_user, organization=None,
                     action="provisioned_offering.create", target=str(offering.pk),
                     after=audit_snapshot(offering))
    return offering


def reservation_create(
    *,
    organization: Organization,
    offering: ProvisionedOffering,
    units: int,
    term: str,
    term_count: int = 1,
    starts_at: datetime | None = None,
    overflow_policy: str = "spillover",
    acting_user: Any = None,
) -> Reservation:
    """Reserve ``units`` of an offering for ``term_count`` terms, copying its current terms."""
    starts_at = _aware(starts_at or timezone.now(), "starts_at")
    if not offering.is_active:
        raise InvalidRequest("This offering is no longer sold.", param="offering")
    if units < offering.min_units:
        raise InvalidRequest(f"At least {offering.min_units} units.", param="units")
    if term_count < 1:
        raise InvalidRequest("term_count must be >= 1", param="term_count")
    if term == ReservationTerm.HOURLY:
        ends_at, unit_price = starts_at + timedelta(hours=term_count), offering.hourly_unit_price
    elif term == ReservationTerm.MONTHLY:
        ends_at, unit_price = add_months(starts_at, term_count), offering.monthly_unit_price
    else:
        raise InvalidRequest(f"Unknown term {term!r}", param="term")
    with transaction.atomic():
        reservation = Reservation.objects.create(
            organization=organization, offering=offering, model=offering.model,
            region=offering.region, units=units, term=term, term_count=term_count,
            unit_price=unit_price, currency=offering.currency,
            tokens_per_minute_per_unit=offering.tokens_per_minute_per_unit,
            cache_burndown=offering.cache_burndown, output_burndown=offering.output_burndown,
            overflow_policy=overflow_policy, starts_at=starts_at, ends_at=ends_at)
        audit_record(acting_user=acting_user, organization=organization,
                     action="reservation.create", target=reservation.public_id,
                     after=audit_snapshot(reservation))
    return reservation


def reservation_update(*, reservation: Reservation, overflow_policy: str | None = None,
                       ends_at: datetime | None = None, acting_user: Any = None
                       ) -> Reservation:
    """Change a reservation's overflow policy or end it early (staff)."""
    before = {"overflow_policy": reservation.overflow_policy, "ends_at": reservation.ends_at}
    if overflow_policy is not None:
        reservation.overflow_policy = overflow_policy
    if ends_at is not None:
        if _aware(ends_at, "ends_at") <= reservation.starts_at:
            raise InvalidRequest("ends_at must be after starts_at", param="ends_at")
        reservation.ends_at = ends_at
    with transaction.atomic():
        reservation.save()
        audit_record(acting_user=acting_user, organization=reservation.organization_id,
                     action="reservation.update", target=reservation.public_id, before=before,
                     after={"overflow_policy": reservation.overflow_policy,
                            "ends_at": reservation.ends_at})
    return reservation


def reservation_renew(*, reservation: Reservation, term_count: int = 1,
                      at: datetime | None = None, acting_user: Any = None) -> Reservation:
    """Reserve the same units of the same offering for ``term_count`` more terms, from the
    reservation's end (or from ``at``, when it has ended): the renewal is a new reservation, at
    the offering's terms of today, billed as any other."""
    at = _aware(at or timezone.now(), "at")
    with transaction.atomic():
        renewal = reservation_create(
            organization=reservation.organization, offering=reservation.offering,
            units=reservation.units, term=reservation.term, term_count=term_count,
            starts_at=max(at, reservation.ends_at),
            overflow_policy=reservation.overflow_policy, acting_user=acting_user)
        audit_record(acting_user=acting_user, organization=reservation.organization_id,
                     action="reservation.renew", target=reservation.public_id,
                     after={"renewal": renewal.public_id, "starts_at": renewal.starts_at,
                            "ends_at": renewal.ends_at, "fee": renewal.fee,
                            "currency": renewal.currency})
    return renewal


RESERVATION_REQUEST = "reservation.request"


def reservation_request(*, organization: Organization, offering: ProvisionedOffering,
                        units: int, term: str, term_count: int = 1,
                        renews: Reservation | None = None, note: str = "",
                        acting_user: Any = None) -> str:
    """Ask staff for a reservation (or a renewal of ``renews``) where customers do not buy
    them themselves; return the request's id.

    Nothing is reserved or billed: the request is one audit row (``reservation.request``, with
    the fee at today's prices), which staff read in the whole-platform audit log and act on
    with ``reservation_create``. Refused as ``reservation_create`` would refuse it.
    """
    if not offering.is_active:
        raise InvalidRequest("This offering is no longer sold.", param="offering")
    if units < offering.min_units:
        raise InvalidRequest(f"At least {offering.min_units} units.", param="units")
    if term_count < 1:
        raise InvalidRequest("term_count must be >= 1", param="term_count")
    prices: dict[str, Decimal] = {ReservationTerm.HOURLY: offering.hourly_unit_price,
                                  ReservationTerm.MONTHLY: offering.monthly_unit_price}
    if term not in prices:
        raise InvalidRequest(f"Unknown term {term!r}", param="term")
    if renews is not None and renews.organization_id != organization.pk:
        raise InvalidRequest("No such reservation.", param="reservation")
    with transaction.atomic():
        row = audit_record(
            acting_user=acting_user, organization=organization, action=RESERVATION_REQUEST,
            target=renews.public_id if renews is not None else offering.code,
            after={"offering": offering.code, "model": offering.model,
                   "region": offering.region, "units": units, "term": term,
                   "term_count": term_count, "renews": renews.public_id if renews else None,
                   "fee": units * prices[term] * term_count, "currency": offering.currency,
                   "note": note})
    return row.public_id


# --- credit grants -----------------------------------------------------------------------------

def credit_grant_create(
    *,
    organization: Organization,
    kind: str,
    amount: Decimal | str,
    currency: str | None = None,
    expires_at: datetime | None = None,
    note: str = "",
    created_by: User | None = None,
    granted_at: datetime | None = None,
    acting_user: Any = None,
) -> CreditGrant:
    """Grant an organization credit (money), usable until ``expires_at``."""
    value = _decimal(amount, "amount")
    if value <= 0:
        raise InvalidRequest("amount must be > 0", param="amount")
    if expires_at is not None:
        _aware(expires_at, "expires_at")
    with transaction.atomic():
        grant = CreditGrant.objects.create(
            organization=organization, kind=kind,
            currency=(currency or organization.currency).upper(), amount=value, remaining=value,
            expires_at=expires_at, note=note, created_by=created_by,
            granted_at=granted_at or timezone.now())
        audit_record(acting_user=acting_user or created_by, organization=organization,
                     action="credit_grant.create", target=grant.public_id,
                     after=audit_snapshot(grant))
    return grant


def credit_grants_apply(
    *, organization: Organization, currency: str, amount: Decimal, reference: str,
    at: datetime | None = None, kinds: Collection[str] | None = None,
) -> list[CreditGrantApplication]:
    """Use the organization's credit against ``amount``, oldest expiry first; once per reference.

    Only grants of ``kinds`` are used when it is given (invoicing applies discount credit
    before tax and a credit balance after it). Returns the applications (empty when there is
    no credit). Calling it again with the same ``reference`` returns the applications made the
    first time and takes nothing more.
    """
    at = _aware(at or timezone.now(), "at")
    amount = _decimal(amount, "amount")
    with transaction.atomic():
        grants = list(
            CreditGrant.objects.select_for_update()
            .filter(organization=organization, currency=currency.upper(), granted_at__lte=at,
                    **({} if kinds is None else {"kind__in": list(kinds)}))
            .order_by(F("expires_at").asc(nulls_last=True), "granted_at", "id"))
        done = list(CreditGrantApplication.objects.filter(
            grant__organization=organization, reference=reference).order_by("id"))
        if done:
            return done
        applications = []
        left = amount
        for grant in grants:
            if left <= 0:
                break
            if grant.remaining <= 0 or (grant.expires_at is not None and grant.expires_at <= at):
                continue
            part = min(grant.remaining, left)
            grant.remaining -= part
            grant.save(update_fields=["remaining"])
            applications.append(CreditGrantApplication.objects.create(
                grant=grant, reference=reference, amount=part, applied_at=at))
            left -= part
        return applications
