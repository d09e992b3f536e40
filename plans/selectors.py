"""Reads of the plans app: what is in force, what a customer holds, what is left of it.

Length: every read of the app is here (STYLE.md), the querysets admission compiles included
(``plans.admission.loading`` builds its token-plan reads from ``token_plan_period``,
``token_plan_window_usage`` and ``credit_packs_in_force``, and computes the status with
``token_plan_status_of`` as ``token_plan_status`` does); split, a read and the status it feeds
would sit in two modules.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import ROUND_HALF_EVEN, Context, Decimal, localcontext
from typing import Any, NamedTuple

from django.db.models import F, Min, Q, QuerySet, Sum
from django.utils import timezone

from billing_platform.accounts.models import Organization
from billing_platform.db import reading_connection
from engine_adapter.selectors import zone_regions
from metering.provisioned_usage import provisioned_usage_by_hour
from metering.selectors import usage_events_outside_regions
from plans.choices import PlanKind, ReservationTerm
from plans.models import (
    BudgetAlert,
    CreditGrant,
    CreditPack,
    CreditPackPurchase,
    ModelPrice,
    Plan,
    PriceBook,
    PriceVersion,
    ProvisionedOffering,
    Reservation,
    Subscription,
    TokenPlanPeriod,
    TokenPlanUsage,
    WebhookDelivery,
    WebhookEndpoint,
)
from plans.periods import add_months, period_bounds
from plans.pricing import PriceSet

ZERO = Decimal("0")


def price_books_visible(*, staff: bool) -> QuerySet[PriceBook]:
    """Return the books a caller may read: staff all, customers the public default books."""
    books = PriceBook.objects.order_by("currency", "code")
    return books if staff else books.filter(is_default=True)


def price_version_at(*, price_book: PriceBook, at: datetime | None = None
                     ) -> PriceVersion | None:
    """Return the version of ``price_book`` in force at ``at`` (default now)."""
    return (PriceVersion.objects.filter(price_book=price_book,
                                        effective_from__lte=at or timezone.now())
            .order_by("-effective_from").first())


def plans_visible(*, staff: bool) -> QuerySet[Plan]:
    """Return the plans a caller may read: staff all, customers the public active ones."""
    plans = Plan.objects.select_related("price_book").prefetch_related(
        "coefficients", "credit_packs").order_by("code")
    return plans if staff else plans.filter(is_public=True, is_active=True)


def plans_offered(*, currency: str) -> QuerySet[Plan]:
    """Return the plans a customer invoiced in ``currency`` may choose itself (public,
    active, in that currency: a plan fee in another currency would never be invoiced)."""
    return plans_visible(staff=False).filter(currency=currency.upper())


def credit_packs_offered(*, plan: Plan) -> QuerySet[CreditPack]:
    """Return the credit packs on sale for a plan, smallest first."""
    return CreditPack.objects.filter(plan=plan, is_active=True).order_by("credits", "code")


def pack_purchases_of(*, subscription: Subscription) -> QuerySet[CreditPackPurchase]:
    """Return a subscription's credit-pack purchases, newest first."""
    return (CreditPackPurchase.objects.filter(subscription=subscription)
            .select_related("pack").order_by("-purchased_at", "-id"))


def offerings_visible(*, staff: bool) -> QuerySet[ProvisionedOffering]:
    """Return provisioned offerings: staff all, customers the active ones."""
    offerings = ProvisionedOffering.objects.order_by("code")
    return offerings if staff else offerings.filter(is_active=True)


def subscription_at(*, organization: Organization, at: datetime | None = None
                    ) -> Subscription | None:
    """Return the organization's subscription covering ``at`` (None: it is on-demand)."""
    return subscriptions_at(organization_id=organization.pk, at=at or timezone.now()
                            ).select_related("plan").first()


def subscriptions_at(*, organization_id: int, at: datetime) -> QuerySet[Subscription]:
    """Return the organization's subscriptions covering ``at`` (one at most)."""
    return Subscription.objects.filter(organization_id=organization_id, starts_at__lte=at).filter(
        Q(ends_at__isnull=True) | Q(ends_at__gt=at))


@dataclass(frozen=True)
class TokenPlanStatus:
    """Credits of a token-plan subscription at one instant (what the console shows)."""

    period_start: datetime
    period_end: datetime
    period_credits: Decimal
    period_used: Decimal
    window_hours: int
    window_credits: Decimal | None
    window_used: Decimal
    window_frees_at: datetime | None  # when the oldest credits in the window drop out
    pack_credits_left: Decimal
    overage_credits: Decimal
    cap_policy: str

    @property
    def plan_credits_left(self) -> Decimal:
        left = self.period_credits - self.period_used
        if self.window_credits is not None:
            left = min(left, self.window_credits - self.window_used)
        return max(left, ZERO)

    @property
    def credits_left(self) -> Decimal:
        return self.plan_credits_left + self.pack_credits_left


def token_plan_period(*, subscription_id: int, period_start: datetime
                      ) -> QuerySet[TokenPlanPeriod]:
    """Return a token-plan subscription's totals row of the period starting at
    ``period_start`` (none before its first event of the period)."""
    return TokenPlanPeriod.objects.filter(subscription_id=subscription_id,
                                          period_start=period_start)


def token_plan_window_usage(*, subscription_id: int, since: datetime, at: datetime
                            ) -> QuerySet[TokenPlanUsage]:
    """Return the ledger rows that drew plan credits in the rolling window (since, at]."""
    return TokenPlanUsage.objects.filter(subscription_id=subscription_id, event_time__gt=since,
                                         event_time__lte=at, plan_credits__gt=0)


def credit_packs_in_force(*, subscription_id: int, at: datetime
                          ) -> QuerySet[CreditPackPurchase]:
    """Return the credit packs bought on a subscription by ``at`` and not expired then."""
    return (CreditPackPurchase.objects
            .filter(subscription_id=subscription_id, purchased_at__lte=at)
            .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=at)))


def token_plan_status_of(plan: Plan, *, start: datetime, end: datetime,
                         period: tuple[Decimal, Decimal] | None, window_used: Decimal | None,
                         window_oldest: datetime | None, pack_credits_left: Decimal
                         ) -> TokenPlanStatus:
    """Return a token plan's status from its reads: the period's (plan credits, overage
    credits), the window's plan credits and oldest event, the packs' credits left."""
    return TokenPlanStatus(
        period_start=start, period_end=end, period_credits=plan.credits_per_period or ZERO,
        period_used=period[0] if period else ZERO, window_hours=plan.window_hours,
        window_credits=plan.window_credits, window_used=window_used or ZERO,
        window_frees_at=(window_oldest + timedelta(hours=plan.window_hours)
                         if window_oldest else None),
        pack_credits_left=pack_credits_left,
        overage_credits=period[1] if period else ZERO, cap_policy=plan.cap_policy,
    )


def token_plan_status(*, subscription: Subscription, at: datetime | None = None
                      ) -> TokenPlanStatus | None:
    """Return the credits used and left now; None for a subscription that is not a token plan."""
    plan = subscription.plan
    if plan.kind != PlanKind.TOKEN_PLAN:
        return None
    at = at or timezone.now()
    start, end = period_bounds(subscription.billing_anchor, at)
    period = token_plan_period(subscription_id=subscription.pk, period_start=start).values_list(
        "plan_credits", "overage_credits").first()
    window = token_plan_window_usage(
        subscription_id=subscription.pk, since=at - timedelta(hours=plan.window_hours), at=at,
    ).aggregate(used=Sum("plan_credits"), oldest=Min("event_time"))
    packs = credit_packs_in_force(subscription_id=subscription.pk, at=at)
    return token_plan_status_of(
        plan, start=start, end=end, period=period, window_used=window["used"],
        window_oldest=window["oldest"],
        pack_credits_left=sum((p.credits_left for p in packs), ZERO))


def reservations_of(*, organization: Organization) -> QuerySet[Reservation]:
    """Return an organization's reservations, newest first."""
    return Reservation.objects.filter(organization=organization).order_by("-starts_at")


def active_reservations(*, organization_id: int, at: datetime | None = None
                        ) -> QuerySet[Reservation]:
    """Return the reservations in force at ``at`` (what admission checks capacity against)."""
    at = at or timezone.now()
    return Reservation.objects.filter(organization_id=organization_id, starts_at__lte=at,
                                      ends_at__gt=at)


@dataclass(frozen=True)
class ReservedShare:
    """The reservations in force on one model in one region, all organizations together:
    ``(normalized tokens per minute, output burndown)`` of each."""

    model: str
    region: str
    reservations: tuple[tuple[int, Decimal], ...]


def reserved_shares(*, at: datetime | None = None) -> list[ReservedShare]:
    """Return what is reserved now on each (model, region) that has a reservation in force:
    the share of a pool's capacity held back from on-demand traffic."""
    at = at or timezone.now()
    rows: dict[tuple[str, str], list[tuple[int, Decimal]]] = {}
    for model, region, units, per_unit, burndown in Reservation.objects.filter(
            starts_at__lte=at, ends_at__gt=at).values_list(
            "model", "region", "units", "tokens_per_minute_per_unit", "output_burndown"):
        rows.setdefault((model, region), []).append((units * per_unit, burndown))
    return [ReservedShare(model, region, tuple(r)) for (model, region), r in sorted(rows.items())]


def reservation_fee_for_period(*, reservation: Reservation, period_start: datetime,
                               period_end: datetime) -> Decimal:
    """Return the fee of the reservation's terms that start in [period_start, period_end).

    Terms are billed in advance, each in the period it starts in: units x unit price per term.
    """
    step_hours = reservation.term == ReservationTerm.HOURLY
    count = 0
    for k in range(reservation.term_count):
        term_start = (reservation.starts_at + timedelta(hours=k) if step_hours
                      else add_months(reservation.starts_at, k))
        if period_start <= term_start < period_end:
            count += 1
    return reservation.units * reservation.unit_price * count


_MICROSECOND = timedelta(microseconds=1)


# --- reservation utilization --------------------------------------------------------------

HOUR = timedelta(hours=1)
_MINUTE_US = 60_000_000


def _percent(part: int, whole: int) -> Decimal | None:
    """Return part / whole in percent to one place (half-even), None when whole is 0."""
    if whole <= 0:
        return None
    return (Decimal(part) * 100 / Decimal(whole)).quantize(Decimal("0.1"), ROUND_HALF_EVEN)


@dataclass(frozen=True)
class UtilizationHour:
    """One UTC hour of a reservation, in normalized tokens.

    ``reserved`` is what the reservation could serve in the hour: its tokens per minute x the
    minutes of the hour inside its term (rounded down); ``peak_minute_used`` is the busiest
    minute's use, to set against ``reserved_per_minute``; ``spillover`` ran on-demand (billed)
    because the reservation was full.
    """

    hour: datetime
    reserved_per_minute: int
    reserved: int
    used: int
    peak_minute_used: int
    spillover: int

    @property
    def used_percent(self) -> Decimal | None:
        return _percent(self.used, self.reserved)

    @property
    def peak_percent(self) -> Decimal | None:
        return _percent(self.peak_minute_used, self.reserved_per_minute)

    @property
    def spillover_share(self) -> Decimal | None:
        """Percent of the hour's provisioned-model tokens that spilled over."""
        return _percent(self.spillover, self.used + self.spillover)


@dataclass(frozen=True)
class ReservationUtilization:
    """A reservation's hours in [start, end) that its term reaches, and their totals."""

    reservation: Reservation
    start: datetime
    end: datetime
    hours: list[UtilizationHour]

    @property
    def reserved(self) -> int:
        return sum(h.reserved for h in self.hours)

    @property
    def used(self) -> int:
        return sum(h.used for h in self.hours)

    @property
    def spillover(self) -> int:
        return sum(h.spillover for h in self.hours)

    @property
    def peak_minute_used(self) -> int:
        return max((h.peak_minute_used for h in self.hours), default=0)

    @property
    def used_percent(self) -> Decimal | None:
        return _percent(self.used, self.reserved)

    @property
    def spillover_share(self) -> Decimal | None:
        return _percent(self.spillover, self.used + self.spillover)


def reservation_utilization(*, reservation: Reservation, start: datetime, end: datetime
                            ) -> ReservationUtilization:
    """Return the reservation's use per hour over [start, end) (hour-aligned, UTC).

    Usage is the organization's provisioned and spillover events of the reservation's model and
    region (events name no reservation; two reservations of one model and region in force at
    once are both shown the pool's usage). One query.
    """
    first = max(start, reservation.starts_at.replace(minute=0, second=0, microsecond=0))
    last = min(end, reservation.ends_at)
    if first >= last:
        return ReservationUtilization(reservation=reservation, start=start, end=end, hours=[])
    usage = {row.hour: row for row in provisioned_usage_by_hour(
        org_id=reservation.organization_id, model=reservation.model,
        region=reservation.region, start=first, end=last,
        cache_burndown=reservation.cache_burndown,
        output_burndown=reservation.output_burndown)}
    tpm = reservation.tokens_per_minute
    hours: list[UtilizationHour] = []
    hour = first
    while hour < last:
        inside = (min(hour + HOUR, reservation.ends_at) - max(hour, reservation.starts_at))
        row = usage.get(hour)
        hours.append(UtilizationHour(
            hour=hour, reserved_per_minute=tpm,
            reserved=tpm * (inside // _MICROSECOND) // _MINUTE_US,
            used=row.used if row else 0, peak_minute_used=row.peak_minute_used if row else 0,
            spillover=row.spillover if row else 0))
        hour += HOUR
    return ReservationUtilization(reservation=reservation, start=start, end=end, hours=hours)


def subscription_months_in_period(*, subscription: Subscription, period_start: datetime,
                                   period_end: datetime) -> Decimal:
    """Return how many of the subscription's billing months fall in [period_start, period_end).

    1 for a period that is exactly one of its months. A subscription that starts, ends or
    changes anchor inside the period gets the covered share of each of its months, by time
    (Stripe's proration): starting on Oct 15 on calendar invoices is 17/31 of a month on
    October's invoice and 14/31 on the next one (Nov 1-15), then whole months.
    """
    lo = max(period_start, subscription.starts_at)
    hi = min(period_end, subscription.ends_at or period_end)
    months = Decimal(0)
    with localcontext(Context(prec=50)):
        t = lo
        while t < hi:
            month_start, month_end = period_bounds(subscription.billing_anchor, t)
            part_end = min(hi, month_end)
            months += (Decimal((part_end - t) // _MICROSECOND)
                       / Decimal((month_end - month_start) // _MICROSECOND))
            t = part_end
    return months


def credit_balance(*, organization: Organization, at: datetime | None = None
                   ) -> dict[str, Decimal]:
    """Return unexpired credit left per currency."""
    at = at or timezone.now()
    rows = (CreditGrant.objects
            .filter(organization=organization, remaining__gt=0, granted_at__lte=at)
            .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=at))
            .values("currency").annotate(total=Sum("remaining")).order_by("currency"))
    return {r["currency"]: r["total"] for r in rows}


def credit_grants_of(*, organization: Organization) -> QuerySet[CreditGrant]:
    """Return an organization's grants, next to expire first."""
    return CreditGrant.objects.filter(organization=organization).order_by(
        "expires_at", "granted_at")


def usage_events_outside_zone(*, limit: int = 1000) -> list[dict[str, object]]:
    """Return usage events that ran in a region outside their org's data zone (expect none).

    A region belongs to a zone through the fleet's pools (every pool known, in the spec or
    not: past usage is judged); an event of a non-global org whose region is not among its
    zone's regions is a residency violation. At most ``limit`` events per zone.
    """
    regions = zone_regions(in_spec_only=False)
    zones = (set(regions) | {"us", "eu"}) - {"global"}
    return usage_events_outside_regions(
        zone_regions={zone: regions.get(zone, set()) for zone in zones}, limit=limit)


# --- credit grants across organizations (finance's credits report) ---------------------------

class CreditMovement(NamedTuple):
    """Credit grants of one currency x kind x expiry month, rolled forward over [start, end).

    ``opening`` is what was left unexpired at ``start``, ``closing`` at ``end`` (the
    liability); ``granted`` the amounts granted in the range, ``consumed`` what invoices used in
    it, ``expired`` what was left on grants whose expiry fell in it (breakage). So
    ``opening + granted - consumed - expired == closing``. ``expiry_month`` is None for grants
    that never expire. A grant counts from ``granted_at`` on and is gone at ``expires_at``
    (as ``credit_balance`` reads it): it is outstanding at T when granted before T and expiring
    after T, and expires in the range when ``start < expires_at <= end``.
    """

    currency: str
    kind: str
    expiry_month: datetime | None
    grants: int
    opening: Decimal
    granted: Decimal
    consumed: Decimal
    expired: Decimal
    closing: Decimal


_CREDIT_MOVEMENTS_SQL = """
WITH a AS (
    SELECT grant_id,
           SUM(amount) FILTER (WHERE applied_at < %(start)s) AS before_start,
           SUM(amount) FILTER (WHERE applied_at < %(end)s) AS before_end,
           SUM(amount) FILTER (WHERE applied_at >= %(start)s AND applied_at < %(end)s) AS within,
           SUM(amount) AS applied
      FROM plans_creditgrantapplication GROUP BY grant_id
)
SELECT g.currency, g.kind, date_trunc('month', g.expires_at, 'UTC'), count(*),
       COALESCE(SUM(g.amount - COALESCE(a.before_start, 0)) FILTER (
           WHERE g.granted_at < %(start)s
             AND (g.expires_at IS NULL OR g.expires_at > %(start)s)), 0),
       COALESCE(SUM(g.amount) FILTER (
           WHERE g.granted_at >= %(start)s AND g.granted_at < %(end)s), 0),
       COALESCE(SUM(a.within), 0),
       COALESCE(SUM(g.amount - COALESCE(a.applied, 0)) FILTER (
           WHERE g.expires_at > %(start)s AND g.expires_at <= %(end)s
             AND g.granted_at < %(end)s), 0),
       COALESCE(SUM(g.amount - COALESCE(a.before_end, 0)) FILTER (
           WHERE g.granted_at < %(end)s
             AND (g.expires_at IS NULL OR g.expires_at > %(end)s)), 0)
  FROM plans_creditgrant g
  LEFT JOIN a ON a.grant_id = g.id
 WHERE g.granted_at < %(end)s AND (g.expires_at IS NULL OR g.expires_at > %(start)s){where}
 GROUP BY 1, 2, 3
 ORDER BY 1, 2, 3 NULLS LAST
"""


def credit_movements(*, start: datetime, end: datetime, currency: str | None = None,
                     kind: str | None = None, organization_id: int | None = None
                     ) -> list[CreditMovement]:
    """Return every organization's credit grants rolled forward over [start, end), per
    currency x kind x expiry month (``CreditMovement``). One query."""
    params: dict[str, Any] = {"start": start, "end": end}
    where = ""
    for column, value in (("currency", currency), ("kind", kind),
                          ("organization_id", organization_id)):
        if value is not None:
            params[column] = value
            where += f" AND g.{column} = %({column})s"
    with reading_connection().cursor() as cur:
        cur.execute(_CREDIT_MOVEMENTS_SQL.format(where=where), params)
        return [CreditMovement._make(row) for row in cur]


def plan_kinds(*, codes: Iterable[str]) -> dict[str, str]:
    """Return the kind (``PlanKind``) of each plan code that exists."""
    return dict(Plan.objects.filter(code__in=set(codes)).values_list("code", "kind"))


def list_prices(*, currency: str, models: Iterable[str], at: datetime | None = None
                ) -> dict[str, PriceSet]:
    """Return the base per-1M prices (no tier, zone or context-band multiplier) of each
    model the default book of ``currency`` lists in its version in force at ``at``."""
    book = PriceBook.objects.filter(currency=currency, is_default=True).first()
    version = price_version_at(price_book=book, at=at) if book is not None else None
    if version is None:
        return {}
    return {row.model: PriceSet.of(row)
            for row in ModelPrice.objects.filter(version=version, model__in=set(models))}


def models_first_priced(*, version_models: Iterable[tuple[int, str]]) -> dict[str, datetime]:
    """Return, for each (price version, model), when the model was first priced in that
    version's book: the earliest version of the book that lists it (a new version copies the
    one before, so this is when the model was offered), keyed by model."""
    pairs = list(version_models)
    if not pairs:
        return {}
    books = dict(PriceVersion.objects.filter(id__in={v for v, _ in pairs})
                 .values_list("id", "price_book_id"))
    out: dict[str, datetime] = {}
    for book_id, model, first in (
            ModelPrice.objects.filter(version__price_book_id__in=set(books.values()),
                                      model__in={m for _, m in pairs})
            .values_list("version__price_book_id", "model")
            .annotate(first=Min("version__effective_from"))):
        if any(books.get(v) == book_id and m == model for v, m in pairs):
            out[model] = first
    return out


def webhook_endpoints_of(*, organization: Organization) -> list[WebhookEndpoint]:
    """Return an organization's webhook endpoints, enabled ones first, newest first."""
    return list(WebhookEndpoint.objects.filter(organization=organization)
                .order_by(F("disabled_at").desc(nulls_first=True), "-created_at"))


def webhook_deliveries_of(*, organization: Organization, limit: int = 50
                          ) -> list[WebhookDelivery]:
    """Return an organization's latest webhook deliveries, newest first, with their attempts."""
    return list(WebhookDelivery.objects.filter(endpoint__organization=organization)
                .select_related("endpoint").prefetch_related("attempt_log")
                .order_by("-created_at", "-id")[:limit])


def budget_alerts_of(*, organization: Organization, limit: int = 50) -> list[BudgetAlert]:
    """Return an organization's latest budget alerts, newest first."""
    return list(BudgetAlert.objects.filter(budget__organization=organization)
                .select_related("budget__project").order_by("-created_at", "-id")[:limit])
