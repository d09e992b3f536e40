"""Stripe through the official library against a real localstripe server over HTTP.

Customer created once, one PaymentIntent even when the charge runs twice, signed webhooks move
the invoice to paid (a bad signature: 400, nothing changes; a replay: nothing changes), and
dunning retries a declined card on schedule, emails each time, then suspends the org.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import threading
import time
import urllib.parse
from datetime import timedelta
from decimal import Decimal
from types import SimpleNamespace

import pytest
import stripe
from django.utils import timezone

from billing_platform.accounts.choices import OrgStatus
from billing_platform.accounts.selectors import api_key_authenticate
from billing_platform.audit.models import AuditEvent
from billing_platform.errors import Conflict
from billing_platform.invoicing import services, stripe_client
from billing_platform.invoicing.choices import InvoiceStatus, PaymentStatus
from billing_platform.invoicing.models import BillingAccount, Invoice, PaymentAttempt, StripeEvent
from plans import services as plan_services
from tests.factories import UserFactory, make_billed_org, make_key, make_offering
from tests.invoicing.conftest import NOV, OCT

WEBHOOK_URL = "/stripe/webhook/"


@pytest.fixture
def open_invoice(stripe_settings, catalog, django_capture_on_commit_callbacks):
    """An org with a 200.00 October invoice (a reservation fee), open and unpaid."""
    org = make_billed_org(name="Payer")
    plan_services.reservation_create(organization=org, offering=make_offering(model="m-big"),
                                     units=2, term="monthly", starts_at=OCT)
    services.period_close_run(now=NOV + timedelta(hours=1), enqueue_payments=False)
    invoice = Invoice.objects.get(organization=org)
    assert invoice.status == InvoiceStatus.OPEN and invoice.amount_due == Decimal("200.00")
    return invoice


def _set_default_card(org, pm_alias: str) -> str:
    account = services.billing_account_ensure_customer(organization=org)
    client = stripe_client.client()
    pm = client.v1.payment_methods.attach(pm_alias, {"customer": account.stripe_customer_id})
    client.v1.customers.update(account.stripe_customer_id,
                               {"invoice_settings": {"default_payment_method": pm.id}})
    return account.stripe_customer_id


def _signed(payload: str, secret: str = "whsec_tollgate_test") -> str:
    t = int(time.time())
    sig = hmac.new(secret.encode(), f"{t}.{payload}".encode(), hashlib.sha256).hexdigest()
    return f"t={t},v1={sig}"


def _event(event_id: str, kind: str, obj: dict) -> str:
    return json.dumps({"id": event_id, "object": "event", "type": kind, "api_version": None,
                       "created": int(time.time()), "livemode": False,
                       "data": {"object": obj}})


def test_customer_once_charge_once_and_signed_webhook_marks_paid(open_invoice, client):
    org = open_invoice.organization
    customer_id = _set_default_card(org, "pm_card_visa")

    # the customer exists once, however often it is ensured
    services.billing_account_ensure_customer(organization=org)
    services.billing_account_ensure_customer(organization=org)
    assert BillingAccount.objects.get(organization=org).stripe_customer_id == customer_id
    found = stripe_client.client().v1.customers.list({"email": org.billing_email})
    assert [c.id for c in found.data] == [customer_id]

    # when the charge task runs twice
    first = services.invoice_charge(invoice_id=open_invoice.id)
    second = services.invoice_charge(invoice_id=open_invoice.id)

    # then Stripe charged once, with the idempotency key built from the invoice id
    assert (first, second) == ("succeeded", "in_progress")
    (attempt,) = PaymentAttempt.objects.filter(invoice=open_invoice)
    assert attempt.idempotency_key == f"invoice:{open_invoice.id}:charge:1"
    charges = stripe_client.client().v1.charges.list({"customer": customer_id})
    assert len(charges.data) == 1 and charges.data[0].amount == 20000
    intent = stripe_client.payment_intent_retrieve(attempt.stripe_payment_intent_id)
    assert intent.status == "succeeded"
    assert intent.metadata["invoice_id"] == str(open_invoice.id)
    open_invoice.refresh_from_db()
    assert open_invoice.status == InvoiceStatus.OPEN  # Stripe's webhook settles it

    body = _event("evt_paid_1", "payment_intent.succeeded", intent.to_dict())

    # a bad signature: 400, nothing changes
    bad = client.post(WEBHOOK_URL, body, content_type="application/json",
                      HTTP_STRIPE_SIGNATURE=_signed(body, secret="whsec_wrong"))
    assert bad.status_code == 400
    open_invoice.refresh_from_db()
    assert open_invoice.status == InvoiceStatus.OPEN
    assert not StripeEvent.objects.filter(verified=True).exists()

    # a signed webhook marks the invoice paid
    ok = client.post(WEBHOOK_URL, body, content_type="application/json",
                     HTTP_STRIPE_SIGNATURE=_signed(body))
    assert ok.status_code == 200, ok.content
    open_invoice.refresh_from_db()
    assert open_invoice.status == InvoiceStatus.PAID
    assert open_invoice.amount_paid == Decimal("200.00")
    paid_at = open_invoice.paid_at

    # a replay changes nothing
    again = client.post(WEBHOOK_URL, body, content_type="application/json",
                        HTTP_STRIPE_SIGNATURE=_signed(body))
    assert again.status_code == 200 and b"duplicate" in again.content
    open_invoice.refresh_from_db()
    assert (open_invoice.status, open_invoice.paid_at) == (InvoiceStatus.PAID, paid_at)
    assert StripeEvent.objects.filter(stripe_id="evt_paid_1", processed_at__isnull=False
                                      ).count() == 1
    # and a charge after payment does nothing
    assert services.invoice_charge(invoice_id=open_invoice.id) == "not_due"
    assert len(stripe_client.client().v1.charges.list({"customer": customer_id}).data) == 1


def test_no_payment_method_leaves_the_invoice_open(open_invoice):
    assert services.invoice_charge(invoice_id=open_invoice.id) == "no_payment_method"
    open_invoice.refresh_from_db()
    assert open_invoice.status == InvoiceStatus.OPEN
    assert not PaymentAttempt.objects.exists()


def test_network_error_charges_nothing_and_the_retry_reuses_the_key(open_invoice, settings):
    customer_id = _set_default_card(open_invoice.organization, "pm_card_visa")
    good = settings.STRIPE_API_BASE
    settings.STRIPE_API_BASE = "http://127.0.0.1:9"  # nothing listens: connection refused
    with pytest.raises(stripe.APIConnectionError):
        services.invoice_charge(invoice_id=open_invoice.id)
    assert not PaymentAttempt.objects.exists()

    settings.STRIPE_API_BASE = good
    assert services.invoice_charge(invoice_id=open_invoice.id) == "succeeded"
    (attempt,) = PaymentAttempt.objects.all()
    assert attempt.idempotency_key == f"invoice:{open_invoice.id}:charge:1"
    assert len(stripe_client.client().v1.charges.list({"customer": customer_id}).data) == 1


@pytest.fixture
def answer_dropping_proxy(localstripe_url):
    """A TCP proxy that forwards each request to Stripe, waits for Stripe's answer, and then
    hangs up without passing it on: the request was applied, the caller never learns it."""
    upstream = urllib.parse.urlsplit(localstripe_url)
    listener = socket.create_server(("127.0.0.1", 0))
    forwarded: list[bytes] = []
    answers: list[bytes] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(30)
                request = _read_http_message(conn)
                forwarded.append(request)
                with socket.create_connection((upstream.hostname, upstream.port),
                                              timeout=30) as up:
                    up.sendall(request)
                    answers.append(_read_http_message(up))  # Stripe answered; dropped here

    threading.Thread(target=serve, daemon=True).start()
    yield SimpleNamespace(url=f"http://127.0.0.1:{listener.getsockname()[1]}",
                          forwarded=forwarded, answers=answers)
    listener.close()


def _read_http_message(sock: socket.socket) -> bytes:
    """Read one HTTP/1.1 message with a Content-Length body (all the Stripe library sends)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += _recv(sock)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = _recv(sock)
        body += chunk
        data += chunk
    return data


def _recv(sock: socket.socket) -> bytes:
    chunk = sock.recv(65536)
    if not chunk:
        raise ConnectionError("the peer closed the connection mid-message")
    return chunk


def test_a_charge_whose_answer_was_lost_is_sent_again_and_charges_once(
        open_invoice, settings, answer_dropping_proxy):
    customer_id = _set_default_card(open_invoice.organization, "pm_card_visa")
    payment_method = stripe_client.default_payment_method(customer_id)
    # given a worker that committed its attempt and sent it; Stripe charged, but the answer
    # was lost on the way back (invoice_charge's two steps, the second through the proxy)
    attempt = services._charge_attempt_begin(invoice_id=open_invoice.id, now=timezone.now())
    good = settings.STRIPE_API_BASE
    settings.STRIPE_API_BASE = answer_dropping_proxy.url
    with pytest.raises(stripe.APIConnectionError):
        services._charge_attempt_send(attempt, customer_id=customer_id,
                                      payment_method=payment_method, now=timezone.now())
    settings.STRIPE_API_BASE = good
    assert len(answer_dropping_proxy.forwarded) == 1
    assert answer_dropping_proxy.answers[0].startswith(b"HTTP/1.1 200")
    assert len(stripe_client.client().v1.charges.list({"customer": customer_id}).data) == 1
    (attempt,) = PaymentAttempt.objects.all()
    assert (attempt.status, attempt.stripe_payment_intent_id) == (PaymentStatus.PENDING, "")

    # when the charge runs again (the task's retry, or the sync)
    assert services.payments_sync(older_than=timedelta(0)) == 1

    # then Stripe replayed its first answer: one attempt, one charge, recorded, invoice paid
    (attempt,) = PaymentAttempt.objects.all()
    open_invoice.refresh_from_db()
    assert open_invoice.status == InvoiceStatus.PAID
    assert attempt.status == PaymentStatus.SUCCEEDED and attempt.stripe_payment_intent_id
    charges = stripe_client.client().v1.charges.list({"customer": customer_id}).data
    assert len(charges) == 1 and charges[0].payment_intent == attempt.stripe_payment_intent_id


def test_dunning_retries_emails_then_uncollectible_and_suspended(
        open_invoice, mailoutbox, django_capture_on_commit_callbacks, client):
    org = open_invoice.organization
    _set_default_card(org, "pm_card_chargeCustomerFail")
    _, secret = make_key(org.projects.first())
    assert api_key_authenticate(secret) is not None  # and now cached in Redis
    t0 = NOV + timedelta(hours=2)

    with django_capture_on_commit_callbacks(execute=True):
        assert services.invoice_charge(invoice_id=open_invoice.id, now=t0) == "failed"
    open_invoice.refresh_from_db()
    assert open_invoice.next_payment_attempt_at == t0 + timedelta(days=1)
    assert len(mailoutbox) == 1 and mailoutbox[0].to == [org.billing_email]
    # a retry before its time does nothing
    assert services.invoice_charge(invoice_id=open_invoice.id, now=t0) == "not_due"

    when = t0
    for days in (1, 3, 7):
        when = when + timedelta(days=days)
        assert services.invoices_dunning_run(now=when) == [open_invoice.id]
        with django_capture_on_commit_callbacks(execute=True):
            assert services.invoice_charge(invoice_id=open_invoice.id, now=when) == "failed"

    open_invoice.refresh_from_db()
    org.refresh_from_db()
    assert open_invoice.status == InvoiceStatus.UNCOLLECTIBLE
    assert open_invoice.payment_failures == 4
    assert PaymentAttempt.objects.filter(status=PaymentStatus.FAILED).count() == 4
    assert org.status == OrgStatus.SUSPENDED
    assert api_key_authenticate(secret) is None  # the gateway refuses at once
    assert len(mailoutbox) == 4 and "suspended" in mailoutbox[-1].subject.lower()
    assert services.invoices_dunning_run(now=when + timedelta(days=30)) == []

    # paid out of band: the org is active again
    with django_capture_on_commit_callbacks(execute=True):
        services.invoice_mark_paid(invoice=open_invoice, acting_user=None)
    org.refresh_from_db()
    assert org.status == OrgStatus.ACTIVE
    assert api_key_authenticate(secret) is not None


def test_failed_payment_webhook_starts_dunning_once(open_invoice, client):
    _set_default_card(open_invoice.organization, "pm_card_visa")
    services.invoice_charge(invoice_id=open_invoice.id)
    attempt = PaymentAttempt.objects.get()
    failed = {"id": attempt.stripe_payment_intent_id, "object": "payment_intent",
              "status": "requires_payment_method", "amount": 20000,
              "metadata": {"invoice_id": str(open_invoice.id)},
              "last_payment_error": {"code": "card_declined", "message": "declined"}}
    body = _event("evt_failed_1", "payment_intent.payment_failed", failed)
    for _ in range(2):
        assert client.post(WEBHOOK_URL, body, content_type="application/json",
                           HTTP_STRIPE_SIGNATURE=_signed(body)).status_code == 200
    open_invoice.refresh_from_db()
    assert open_invoice.payment_failures == 1
    assert open_invoice.status == InvoiceStatus.OPEN
    assert open_invoice.next_payment_attempt_at is not None


def test_a_lost_webhook_is_made_up_by_the_sync(open_invoice):
    _set_default_card(open_invoice.organization, "pm_card_visa")
    assert services.invoice_charge(invoice_id=open_invoice.id) == "succeeded"
    open_invoice.refresh_from_db()
    assert open_invoice.status == InvoiceStatus.OPEN  # no webhook arrived

    assert services.payments_sync(older_than=timedelta(0)) == 1
    open_invoice.refresh_from_db()
    assert open_invoice.status == InvoiceStatus.PAID
    assert open_invoice.amount_paid == Decimal("200.00")
    assert services.payments_sync(older_than=timedelta(0)) == 0


def test_a_new_default_card_retries_open_invoices_at_once(
        open_invoice, client, django_capture_on_commit_callbacks):
    # given an invoice declined once, its next retry a day away
    org = open_invoice.organization
    customer_id = _set_default_card(org, "pm_card_chargeCustomerFail")
    t0 = timezone.now()
    assert services.invoice_charge(invoice_id=open_invoice.id, now=t0) == "failed"
    open_invoice.refresh_from_db()
    assert open_invoice.next_payment_attempt_at > t0 + timedelta(hours=23)

    # when the customer sets a working card as default (Stripe sends customer.updated)
    customer_id = _set_default_card(org, "pm_card_visa")
    customer = stripe_client.client().v1.customers.retrieve(customer_id).to_dict()
    body = _event("evt_customer_1", "customer.updated", customer)
    with django_capture_on_commit_callbacks() as enqueued:
        response = client.post(WEBHOOK_URL, body, content_type="application/json",
                               HTTP_STRIPE_SIGNATURE=_signed(body))

    # then the invoice is due for a retry now, and its charge is enqueued
    assert response.status_code == 200
    assert StripeEvent.objects.get(stripe_id="evt_customer_1").outcome == (
        "retrying 1 open invoice(s)")
    assert len(enqueued) == 1
    now = timezone.now()
    assert services.invoices_dunning_run(now=now) == [open_invoice.id]
    assert services.invoice_charge(invoice_id=open_invoice.id, now=now) == "succeeded"
    charges = stripe_client.client().v1.charges.list({"customer": customer_id}).data
    assert [c.status for c in charges if c.paid] == ["succeeded"]


def test_credit_notes_voids_and_manual_payments_are_audited_with_who_did_them(open_invoice):
    org = open_invoice.organization
    finance = UserFactory(email="finance@example.com")

    # a credit note, then a void of the invoice, by a finance person
    note = services.credit_note_create(invoice=open_invoice, amount=Decimal("20.00"),
                                       reason="outage", acting_user=finance)
    services.invoice_void(invoice=open_invoice, reason="billed in error", acting_user=finance)
    with pytest.raises(Conflict):  # refused: no row for what did not happen
        services.invoice_void(invoice=open_invoice, acting_user=finance)

    rows = {r.action: r for r in AuditEvent.objects.filter(organization_id=org.id)}
    assert set(rows) >= {"credit_note.create", "invoice.void"}
    assert AuditEvent.objects.filter(action="invoice.void").count() == 1
    created = rows["credit_note.create"]
    assert (created.actor_user_id, created.target) == (finance.id, note.public_id)
    assert created.after["amount"] == "20.00" and created.after["corrects"] == (
        open_invoice.public_id)
    voided = rows["invoice.void"]
    assert voided.actor_label == "finance@example.com"
    assert (voided.before["status"], voided.after["status"]) == ("open", "void")
    assert voided.after["reason"] == "billed in error"


def test_a_payment_recorded_by_hand_is_audited_with_who_recorded_it(open_invoice):
    finance = UserFactory(email="books@example.com")
    services.invoice_mark_paid(invoice=open_invoice, acting_user=finance)
    (row,) = AuditEvent.objects.filter(action="invoice.mark_paid")
    assert (row.actor_user_id, row.target) == (finance.id, open_invoice.public_id)
    assert row.organization_id == open_invoice.organization_id
    assert (row.before["status"], row.after["status"]) == ("open", "paid")
    assert row.after["amount_paid"] == "200.00"
