"""Period close over a month of mixed traffic: every line equals a hand computation.

The traffic is recorded through metering's real record path (``usage_events_record``: rating by
plans, idempotency, hourly rollups in the same transaction), not through a live gateway: the
gateway's own tests prove it appends what the engine reported, and this suite proves what
invoicing makes of recorded, rated usage.
"""

from __future__ import annotations

from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal

import pytest
from django.conf import settings
from django.db import DatabaseError, DataError, IntegrityError, transaction

from billing_platform.errors import Conflict
from billing_platform.invoicing import services
from billing_platform.invoicing.choices import InvoiceStatus, LineKind
from billing_platform.invoicing.models import Invoice, InvoiceLine
from metering.models import UsageEvent, UsageRollupHourly
from plans import services as plan_services
from plans.models import CreditGrant
from tests.factories import make_billed_org, make_offering, make_token_plan
from tests.invoicing.conftest import DEC, NOV, OCT, record

CENT = Decimal("0.01")
TEN = Decimal("1E-10")
M = Decimal(1_000_000)


def d(value: str) -> Decimal:
    return Decimal(value)


def cents(value: Decimal) -> Decimal:
    return value.quantize(CENT, rounding=ROUND_HALF_UP)


def per_class(*requests, p_in, p_cached, p_out, mult=Decimal(1)) -> dict[str, Decimal]:
    """What DESIGN.md says requests cost, per token class: each request's class amount rounded
    to 10 places (as rated), summed over the requests. ``requests``: (prompt, cached, out)."""
    out: dict[str, Decimal] = defaultdict(Decimal)
    for prompt, cached, completion in requests:
        for cls, tokens, price in (("input", prompt - cached, p_in),
                                   ("cached_input", cached, p_cached),
                                   ("output", completion, p_out)):
            out[cls] += (tokens * price * mult / M).quantize(TEN, rounding=ROUND_HALF_EVEN)
    return dict(out)


@pytest.fixture
def month(catalog):
    """October 2026: org A on-demand (tax 20 %) with a reservation and a credit grant; org B on
    a token plan that crosses its cap into overage."""
    a = make_billed_org(name="Acme", tax_rate="0.2000")
    b = make_billed_org(name="Beta")
    # A: on-demand with cached tokens (two requests, same line), priority, flex
    record(a, "a1", OCT + timedelta(days=2, hours=3), prompt_tokens=123_457,
           cached_tokens=23_456, completion_tokens=34_567)
    record(a, "a2", OCT + timedelta(days=9), prompt_tokens=2_000_000, cached_tokens=1_000_000,
           completion_tokens=500_000)
    record(a, "a3", OCT + timedelta(days=10), service_tier="priority", prompt_tokens=300_000,
           completion_tokens=100_001)
    record(a, "a4", OCT + timedelta(days=11), model="m-big", service_tier="flex",
           prompt_tokens=1_000_000, cached_tokens=500_000, completion_tokens=200_000)
    # A: 2 reserved units of m-big in us-east for October; one request inside, one spilled
    plan_services.reservation_create(organization=a, offering=make_offering(model="m-big"),
                                     units=2, term="monthly", starts_at=OCT)
    record(a, "a5", OCT + timedelta(days=12), model="m-big", capacity_source="provisioned",
           prompt_tokens=100_000, completion_tokens=50_000)
    record(a, "a6", OCT + timedelta(days=12, hours=1), model="m-big",
           capacity_source="spillover", prompt_tokens=200_000, completion_tokens=10_000)
    plan_services.credit_grant_create(organization=a, kind="promotional", amount="5.00",
                                      granted_at=OCT)
    # B: token plan, 1,000,000 credits, overage at on-demand prices past the cap
    plan = make_token_plan(window_credits=None, credits_per_period="1000000", coefficients=[
        {"model": "m-small", "token_class": "input", "coefficient": "1"},
        {"model": "m-small", "token_class": "cached_input", "coefficient": "0.1"},
        {"model": "m-small", "token_class": "output", "coefficient": "3"},
    ])
    plan_services.subscription_create(organization=b, plan=plan, starts_at=OCT)
    record(b, "b1", OCT + timedelta(days=3), prompt_tokens=600_000, completion_tokens=100_000)
    record(b, "b2", OCT + timedelta(days=4), prompt_tokens=400_000, cached_tokens=100_000,
           completion_tokens=50_000)
    return a, b


def _lines(invoice: Invoice) -> dict[tuple, InvoiceLine]:
    return {(ln.kind, ln.model, ln.service_tier, ln.capacity_source, ln.token_class): ln
            for ln in invoice.lines.all()}


def _check_usage(lines: dict, model: str, tier: str, source: str,
                 expected: dict[str, tuple[int, Decimal, str]]) -> None:
    """Each token class line of one model x tier x source: (tokens, exact amount, rounded)."""
    got = {key[4]: (int(ln.quantity), ln.amount_precise, ln.amount) for key, ln in lines.items()
           if key[:4] == (LineKind.USAGE, model, tier, source)}
    assert got == {c: (q, exact, d(rounded)) for c, (q, exact, rounded) in expected.items()}
    for cls, (tokens, exact, _) in expected.items():
        unit_price = lines[(LineKind.USAGE, model, tier, source, cls)].unit_price
        assert unit_price == (exact * M / tokens).quantize(TEN), (cls, unit_price)


def test_a_month_of_mixed_traffic_closes_to_hand_computed_lines(month):
    a, b = month

    # when October closes (an hour into November)
    report = services.period_close_run(now=NOV + timedelta(hours=1), enqueue_payments=False)

    # then each org has one open invoice for October
    assert report.invoices == 2
    inv_a = Invoice.objects.get(organization=a)
    inv_b = Invoice.objects.get(organization=b)
    assert (inv_a.period_start, inv_a.period_end) == (OCT, NOV)
    assert inv_a.status == InvoiceStatus.OPEN and inv_a.number.startswith("INV-2026-")
    small = {"p_in": d("1.00"), "p_cached": d("0.10"), "p_out": d("2.00")}
    big = {"p_in": d("3.00"), "p_cached": d("0.30"), "p_out": d("15.00")}
    lines = _lines(inv_a)
    # on-demand with cached tokens: two requests, a line per token class, each rounded once
    std = per_class((123_457, 23_456, 34_567), (2_000_000, 1_000_000, 500_000), **small)
    assert std == {"input": d("1.100001"), "cached_input": d("0.1023456"),
                   "output": d("1.069134")}
    _check_usage(lines, "m-small", "default", "on_demand", {
        "input": (1_100_001, std["input"], "1.10"),
        "cached_input": (1_023_456, std["cached_input"], "0.10"),
        "output": (534_567, std["output"], "1.07")})
    # the effective unit prices are the price book's, per 1M tokens
    assert lines[(LineKind.USAGE, "m-small", "default", "on_demand", "output")].unit_price == \
        d("2.00")
    assert lines[(LineKind.USAGE, "m-small", "default", "on_demand", "input")].details == {
        "requests": 2}
    # priority x2 (no cached tokens: no cached line)
    prio = per_class((300_000, 0, 100_001), mult=d("2"), **small)
    _check_usage(lines, "m-small", "priority", "on_demand", {
        "input": (300_000, prio["input"], "0.60"), "output": (100_001, prio["output"], "0.40")})
    # flex x0.5: cached 0.075 rounds half-up to 0.08
    flex = per_class((1_000_000, 500_000, 200_000), mult=d("0.5"), **big)
    _check_usage(lines, "m-big", "flex", "on_demand", {
        "input": (500_000, d("0.75"), "0.75"), "cached_input": (500_000, d("0.075"), "0.08"),
        "output": (200_000, d("1.5"), "1.50")})
    assert flex == {"input": d("0.75"), "cached_input": d("0.075"), "output": d("1.5")}
    # inside the reservation: the tokens are listed, with no per-token charge
    _check_usage(lines, "m-big", "default", "provisioned", {
        "input": (100_000, d("0"), "0.00"), "output": (50_000, d("0"), "0.00")})
    # spillover at on-demand prices
    spill = per_class((200_000, 0, 10_000), **big)
    _check_usage(lines, "m-big", "default", "spillover", {
        "input": (200_000, spill["input"], "0.60"), "output": (10_000, spill["output"], "0.15")})
    # the reservation fee: 2 units x 100.00 x 1 month
    fee = lines[(LineKind.RESERVATION_FEE, "m-big", "", "provisioned", "")]
    assert fee.amount == d("200.00")
    subtotal = (d("1.10") + d("0.10") + d("1.07") + d("0.60") + d("0.40") + d("0.75")
                + d("0.08") + d("1.50") + d("0.60") + d("0.15") + d("200.00"))
    assert inv_a.subtotal == subtotal == d("206.35")
    # the 5.00 promotional grant is consumed before tax (a discount: it lowers what is taxed);
    # total = sum of the rounded lines
    assert inv_a.credits_applied == d("5.00")
    assert inv_a.tax == cents((subtotal - d("5.00")) * d("0.2")) == d("40.27")
    assert inv_a.total == inv_a.amount_due == d("241.62")
    assert sum(ln.amount for ln in inv_a.lines.all()) == inv_a.total
    assert CreditGrant.objects.get(organization=a).remaining == 0

    # B: the plan fee, b1 inside the plan at 0, the overage share of b2 at on-demand
    lines = _lines(inv_b)
    assert lines[(LineKind.PLAN_FEE, "", "", "", "")].amount == d("10.00")
    _check_usage(lines, "m-small", "default", "plan", {
        "input": (600_000, d("0"), "0.00"), "output": (100_000, d("0"), "0.00")})
    # b2 needs 460,000 credits with 100,000 left: 360/460 of its on-demand price, per class
    share = Decimal(360_000) / Decimal(460_000)
    over = {c: (x * share).quantize(TEN, rounding=ROUND_HALF_EVEN)
            for c, x in per_class((400_000, 100_000, 50_000), **small).items()}
    _check_usage(lines, "m-small", "default", "overage", {
        "input": (300_000, over["input"], "0.23"),
        "cached_input": (100_000, over["cached_input"], "0.01"),
        "output": (50_000, over["output"], "0.08")})
    assert inv_b.total == d("10.32") and inv_b.tax == 0

    # and every usage line equals the sum of its events' rated amounts, rounded once
    sums: dict[tuple, Decimal] = defaultdict(Decimal)
    for e in UsageEvent.objects.filter(organization_id__in=[a.id, b.id]):
        for cls, amount in e.rating_breakdown.items():
            sums[(e.organization_id, e.model, e.service_tier, e.capacity_source, cls)] += \
                Decimal(amount)
    usage = InvoiceLine.objects.filter(kind=LineKind.USAGE).select_related("invoice")
    assert {(ln.invoice.organization_id, ln.model, ln.service_tier, ln.capacity_source,
             ln.token_class): ln.amount for ln in usage if ln.amount} == {
        k: cents(v) for k, v in sums.items() if cents(v)}

    # when the close runs again, nothing new is created
    count = InvoiceLine.objects.count()
    again = services.period_close_run(now=NOV + timedelta(hours=2), enqueue_payments=False)
    assert again.invoices == 0
    assert Invoice.objects.count() == 2 and InvoiceLine.objects.count() == count


def test_usage_that_arrives_months_late_is_billed_once_on_the_next_invoice(catalog):
    # given an org invoiced monthly since June, June to October closed
    org = make_billed_org(name="Archive", created_at=datetime(2026, 6, 1, tzinfo=UTC))
    services.period_close_run(now=NOV + timedelta(hours=1), enqueue_payments=False)
    assert Invoice.objects.filter(organization=org).count() == 5

    # when a July event arrives now (a spool replayed, an import), far past the lookback
    july = datetime(2026, 7, 15, tzinfo=UTC)
    assert NOV - july > timedelta(days=settings.INVOICING_LATE_LOOKBACK_DAYS)
    record(org, "from-july", july, prompt_tokens=2_000_000)
    services.period_close_run(now=DEC + timedelta(hours=1), enqueue_payments=False)

    # then November's invoice bills it as late usage from July
    november = Invoice.objects.get(organization=org, period_start=NOV)
    (late,) = november.lines.filter(kind=LineKind.LATE_USAGE)
    assert late.description.startswith("Late usage from 2026-07-01 to 2026-08-01")
    assert (late.quantity, late.amount) == (2_000_000, d("2.00"))
    # and December's does not bill it again
    services.period_close_run(now=DEC + timedelta(days=31, hours=1), enqueue_payments=False)
    december = Invoice.objects.get(organization=org, period_start=DEC)
    assert not december.lines.filter(kind=LineKind.LATE_USAGE).exists()


def test_a_plan_started_and_ended_mid_month_has_its_fee_prorated_by_time(catalog):
    # given an org invoiced by calendar month since October, on a 10.00/month plan from Oct 15
    # (anchored there) until Dec 1
    org = make_billed_org(name="Midway")
    plan = make_token_plan(monthly_fee="10.00", window_credits=None)
    plan_services.subscription_create(organization=org, plan=plan,
                                      starts_at=OCT + timedelta(days=14), ends_at=DEC)

    # when every period up to mid-December closes
    services.period_close_run(now=DEC + timedelta(days=20), enqueue_payments=False)

    # then: October (calendar) bills Oct 15-31 of the plan's first month, 17/31; the next
    # period runs to the plan's anchor, Nov 1-15, 14/31; then Nov 15 - Dec 1 of a 30-day month
    fees = [(inv.period_start.date().isoformat(), ln.quantity, ln.amount_precise, ln.amount,
             ln.description) for inv in Invoice.objects.filter(organization=org)
            .order_by("period_start") for ln in inv.lines.filter(kind=LineKind.PLAN_FEE)]
    ten = d("10.00")
    expected = [("2026-10-01", Decimal(17) / 31, "5.48", "2026-10-15 to 2026-11-01"),
                ("2026-11-01", Decimal(14) / 31, "4.52", "2026-11-01 to 2026-11-15"),
                ("2026-11-15", Decimal(16) / 30, "5.33", "2026-11-15 to 2026-12-01")]
    assert len(fees) == len(expected)
    for (start, qty, precise, amount, text), (e_start, months, e_amount, e_text) in zip(
            fees, expected, strict=True):
        assert start == e_start
        assert qty == months.quantize(d("1E-6"))
        assert precise == (ten * months).quantize(TEN)
        assert amount == d(e_amount)
        assert text.endswith(f"(prorated {e_text})")
    # the plan's first whole month, split over two invoices, adds up to its fee
    assert d("5.48") + d("4.52") == ten


def test_a_whole_plan_month_is_billed_once_unprorated(catalog):
    org = make_billed_org(name="Whole")
    plan_services.subscription_create(organization=org, plan=make_token_plan(), starts_at=OCT)
    services.period_close_run(now=NOV + timedelta(hours=1), enqueue_payments=False)
    (fee,) = Invoice.objects.get(organization=org).lines.filter(kind=LineKind.PLAN_FEE)
    assert (fee.quantity, fee.amount, fee.description) == (1, d("10.00"),
                                                           "Test token plan — monthly fee")


def test_late_event_goes_on_the_next_invoice_and_the_old_one_never_changes(month):
    a, _ = month
    services.period_close_run(now=NOV + timedelta(hours=1), enqueue_payments=False)
    october = Invoice.objects.get(organization=a)
    before = [(ln.description, ln.amount) for ln in october.lines.all()]

    # given an October event that arrives after October was invoiced
    record(a, "late-1", OCT + timedelta(days=20), prompt_tokens=1_000_000)

    # when November closes
    services.period_close_run(now=DEC + timedelta(hours=1), enqueue_payments=False)

    # then it is billed once, on November's invoice, as late usage from October
    november = Invoice.objects.get(organization=a, period_start=NOV)
    (late,) = november.lines.filter(kind=LineKind.LATE_USAGE)
    assert late.description.startswith("Late usage from 2026-10-01")
    assert (late.source_period_start, late.source_period_end) == (OCT, NOV)
    assert late.amount == d("1.00")
    assert november.subtotal == d("1.00") and november.tax == d("0.20")
    assert november.total == d("1.20")
    october.refresh_from_db()
    assert [(ln.description, ln.amount) for ln in october.lines.all()] == before
    assert october.total == d("241.62")

    # and a later close does not bill it a second time
    services.period_close_run(now=DEC + timedelta(days=31, hours=1), enqueue_payments=False)
    january = Invoice.objects.get(organization=a, period_start=DEC)
    assert not january.lines.filter(kind=LineKind.LATE_USAGE).exists()


def _corrupt_usage(org) -> None:
    """October usage adding up past what an invoice can hold (150 hourly rollups of ~1e18)."""
    UsageRollupHourly.objects.bulk_create([UsageRollupHourly(
        organization=org, project=org.projects.first(), model="m-small", region="us-east",
        service_tier="default", capacity_source="on_demand", currency=org.currency,
        hour=OCT + timedelta(hours=h), requests=1, amount=d("999999999999999999"),
        input_amount=d("999999999999999999")) for h in range(150)])


def test_an_org_that_cannot_be_invoiced_never_holds_back_the_others(catalog, caplog):
    # given five orgs with October usage, and one whose October usage adds up past what an
    # invoice can hold (150 hourly rollups of ~1e18, corrupt data)
    good = [make_billed_org(name=f"Good {i}") for i in range(5)]
    for org in good:
        record(org, f"good-{org.id}", OCT + timedelta(days=3), prompt_tokens=1_000_000)
    bad = make_billed_org(name="Corrupt")
    _corrupt_usage(bad)

    # when October closes, in chunks of four
    report = services.period_close_run(now=NOV + timedelta(hours=1), enqueue_payments=False,
                                       chunk=4)

    # then every other org is invoiced, numbered without gaps; the bad one is named and logged
    assert report.failed_orgs == [bad.id] and report.invoices == 5
    invoices = Invoice.objects.order_by("number")
    assert {i.organization_id for i in invoices} == {o.id for o in good}
    assert {i.total for i in invoices} == {d("1.00")}
    numbers = [int(i.number.rsplit("-", 1)[1]) for i in invoices]
    assert numbers == list(range(numbers[0], numbers[0] + 5))
    assert f"organization {bad.id}" in caplog.text and "could not be invoiced" in caplog.text


def test_chunks_closed_in_parallel_invoice_every_org_once_numbered_without_gaps(
        transactional_db, catalog, settings):
    # given nine orgs with October usage, closed two orgs a chunk, two chunks at a time
    settings.INVOICING_CLOSE_WORKERS = 2
    orgs = [make_billed_org(name=f"Parallel {i}") for i in range(9)]
    for i, org in enumerate(orgs):
        record(org, f"par-{i}", OCT + timedelta(days=i + 1), prompt_tokens=(i + 1) * 1_000_000)

    # when two closers run at once
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda _: services.period_close_run(
            now=NOV + timedelta(hours=1), enqueue_payments=False, chunk=2), range(2)))

    # then each org has one invoice with its own usage, and the numbers have no gaps
    assert sum(r.invoices for r in runs) == 9
    invoices = list(Invoice.objects.order_by("number"))
    assert sorted(i.organization_id for i in invoices) == sorted(o.id for o in orgs)
    totals = {i.organization_id: i.total for i in invoices}
    assert totals == {o.id: Decimal(n + 1) for n, o in enumerate(orgs)}
    numbers = [int(i.number.rsplit("-", 1)[1]) for i in invoices]
    assert numbers == list(range(numbers[0], numbers[0] + 9))


def test_a_fault_common_to_many_orgs_fails_the_run_instead_of_skipping_them(catalog):
    for i in range(services.MAX_FAILED_ORGS + 1):
        _corrupt_usage(make_billed_org(name=f"Corrupt {i}"))
    with pytest.raises(DataError):
        services.period_close_run(now=NOV + timedelta(hours=1), enqueue_payments=False)
    assert not Invoice.objects.exists()


def test_finalized_invoices_are_immutable_and_unique_per_period(month):
    a, _ = month
    services.period_close_run(now=NOV + timedelta(hours=1), enqueue_payments=False)
    invoice = Invoice.objects.get(organization=a)
    line = invoice.lines.first()

    with pytest.raises(DatabaseError, match="finalized"), transaction.atomic():
        InvoiceLine.objects.filter(pk=line.pk).update(amount=d("0.01"))
    with pytest.raises(DatabaseError, match="finalized"), transaction.atomic():
        Invoice.objects.filter(pk=invoice.pk).update(total=d("1.00"))
    with pytest.raises(DatabaseError, match="finalized"), transaction.atomic():
        invoice.lines.all().delete()
    with pytest.raises(IntegrityError), transaction.atomic():
        Invoice.objects.create(organization=a, currency="USD", period_start=OCT,
                               period_end=NOV)
    # status may still move (payment bookkeeping)
    services.invoice_mark_paid(invoice=invoice, acting_user=None)
    invoice.refresh_from_db()
    assert invoice.status == InvoiceStatus.PAID and invoice.total == d("241.62")


def test_credit_note_reduces_what_is_due_and_void_returns_credits(month):
    a, b = month
    services.period_close_run(now=NOV + timedelta(hours=1), enqueue_payments=False)
    inv_a = Invoice.objects.get(organization=a)
    inv_b = Invoice.objects.get(organization=b)

    note = services.credit_note_create(invoice=inv_b, amount=d("2.50"), reason="outage",
                                       acting_user=None)
    assert note.number.startswith("CN-2026-") and note.total == d("-2.50")
    # an open invoice's note reduces what is due (as Stripe's do), not a credit grant
    assert not CreditGrant.objects.filter(organization=b, kind="credit_note").exists()
    inv_b.refresh_from_db()
    assert inv_b.total == d("10.32")  # the invoice's figures never change
    assert (inv_b.status, inv_b.amount_due) == (InvoiceStatus.OPEN, d("7.82"))

    services.invoice_void(invoice=inv_a, reason="billed in error", acting_user=None)
    inv_a.refresh_from_db()
    assert inv_a.status == InvoiceStatus.VOID
    returned = CreditGrant.objects.get(organization=a, kind="credit_note")
    assert returned.remaining == d("5.00")


def test_upcoming_invoice_matches_what_close_will_bill(month):
    a, _ = month
    draft = services.upcoming_invoice(organization=a, now=OCT + timedelta(days=20))
    services.period_close_run(now=NOV + timedelta(hours=1), enqueue_payments=False)
    final = Invoice.objects.get(organization=a)
    assert [(ln.kind, ln.description, ln.amount) for ln in draft.lines] == [
        (ln.kind, ln.description, ln.amount) for ln in final.lines.all()]
    assert draft.total == final.total


@pytest.mark.django_db(transaction=True)
def test_concurrent_closes_create_one_invoice_per_org(catalog):
    import threading

    from django.db import connection

    orgs = [make_billed_org() for _ in range(6)]
    for i, org in enumerate(orgs):
        record(org, f"c{i}", OCT + timedelta(days=1), prompt_tokens=1_000_000)
    errors = []

    def close():
        try:
            services.period_close_run(now=NOV + timedelta(hours=1), enqueue_payments=False,
                                      chunk=2)
        except Exception as exc:  # surfaced below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=close) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert Invoice.objects.count() == 6
    numbers = sorted(int(n.rsplit("-", 1)[1]) for n in
                     Invoice.objects.values_list("number", flat=True))
    assert numbers == list(range(numbers[0], numbers[0] + 6))  # gapless


def test_a_hand_made_draft_is_finalized_with_tax_credits_and_a_number(catalog):
    org = make_billed_org(tax_rate="0.2000")
    plan_services.credit_grant_create(organization=org, kind="promotional", amount="1.00")
    draft = Invoice.objects.create(organization=org, currency="USD", period_start=OCT,
                                   period_end=NOV, kind="invoice")
    InvoiceLine.objects.create(invoice=draft, position=1, kind=LineKind.ADJUSTMENT,
                               description="Onboarding", amount_precise=d("10.005"),
                               amount=d("10.01"))
    invoice = services.invoice_finalize(invoice=draft, enqueue_payment=False)
    assert invoice.status == InvoiceStatus.OPEN and invoice.number.startswith("INV-")
    # 10.01 - 1.00 promotional credit (before tax) + tax 1.80 (20 % of 9.01 = 1.802)
    assert [ln.amount for ln in invoice.lines.all()] == [d("10.01"), d("-1.00"), d("1.80")]
    assert (invoice.subtotal, invoice.tax, invoice.total) == (d("10.01"), d("1.80"), d("10.81"))
    with pytest.raises(Conflict, match="already finalized"):
        services.invoice_finalize(invoice=invoice)


def test_periods_between_second_precise_anchors_bill_each_event_once(catalog):
    # given an org invoiced by calendar month since August, on a plan from Aug 10 14:22:05
    # (anchored there), then from Sep 25 on a plan anchored at 14:40:00 on the 10th: so one
    # period runs from Oct 10 14:22:05 to 14:40:00, inside one clock hour
    org = make_billed_org(name="Anchors", created_at=datetime(2026, 8, 1, tzinfo=UTC))
    first_anchor = datetime(2026, 8, 10, 14, 22, 5, tzinfo=UTC)
    second_anchor = datetime(2026, 9, 10, 14, 40, tzinfo=UTC)
    for code, starts_at, anchor in (("anchor-a", first_anchor, None),
                                    ("anchor-b", datetime(2026, 9, 25, tzinfo=UTC),
                                     second_anchor)):
        plan = plan_services.plan_create(code=code, name=code, kind="on_demand")
        plan_services.subscription_create(organization=org, plan=plan, starts_at=starts_at,
                                          billing_anchor=anchor)
    sep10, oct10, nov10 = (datetime(2026, m, 10, 14, tzinfo=UTC) for m in (9, 10, 11))
    usage = {  # event time -> input tokens (powers of ten, so each sum names its events)
        sep10 + timedelta(minutes=10): 1,                # Sep 1 - Sep 10 14:22:05
        sep10 + timedelta(minutes=22, seconds=5): 10,    # Sep 10 14:22:05 - Oct 10 14:22:05
        oct10: 100,
        oct10 + timedelta(minutes=30): 1_000,            # Oct 10 14:22:05 - 14:40:00
        oct10 + timedelta(minutes=40): 10_000,           # Oct 10 14:40 - Nov 10 14:40
        oct10 + timedelta(minutes=59): 100_000,
        nov10 + timedelta(minutes=39, seconds=59): 1_000_000,
        nov10 + timedelta(minutes=41): 10_000_000,       # the open period: on the draft
    }
    for i, (when, tokens) in enumerate(usage.items()):
        record(org, f"anchors-{i}", when, prompt_tokens=tokens)

    # when every period that has ended closes
    services.period_close_run(now=nov10 + timedelta(hours=1), enqueue_payments=False)

    # then the periods run anchor to anchor, and each event is on the one holding its time
    billed = [(inv.period_start, inv.period_end,
               sum(int(ln.quantity) for ln in inv.lines.filter(kind=LineKind.USAGE)))
              for inv in Invoice.objects.filter(organization=org).order_by("period_start")]
    assert billed == [
        (datetime(2026, 8, 1, tzinfo=UTC), datetime(2026, 9, 1, tzinfo=UTC), 0),
        (datetime(2026, 9, 1, tzinfo=UTC), sep10 + timedelta(minutes=22, seconds=5), 1),
        (sep10 + timedelta(minutes=22, seconds=5), oct10 + timedelta(minutes=22, seconds=5),
         110),
        (oct10 + timedelta(minutes=22, seconds=5), oct10 + timedelta(minutes=40), 1_000),
        (oct10 + timedelta(minutes=40), nov10 + timedelta(minutes=40), 1_110_000),
    ]
    draft = services.upcoming_invoice(organization=org)
    assert draft.target.period_start == nov10 + timedelta(minutes=40)
    assert sum(ln.quantity for ln in draft.lines if ln.kind == LineKind.USAGE) == 10_000_000

    # and an event of the short period that arrives after it closed is late usage, once
    record(org, "anchors-late", oct10 + timedelta(minutes=35), prompt_tokens=20_000)
    services.period_close_run(now=nov10 + timedelta(days=30, hours=1), enqueue_payments=False)
    december = Invoice.objects.get(organization=org, period_start=nov10 + timedelta(minutes=40))
    (late,) = december.lines.filter(kind=LineKind.LATE_USAGE)
    assert (late.quantity, late.amount) == (20_000, d("0.02"))
    assert late.source_period_start == oct10 + timedelta(minutes=22, seconds=5)
