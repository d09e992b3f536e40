"""Receivables show what Stripe moved back after payment: refunded, refunds pending, disputed,
charged back, per currency, on the report, over REST and on the /finance/ page.

Invoices are made by period close for last month (so the report's 90-day window, which ends
now, holds them), paid through the Stripe stand-in with the official library; a controller
issues a credit note with a refund through ``/api/v1/finance/``, its task is run, and the
stand-in's signed ``charge.refunded`` and ``charge.dispute.*`` deliveries are posted byte for
byte to the webhook endpoint. Each figure below is computed by hand from those amounts.
"""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.test import Client
from django.utils import timezone

from billing_platform.finance import reports
from billing_platform.finance.permissions import ANALYST_GROUP
from billing_platform.invoicing import services, stripe_client
from billing_platform.invoicing.choices import InvoiceStatus, RefundStatus
from billing_platform.invoicing.models import Invoice, Refund
from plans import services as plan_services
from tests.console.test_finance_pages import Tables
from tests.factories import make_billed_org, make_offering
from tests.finance.conftest import finance_user
from tests.finance.operations_setup import last_month_start, post, price_book, set_default_card
from tests.invoicing.conftest import billing_invariant_holds  # noqa: F401 - autouse check
from tests.invoicing.test_invoice_payments import WEBHOOK_URL

D = Decimal
FIGURES = ("refunded", "refunds_pending", "disputed", "charged_back")


@pytest.fixture
def deliver(client, stripe_webhook_inbox):
    """Post the stand-in's next signed ``kind`` webhook about ``object_id``."""
    def post_delivery(kind: str, object_id: str) -> None:
        delivery = stripe_webhook_inbox.take(kind, object_id=object_id)
        response = client.post(WEBHOOK_URL, delivery.body, content_type="application/json",
                               HTTP_STRIPE_SIGNATURE=delivery.signature)
        assert response.status_code == 200, response.content

    return post_delivery


def paid_invoice(name: str, card: str = "pm_card_visa") -> Invoice:
    """Last month's 200.00 invoice of a new org, charged on ``card`` and settled."""
    start = last_month_start()
    org = make_billed_org(name=name, created_at=start)
    plan_services.reservation_create(organization=org, offering=make_offering(model="m-big"),
                                     units=2, term="monthly", starts_at=start)
    services.period_close_run(now=timezone.now(), enqueue_payments=False, org_ids=[org.id])
    invoice = Invoice.objects.get(organization=org, period_start=start)
    set_default_card(org, card)
    assert services.invoice_charge(invoice_id=invoice.id) == "succeeded"
    assert services.payments_sync(older_than=timedelta(0)) == 1
    invoice.refresh_from_db()
    assert (invoice.status, invoice.total, invoice.amount_paid) == (
        InvoiceStatus.PAID, D("200.00"), D("200.00"))
    return invoice


def figures(as_of=None, **narrow) -> dict[str, tuple[Decimal, ...]]:
    """The summaries' after-payment figures per currency, at ``as_of`` (now by default)."""
    report = reports.receivables_report(report_filter=reports.ReceivablesFilter(
        as_of=as_of or timezone.now(), **narrow))
    return {s.currency: tuple(getattr(s, name) for name in FIGURES) for s in report.summaries}


def _charge_id(intent_id: str) -> str:
    return str(stripe_client.payment_intent_retrieve(intent_id).latest_charge.id)


def test_a_credit_note_refund_is_pending_until_stripe_reports_it_then_refunded(
        db, stripe_settings, controller_client, deliver, django_capture_on_commit_callbacks):
    price_book()
    invoice = paid_invoice("Refunded Co")
    # nothing moved back yet, and a paid invoice owes nothing: no summary at all
    assert figures() == {}

    # a credit note of 50.00 on the paid invoice, refunded through Stripe (task not run yet)
    with django_capture_on_commit_callbacks():
        note = post(controller_client, f"invoices/{invoice.public_id}/credit-notes/",
                    {"reason": "overcharged", "amount": "50.00", "outcome": "refund"})
    assert note.status_code == 201, note.content
    (refund,) = Refund.objects.all()
    assert refund.status == RefundStatus.PENDING
    assert figures() == {"USD": (D("0.00"), D("50.00"), D("0.00"), D("0.00"))}
    (usd,) = reports.receivables_report(
        report_filter=reports.ReceivablesFilter(as_of=timezone.now())).summaries
    # the summary exists for the refund alone: nothing is open; billed nets the note
    assert (usd.open, usd.open_invoices, usd.billed_90_days) == (D("0.00"), 0, D("150.00"))

    # Stripe accepted the refund, but has not reported the charge refunded: still pending
    assert services.refund_send(refund_id=refund.id) == "succeeded"
    assert figures() == {"USD": (D("0.00"), D("50.00"), D("0.00"), D("0.00"))}

    # Stripe's charge.refunded arrives: refunded, nothing pending
    intent_id = invoice.payments.get().stripe_payment_intent_id
    deliver("charge.refunded", _charge_id(intent_id))
    assert figures() == {"USD": (D("50.00"), D("0.00"), D("0.00"), D("0.00"))}
    # a refund Stripe reports is the window's: an invoice finalized over 90 days before
    # as_of is no longer counted (and nothing else is)
    assert figures(as_of=timezone.now() + timedelta(days=91)) == {
        "USD": (D("0.00"), D("0.00"), D("0.00"), D("0.00"))}


def test_a_dispute_is_disputed_while_open_then_charged_back_when_lost(
        db, stripe_settings, deliver):
    price_book()
    visa = paid_invoice("Kept Co")
    disputed = paid_invoice("Disputed Co", card="pm_card_createDispute")
    intent_id = disputed.payments.get().stripe_payment_intent_id
    (dispute,) = stripe_client.client().v1.disputes.list({"payment_intent": intent_id}).data
    before_dispute = timezone.now()

    deliver("charge.dispute.created", dispute.id)
    opened = timezone.now()
    assert figures() == {"USD": (D("0.00"), D("0.00"), D("200.00"), D("0.00"))}

    stripe_client.client().v1.disputes.close(dispute.id)
    deliver("charge.dispute.closed", dispute.id)
    assert figures() == {"USD": (D("0.00"), D("0.00"), D("0.00"), D("200.00"))}
    # as of earlier instants: open then, nothing before it opened
    assert figures(as_of=opened) == {"USD": (D("0.00"), D("0.00"), D("200.00"), D("0.00"))}
    assert figures(as_of=before_dispute) == {}
    # the loss is its window's: 91 days on, nothing
    assert figures(as_of=timezone.now() + timedelta(days=91)) == {
        "USD": (D("0.00"), D("0.00"), D("0.00"), D("0.00"))}
    # narrowed to an organization: only its own
    assert figures(org_id=visa.organization_id) == {}
    assert figures(org_id=disputed.organization_id, currency="USD") == {
        "USD": (D("0.00"), D("0.00"), D("0.00"), D("200.00"))}
    assert figures(currency="EUR") == {}


def test_the_api_and_the_page_show_the_after_payment_figures(
        db, stripe_settings, controller_client, analyst_client, deliver,
        django_capture_on_commit_callbacks):
    price_book()
    refunded = paid_invoice("Refunded Co")
    with django_capture_on_commit_callbacks():
        post(controller_client, f"invoices/{refunded.public_id}/credit-notes/",
             {"reason": "overcharged", "amount": "50.00", "outcome": "refund"})
    services.refund_send(refund_id=Refund.objects.get().id)
    deliver("charge.refunded", _charge_id(refunded.payments.get().stripe_payment_intent_id))
    disputed = paid_invoice("Disputed Co", card="pm_card_createDispute")
    (dispute,) = stripe_client.client().v1.disputes.list(
        {"payment_intent": disputed.payments.get().stripe_payment_intent_id}).data
    deliver("charge.dispute.created", dispute.id)
    # a second credit note refund, not sent yet: pending
    with django_capture_on_commit_callbacks():
        post(controller_client, f"invoices/{refunded.public_id}/credit-notes/",
             {"reason": "overcharged again", "amount": "20.25", "outcome": "refund"})

    body = analyst_client.get("/api/v1/finance/receivables/").json()
    (usd,) = body["summaries"]
    assert {k: usd[k] for k in ("currency", *FIGURES)} == {
        "currency": "USD", "refunded": "50.00", "refunds_pending": "20.25",
        "disputed": "200.00", "charged_back": "0.00"}
    # narrowed to the disputed org over REST: its dispute only
    (theirs,) = analyst_client.get("/api/v1/finance/receivables/", {
        "organization": disputed.organization.public_id}).json()["summaries"]
    assert [theirs[k] for k in FIGURES] == ["0.00", "0.00", "200.00", "0.00"]

    # the /finance/ page: its own small table of them
    page = Client()
    page.force_login(finance_user(ANALYST_GROUP, email="reader@platform.example.com"))
    html = page.get("/finance/reports/receivables/").content.decode()
    assert Tables(html).tables["after_payment"] == [
        ["currency", *FIGURES], ["USD", "50.00", "20.25", "200.00", "0.00"]]
