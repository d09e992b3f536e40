"""Stripe webhooks cannot be forged: the attacks, played against the real endpoint.

The endpoint is POSTed to as Stripe would (a ``Stripe-Signature`` over the raw body); Stripe
itself is localstripe behind the official library. No secret: nothing is accepted. A signed
event pays an invoice only for a PaymentIntent this platform created for it, with exactly the
amount due; anything else is left for finance, visibly. Unsigned bodies are not kept.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from django.utils import timezone

from billing_platform.audit.models import AuditEvent
from billing_platform.invoicing import services, stripe_client
from billing_platform.invoicing.choices import InvoiceStatus, PaymentStatus
from billing_platform.invoicing.models import PaymentAttempt, StripeEvent
from tests.invoicing import conftest as invoicing_fixtures
from tests.invoicing import test_invoice_payments as payments
from tests.invoicing.test_invoice_payments import WEBHOOK_URL, _event, _set_default_card, _signed

# the payment tests' fixtures: a priced catalogue and an open 200.00 USD invoice, Stripe set up
catalog = invoicing_fixtures.catalog
open_invoice = payments.open_invoice

REPO = Path(__file__).resolve().parents[2]


def _post(client, body: str, signature: str):
    return client.post(WEBHOOK_URL, body, content_type="application/json",
                       HTTP_STRIPE_SIGNATURE=signature)


def _forged_success(invoice, *, pi_id: str = "pi_forged", amount: int = 20000) -> str:
    return _event("evt_forged_1", "payment_intent.succeeded", {
        "id": pi_id, "object": "payment_intent", "status": "succeeded", "amount": amount,
        "amount_received": amount, "currency": "usd",
        "metadata": {"invoice_id": str(invoice.id), "invoice": invoice.number, "attempt": "1"}})


def test_with_no_secret_configured_the_endpoint_accepts_nothing_and_says_what_to_set(
        open_invoice, client, settings):
    # given a default install: STRIPE_WEBHOOK_SECRET unset
    settings.STRIPE_WEBHOOK_SECRET = ""
    body = _forged_success(open_invoice)

    # when a forger signs a payment_intent.succeeded with the empty secret
    reply = _post(client, body, _signed(body, secret=""))

    # then it is refused with an error that names the setting, and nothing changed or was kept
    assert reply.status_code == 503
    assert b"STRIPE_WEBHOOK_SECRET" in reply.content
    open_invoice.refresh_from_db()
    assert open_invoice.status == InvoiceStatus.OPEN
    assert not StripeEvent.objects.exists()


def _manage_check(**env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("STRIPE_WEBHOOK_SECRET", "SECRET_KEY", "TOLLGATE_ENV")}
    # production also requires ALLOWED_HOSTS (tests/security/test_production_defaults.py):
    # set, so that the webhook secret is the only thing these checks leave out
    return subprocess.run([sys.executable, "manage.py", "check"], cwd=REPO,
                          env={**clean, "ALLOWED_HOSTS": "billing.example.com", **env},
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize("secret", [None, "", "   "])
def test_production_refuses_to_start_without_the_webhook_secret(secret):
    env = {"TOLLGATE_ENV": "production", "SECRET_KEY": "prod-secret-key-" + "x" * 40}
    if secret is not None:
        env["STRIPE_WEBHOOK_SECRET"] = secret
    result = _manage_check(**env)
    assert result.returncode != 0
    assert "STRIPE_WEBHOOK_SECRET" in result.stderr
    assert "TOLLGATE_ENV=production" in result.stderr


def test_production_starts_with_the_webhook_secret_set():
    result = _manage_check(TOLLGATE_ENV="production", SECRET_KEY="prod-secret-key-" + "x" * 40,
                           STRIPE_WEBHOOK_SECRET="whsec_live_example")
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("amount", [50, 20000])
def test_a_signed_event_for_a_payment_intent_the_platform_never_created_pays_nothing(
        open_invoice, client, amount):
    # given a real, succeeded PaymentIntent on the platform's Stripe account that someone else
    # created (50 cents, or even the full amount), its metadata naming the victim invoice
    org = open_invoice.organization
    customer_id = _set_default_card(org, "pm_card_visa")
    stripe = stripe_client.client()
    intent = stripe.v1.payment_intents.create(params={
        "amount": amount, "currency": "usd", "customer": customer_id,
        "payment_method": stripe_client.default_payment_method(customer_id), "confirm": True,
        "metadata": {"invoice_id": str(open_invoice.id), "invoice": open_invoice.number,
                     "attempt": "1"}})
    assert intent.status == "succeeded"
    body = _event("evt_foreign_1", "payment_intent.succeeded", intent.to_dict())

    # when Stripe (correctly signed) reports it
    reply = _post(client, body, _signed(body))

    # then the invoice is not paid; the event is recorded for finance, with an audit row
    assert reply.status_code == 200
    open_invoice.refresh_from_db()
    assert open_invoice.status == InvoiceStatus.OPEN
    assert open_invoice.amount_paid == Decimal("0")
    event = StripeEvent.objects.get(stripe_id="evt_foreign_1")
    assert event.needs_review and event.verified
    assert event.outcome.startswith("review:") and "did not create" in event.outcome
    review = AuditEvent.objects.get(action="payment.review")
    assert review.target == intent.id and review.actor_kind == "system"
    assert review.after["claimed_invoice_id"] == str(open_invoice.id)
    assert not AuditEvent.objects.filter(action="invoice.pay").exists()


def test_metadata_naming_an_invoice_whose_charge_is_in_flight_pays_nothing_either(
        open_invoice, client):
    # given our own charge committed but its answer not recorded yet (the attempt has no id)
    services._charge_attempt_begin(invoice_id=open_invoice.id, now=timezone.now())
    body = _forged_success(open_invoice, pi_id="pi_not_ours")

    reply = _post(client, body, _signed(body))

    # then nothing is paid; the sync settles our own charge by its key later
    assert reply.status_code == 200 and b"deferred" in reply.content
    open_invoice.refresh_from_db()
    assert open_invoice.status == InvoiceStatus.OPEN
    assert PaymentAttempt.objects.get().status == PaymentStatus.PENDING


@pytest.mark.parametrize(("amount_received", "currency", "why"), [
    (10000, "usd", "received 100.00 USD of 200.00 USD due"),
    (20000, "eur", "received EUR, the invoice is in USD"),
])
def test_a_signed_event_for_our_own_payment_intent_pays_only_the_exact_amount_due(
        open_invoice, client, amount_received, currency, why):
    # given our real charge of the invoice (the PaymentIntent id recorded on the attempt)
    customer_id = _set_default_card(open_invoice.organization, "pm_card_visa")
    assert services.invoice_charge(invoice_id=open_invoice.id) == "succeeded"
    attempt = PaymentAttempt.objects.get()
    intent = stripe_client.payment_intent_retrieve(attempt.stripe_payment_intent_id).to_dict()

    # when a signed event for that PaymentIntent reports a different amount or currency
    intent.update(amount_received=amount_received, currency=currency)
    body = _event("evt_short_1", "payment_intent.succeeded", intent)
    reply = _post(client, body, _signed(body))

    # then the invoice stays open and the payment is held for finance, visibly
    assert reply.status_code == 200
    open_invoice.refresh_from_db()
    assert open_invoice.status == InvoiceStatus.OPEN
    assert open_invoice.amount_paid == Decimal("0")
    attempt.refresh_from_db()
    assert attempt.status == PaymentStatus.NEEDS_REVIEW and why in attempt.failure_message
    event = StripeEvent.objects.get(stripe_id="evt_short_1")
    assert event.needs_review and why in event.outcome
    review = AuditEvent.objects.get(action="payment.review")
    assert review.organization_id == open_invoice.organization_id
    assert review.target == open_invoice.public_id and review.actor_kind == "system"

    # and neither the task nor the sync charges or settles it behind finance's back
    assert services.invoice_charge(invoice_id=open_invoice.id) == "in_progress"
    assert services.payments_sync(older_than=timedelta(0)) == 0
    open_invoice.refresh_from_db()
    assert open_invoice.status == InvoiceStatus.OPEN
    assert len(stripe_client.client().v1.charges.list({"customer": customer_id}).data) == 1


def test_the_real_payment_pays_once_as_the_system_and_is_audited(open_invoice, client):
    _set_default_card(open_invoice.organization, "pm_card_visa")
    assert services.invoice_charge(invoice_id=open_invoice.id) == "succeeded"
    attempt = PaymentAttempt.objects.get()
    intent = stripe_client.payment_intent_retrieve(attempt.stripe_payment_intent_id).to_dict()
    body = _event("evt_real_1", "payment_intent.succeeded", intent)

    assert _post(client, body, _signed(body)).content == b"paid"
    assert _post(client, body, _signed(body)).status_code == 200  # a replay

    open_invoice.refresh_from_db()
    assert open_invoice.status == InvoiceStatus.PAID
    assert open_invoice.amount_paid == Decimal("200.00")
    (paid,) = AuditEvent.objects.filter(action="invoice.pay")
    assert paid.actor_kind == "system" and paid.target == open_invoice.public_id
    assert paid.before["status"] == "open" and paid.after["status"] == "paid"
    assert paid.after["payment_intent"] == attempt.stripe_payment_intent_id
    assert not StripeEvent.objects.filter(needs_review=True).exists()


def test_unsigned_bodies_are_not_stored_and_an_oversized_one_is_refused_unread(
        open_invoice, client):
    # an oversized body (2 MiB), unsigned: refused before it is even verified; nothing kept
    huge = json.dumps({"id": "evt_huge", "object": "event", "type": "payment_intent.succeeded",
                       "data": {"object": {"id": "pi_x", "padding": "A" * (2 * 1024 * 1024)}}})
    reply = _post(client, huge, "t=1,v1=deadbeef")
    assert reply.status_code == 413
    assert not StripeEvent.objects.exists()

    # a small body with a bad signature: a 400, recorded by its size only
    body = _forged_success(open_invoice)
    reply = _post(client, body, _signed(body, secret="whsec_guess"))
    assert reply.status_code == 400
    (rejected,) = StripeEvent.objects.all()
    assert (rejected.verified, rejected.payload) == (False, "")
    assert rejected.payload_bytes == len(body.encode())
    assert rejected.outcome.startswith("rejected")
    open_invoice.refresh_from_db()
    assert open_invoice.status == InvoiceStatus.OPEN


def test_money_received_for_an_invoice_voided_meanwhile_is_left_for_finance(open_invoice, client):
    # given our charge went through, then finance voided the invoice before Stripe's webhook
    _set_default_card(open_invoice.organization, "pm_card_visa")
    assert services.invoice_charge(invoice_id=open_invoice.id) == "succeeded"
    services.invoice_void(invoice=open_invoice, reason="billed in error", acting_user=None)
    attempt = PaymentAttempt.objects.get()
    intent = stripe_client.payment_intent_retrieve(attempt.stripe_payment_intent_id).to_dict()
    body = _event("evt_void_1", "payment_intent.succeeded", intent)

    assert _post(client, body, _signed(body)).status_code == 200

    # then the void stands and the payment (to refund, or to apply elsewhere) awaits finance
    open_invoice.refresh_from_db()
    assert open_invoice.status == InvoiceStatus.VOID
    attempt.refresh_from_db()
    assert (attempt.status, attempt.failure_code) == (PaymentStatus.NEEDS_REVIEW,
                                                      "invoice_not_payable")
    assert StripeEvent.objects.get(stripe_id="evt_void_1").needs_review
    assert AuditEvent.objects.filter(action="payment.review",
                                     target=open_invoice.public_id).exists()
