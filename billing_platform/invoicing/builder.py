"""Build invoices (as plain drafts, not yet rows) for many organizations at once, in SQL.

One pass over a chunk of organizations costs a fixed number of queries whatever its size:
usage of the period from the hourly rollups (one ``GROUP BY`` joined to the chunk's periods),
late usage (rollups of earlier finalized periods minus what was billed for them), plan fees,
reservation fees and credit-pack purchases. The same builder answers "upcoming invoice" for
one organization, so the preview and the final invoice can never disagree.

Usage belongs to the period that holds its event time, to the microsecond: a period runs from
its anchor instant (a subscription's start, e.g. 08:37:18) to the next, as Stripe's do, while
rollups are whole UTC hours. So a period's usage is read from the rollups of the hours that lie
wholly inside it, plus the raw events of the (at most two) hours cut by its start and its end
(``_PERIOD_ROWS``). Every event then lies in exactly one period; on hour-aligned periods
(calendar months) the event ranges are empty and the query is the rollups' alone.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.db import connection
from django.db.models import Q

from billing_platform.invoicing.choices import CHARGE_KINDS, LineKind
from billing_platform.invoicing.money import EXACT, ZERO, quantize_money
from plans.choices import TokenClass
from plans.models import CreditPackPurchase, Reservation, Subscription
from plans.selectors import reservation_fee_for_period, subscription_months_in_period

log = logging.getLogger(__name__)
MILLION = Decimal(1_000_000)
PRECISE = Decimal("1E-10")
QUANTITY = Decimal("1E-6")  # invoice line quantities have 6 places

TIER_LABELS = {"default": "standard", "priority": "priority", "flex": "flex", "batch": "batch"}
CLASS_LABELS = {"input": "input", "cached_input": "cached input", "output": "output"}
SOURCE_LABELS = {
    "on_demand": "", "spillover": "spillover from reserved units",
    "provisioned": "reserved units (no per-token charge)",
    "plan": "included in token plan", "overage": "token plan overage",
}


@dataclass(frozen=True, slots=True)
class Target:
    """An organization and the period to invoice."""

    org_id: int
    currency: str
    tax_rate: Decimal
    period_start: datetime
    period_end: datetime


@dataclass(slots=True)
class DraftLine:
    kind: str
    description: str
    amount_precise: Decimal
    amount: Decimal
    quantity: Decimal = ZERO
    unit: str = ""
    unit_price: Decimal | None = None
    model: str = ""
    region: str = ""
    service_tier: str = ""
    capacity_source: str = ""
    token_class: str = ""
    source_period_start: datetime | None = None
    source_period_end: datetime | None = None
    details: dict = field(default_factory=dict)


@dataclass(slots=True)
class UsageSum:
    """Exact sums of rollups for one (source period, model, region, tier, capacity source)."""

    source_period_start: datetime
    model: str
    region: str
    service_tier: str
    capacity_source: str
    amount: Decimal
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    input_amount: Decimal
    cached_input_amount: Decimal
    output_amount: Decimal

    def by_token_class(self) -> list[tuple[str, int, Decimal]]:
        """Return (token class, tokens, exact amount) for each class, in invoice order."""
        return [(TokenClass.INPUT.value, self.prompt_tokens - self.cached_tokens,
                 self.input_amount),
                (TokenClass.CACHED_INPUT.value, self.cached_tokens, self.cached_input_amount),
                (TokenClass.OUTPUT.value, self.completion_tokens, self.output_amount)]


# The summed columns of a UsageSum, in the order the SQL below selects them. A rollup's amount
# is the sum of its class amounts, so the rollups' SUM(amount) is not read: numeric sums are
# the dearest part of the usage query (about 0.3 us a row each, measured by
# bench/invoice_run.py); the billed-usage ledger (small) keeps and sums its own amount.
_SUMS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "input_amount",
         "cached_input_amount", "output_amount")
# In the ledger's order (amount, *_SUMS): amount, requests and token counts come first.
_CORE_SUMS = 5
_SUM_SQL = ", ".join(f"SUM(r.{c})" for c in _SUMS)


@dataclass(slots=True)
class DraftInvoice:
    target: Target
    lines: list[DraftLine] = field(default_factory=list)
    billed: list[UsageSum] = field(default_factory=list)

    @property
    def currency(self) -> str:
        return self.target.currency

    @property
    def subtotal(self) -> Decimal:
        return sum((ln.amount for ln in self.lines if ln.kind in CHARGE_KINDS), ZERO)

    @property
    def tax(self) -> Decimal:
        return sum((ln.amount for ln in self.lines if ln.kind == LineKind.TAX), ZERO)

    @property
    def credits_applied(self) -> Decimal:
        return -sum((ln.amount for ln in self.lines if ln.kind == LineKind.CREDIT), ZERO)

    @property
    def total(self) -> Decimal:
        return sum((ln.amount for ln in self.lines), ZERO)

    def add(self, kind: str, description: str, precise: Decimal, **extra) -> DraftLine:
        """Append a line: the exact amount and that amount rounded once."""
        line = DraftLine(kind=kind, description=description,
                         amount_precise=precise.quantize(PRECISE, context=EXACT),
                         amount=quantize_money(precise, self.currency), **extra)
        self.lines.append(line)
        return line

    def add_tax(self) -> None:
        """Append the tax line: the org's rate on the rounded subtotal, rounded once."""
        rate = self.target.tax_rate
        if rate:
            self.add(LineKind.TAX, f"Tax ({rate * 100:.2f} %)",
                     EXACT.multiply(self.subtotal, rate), quantity=Decimal(1), unit_price=rate)

    def add_credit(self, applied: Decimal) -> None:
        if applied > 0:
            self.add(LineKind.CREDIT, "Credits applied", -applied)


def _usage_lines(draft: DraftInvoice, u: UsageSum, *, late_from: tuple | None = None) -> None:
    """Append one line per token class of ``u`` (model x tier x region x capacity source).

    The unit price is the effective price per 1M tokens (amount / tokens): the price book's
    price x tier x zone multipliers, or a blend where prices changed within the period.
    """
    parts = [u.model, TIER_LABELS.get(u.service_tier, u.service_tier), u.region]
    if SOURCE_LABELS.get(u.capacity_source):
        parts.append(SOURCE_LABELS[u.capacity_source])
    prefix = " · ".join(p for p in parts if p)
    kind = LineKind.USAGE
    extra = {}
    if late_from is not None:
        kind = LineKind.LATE_USAGE
        prefix = f"Late usage from {late_from[0]:%Y-%m-%d} to {late_from[1]:%Y-%m-%d}: {prefix}"
        extra = {"source_period_start": late_from[0], "source_period_end": late_from[1]}
    classes = u.by_token_class()
    rest = u.amount - sum((amount for _, _, amount in classes), ZERO)
    if rest:
        # Only late usage measured against a ledger row written before the class split
        # (invoicing migration 0003 could not split it): bill the remainder as its own line so
        # the invoice still equals its events.
        classes.append(("", 0, rest))
    for token_class, tokens, amount in classes:
        if not tokens and not amount:
            continue
        unit_price = (EXACT.divide(amount * MILLION, tokens).quantize(PRECISE, context=EXACT)
                      if tokens else None)
        label = CLASS_LABELS.get(token_class, "other usage")
        draft.add(kind, f"{prefix} · {label}"[:300], amount, quantity=Decimal(tokens),
                  unit="tokens", unit_price=unit_price, model=u.model, region=u.region,
                  service_tier=u.service_tier, capacity_source=u.capacity_source,
                  token_class=token_class, details={"requests": u.requests}, **extra)


# The first whole hour at or after a period's start, and the start of the hour its end cuts
# (UTC, whatever the session's time zone; timestamps have microsecond resolution).
_HOUR_CEIL = "date_trunc('hour', {} + interval '1 hour' - interval '1 microsecond', 'UTC')"
_HOUR_FLOOR = "date_trunc('hour', {}, 'UTC')"
# An event's class amounts, as its rollup sums them (``metering.recording``).
_EVENT_CLASS_SQL = ", ".join(
    f"COALESCE((e.rating_breakdown ->> '{c}')::numeric, 0) AS {c}_amount"
    for c in ("input", "cached_input", "output"))
_EVENT_SUM_SQL = "COUNT(*), " + ", ".join(f"SUM(e.{c})" for c in _SUMS[1:])
_DIMS = "model, region, service_tier, capacity_source, currency"
# The usage sums of period ``p`` (ps, pe; hs = its first whole hour, he = the hour its end
# cuts) per dimensions and currency: the rollups of its whole hours, summed straight off their
# index range as before, plus its events before the first whole hour and from the cut hour on
# (one index range each, skipped outright where the period starts or ends on the hour), then
# the two added up. When the period starts and ends within one hour (hs > he) there are no
# whole hours and the first event range is the whole period.
_PERIOD_SUMS = f"""
        SELECT {_DIMS}, {", ".join(f"SUM({c})" for c in _SUMS)}
          FROM (SELECT r.{_DIMS.replace(", ", ", r.")}, {_SUM_SQL}
                  FROM usage_rollup_hourly r
                 WHERE r.organization_id = p.org AND r.hour >= p.hs AND r.hour < p.he
                 GROUP BY 1, 2, 3, 4, 5
                UNION ALL
                SELECT e.{_DIMS.replace(", ", ", e.")}, {_EVENT_SUM_SQL}
                  FROM (SELECT e.{_DIMS.replace(", ", ", e.")}, e.prompt_tokens,
                               e.cached_tokens, e.completion_tokens, {_EVENT_CLASS_SQL}
                          FROM usage_event e
                         WHERE p.ps < p.hs AND e.organization_id = p.org
                           AND e.event_time >= p.ps AND e.event_time < LEAST(p.hs, p.pe)
                        UNION ALL
                        SELECT e.{_DIMS.replace(", ", ", e.")}, e.prompt_tokens,
                               e.cached_tokens, e.completion_tokens, {_EVENT_CLASS_SQL}
                          FROM usage_event e
                         WHERE p.he < p.pe AND e.organization_id = p.org
                           AND e.event_time >= GREATEST(p.he, p.hs) AND e.event_time < p.pe
                       ) e
                 GROUP BY 1, 2, 3, 4, 5
               ) x (model, region, service_tier, capacity_source, currency, {", ".join(_SUMS)})
         GROUP BY 1, 2, 3, 4, 5
"""  # noqa: S608

# One aggregate per organization (LATERAL): each is a small in-memory hash over one org's
# index range, where one big GROUP BY over the whole chunk spilled a sort of millions of rows
# to disk (measured 2x slower at 500 orgs x 3,600 rollup rows).
_USAGE_SQL = f"""
WITH p AS (
    SELECT org, ps, pe, {_HOUR_CEIL.format("ps")} AS hs, {_HOUR_FLOOR.format("pe")} AS he
      FROM unnest(%s::bigint[], %s::timestamptz[], %s::timestamptz[]) AS t(org, ps, pe)
)
SELECT p.org, a.*
  FROM p CROSS JOIN LATERAL ({_PERIOD_SUMS} ORDER BY 1, 3, 2, 4) a
"""  # noqa: S608 (only our own column names are interpolated)

# Usage of earlier finalized periods, read exactly as at their close (``_PERIOD_ROWS``); a late
# hour marks the periods it overlaps, including the one whose start cuts it.
_LATE_SQL = f"""
WITH p AS (
    SELECT i.organization_id AS org, i.period_start AS ps, i.period_end AS pe, i.currency AS cur,
           {_HOUR_CEIL.format("i.period_start")} AS hs, {_HOUR_FLOOR.format("i.period_end")} AS he
      FROM unnest(%s::bigint[], %s::timestamptz[]) AS t(org, start)
      JOIN invoicing_invoice i
        ON i.organization_id = t.org AND i.kind = 'invoice' AND i.status <> 'draft'
       AND i.period_end <= t.start
     WHERE i.period_start >= t.start - %s::interval
        OR EXISTS (SELECT 1 FROM usage_late_hour m
                    WHERE m.organization_id = t.org
                      AND m.hour >= {_HOUR_FLOOR.format("i.period_start")}
                      AND m.hour < i.period_end AND m.recorded_at >= t.start - %s::interval)
)
SELECT p.org, p.ps, p.pe, a.model, a.region, a.service_tier, a.capacity_source,
       {", ".join(f"a.{c}" for c in _SUMS)}
  FROM p CROSS JOIN LATERAL ({_PERIOD_SUMS}) a ({_DIMS}, {", ".join(_SUMS)})
 WHERE a.currency = p.cur
"""  # noqa: S608

_BILLED_SQL = f"""
SELECT organization_id, source_period_start, model, region, service_tier, capacity_source,
       SUM(r.amount), {_SUM_SQL}
  FROM invoicing_billedusage r
 WHERE organization_id = ANY(%s) AND source_period_start >= %s
 GROUP BY 1, 2, 3, 4, 5, 6
"""  # noqa: S608


def _with_amount(sums: tuple) -> list:
    """Prepend the amount to a rollup's sums: (amount, *sums), the ledger's order."""
    return [sums[4] + sums[5] + sums[6], *sums]


def _usage_sum(period_start: datetime, model: str, region: str, tier: str, source: str,
               sums: list) -> UsageSum:
    """``sums``: amount, requests, prompt, cached, completion tokens, class amounts."""
    amount, req, prompt, cached, completion, in_amount, cached_amount, out_amount = sums
    return UsageSum(period_start, model, region, tier, source, amount, int(req), int(prompt),
                    int(cached), int(completion), in_amount, cached_amount, out_amount)


def _usage(targets: list[Target]) -> dict[int, list[UsageSum]]:
    by_org = {t.org_id: t for t in targets}
    out: dict[int, list[UsageSum]] = defaultdict(list)
    with connection.cursor() as cur:
        cur.execute(_USAGE_SQL, [[t.org_id for t in targets], [t.period_start for t in targets],
                                 [t.period_end for t in targets]])
        for org, model, region, tier, source, currency, *rollup in cur:
            sums = _with_amount(rollup)
            amount = sums[0]
            if currency != by_org[org].currency:
                # Rated in another currency than the org is invoiced in (a plan in another
                # currency): never convert silently; finance must see it.
                log.error("org %s: %s %s of %s usage in %s not invoiced (invoice currency %s)",
                          org, amount, currency, model, by_org[org].period_start.date(),
                          by_org[org].currency)
                continue
            out[org].append(_usage_sum(by_org[org].period_start, model, region, tier, source,
                                       sums))
    return out


def _late(targets: list[Target]) -> dict[int, list[tuple[datetime, UsageSum]]]:
    """Return, per org, usage of earlier finalized periods not billed yet (with period end).

    The periods looked at again: those that started within the lookback (usage a little
    late), and older ones holding an hour metering marked late since then (a spool replayed
    or usage imported months later), so no accepted event is ever left unbilled.
    """
    ids = [t.org_id for t in targets]
    lookback = timedelta(days=settings.INVOICING_LATE_LOOKBACK_DAYS)
    seen: dict[tuple, tuple[datetime, list]] = {}
    with connection.cursor() as cur:
        cur.execute(_LATE_SQL, [ids, [t.period_start for t in targets], lookback, lookback])
        for org, ps, pe, model, region, tier, source, *rollup in cur:
            seen[(org, ps, model, region, tier, source)] = (pe, _with_amount(rollup))
        if not seen:
            return {}
        cur.execute(_BILLED_SQL, [ids, min(key[1] for key in seen)])
        billed = {tuple(r[:6]): list(r[6:]) for r in cur}
    starts = {t.org_id: t.period_start for t in targets}
    out: dict[int, list[tuple[datetime, UsageSum]]] = defaultdict(list)
    for key, (pe, sums) in sorted(seen.items()):
        org, ps, model, region, tier, source = key
        if ps >= starts[org]:
            continue
        done = billed.get(key, [0] * (len(_SUMS) + 1))
        diff = [a - b for a, b in zip(sums, done, strict=True)]
        # Late usage is new amount or new tokens; the class split alone differing means only
        # a ledger row written before the split existed (see invoicing migration 0003).
        if any(diff[:_CORE_SUMS]):
            out[org].append((pe, _usage_sum(ps, model, region, tier, source, diff)))
    return out


def _subscriptions(targets: list[Target]) -> dict[int, list[Subscription]]:
    lo = min(t.period_start for t in targets)
    hi = max(t.period_end for t in targets)
    out: dict[int, list[Subscription]] = defaultdict(list)
    for sub in (Subscription.objects.select_related("plan")
                .filter(organization_id__in=[t.org_id for t in targets], starts_at__lt=hi)
                .filter(Q(ends_at__isnull=True) | Q(ends_at__gt=lo)).order_by("starts_at")):
        out[sub.organization_id].append(sub)
    return out


def _reservations(targets: list[Target]) -> dict[int, list[Reservation]]:
    lo = min(t.period_start for t in targets)
    hi = max(t.period_end for t in targets)
    out: dict[int, list[Reservation]] = defaultdict(list)
    for r in (Reservation.objects.filter(organization_id__in=[t.org_id for t in targets],
                                         starts_at__lt=hi, ends_at__gt=lo)
              .order_by("starts_at", "id")):
        out[r.organization_id].append(r)
    return out


def _packs(targets: list[Target]) -> dict[int, list[CreditPackPurchase]]:
    lo = min(t.period_start for t in targets)
    hi = max(t.period_end for t in targets)
    out: dict[int, list[CreditPackPurchase]] = defaultdict(list)
    for p in (CreditPackPurchase.objects.select_related("subscription", "pack")
              .filter(subscription__organization_id__in=[t.org_id for t in targets],
                      purchased_at__gte=lo, purchased_at__lt=hi).order_by("purchased_at", "id")):
        out[p.subscription.organization_id].append(p)
    return out


def _plan_fee_line(draft: DraftInvoice, sub: Subscription) -> None:
    """Append the plan's monthly fee for the part of the period the subscription covers."""
    plan, t = sub.plan, draft.target
    if plan.monthly_fee <= 0 or plan.currency != t.currency:
        return
    months = subscription_months_in_period(subscription=sub, period_start=t.period_start,
                                           period_end=t.period_end)
    if months <= 0:
        return
    description = f"{plan.name} — monthly fee"
    if months != 1:
        lo = max(t.period_start, sub.starts_at)
        hi = min(t.period_end, sub.ends_at or t.period_end)
        description += f" (prorated {lo:%Y-%m-%d} to {hi:%Y-%m-%d})"
    draft.add(LineKind.PLAN_FEE, description, EXACT.multiply(plan.monthly_fee, months),
              quantity=months.quantize(QUANTITY, context=EXACT), unit="month",
              unit_price=plan.monthly_fee,
              details={"subscription": sub.public_id, "plan": plan.code,
                       "months": str(months.quantize(PRECISE, context=EXACT))})


def build_drafts(targets: list[Target]) -> dict[int, DraftInvoice]:
    """Return the invoice of each target's period, before credits, keyed by organization id.

    Lines, in order: usage (model, tier, region, source, token class), late usage, plan fees,
    reservation fees, credit packs, then tax. Credits are applied when the invoice is finalized.
    """
    if not targets:
        return {}
    usage, late = _usage(targets), _late(targets)
    subs, reservations, packs = _subscriptions(targets), _reservations(targets), _packs(targets)
    drafts: dict[int, DraftInvoice] = {}
    for t in targets:
        draft = drafts[t.org_id] = DraftInvoice(t)
        for u in usage.get(t.org_id, ()):
            _usage_lines(draft, u)
            draft.billed.append(u)
        for pe, u in late.get(t.org_id, ()):
            _usage_lines(draft, u, late_from=(u.source_period_start, pe))
            draft.billed.append(u)
        for sub in subs.get(t.org_id, ()):
            _plan_fee_line(draft, sub)
        for r in reservations.get(t.org_id, ()):
            if r.currency != t.currency:
                continue
            fee = reservation_fee_for_period(reservation=r, period_start=t.period_start,
                                             period_end=t.period_end)
            if fee:
                terms = fee / (r.units * r.unit_price) if r.unit_price else Decimal(0)
                draft.add(LineKind.RESERVATION_FEE,
                          f"Reserved units: {r.units} x {r.model} in {r.region} "
                          f"({terms.normalize()} {r.term} term(s))", fee,
                          quantity=Decimal(r.units) * terms, unit=f"unit-{r.term}",
                          unit_price=r.unit_price, model=r.model, region=r.region,
                          capacity_source="provisioned", details={"reservation": r.public_id})
        for p in packs.get(t.org_id, ()):
            if p.currency == t.currency and p.price > 0:
                draft.add(LineKind.CREDIT_PACK,
                          f"Credit pack: {p.pack.name if p.pack else 'credits'} "
                          f"({p.credits.normalize()} credits)", p.price, quantity=Decimal(1),
                          unit="pack", unit_price=p.price, details={"purchase": p.public_id})
        draft.add_tax()
    return drafts
