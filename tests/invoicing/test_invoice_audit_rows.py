"""Every service that moves an invoice's money leaves one audit row, by whoever acted, or none.

Finalize (of one draft, and in bulk by period close), void, credit note, mark paid, charge,
and the write-off at the end of dunning each write their row in their own transaction: a
refusal writes none, and a failure half-way rolls the row back with everything else the action
had done (lines, credits taken, invoice numbers).
"""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import DataError
from django.utils import timezone

from billing_platform.audit.models import AuditEvent
from billing_platform.errors import Conflict, InvalidRequest
from billing_platform.invoicing import services, stripe_client
from billing_platform.invoicing.choices import InvoiceStatus, LineKind
from billing_platform.invoicing.models import Invoice, InvoiceLine, InvoiceSequence
from metering.models import UsageRollupHourly
from plans import services as plan_services
from plans.models import CreditGrant
from tests.factories import UserFactory, make_billed_org, make_offering
from tests.invoicing.conftest import NOV, OCT, record


def d(value: str) -> Decimal:
    return Decimal(value)


def _draft(org, amount: str) -> Invoice:
    """A hand-made October draft of ``org`` with one adjustment line of ``amount``."""
    draft = Invoice.objects.create(organization=org, currency="USD", period_start=OCT,
                                   period_end=NOV, kind="invoice")
    InvoiceLine.objects.create(invoice=draft, position=1, kind=LineKind.ADJUSTMENT,
                               description="Onboarding", amount_precise=d(amount),
                               amount=d(amount))
    return draft


@pytest.fixture
def draft(catalog):
    """A 50.00 draft of an org holding 1.00 of promotional credit."""
    org = make_billed_org(name="Audited")
    plan_services.credit_grant_create(organization=org, kind="promotional", amount="1.00")
    return _draft(org, "50.00")


@pytest.fixture
def finance():
    return UserFactory(email="finance@example.com")


class NewRows:
    """The audit rows written since this object was made."""

    def __init__(self) -> None:
        self.after_id = AuditEvent.objects.order_by("-id").values_list("id", flat=True).first() or 0

    def __call__(self) -> list[AuditEvent]:
        return list(AuditEvent.objects.filter(id__gt=self.after_id).order_by("id"))


def test_finalizing_a_draft_leaves_one_row_by_who_finalized_it(draft, finance):
    new = NewRows()
    invoice = services.invoice_finalize(invoice=draft, enqueue_payment=False,
                                        acting_user=finance)

    (row,) = new()
    assert (row.action, row.target, row.organization_id) == (
        "invoice.finalize", invoice.public_id, draft.organization_id)
    assert (row.actor_user_id, row.actor_label) == (finance.id, "finance@example.com")
    assert row.before["status"] == "draft"
    assert row.after == {"status": "open", "number": invoice.number, "total": "49.00",
                         "credits_applied": "1.00", "amount_due": "49.00",
                         "amount_paid": "0.00", "currency": "USD"}


def test_finalizing_twice_is_refused_and_leaves_no_second_row(draft, finance):
    services.invoice_finalize(invoice=draft, enqueue_payment=False, acting_user=finance)
    new = NewRows()
    with pytest.raises(Conflict, match="already finalized"):
        services.invoice_finalize(invoice=draft, acting_user=finance)
    assert new() == []


def test_a_finalize_that_fails_half_way_leaves_no_row_and_nothing_else(catalog, finance):
    # given a draft whose total, with 50 % tax, is past what an invoice can hold: the tax line
    # is written, the credit taken and a number reserved before the invoice's save fails
    org = make_billed_org(name="Overflowing", tax_rate="0.5000")
    plan_services.credit_grant_create(organization=org, kind="promotional", amount="1.00")
    huge = _draft(org, "90000000000000000000.00")
    series = f"INV-{timezone.now():%Y}"
    numbers = list(InvoiceSequence.objects.filter(series=series).values_list("next_number"))
    new = NewRows()

    # when it is finalized
    with pytest.raises(DataError):
        services.invoice_finalize(invoice=huge, enqueue_payment=False, acting_user=finance)

    # then nothing of it remains: no audit row, still a draft with its one line, the credit
    # untouched, no invoice number used
    assert new() == []
    huge.refresh_from_db()
    assert (huge.status, huge.number, huge.total) == (InvoiceStatus.DRAFT, None, d("0"))
    assert [ln.kind for ln in huge.lines.all()] == [LineKind.ADJUSTMENT]
    assert CreditGrant.objects.get(organization=org).remaining == d("1.00")
    assert list(InvoiceSequence.objects.filter(series=series).values_list("next_number")) == (
        numbers)


def test_period_close_leaves_one_system_row_per_invoice_and_none_for_an_org_it_cannot_bill(
        catalog):
    # given two orgs with October usage, and one whose usage no invoice can hold (150 hourly
    # rollups of ~1e18: corrupt data)
    orgs = [make_billed_org(name=f"Closed {i}") for i in range(2)]
    for org in orgs:
        record(org, f"audit-close-{org.id}", OCT + timedelta(days=2), prompt_tokens=1_000_000)
    bad = make_billed_org(name="Unbillable")
    UsageRollupHourly.objects.bulk_create([UsageRollupHourly(
        organization=bad, project=bad.projects.first(), model="m-small", region="us-east",
        service_tier="default", capacity_source="on_demand", currency="USD",
        hour=OCT + timedelta(hours=h), requests=1, amount=d("999999999999999999"),
        input_amount=d("999999999999999999")) for h in range(150)])
    new = NewRows()

    # when the beat closes October
    report = services.period_close_run(now=NOV + timedelta(hours=1), enqueue_payments=False)

    # then each invoice has its row, by the system, and the org left open has none
    assert report.failed_orgs == [bad.id]
    rows = new()
    invoices = {i.organization_id: i for i in Invoice.objects.all()}
    assert sorted(invoices) == sorted(o.id for o in orgs)
    assert sorted((r.organization_id, r.action, r.target, r.actor_kind) for r in rows) == sorted(
        (o.id, "invoice.finalize", invoices[o.id].public_id, "system") for o in orgs)
    for row in rows:
        invoice = invoices[row.organization_id]
        assert row.before is None
        assert row.after == {"status": "open", "number": invoice.number, "total": "1.00",
                             "credits_applied": "0.00", "amount_due": "1.00",
                             "amount_paid": "0.00", "currency": "USD"}


def test_period_close_by_a_person_names_them(catalog, finance):
    org = make_billed_org(name="Closed by hand")
    record(org, "audit-close-hand", OCT + timedelta(days=2), prompt_tokens=1_000_000)
    services.period_close_run(now=NOV + timedelta(hours=1), enqueue_payments=False,
                              acting_user=finance)
    (row,) = AuditEvent.objects.filter(organization=org, action="invoice.finalize")
    assert row.actor_user_id == finance.id


@pytest.fixture
def open_invoice(draft):
    return services.invoice_finalize(invoice=draft, enqueue_payment=False)


def test_a_void_leaves_one_row_and_a_refused_void_none(open_invoice, finance):
    new = NewRows()
    services.invoice_void(invoice=open_invoice, reason="billed in error", acting_user=finance)

    # the void's row, and the row of the credit grant it gave back (the 1.00 it had used)
    rows = new()
    assert [(r.action, r.actor_user_id) for r in rows] == [
        ("credit_grant.create", finance.id), ("invoice.void", finance.id)]
    assert rows[1].target == open_invoice.public_id
    assert (rows[1].before["status"], rows[1].after["status"]) == ("open", "void")

    again = NewRows()
    with pytest.raises(Conflict):
        services.invoice_void(invoice=open_invoice, acting_user=finance)
    assert again() == []


def test_a_credit_note_leaves_one_row_and_a_refused_one_none(open_invoice, finance):
    new = NewRows()
    note = services.credit_note_create(invoice=open_invoice, amount=d("10.00"), reason="outage",
                                       acting_user=finance)
    # on an open invoice the note reduces the amount due (no credit grant): one row
    (row,) = new()
    assert (row.action, row.actor_user_id) == ("credit_note.create", finance.id)
    assert (row.target, row.after["amount"]) == (note.public_id, "10.00")
    assert (row.before["amount_due"], row.after["amount_due"]) == ("49.00", "39.00")

    # more than the invoice charged: refused, with no row, no note and no grant
    refused = NewRows()
    grants = CreditGrant.objects.count()
    with pytest.raises(InvalidRequest):
        services.credit_note_create(invoice=open_invoice, amount=d("40.00"), reason="too much",
                                    acting_user=finance)
    assert refused() == []
    assert Invoice.objects.filter(corrects=open_invoice).count() == 1
    assert CreditGrant.objects.count() == grants


def test_marking_paid_leaves_one_row_and_a_refused_one_none(open_invoice, finance):
    new = NewRows()
    services.invoice_mark_paid(invoice=open_invoice, acting_user=finance)
    (row,) = new()
    assert (row.action, row.actor_user_id, row.target) == (
        "invoice.mark_paid", finance.id, open_invoice.public_id)
    assert (row.before["status"], row.after["status"], row.after["amount_paid"]) == (
        "open", "paid", "49.00")

    again = NewRows()
    with pytest.raises(Conflict):
        services.invoice_mark_paid(invoice=open_invoice, acting_user=finance)
    assert again() == []


def _set_default_card(org, pm_alias: str) -> None:
    account = services.billing_account_ensure_customer(organization=org)
    client = stripe_client.client()
    pm = client.v1.payment_methods.attach(pm_alias, {"customer": account.stripe_customer_id})
    client.v1.customers.update(account.stripe_customer_id,
                               {"invoice_settings": {"default_payment_method": pm.id}})


@pytest.fixture
def reserved_invoice(stripe_settings, catalog):
    """An open 200.00 October invoice (a reservation fee), made by period close."""
    org = make_billed_org(name="Charged")
    plan_services.reservation_create(organization=org, offering=make_offering(model="m-big"),
                                     units=2, term="monthly", starts_at=OCT)
    services.period_close_run(now=NOV + timedelta(hours=1), enqueue_payments=False)
    return Invoice.objects.get(organization=org)


def test_a_charge_leaves_one_row_per_attempt_never_one_for_a_charge_not_made(
        reserved_invoice):
    org = reserved_invoice.organization
    _set_default_card(org, "pm_card_visa")
    new = NewRows()

    assert services.invoice_charge(invoice_id=reserved_invoice.id) == "succeeded"
    assert services.invoice_charge(invoice_id=reserved_invoice.id) == "in_progress"

    (row,) = new()
    (attempt,) = reserved_invoice.payments.all()
    assert (row.action, row.target, row.actor_kind) == (
        "invoice.charge", reserved_invoice.public_id, "system")
    assert row.after == {"attempt": attempt.idempotency_key, "amount": "200.00",
                         "currency": "USD"}


def test_the_write_off_at_the_end_of_dunning_leaves_one_system_row(reserved_invoice, settings):
    # given a card that always declines, and dunning that gives up after one retry
    settings.INVOICING_DUNNING_DAYS = [1]
    _set_default_card(reserved_invoice.organization, "pm_card_chargeCustomerFail")
    t0 = NOV + timedelta(hours=2)

    # when the first charge and its one retry are declined
    assert services.invoice_charge(invoice_id=reserved_invoice.id, now=t0) == "failed"
    assert services.invoice_charge(invoice_id=reserved_invoice.id,
                                   now=t0 + timedelta(days=1)) == "failed"

    # then the invoice is written off once, by the system, with its payment state
    (row,) = AuditEvent.objects.filter(action="invoice.mark_uncollectible")
    assert (row.target, row.actor_kind) == (reserved_invoice.public_id, "system")
    assert (row.before["status"], row.after["status"]) == ("open", "uncollectible")
    assert row.after["payment_failures"] == "2"
    assert AuditEvent.objects.filter(action="invoice.charge").count() == 2
