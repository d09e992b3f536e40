"""Refunds and disputes move invoices: Stripe's own signed webhooks from the stand-in.

Each test charges an invoice through the platform (the official library against the stand-in),
lets the stand-in's signed ``payment_intent.succeeded`` pay it, then refunds or disputes the
charge in Stripe and posts the stand-in's signed delivery, byte for byte, to the webhook
endpoint: refunds are recorded per invoice (partial, then full), a dispute marks the invoice
disputed with its amount, a lost one becomes a chargeback, a won one clears it. A replay changes
nothing; a charge the platform did not create is left for review, never applied; a delivery
altered after signing is refused.
"""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
import stripe

from billing_platform.audit.models import AuditEvent
from billing_platform.invoicing import services, stripe_client
from billing_platform.invoicing.choices import InvoiceStatus
from billing_platform.invoicing.models import Dispute, Invoice, StripeEvent
from plans import services as plan_services
from tests.factories import make_billed_org, make_offering
from tests.invoicing.conftest import NOV, OCT
from tests.invoicing.test_invoice_payments import WEBHOOK_URL, _set_default_card
from tests.invoicing.test_stripe_refunds import paid_intent


@pytest.fixture
def deliver(client, stripe_webhook_inbox):
    """Post the stand-in's next signed ``kind`` webhook about ``object_id``; return it."""
    def post(kind: str, object_id: str, *, expect: int = 200):
        delivery = stripe_webhook_inbox.take(kind, object_id=object_id)
        response = client.post(WEBHOOK_URL, delivery.body, content_type="application/json",
                               HTTP_STRIPE_SIGNATURE=delivery.signature)
        assert response.status_code == expect, response.content
        return delivery

    return post


def _post_again(client, delivery) -> StripeEvent:
    response = client.post(WEBHOOK_URL, delivery.body, content_type="application/json",
                           HTTP_STRIPE_SIGNATURE=delivery.signature)
    assert response.status_code == 200 and b"duplicate" in response.content
    return StripeEvent.objects.filter(stripe_id=delivery.event["id"]).get()


@pytest.fixture
def charge_paid_invoice(stripe_settings, catalog, deliver):
    """An org's 200.00 October invoice, charged on ``card`` and paid by Stripe's webhook."""
    def make(card: str = "pm_card_visa") -> tuple[Invoice, str]:
        org = make_billed_org(name="Refunded")
        plan_services.reservation_create(organization=org,
                                         offering=make_offering(model="m-big"), units=2,
                                         term="monthly", starts_at=OCT)
        services.period_close_run(now=NOV + timedelta(hours=1), enqueue_payments=False)
        invoice = Invoice.objects.get(organization=org)
        _set_default_card(org, card)
        assert services.invoice_charge(invoice_id=invoice.id) == "succeeded"
        intent_id = invoice.payments.get().stripe_payment_intent_id
        deliver("payment_intent.succeeded", intent_id)
        invoice.refresh_from_db()
        assert (invoice.status, invoice.amount_paid) == (InvoiceStatus.PAID, Decimal("200.00"))
        return invoice, intent_id

    return make


def _charge_id(intent_id: str) -> str:
    return str(stripe_client.payment_intent_retrieve(intent_id).latest_charge.id)


def _refund(intent_id: str, minor: int, key: str) -> None:
    stripe_client.refund_create(payment_intent_id=intent_id, amount_minor=minor, currency="usd",
                                idempotency_key=key, metadata={"test": key})


def test_partial_then_full_refund_is_recorded_once_and_in_order(
        charge_paid_invoice, stripe_webhook_inbox, client):
    invoice, intent_id = charge_paid_invoice()
    charge_id = _charge_id(intent_id)

    # a partial refund in Stripe (sent twice with one key: refunded once)
    _refund(intent_id, 5000, f"test:{invoice.id}:refund:1")
    _refund(intent_id, 5000, f"test:{invoice.id}:refund:1")
    partial = stripe_webhook_inbox.take("charge.refunded", object_id=charge_id)
    client.post(WEBHOOK_URL, partial.body, content_type="application/json",
                HTTP_STRIPE_SIGNATURE=partial.signature)

    invoice.refresh_from_db()
    assert (invoice.amount_refunded, invoice.refunded_at) == (Decimal("50.00"), None)
    assert invoice.status == InvoiceStatus.PAID
    assert invoice.payments.get().amount_refunded == Decimal("50.00")
    (row,) = AuditEvent.objects.filter(action="invoice.refund", target=invoice.public_id)
    assert (row.before["amount_refunded"], row.after["amount_refunded"]) == ("0.00", "50.00")
    assert row.after["in_full"] == "false" and row.actor_label == "system"

    # a replay changes nothing
    assert _post_again(client, partial).outcome == "refunded 50.00 in total"
    # the rest refunded; its webhook arrives, then the older one again under a new delivery
    _refund(intent_id, 15000, f"test:{invoice.id}:refund:2")
    full = stripe_webhook_inbox.take("charge.refunded", object_id=charge_id)
    response = client.post(WEBHOOK_URL, full.body, content_type="application/json",
                           HTTP_STRIPE_SIGNATURE=full.signature)
    assert response.status_code == 200

    invoice.refresh_from_db()
    assert invoice.amount_refunded == Decimal("200.00") and invoice.refunded_at is not None
    assert invoice.status == InvoiceStatus.PAID and invoice.amount_paid == Decimal("200.00")
    assert StripeEvent.objects.get(stripe_id=full.event["id"]).outcome == "refunded in full"
    assert AuditEvent.objects.filter(action="invoice.refund").count() == 2
    assert _post_again(client, full).outcome == "refunded in full"
    refunded_at = invoice.refunded_at
    invoice.refresh_from_db()
    assert (invoice.amount_refunded, invoice.refunded_at) == (Decimal("200.00"), refunded_at)


def test_an_older_refund_event_arriving_late_changes_nothing(
        charge_paid_invoice, stripe_webhook_inbox, client):
    invoice, intent_id = charge_paid_invoice()
    charge_id = _charge_id(intent_id)
    _refund(intent_id, 2000, f"test:{invoice.id}:late:1")
    first = stripe_webhook_inbox.take("charge.refunded", object_id=charge_id)
    _refund(intent_id, 3000, f"test:{invoice.id}:late:2")
    second = stripe_webhook_inbox.take("charge.refunded", object_id=charge_id)

    for delivery in (second, first):  # Stripe does not promise order
        client.post(WEBHOOK_URL, delivery.body, content_type="application/json",
                    HTTP_STRIPE_SIGNATURE=delivery.signature)

    invoice.refresh_from_db()
    assert invoice.amount_refunded == Decimal("50.00") and invoice.refunded_at is None
    assert StripeEvent.objects.get(stripe_id=first.event["id"]).outcome == "no change"


@pytest.mark.parametrize("outcome", ["won", "lost"])
def test_a_dispute_marks_the_invoice_then_clears_or_becomes_a_chargeback(
        charge_paid_invoice, deliver, client, outcome):
    # given an invoice paid by a card whose charge the cardholder's bank disputes
    invoice, intent_id = charge_paid_invoice(card="pm_card_createDispute")
    (dispute,) = stripe_client.client().v1.disputes.list({"payment_intent": intent_id}).data
    assert (dispute.status, dispute.amount) == ("needs_response", 20000)

    # when Stripe reports it
    created = deliver("charge.dispute.created", dispute.id)

    # then the invoice is disputed for the amount; a replay changes nothing
    invoice.refresh_from_db()
    assert (invoice.amount_disputed, invoice.amount_charged_back) == (Decimal("200.00"), 0)
    assert invoice.status == InvoiceStatus.PAID
    row = Dispute.objects.get(stripe_id=dispute.id)
    assert (row.invoice_id, row.reason, row.is_open) == (invoice.id, "fraudulent", True)
    assert _post_again(client, created).outcome == "disputed 200.00 USD"
    # a disputed charge cannot be refunded (Stripe refuses)
    with pytest.raises(stripe.InvalidRequestError) as refused:
        _refund(intent_id, 100, f"test:{invoice.id}:disputed")
    assert refused.value.code == "charge_disputed"

    # when the dispute is decided
    if outcome == "won":
        stripe_client.client().v1.disputes.update(
            dispute.id, {"evidence": {"uncategorized_text": "winning_evidence"}})
    else:
        stripe_client.client().v1.disputes.close(dispute.id)
    closed = deliver("charge.dispute.closed", dispute.id)
    deliver("charge.dispute.updated", dispute.id)  # the same news, in the other event

    # then a won dispute clears it and a lost one is a chargeback finance sees
    invoice.refresh_from_db()
    lost = Decimal("200.00") if outcome == "lost" else Decimal("0")
    assert (invoice.amount_disputed, invoice.amount_charged_back) == (0, lost)
    row.refresh_from_db()
    assert (row.status, row.is_open) == (outcome, False)
    (audit,) = AuditEvent.objects.filter(action=f"invoice.dispute_{outcome}")
    assert audit.target == invoice.public_id and audit.after["amount"] == "200.00"
    assert audit.after["amount_charged_back"] == str(lost.quantize(Decimal("0.01")))
    assert AuditEvent.objects.filter(action__startswith="invoice.dispute_").count() == 2
    assert _post_again(client, closed).outcome == f"dispute {outcome}"
    invoice.refresh_from_db()
    assert (invoice.amount_disputed, invoice.amount_charged_back) == (0, lost)


@pytest.mark.parametrize("kind", ["charge.refunded", "charge.dispute.created"])
def test_a_charge_the_platform_did_not_create_is_left_for_review(
        charge_paid_invoice, stripe_webhook_inbox, client, kind):
    # given a paid invoice of ours, and a charge someone made on the Stripe account directly
    invoice, _ = charge_paid_invoice()
    if kind == "charge.refunded":
        foreign = paid_intent(amount=20000)
        _refund(foreign.id, 20000, f"test:foreign:{foreign.id}")
        object_id = _charge_id(foreign.id)
    else:
        foreign = paid_intent(amount=20000, card="pm_card_createDispute")
        (dispute,) = stripe_client.client().v1.disputes.list(
            {"payment_intent": foreign.id}).data
        object_id = dispute.id
    delivery = stripe_webhook_inbox.take(kind, object_id=object_id)

    response = client.post(WEBHOOK_URL, delivery.body, content_type="application/json",
                           HTTP_STRIPE_SIGNATURE=delivery.signature)

    # then it is recorded for finance, and no invoice moves
    assert response.status_code == 200
    event = StripeEvent.objects.get(stripe_id=delivery.event["id"])
    assert event.needs_review and "did not create" in event.outcome
    (review,) = AuditEvent.objects.filter(action="payment.review", target=object_id)
    assert review.after["payment_intent"] == foreign.id
    invoice.refresh_from_db()
    assert (invoice.amount_refunded, invoice.amount_disputed) == (0, 0)
    assert not Dispute.objects.exists()


def test_a_delivery_altered_after_signing_is_refused(
        charge_paid_invoice, stripe_webhook_inbox, client):
    invoice, intent_id = charge_paid_invoice()
    _refund(intent_id, 100, f"test:{invoice.id}:forged")
    genuine = stripe_webhook_inbox.take("charge.refunded", object_id=_charge_id(intent_id))
    forged = genuine.body.replace(b'"amount_refunded": 100', b'"amount_refunded": 20000')
    assert forged != genuine.body

    response = client.post(WEBHOOK_URL, forged, content_type="application/json",
                           HTTP_STRIPE_SIGNATURE=genuine.signature)

    assert response.status_code == 400
    invoice.refresh_from_db()
    assert invoice.amount_refunded == 0
    assert not StripeEvent.objects.filter(stripe_id=genuine.event["id"]).exists()
    assert not AuditEvent.objects.filter(action="invoice.refund").exists()
