"""The revenue report: billed and accrued revenue per period and dimensions (see the package
docstring for what counts)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import date, datetime
from decimal import Decimal
from typing import Any

from billing_platform.finance.reports.rows import Row, day, money
from billing_platform.invoicing import reports as invoicing_reports
from billing_platform.invoicing.money import ZERO
from plans.choices import RatingKind
from plans.selectors import plan_kinds

UNITS = ("month", "quarter", "year")
# What a usage line's capacity source says about the customer's arrangement
PLAN_KIND_OF_SOURCE = {
    "on_demand": RatingKind.ON_DEMAND.value, "plan": RatingKind.TOKEN_PLAN.value,
    "overage": RatingKind.TOKEN_PLAN.value, "provisioned": RatingKind.PROVISIONED.value,
    "spillover": RatingKind.PROVISIONED.value,
}
PLAN_KIND_OF_LINE = {"reservation_fee": RatingKind.PROVISIONED.value,
                     "credit_pack": RatingKind.TOKEN_PLAN.value}
PLAN_KINDS = tuple(RatingKind.values)
USAGE_LINE_KINDS = ("usage", "late_usage")
LINE_KINDS = ("usage", "late_usage", "plan_fee", "reservation_fee", "credit_pack", "one_off",
              "adjustment", "tax", "credit", "credit_note")


@dataclass(frozen=True)
class RevenueFilter:
    """Billing periods starting in [start, end), bucketed by ``unit``; optional dimensions."""

    start: datetime
    end: datetime
    unit: str = "month"
    currency: str | None = None
    org_id: int | None = None
    plan_kind: str | None = None
    kind: str | None = None
    model: str | None = None
    region: str | None = None
    service_tier: str | None = None
    token_class: str | None = None


@dataclass(frozen=True)
class RevenueRow(Row):
    """Billed and accrued revenue of one period x currency x plan kind x line kind x model x
    region x tier x token class. ``*_tokens``: the usage lines' token counts."""

    period: date
    currency: str
    plan_kind: str
    kind: str
    model: str
    region: str
    service_tier: str
    token_class: str
    billed: Decimal
    accrued: Decimal
    billed_tokens: int
    accrued_tokens: int


@dataclass(frozen=True)
class RevenueTotal(Row):
    """Billed and accrued revenue of one currency (in one period, or the whole range)."""

    period: date | None
    currency: str
    billed: Decimal
    accrued: Decimal
    accrued_precise: Decimal  # the exact sum the accrued amount is rounded once from


@dataclass(frozen=True)
class RevenueReport:
    report_filter: RevenueFilter
    rows: list[RevenueRow]
    totals: list[RevenueTotal]
    currency_totals: list[RevenueTotal]


_RevenueKey = tuple[date, str, str, str, str, str, str, str]


def _billed_rows(f: RevenueFilter) -> dict[_RevenueKey, list[Any]]:
    """Return billed [amount, tokens] per row key."""
    lines = invoicing_reports.billed_lines(line_filter=invoicing_reports.LineFilter(
        start=f.start, end=f.end, currency=f.currency, org_id=f.org_id, model=f.model,
        region=f.region, service_tier=f.service_tier, token_class=f.token_class), unit=f.unit)
    kinds_of_plans = plan_kinds(codes={ln.plan_code for ln in lines if ln.plan_code})
    out: dict[_RevenueKey, list[Any]] = defaultdict(lambda: [ZERO, 0])
    for ln in lines:
        if ln.kind in USAGE_LINE_KINDS:
            plan_kind = PLAN_KIND_OF_SOURCE.get(ln.capacity_source, "")
        elif ln.kind == "plan_fee":
            plan_kind = kinds_of_plans.get(ln.plan_code, RatingKind.TOKEN_PLAN.value)
        else:
            plan_kind = PLAN_KIND_OF_LINE.get(ln.kind, "")
        key = (day(ln.bucket), ln.currency, plan_kind, ln.kind, ln.model, ln.region,
               ln.service_tier, ln.token_class)
        out[key][0] += ln.amount
        out[key][1] += int(ln.tokens)
    return out


def _accrued_rows(f: RevenueFilter) -> dict[_RevenueKey, list[Any]]:
    """Return accrued [exact amount, tokens] per row key (usage lines, per token class)."""
    if f.kind is not None and f.kind != "usage":
        return {}
    out: dict[_RevenueKey, list[Any]] = defaultdict(lambda: [ZERO, 0])
    start_bucket = invoicing_reports.bucket_of(f.unit, f.start)
    for u in invoicing_reports.unbilled_usage(
            org_ids=None if f.org_id is None else [f.org_id], unit=f.unit, currency=f.currency):
        if not start_bucket <= u.bucket < f.end:
            continue
        if any(want is not None and want != got for want, got in (
                (f.model, u.model), (f.region, u.region), (f.service_tier, u.service_tier))):
            continue
        plan_kind = PLAN_KIND_OF_SOURCE.get(u.capacity_source, "")
        for token_class, tokens, amount in (
                ("input", u.input_tokens, u.input_amount),
                ("cached_input", u.cached_tokens, u.cached_input_amount),
                ("output", u.output_tokens, u.output_amount)):
            if f.token_class not in (None, token_class) or (not tokens and not amount):
                continue
            key = (day(u.bucket), u.currency, plan_kind, "usage", u.model, u.region,
                   u.service_tier, token_class)
            out[key][0] += amount
            out[key][1] += int(tokens)
    return out


def revenue_report(*, report_filter: RevenueFilter) -> RevenueReport:
    """Return billed and accrued revenue per period and dimensions, with totals per currency."""
    f = report_filter
    if f.unit not in UNITS:
        raise ValueError(f"unit must be one of {UNITS}")
    billed, accrued = _billed_rows(f), _accrued_rows(f)
    rows = []
    totals: dict[tuple[date | None, str], list[Decimal]] = defaultdict(lambda: [ZERO, ZERO])
    for key in sorted(set(billed) | set(accrued)):
        period, currency, plan_kind, kind = key[:4]
        if f.plan_kind is not None and plan_kind != f.plan_kind:
            continue
        if f.kind is not None and kind != f.kind:
            continue
        b_amount, b_tokens = billed.get(key, (ZERO, 0))
        a_exact, a_tokens = accrued.get(key, (ZERO, 0))
        rows.append(RevenueRow(*key, billed=money(b_amount, currency),
                               accrued=money(a_exact, currency), billed_tokens=b_tokens,
                               accrued_tokens=a_tokens))
        for total_key in ((period, currency), (None, currency)):
            totals[total_key][0] += b_amount
            totals[total_key][1] += a_exact

    def total(key: tuple[date | None, str]) -> RevenueTotal:
        b, a = totals[key]
        return RevenueTotal(period=key[0], currency=key[1], billed=money(b, key[1]),
                            accrued=money(a, key[1]), accrued_precise=a)

    return RevenueReport(
        report_filter=f, rows=rows,
        totals=[total(k) for k in sorted(k for k in totals if k[0] is not None)],
        currency_totals=[total(k) for k in sorted(k for k in totals if k[0] is None)])


