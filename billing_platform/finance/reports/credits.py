"""The credits report: grants rolled forward (liability, consumed, breakage)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import date, datetime
from decimal import Decimal

from billing_platform.finance.reports.rows import Row, day, money
from billing_platform.invoicing.money import ZERO
from plans.selectors import credit_movements


@dataclass(frozen=True)
class CreditsFilter:
    """Credit grants rolled forward over [start, end); optional currency, kind, organization."""

    start: datetime
    end: datetime
    currency: str | None = None
    kind: str | None = None
    org_id: int | None = None


@dataclass(frozen=True)
class CreditRow(Row):
    """Grants of one currency x kind x expiry month (None: never expire), rolled forward:
    ``opening + granted - consumed - expired == closing``; ``closing`` is the liability at the
    range's end, ``expired`` the breakage (expired unused)."""

    currency: str
    kind: str
    expiry_month: date | None
    grants: int
    opening: Decimal
    granted: Decimal
    consumed: Decimal
    expired: Decimal
    closing: Decimal


@dataclass(frozen=True)
class CreditsReport:
    report_filter: CreditsFilter
    rows: list[CreditRow]
    totals: list[CreditRow]  # per currency (kind "", expiry_month None)


def credits_report(*, report_filter: CreditsFilter) -> CreditsReport:
    """Return credit grants rolled forward per currency x kind x expiry month, with totals."""
    f = report_filter
    rows = []
    totals: dict[str, list[Decimal]] = defaultdict(lambda: [ZERO] * 6)
    for m in credit_movements(start=f.start, end=f.end, currency=f.currency, kind=f.kind,
                              organization_id=f.org_id):
        c = m.currency
        values = (m.opening, m.granted, m.consumed, m.expired, m.closing)
        rows.append(CreditRow(c, m.kind, day(m.expiry_month) if m.expiry_month else None,
                              m.grants, *(money(v, c) for v in values)))
        totals[c] = [a + b for a, b in zip(totals[c], (Decimal(m.grants), *values),
                                           strict=True)]
    return CreditsReport(report_filter=f, rows=rows, totals=[
        CreditRow(c, "", None, int(t[0]), *(money(v, c) for v in t[1:]))
        for c, t in sorted(totals.items())])


