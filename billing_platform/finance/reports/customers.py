"""The customers report: top customers, month-over-month change, new and churned."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from decimal import Decimal
from typing import Any

from billing_platform.finance.reports.rows import Row, day, money, org_labels
from billing_platform.invoicing import reports as invoicing_reports
from billing_platform.invoicing.money import ZERO


@dataclass(frozen=True)
class CustomersFilter:
    """Billing months starting in [start, end); the top ``limit`` customers per currency."""

    start: datetime
    end: datetime
    currency: str | None = None
    limit: int = 25


@dataclass(frozen=True)
class TopCustomerRow(Row):
    """A customer's billed revenue in the range, and its last month against the one before."""

    organization: str
    organization_name: str
    currency: str
    revenue: Decimal
    last_month: date
    last_month_revenue: Decimal
    previous_month_revenue: Decimal
    change: Decimal
    change_pct: Decimal | None  # None when the month before billed nothing


@dataclass(frozen=True)
class CustomerMonthRow(Row):
    """One month x currency: customers billed (> 0), new ones (their first billed month ever)
    and churned ones (billed the month before, nothing this month), with their revenue
    (churned: what they were billed the month before)."""

    month: date
    currency: str
    customers: int
    revenue: Decimal
    new: int
    new_revenue: Decimal
    churned: int
    churned_revenue: Decimal


@dataclass(frozen=True)
class CustomerMovementRow(Row):
    """One organization that is new or churned in a month."""

    month: date
    organization: str
    organization_name: str
    currency: str
    movement: str  # "new" | "churned"
    revenue: Decimal


@dataclass(frozen=True)
class CustomersReport:
    report_filter: CustomersFilter
    top: list[TopCustomerRow]
    months: list[CustomerMonthRow]
    movements: list[CustomerMovementRow]


MAX_MOVEMENTS = 1000


def _month_before(month: datetime) -> datetime:
    return (month - timedelta(days=1)).replace(day=1)


def customers_report(*, report_filter: CustomersFilter) -> CustomersReport:
    """Return top customers with their month-over-month change, and new and churned ones."""
    f = report_filter
    first = invoicing_reports.bucket_of("month", f.start)
    months: list[datetime] = []
    m = first
    while m < f.end:
        months.append(m)
        m = (m + timedelta(days=32)).replace(day=1)
    if not months:
        return CustomersReport(report_filter=f, top=[], months=[], movements=[])
    billed: dict[tuple[int, str], dict[datetime, Decimal]] = defaultdict(dict)
    for month, org_id, currency, amount in invoicing_reports.billed_by_org_month(
            start=_month_before(first), end=f.end, currency=f.currency):
        billed[(org_id, currency)][month] = amount
    firsts = invoicing_reports.first_billed_month(org_ids=sorted({o for o, _ in billed}))
    last, before_last = months[-1], _month_before(months[-1])
    # ranked within each currency (amounts of two currencies are never compared)
    ranked = sorted(((key[1], -sum((v for k, v in by_month.items() if k >= first), ZERO), key)
                     for key, by_month in billed.items()))
    per_currency: dict[str, int] = defaultdict(int)
    top_keys = []
    for currency, minus_revenue, key in ranked:
        if minus_revenue < 0 and per_currency[currency] < f.limit:
            per_currency[currency] += 1
            top_keys.append(key)
    month_sums: dict[tuple[datetime, str], list[Any]] = defaultdict(
        lambda: [0, ZERO, 0, ZERO, 0, ZERO])
    movements: list[tuple[datetime, int, str, str, Decimal]] = []
    for (org_id, currency), by_month in billed.items():
        for month in months:
            now_rev = by_month.get(month, ZERO)
            prev_rev = by_month.get(_month_before(month), ZERO)
            acc = month_sums[(month, currency)]
            if now_rev > 0:
                acc[0] += 1
                acc[1] += now_rev
                if firsts.get((org_id, currency)) == month:
                    acc[2] += 1
                    acc[3] += now_rev
                    movements.append((month, org_id, currency, "new", now_rev))
            elif prev_rev > 0:
                acc[4] += 1
                acc[5] += prev_rev
                movements.append((month, org_id, currency, "churned", prev_rev))
    movements.sort(key=lambda r: (r[0], r[3], -r[4], r[1]))
    movements = movements[:MAX_MOVEMENTS]
    labels = org_labels({k[0] for k in top_keys} | {r[1] for r in movements})
    top = []
    for org_id, currency in top_keys:
        by_month = billed[(org_id, currency)]
        last_rev, prev_rev = by_month.get(last, ZERO), by_month.get(before_last, ZERO)
        change = last_rev - prev_rev
        top.append(TopCustomerRow(
            organization=labels[org_id][0], organization_name=labels[org_id][1],
            currency=currency,
            revenue=money(sum((v for k, v in by_month.items() if k >= first), ZERO), currency),
            last_month=day(last), last_month_revenue=money(last_rev, currency),
            previous_month_revenue=money(prev_rev, currency), change=money(change, currency),
            change_pct=(change / prev_rev * 100).quantize(Decimal("0.1"))
            if prev_rev > 0 else None))
    return CustomersReport(
        report_filter=f, top=top,
        months=[CustomerMonthRow(day(month), currency, s[0], money(s[1], currency), s[2],
                                 money(s[3], currency), s[4], money(s[5], currency))
                for (month, currency), s in sorted(month_sums.items()) if any(s)],
        movements=[CustomerMovementRow(day(month), labels[org_id][0], labels[org_id][1],
                                       currency, kind, money(revenue, currency))
                   for month, org_id, currency, kind, revenue in movements])


