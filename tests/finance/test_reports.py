"""Finance's reports against a ledger built through the real services, each number computed by
hand here: usage recorded through metering's record path (rated, rolled up), October closed by
period close, a credit note, a void, a payment, a late event, November left open.

USD prices per 1M tokens: input 1.00, cached input 0.10, output 2.00; EUR: 0.90, 0.09, 1.80.
Every event's amount is exact at 10 places, so the hand computations below are exact too.

Every test here ends with the billing invariant (rated usage = what invoices and drafts bill),
the invoicing suite's autouse fixture.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import date, datetime, timedelta
from decimal import Decimal

import pytest
from django.db.models import Sum

from billing_platform.finance import reports
from billing_platform.invoicing import reports as invoicing_reports
from billing_platform.invoicing import services
from billing_platform.invoicing.choices import InvoiceStatus
from billing_platform.invoicing.models import BilledRevenue, Invoice
from billing_platform.invoicing.reports import LineFilter
from metering.models import UsageEvent
from plans import services as plan_services
from tests.factories import make_billed_org, make_price_book
from tests.invoicing.conftest import (  # noqa: F401 - the autouse invariant check
    DEC,
    NOV,
    OCT,
    billing_invariant_holds,
    record,
)

D = Decimal


@dataclass
class Ledger:
    a: object  # USD, 10 % tax; credit note 0.31 on October
    b: object  # USD, 1.00 credit applied, 0.40 grant expired unused, paid offline, late event
    c: object  # USD, October voided
    d: object  # USD, October only (churns in November)
    e: object  # EUR
    invoices: dict[str, Invoice]
    note: Invoice


@pytest.fixture
def ledger(db) -> Ledger:
    make_price_book(prices=[{"model": "m-small", "input": "1.00", "output": "2.00"}])
    make_price_book(currency="EUR", prices=[{"model": "m-small", "input": "0.90",
                                             "output": "1.80"}])
    a = make_billed_org(name="Alpha", created_at=OCT, tax_rate="0.10")
    b = make_billed_org(name="Beta", created_at=OCT)
    c = make_billed_org(name="Gamma", created_at=OCT)
    d = make_billed_org(name="Delta", created_at=OCT)
    e = make_billed_org(name="Epsilon", created_at=OCT, currency="EUR")
    plan_services.credit_grant_create(organization=b, kind="promotional", amount="1.00",
                                      granted_at=OCT, expires_at=DEC + timedelta(days=14))
    plan_services.credit_grant_create(organization=b, kind="promotional", amount="0.40",
                                      granted_at=OCT, expires_at=OCT + timedelta(days=14))
    # October: A 1.333333 input, 0.05 cached, 0.722222 output -> lines 1.33 + 0.05 + 0.72
    record(a, "a1", OCT + timedelta(days=1), prompt_tokens=1_500_000, cached_tokens=500_000,
           completion_tokens=250_000)
    record(a, "a2", OCT + timedelta(days=2), prompt_tokens=333_333, completion_tokens=111_111)
    record(b, "b1", OCT + timedelta(days=9), prompt_tokens=2_000_000, completion_tokens=500_000)
    record(c, "c1", OCT + timedelta(days=4), prompt_tokens=1_000_000)
    record(d, "d1", OCT + timedelta(days=6), prompt_tokens=500_000)
    record(e, "e1", OCT + timedelta(days=11), prompt_tokens=1_000_000,
           completion_tokens=1_000_000)
    closed = services.period_close_run(now=NOV + timedelta(hours=1), enqueue_payments=False,
                                       org_ids=[o.id for o in (a, b, c, d, e)])
    assert closed.invoices == 5
    invoices = {o.name: Invoice.objects.get(organization=o, period_start=OCT)
                for o in (a, b, c, d, e)}
    services.invoice_void(invoice=invoices["Gamma"], reason="duplicate", acting_user=None)
    note = services.credit_note_create(invoice=invoices["Alpha"], amount=D("0.31"),
                                       reason="goodwill", acting_user=None)
    services.invoice_mark_paid(invoice=invoices["Beta"], acting_user=None)
    # November (open): A 0.10 + 0.10, E 0.0090009 EUR; B's late October event 0.123456
    record(a, "a3", NOV + timedelta(days=2), prompt_tokens=100_000, completion_tokens=50_000)
    record(e, "e2", NOV + timedelta(days=3), prompt_tokens=10_001)
    record(b, "b2", OCT + timedelta(days=19), prompt_tokens=123_456)
    for inv in invoices.values():
        inv.refresh_from_db()
    return Ledger(a, b, c, d, e, invoices, note)


def test_the_ledger_is_what_the_hand_computation_says(ledger):
    # the invoices the reports read (a check of the fixture, not of the reports)
    inv = ledger.invoices
    assert (inv["Alpha"].subtotal, inv["Alpha"].tax, inv["Alpha"].total) == (
        D("2.10"), D("0.21"), D("2.31"))
    assert (inv["Beta"].credits_applied, inv["Beta"].total) == (D("1.00"), D("2.00"))
    assert inv["Gamma"].status == InvoiceStatus.VOID
    assert inv["Epsilon"].total == D("2.70")
    assert inv["Alpha"].amount_due == D("2.00")  # the credit note reduced what is owed
    assert ledger.note.total == D("-0.31")


def _revenue(**kwargs) -> reports.RevenueReport:
    return reports.revenue_report(report_filter=reports.RevenueFilter(
        start=kwargs.pop("start", OCT), end=kwargs.pop("end", DEC), **kwargs))


def test_billed_revenue_of_a_period_is_the_sum_of_its_invoice_totals_to_the_cent(ledger):
    report = _revenue()
    totals = {(t.period, t.currency): t.billed for t in report.totals}
    # then October: A 2.31 + B 2.00 + D 0.50 - the 0.31 credit note (C's void is no revenue)
    assert totals[(date(2026, 10, 1), "USD")] == D("4.50")
    assert totals[(date(2026, 10, 1), "EUR")] == D("2.70")
    for (period, currency), billed in totals.items():
        start = datetime.combine(period, datetime.min.time(), tzinfo=OCT.tzinfo)
        documents = Invoice.objects.filter(
            currency=currency, period_start__gte=start,
            period_start__lt=NOV if period.month == 10 else DEC).exclude(
            status__in=[InvoiceStatus.DRAFT, InvoiceStatus.VOID])
        assert billed == (documents.aggregate(s=Sum("total"))["s"] or 0), (period, currency)
    # and each row is a line kind of those documents: usage per token class, tax, credits
    october_usd = {(r.kind, r.token_class): r.billed for r in report.rows
                   if r.period == date(2026, 10, 1) and r.currency == "USD"}
    assert october_usd == {
        ("usage", "input"): D("1.33") + D("2.00") + D("0.50"),
        ("usage", "cached_input"): D("0.05"),
        ("usage", "output"): D("0.72") + D("1.00"),
        ("tax", ""): D("0.21"), ("credit", ""): D("-1.00"), ("credit_note", ""): D("-0.31")}
    assert {r.plan_kind for r in report.rows if r.kind == "usage"} == {"on_demand"}
    # never a sum across currencies: each currency its own total
    assert {(t.currency, t.billed) for t in report.currency_totals} == {
        ("USD", D("4.50")), ("EUR", D("2.70"))}


def test_accrued_revenue_is_the_rated_usage_no_invoice_billed_yet(ledger):
    report = _revenue()
    nov = date(2026, 11, 1)
    accrued = {t.currency: (t.accrued, t.accrued_precise) for t in report.totals
               if t.period == nov}
    # then November's open periods: A 0.20 and B's late October event 0.123456; E 0.0090009
    assert accrued == {"USD": (D("0.32"), D("0.323456")), "EUR": (D("0.01"), D("0.0090009"))}
    # which is exactly the rated amount of the events no finalized invoice billed
    unbilled = UsageEvent.objects.filter(request_id__in=["a3", "e2", "b2"]).values(
        "currency").annotate(s=Sum("amount"))
    assert {r["currency"]: r["s"] for r in unbilled} == {
        c: precise for c, (_, precise) in accrued.items()}
    rows = {(r.currency, r.token_class): (r.accrued, r.accrued_tokens) for r in report.rows
            if r.period == nov}
    assert rows == {("USD", "input"): (D("0.22"), 223_456), ("USD", "output"): (D("0.10"), 50_000),
                    ("EUR", "input"): (D("0.01"), 10_001)}
    # and nothing of October is accrued any more (it was invoiced)
    assert all(t.accrued == 0 for t in report.totals if t.period == date(2026, 10, 1))


def test_the_billed_revenue_summary_equals_the_invoice_lines_summed(ledger):
    # what the database keeps as invoices are finalized, noted and voided is what their lines
    # sum to, per unit and under each filter (the report reads the summary)
    year = datetime(OCT.year, 1, 1, tzinfo=OCT.tzinfo)
    everything = LineFilter(start=year, end=year.replace(year=year.year + 1))
    for line_filter in (everything, replace(everything, currency="EUR"),
                        replace(everything, model="m-small", token_class="input"),
                        replace(everything, start=NOV), replace(everything, org_id=ledger.a.id)):
        for unit in ("month", "quarter", "year"):
            summed = sorted(invoicing_reports.billed_lines_summed(line_filter=line_filter,
                                                                  unit=unit))
            assert sorted(invoicing_reports.billed_lines(line_filter=line_filter,
                                                         unit=unit)) == summed
    assert any(ln.kind == "credit_note" for ln in invoicing_reports.billed_lines(
        line_filter=everything))
    # Gamma's void wrote the negating rows (the summary is append-only)
    voided = BilledRevenue.objects.filter(lines__lt=0)
    assert voided.aggregate(s=Sum("amount"))["s"] == -ledger.invoices["Gamma"].total


def test_revenue_filters_narrow_rows_and_totals(ledger):
    assert {(t.currency, t.billed) for t in _revenue(currency="EUR").currency_totals} == {
        ("EUR", D("2.70"))}
    alpha = _revenue(org_id=ledger.a.id)
    assert {(t.period, t.billed, t.accrued) for t in alpha.totals} == {
        (date(2026, 10, 1), D("2.00"), D("0")), (date(2026, 11, 1), D("0"), D("0.20"))}
    outputs = _revenue(token_class="output")
    assert {r.token_class for r in outputs.rows} == {"output"}
    assert sum(r.billed for r in outputs.rows if r.currency == "USD") == D("0.72") + D("1.00")
    assert _revenue(kind="tax").rows[0].billed == D("0.21")
    assert _revenue(plan_kind="token_plan").rows == []
    quarter = _revenue(unit="quarter")
    assert {(t.period, t.currency, t.billed) for t in quarter.totals} == {
        (date(2026, 10, 1), "USD", D("4.50")), (date(2026, 10, 1), "EUR", D("2.70"))}


def test_receivables_age_open_invoices_and_compute_dso(ledger):
    inv = ledger.invoices
    due = inv["Alpha"].due_at
    as_of = due + timedelta(days=45)
    report = reports.receivables_report(report_filter=reports.ReceivablesFilter(as_of=as_of))
    # then A (2.00 after its credit note) and D (0.50) are open in USD, E (2.70) in EUR; B was
    # paid, C voided; all 45 days past due
    assert report.count == 3
    assert {(r.organization, r.amount_due, r.bucket, r.days_past_due, r.stage)
            for r in report.rows} == {
        (ledger.a.public_id, D("2.00"), "31-60", 45, "awaiting_payment"),
        (ledger.d.public_id, D("0.50"), "31-60", 45, "awaiting_payment"),
        (ledger.e.public_id, D("2.70"), "31-60", 45, "awaiting_payment")}
    usd = next(s for s in report.summaries if s.currency == "USD")
    assert (usd.open, usd.overdue, usd.days_31_60, usd.current, usd.days_90_plus) == (
        D("2.50"), D("2.50"), D("2.50"), D("0"), D("0"))
    # DSO: open / (billed, by finalization time, in the 90 days before as_of) x 90
    billed = sum((i.total for i in Invoice.objects.filter(currency="USD").exclude(
        status__in=["draft", "void"]) if as_of - timedelta(days=90) <= i.finalized_at < as_of),
        D(0))
    assert usd.billed_90_days == billed
    assert usd.dso_days == (D("2.50") / billed * 90).quantize(D("0.1"))
    # and on the due date itself nothing is overdue yet; 100 days later it is 90+
    on_time = reports.receivables_report(
        report_filter=reports.ReceivablesFilter(as_of=due - timedelta(seconds=1)))
    assert {r.bucket for r in on_time.rows} == {"current"}
    late = reports.receivables_report(report_filter=reports.ReceivablesFilter(
        as_of=due + timedelta(days=100), currency="EUR"))
    assert [(r.organization, r.bucket) for r in late.rows] == [(ledger.e.public_id, "90+")]


def test_credits_roll_forward_liability_consumption_and_breakage(ledger):
    october = reports.credits_report(report_filter=reports.CreditsFilter(start=OCT, end=NOV))
    november = reports.credits_report(report_filter=reports.CreditsFilter(start=NOV, end=DEC))
    # October: 1.40 granted, the 0.40 that expired Oct 15 unused is breakage, 1.00 left
    assert [(t.currency, t.opening, t.granted, t.consumed, t.expired, t.closing)
            for t in october.totals] == [("USD", D("0"), D("1.40"), D("0"), D("0.40"),
                                          D("1.00"))]
    # November: the close (at Nov 1 01:00) applied the remaining 1.00 to B's invoice
    assert [(t.opening, t.granted, t.consumed, t.expired, t.closing)
            for t in november.totals] == [(D("1.00"), D("0"), D("1.00"), D("0"), D("0"))]
    assert {(r.kind, r.expiry_month, r.expired, r.closing) for r in october.rows} == {
        ("promotional", date(2026, 10, 1), D("0.40"), D("0")),
        ("promotional", date(2026, 12, 1), D("0"), D("1.00"))}
    for row in october.rows + november.rows:
        assert row.opening + row.granted - row.consumed - row.expired == row.closing


def test_customers_top_month_over_month_new_and_churned(ledger):
    # given November closed too (A 0.20 + 0.02 tax, B its late 0.12, E 0.01 EUR, D nothing)
    services.period_close_run(now=DEC + timedelta(hours=1), enqueue_payments=False,
                              org_ids=[o.id for o in (ledger.a, ledger.b, ledger.c,
                                                      ledger.d, ledger.e)])
    report = reports.customers_report(report_filter=reports.CustomersFilter(start=OCT, end=DEC))
    top = [(r.organization_name, r.currency, r.revenue, r.last_month_revenue,
            r.previous_month_revenue, r.change, r.change_pct) for r in report.top]
    assert top == [
        ("Epsilon", "EUR", D("2.71"), D("0.01"), D("2.70"), D("-2.69"), D("-99.6")),
        ("Alpha", "USD", D("2.22"), D("0.22"), D("2.00"), D("-1.78"), D("-89.0")),
        ("Beta", "USD", D("2.12"), D("0.12"), D("2.00"), D("-1.88"), D("-94.0")),
        ("Delta", "USD", D("0.50"), D("0"), D("0.50"), D("-0.50"), D("-100.0"))]
    months = {(m.month, m.currency): (m.customers, m.revenue, m.new, m.churned,
                                      m.churned_revenue) for m in report.months}
    assert months == {
        (date(2026, 10, 1), "EUR"): (1, D("2.70"), 1, 0, D("0")),
        (date(2026, 10, 1), "USD"): (3, D("4.50"), 3, 0, D("0")),
        (date(2026, 11, 1), "EUR"): (1, D("0.01"), 0, 0, D("0")),
        (date(2026, 11, 1), "USD"): (2, D("0.34"), 0, 1, D("0.50"))}
    assert [(m.organization_name, m.movement) for m in report.movements
            if m.month == date(2026, 11, 1)] == [("Delta", "churned")]


def test_an_event_of_the_last_closed_period_that_arrives_after_its_close_is_accrued(db):
    # given an org whose billing period ended 30 minutes ago (a plan anchored then), closed
    # just now with one event of its last hour in it (so no hour of it is marked late)
    from django.utils import timezone

    from plans.periods import add_months

    make_price_book(prices=[{"model": "m-small", "input": "1.00", "output": "2.00"}])
    now = timezone.now()
    period_end = now - timedelta(minutes=30)
    anchor = add_months(period_end, -1)
    org = make_billed_org(name="Anchored", created_at=anchor)
    plan = plan_services.plan_create(code="od-anchored", name="On demand", kind="on_demand")
    plan_services.subscription_create(organization=org, plan=plan, starts_at=anchor,
                                      billing_anchor=anchor)
    record(org, "billed", period_end - timedelta(minutes=20), prompt_tokens=1_000_000)
    assert services.period_close_run(now=now, enqueue_payments=False,
                                     org_ids=[org.id]).invoices == 1
    assert Invoice.objects.get(organization=org).period_end == period_end

    def accrued() -> Decimal:
        totals = _revenue(start=anchor - timedelta(days=31), end=now + timedelta(days=62),
                          org_id=org.id).currency_totals
        return sum((t.accrued_precise for t in totals), D(0))

    assert accrued() == 0
    # when an event of its last 10 minutes arrives after the close (within the hour, so
    # metering does not mark its hour late)
    record(org, "straggler", period_end - timedelta(minutes=10), prompt_tokens=123_457)
    # then it is accrued (the next invoice bills it as late usage), to the 10th place
    assert accrued() == D("0.123457") == UsageEvent.objects.get(request_id="straggler").amount
