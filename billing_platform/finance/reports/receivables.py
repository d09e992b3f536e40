"""The receivables report: unpaid invoices, their aging and dunning stage, DSO, and what
Stripe moved back after payment (refunds, disputes, chargebacks)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from billing_platform.finance.reports.rows import Row, money, org_labels
from billing_platform.invoicing import reports as invoicing_reports
from billing_platform.invoicing.money import ZERO

AGING_BUCKETS = invoicing_reports.AGING_BUCKETS
DUNNING_STAGES = invoicing_reports.DUNNING_STAGES
DSO_DAYS = 90


@dataclass(frozen=True)
class ReceivablesFilter:
    """Unpaid invoices aged at ``as_of``; optionally issued in [issued_from, issued_to)."""

    as_of: datetime
    issued_from: datetime | None = None
    issued_to: datetime | None = None
    currency: str | None = None
    org_id: int | None = None
    bucket: str | None = None
    stage: str | None = None


@dataclass(frozen=True)
class ReceivableRow(Row):
    """One unpaid finalized invoice: what it owes, how late, where dunning stands."""

    invoice: str
    number: str
    organization: str
    organization_name: str
    currency: str
    status: str
    stage: str
    bucket: str
    days_past_due: int | None
    total: Decimal
    amount_due: Decimal
    issued_at: datetime
    due_at: datetime | None
    payment_failures: int
    next_payment_attempt_at: datetime | None
    dunning_paused_at: datetime | None
    written_off_at: datetime | None


@dataclass(frozen=True)
class ReceivablesSummary(Row):
    """One currency's receivables at ``as_of``.

    ``open``: amount due on open invoices, of which ``overdue`` is past its due date; the
    aging buckets split ``open`` by days past due (``current`` not due yet). ``uncollectible``:
    amount due on invoices dunning gave up on; ``written_off``: on invoices finance wrote off.
    ``dso_days``, days sales outstanding: ``open`` / billed in the 90 days before ``as_of``
    (documents finalized then, credit notes net) x 90; None when nothing was billed then.

    After payment, as Stripe reported it (``invoicing.reports.receivable_after_payment``):
    ``refunded``, what Stripe's ``charge.refunded`` reported refunded (partial or full, through
    a credit note or not) of the invoices billed in those 90 days (the documents of
    ``billed_90_days``; an invoice keeps a running total, not when each refund was made);
    ``refunds_pending``, per charge, its credit notes' refunds (``Refund``s made by ``as_of``,
    sent or still to send, not refused) less what Stripe reported refunded of that charge,
    never below zero (Stripe accepting a refund is not its report; ``charge.refunded`` is);
    ``disputed``, under disputes open at ``as_of`` (opened by then, not closed by then);
    ``charged_back``, lost to disputes closed ``lost`` in those 90 days. These are not
    narrowed by the issue range, bucket or stage (those select unpaid invoices), only by
    currency and organization.
    """

    currency: str
    open: Decimal
    open_invoices: int
    overdue: Decimal
    overdue_invoices: int
    current: Decimal
    days_0_30: Decimal
    days_31_60: Decimal
    days_61_90: Decimal
    days_90_plus: Decimal
    uncollectible: Decimal
    written_off: Decimal
    billed_90_days: Decimal
    dso_days: Decimal | None
    refunded: Decimal
    refunds_pending: Decimal
    disputed: Decimal
    charged_back: Decimal
    stages: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class ReceivablesReport:
    report_filter: ReceivablesFilter
    count: int
    rows: list[ReceivableRow]
    summaries: list[ReceivablesSummary]


_BUCKET_FIELDS = {"current": "current", "0-30": "days_0_30", "31-60": "days_31_60",
                  "61-90": "days_61_90", "90+": "days_90_plus"}


def receivables_report(*, report_filter: ReceivablesFilter, limit: int = 100,
                       offset: int = 0) -> ReceivablesReport:
    """Return one page of unpaid invoices (most days past due first) and per-currency sums."""
    f = report_filter
    rf = invoicing_reports.ReceivableFilter(
        as_of=f.as_of, issued_from=f.issued_from, issued_to=f.issued_to, currency=f.currency,
        org_id=f.org_id, bucket=f.bucket, stage=f.stage)
    page = invoicing_reports.receivable_invoices(receivable_filter=rf, limit=limit,
                                                 offset=offset)
    sums_rows = invoicing_reports.receivable_sums(receivable_filter=rf)
    count = sum(s.invoices for s in sums_rows)
    labels = org_labels({r.org_id for r in page})
    rows = [ReceivableRow(
        invoice=r.public_id, number=r.number, organization=labels[r.org_id][0],
        organization_name=labels[r.org_id][1], currency=r.currency, status=r.status,
        stage=r.stage, bucket=r.bucket, days_past_due=r.days_past_due,
        total=money(r.total, r.currency), amount_due=money(r.amount_due, r.currency),
        issued_at=r.finalized_at, due_at=r.due_at, payment_failures=r.payment_failures,
        next_payment_attempt_at=r.next_payment_attempt_at,
        dunning_paused_at=r.dunning_paused_at, written_off_at=r.written_off_at)
        for r in page]
    sums: dict[str, dict[str, Any]] = {}
    for s in sums_rows:
        acc = sums.setdefault(s.currency, defaultdict(lambda: ZERO, stages=defaultdict(int)))
        acc["stages"][s.stage] += s.invoices
        if s.status == "uncollectible":
            acc["written_off" if s.stage == "written_off" else "uncollectible"] += s.amount_due
            continue
        acc["open"] += s.amount_due
        acc["open_invoices"] += s.invoices
        acc[_BUCKET_FIELDS[s.bucket]] += s.amount_due
        if s.bucket != "current":
            acc["overdue"] += s.amount_due
            acc["overdue_invoices"] += s.invoices
    start = f.as_of - timedelta(days=DSO_DAYS)
    after = {a.currency: a for a in invoicing_reports.receivable_after_payment(
        start=start, end=f.as_of, currency=f.currency, org_id=f.org_id)}
    billed = invoicing_reports.billed_between(
        start=start, end=f.as_of, currency=f.currency,
        org_id=f.org_id) if sums or after else {}
    none_after = invoicing_reports.AfterPayment("", ZERO, ZERO, ZERO, ZERO)
    summaries = []
    for currency in sorted(sums.keys() | after.keys()):
        acc = sums.get(currency) or defaultdict(lambda: ZERO, stages={})
        moved = after.get(currency, none_after)
        billed_90 = billed.get(currency, ZERO)
        dso = (acc["open"] / billed_90 * DSO_DAYS).quantize(Decimal("0.1")) \
            if billed_90 > 0 else None
        summaries.append(ReceivablesSummary(
            currency=currency, open=money(acc["open"], currency),
            open_invoices=int(acc["open_invoices"]), overdue=money(acc["overdue"], currency),
            overdue_invoices=int(acc["overdue_invoices"]),
            **{name: money(acc[name], currency) for name in _BUCKET_FIELDS.values()},
            uncollectible=money(acc["uncollectible"], currency),
            written_off=money(acc["written_off"], currency),
            billed_90_days=money(billed_90, currency), dso_days=dso,
            refunded=money(moved.refunded, currency),
            refunds_pending=money(moved.refunds_pending, currency),
            disputed=money(moved.disputed, currency),
            charged_back=money(moved.charged_back, currency),
            stages=dict(sorted(acc["stages"].items()))))
    return ReceivablesReport(report_filter=f, count=count, rows=rows, summaries=summaries)


