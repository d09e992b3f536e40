"""The console's billing page, through the Django test client against the Stripe stand-in (the
official library over HTTP): credits and grants with their expiry, a card saved through a
SetupIntent confirmed with a test card through Stripe's API, the card on the page and the
open invoice charged by the charge task; a replaced card, a declined one; another
organization's SetupIntent is a 404, a developer sees no billing page, a finance member no
form; Stripe.js (and its CSP) only with a publishable key."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
import stripe
from django.utils import timezone

from billing_platform.accounts.choices import Role
from billing_platform.audit.models import AuditEvent
from billing_platform.invoicing import services, stripe_client
from billing_platform.invoicing.choices import InvoiceStatus
from billing_platform.invoicing.models import (
    BillingAccount,
    Invoice,
    PaymentAttempt,
    StripeEvent,
)
from billing_platform.invoicing.tasks import invoice_charge_task
from plans import services as plan_services
from tests.console.browser import open_october_invoice
from tests.factories import MembershipFactory, make_billed_org
from tests.invoicing.test_invoice_payments import _event, _signed

REPLACED = "billing.payment_method_replace"


@pytest.fixture
def payer(stripe_settings, db):
    """An org whose October invoice (a 200.00 reservation fee) is open and unpaid, with three
    credit grants given after it: 25.00 expiring in December, 10.00 never, 5.00 expired."""
    invoice = open_october_invoice("Payer")
    org = invoice.organization
    assert (invoice.status, invoice.amount_due) == (InvoiceStatus.OPEN, Decimal("200.00"))
    now = timezone.now()
    plan_services.credit_grant_create(organization=org, kind="promotional", amount="25.00",
                                      expires_at=now + timedelta(days=30), note="welcome")
    plan_services.credit_grant_create(organization=org, kind="purchased", amount="10.00")
    plan_services.credit_grant_create(organization=org, kind="goodwill", amount="5.00",
                                      granted_at=now - timedelta(days=60),
                                      expires_at=now - timedelta(days=1), note="outage")
    return org


def member(org, role: str):
    return MembershipFactory(organization=org, role=role).user


def start_setup(client, key: str = "form-key-1") -> str:
    """Press "Add a card": return the SetupIntent id the card page is for."""
    reply = client.post("/console/billing/card/start/", {"idempotency_key": key})
    assert reply.status_code == 302, reply.content
    location = reply["Location"]
    assert location.startswith("/console/billing/card/?setup_intent=seti_")
    return location.split("=", 1)[1]


def confirm(setup_intent: str, card: str = "pm_card_visa"):
    """What Stripe.js does in the browser with the card: confirm the SetupIntent."""
    return stripe_client.client().v1.setup_intents.confirm(setup_intent,
                                                          {"payment_method": card})


def complete(client, setup_intent: str, key: str = "form-key-2"):
    return client.post("/console/billing/card/complete/",
                       {"idempotency_key": key, "setup_intent": setup_intent})


def test_credits_grants_with_expiry_and_no_card_yet(payer, client):
    client.force_login(member(payer, Role.OWNER))
    page = client.get("/console/billing/").content.decode()

    # the unexpired balance is 25.00 + 10.00; the expired grant is listed as expired
    assert '<p id="credit-balance"><strong>35.00 USD</strong>' in page
    assert page.count("<tr>\n      <td>") == 3 + 1  # three grants, one invoice
    assert "<td>Goodwill</td>" in page and "expired</span>" in page
    assert page.count("expired</span>") == 1
    assert "<td>Purchased</td>" in page and ">never<" in page
    # no card yet: the open invoice waits for one; the form to add one is there
    assert "No card on file." in page
    number = Invoice.objects.get(organization=payer).number
    assert f">{number}</a> (200.00 USD due)" in page
    assert "They are charged as soon as a card is saved." in page
    assert 'id="card-start"' in page and "Add a card" in page
    # linked: the billing profile, every invoice; the navigation has the page
    assert 'href="/console/settings/#billing-profile"' in page
    assert 'href="/console/invoices/"' in page
    assert '<a href="/console/billing/">Billing</a>' in page
    # nothing was created at Stripe by looking
    assert not BillingAccount.objects.filter(organization=payer).exists()


def test_a_card_saved_through_a_setup_intent_is_shown_and_the_open_invoice_charged(
        payer, client, django_capture_on_commit_callbacks):
    owner = member(payer, Role.OWNER)
    client.force_login(owner)
    invoice = Invoice.objects.get(organization=payer)

    # given "Add a card" pressed twice with one form (a double click): one SetupIntent
    seti = start_setup(client)
    assert start_setup(client) == seti
    customer_id = BillingAccount.objects.get(organization=payer).stripe_customer_id
    intent = stripe_client.setup_intent_retrieve(seti)
    assert (intent["customer"], intent["status"], intent["usage"]) == (
        customer_id, "requires_payment_method", "off_session")
    card_page = client.get(f"/console/billing/card/?setup_intent={seti}").content.decode()
    assert f'<code id="setup-intent-id">{seti}</code>' in card_page
    assert "js.stripe.com/v3" not in card_page  # no publishable key: no Stripe.js

    # when the card is confirmed with Stripe (a test card), and the page is told
    assert confirm(seti).status == "succeeded"
    with django_capture_on_commit_callbacks() as enqueued:
        reply = complete(client, seti)

    # then the card is the customer's default at Stripe, attached to it, and on the page
    assert reply.status_code == 302 and reply["Location"] == "/console/billing/"
    default = stripe_client.default_payment_method(customer_id)
    assert default == stripe_client.setup_intent_retrieve(seti)["payment_method"]
    assert stripe_client.payment_method_retrieve(default)["customer"] == customer_id
    page = client.get("/console/billing/").content.decode()
    assert ("Saved: invoices are now charged to the Visa ending in 4242 (expires 12/2030). "
            "1 open invoice will be charged now.") in page
    assert ('<p id="card-on-file"><strong>Visa</strong> ending in\n'
            '    <strong class="last4">4242</strong>, expires 12/2030</p>') in page
    assert "Replace card" in page and "Being charged to this card." in page
    # one audit row by the owner, the card before (none) and after, never more than that
    (row,) = AuditEvent.objects.filter(action=REPLACED)
    assert (row.actor_user_id, row.organization_id, row.before) == (owner.pk, payer.pk, {})
    assert row.after == {"payment_method": default, "brand": "visa", "last4": "4242",
                         "expiry": "12/2030", "setup_intent": seti}

    # and the open invoice is due now, its charge enqueued once (not again when Stripe's
    # customer.updated for that card arrives); the charge task charges it
    assert len(enqueued) == 1
    customer = stripe_client.client().v1.customers.retrieve(customer_id).to_dict()
    body = _event("evt_customer_card", "customer.updated", customer)
    with django_capture_on_commit_callbacks() as by_webhook:
        assert client.post("/stripe/webhook/", body, content_type="application/json",
                           HTTP_STRIPE_SIGNATURE=_signed(body)).status_code == 200
    assert StripeEvent.objects.get(stripe_id="evt_customer_card").outcome == (
        "no change: the console saved this card and charged the open invoices")
    assert by_webhook == []
    assert services.invoices_dunning_run() == [invoice.id]
    assert invoice_charge_task.apply(args=(invoice.id,)).get() == "succeeded"
    (attempt,) = PaymentAttempt.objects.filter(invoice=invoice)
    paid = stripe_client.payment_intent_retrieve(attempt.stripe_payment_intent_id)
    assert (paid.status, paid.amount, paid.payment_method) == ("succeeded", 20000, default)
    assert services.payments_sync(older_than=timedelta(0)) == 1  # as its webhook would
    invoice.refresh_from_db()
    assert (invoice.status, invoice.amount_paid) == (InvoiceStatus.PAID, Decimal("200.00"))
    page = client.get("/console/billing/").content.decode()
    assert "<td>paid</td>" in page and 'id="open-due"' not in page

    # the same form sent again, or the SetupIntent in a new form: nothing done twice
    with django_capture_on_commit_callbacks() as again:
        complete(client, seti)
        complete(client, seti, key="form-key-3")
    assert AuditEvent.objects.filter(action=REPLACED).count() == 1
    assert again == []
    assert PaymentAttempt.objects.filter(invoice=invoice).count() == 1


def test_a_replaced_card_is_audited_with_the_one_before(payer, client):
    client.force_login(member(payer, Role.ADMIN))  # an admin may replace it too
    first = start_setup(client, "k1")
    confirm(first)
    complete(client, first, "k2")
    second = start_setup(client, "k3")
    assert second != first
    confirm(second, "pm_card_mastercard")
    complete(client, second, "k4")

    page = client.get("/console/billing/").content.decode()
    assert "<strong>Mastercard</strong> ending in" in page and ">4444</strong>" in page
    assert ">4242<" not in page
    latest = AuditEvent.objects.filter(action=REPLACED).order_by("-id").first()
    assert (latest.before["brand"], latest.before["last4"]) == ("visa", "4242")
    assert (latest.after["brand"], latest.after["last4"], latest.after["expiry"]) == (
        "mastercard", "4444", "08/2031")

    # the first SetupIntent sent again in a new form does not bring its card back
    complete(client, first, "k5")
    page = client.get("/console/billing/").content.decode()
    assert "<strong>Mastercard</strong> ending in" in page
    assert AuditEvent.objects.filter(action=REPLACED).count() == 2


def test_a_declined_card_saves_nothing_and_says_so(payer, client,
                                                   django_capture_on_commit_callbacks):
    client.force_login(member(payer, Role.OWNER))
    seti = start_setup(client)

    # when the bank declines the card during setup (Stripe answers 402 to the browser)
    with pytest.raises(stripe.CardError) as declined:
        confirm(seti, "pm_card_visa_chargeDeclined")
    assert declined.value.code == "card_declined"
    intent = stripe_client.setup_intent_retrieve(seti)
    assert (intent["status"], intent["last_setup_error"]["code"]) == (
        "requires_payment_method", "card_declined")
    # and the page is told anyway
    with django_capture_on_commit_callbacks() as enqueued:
        reply = complete(client, seti)

    # then it is sent back to the card form with the reason; nothing is saved or charged
    assert reply["Location"] == f"/console/billing/card/?setup_intent={seti}"
    page = client.get(reply["Location"]).content.decode()
    assert ("The card was not saved: the card setup is requires payment method (Your card "
            "was declined.). Please enter a card again.") in page
    customer_id = BillingAccount.objects.get(organization=payer).stripe_customer_id
    assert stripe_client.default_payment_method(customer_id) is None
    assert enqueued == [] and not AuditEvent.objects.filter(action=REPLACED).exists()
    assert services.invoices_dunning_run() == []

    # the same SetupIntent with a good card then works
    assert confirm(seti).status == "succeeded"
    complete(client, seti, key="form-key-3")
    assert stripe_client.default_payment_method(customer_id) is not None


def test_another_orgs_setup_intent_is_a_404_and_malformed_input_a_message(payer, client):
    # given another organization's owner started a card setup and confirmed it
    other = make_billed_org(name="Other")
    client.force_login(member(other, Role.OWNER))
    theirs = start_setup(client)
    confirm(theirs)
    their_customer = BillingAccount.objects.get(organization=other).stripe_customer_id

    # when the payer's owner uses its id (or one that does not exist)
    client.force_login(member(payer, Role.OWNER))
    mine = start_setup(client)
    for seti in (theirs, "seti_doesnotexist"):
        assert client.get(f"/console/billing/card/?setup_intent={seti}").status_code == 404
        assert complete(client, seti, key=f"k-{seti}").status_code == 404

    # then nothing changed for either: no default card, no audit row
    mine_customer = BillingAccount.objects.get(organization=payer).stripe_customer_id
    assert stripe_client.default_payment_method(their_customer) is None
    assert stripe_client.default_payment_method(mine_customer) is None
    assert not AuditEvent.objects.filter(action=REPLACED).exists()

    # malformed input is a message on the page, nothing written
    for posted in ({"idempotency_key": "k9", "setup_intent": "seti_'; drop table--"},
                   {"idempotency_key": "", "setup_intent": mine},
                   {"setup_intent": mine}):
        reply = client.post("/console/billing/card/complete/", posted)
        assert (reply.status_code, reply["Location"]) == (302, "/console/billing/")
    page = client.get("/console/billing/").content.decode()
    assert "The card was not saved: Card setup: Enter a valid value." in page
    assert "The card was not saved: idempotency_key: This field is required." in page
    assert "drop table" not in page
    assert client.get("/console/billing/card/?setup_intent=<b>x</b>").status_code == 404
    assert client.get("/console/billing/card/start/").status_code == 405
    assert stripe_client.default_payment_method(mine_customer) is None
    assert not AuditEvent.objects.filter(action=REPLACED).exists()


def test_a_developer_sees_no_billing_page_and_finance_no_card_form(payer, client):
    developer = member(payer, Role.DEVELOPER)
    client.force_login(developer)
    assert 'href="/console/billing/"' not in client.get("/console/").content.decode()
    for url in ("/console/billing/", "/console/billing/card/?setup_intent=seti_x"):
        reply = client.get(url)
        assert (reply.status_code, reply["Location"]) == (302, "/console/")
    reply = client.post("/console/billing/card/start/", {"idempotency_key": "dev"})
    assert (reply.status_code, reply["Location"]) == (302, "/console/")

    # the organization's finance member reads the page but gets no form, and one it forges
    # is refused before Stripe is asked for anything
    client.force_login(member(payer, Role.FINANCE))
    page = client.get("/console/billing/").content.decode()
    assert "35.00 USD" in page and 'id="card-start"' not in page
    assert "An owner or admin of the organization can change the payment method." in page
    reply = client.post("/console/billing/card/start/", {"idempotency_key": "fin"})
    assert reply["Location"] == "/console/billing/"
    assert "Your role (finance) cannot change the payment method" in client.get(
        "/console/billing/").content.decode()
    assert not BillingAccount.objects.filter(organization=payer).exists()


def test_stripe_js_and_its_csp_only_on_the_card_page_and_only_with_a_publishable_key(
        payer, client, settings):
    client.force_login(member(payer, Role.OWNER))
    seti = start_setup(client)
    url = f"/console/billing/card/?setup_intent={seti}"
    plain = client.get(url)
    assert "js.stripe.com" not in plain["Content-Security-Policy"]
    assert "<script src=\"https://js.stripe.com" not in plain.content.decode()

    settings.STRIPE_PUBLISHABLE_KEY = "pk_test_tollgate"
    with_key = client.get(url)
    body = with_key.content.decode()
    assert '<script src="https://js.stripe.com/v3/" defer></script>' in body
    assert 'id="card-element"' in body and "billing_card.js" in body
    assert '"publishable_key": "pk_test_tollgate"' in body and '"client_secret": "seti_' in body
    policy = dict(part.strip().split(" ", 1)
                  for part in with_key["Content-Security-Policy"].split(";") if part.strip())
    assert policy["script-src"].split()[-1] == "https://js.stripe.com"
    assert "https://js.stripe.com" in policy["frame-src"].split()
    assert "https://api.stripe.com" in policy["connect-src"].split()
    assert "'unsafe-inline'" not in policy["script-src"]
    # the overview page loads no Stripe.js, and its policy allows none
    overview = client.get("/console/billing/")
    assert "js.stripe.com" not in overview["Content-Security-Policy"]
    assert "js.stripe.com" not in overview.content.decode()


def test_stripe_not_answering_changes_nothing_and_the_same_form_works_later(
        payer, client, settings, django_capture_on_commit_callbacks):
    client.force_login(member(payer, Role.OWNER))
    seti = start_setup(client)
    confirm(seti)
    stripe_base = settings.STRIPE_API_BASE

    # when Stripe cannot be reached as the card is saved (nothing listens on port 9)
    settings.STRIPE_API_BASE = "http://127.0.0.1:9"
    with django_capture_on_commit_callbacks() as enqueued:
        reply = complete(client, seti)
    # then the card page, which cannot ask Stripe either, sends back to the billing page,
    # which says so and still renders; nothing was recorded or made due
    assert reply["Location"] == f"/console/billing/card/?setup_intent={seti}"
    assert client.get(reply["Location"])["Location"] == "/console/billing/"
    page = client.get("/console/billing/").content.decode()
    assert "Stripe did not answer, so nothing was changed." in page
    assert "The card on file cannot be shown right now (Stripe did not answer)" in page
    reply = client.post("/console/billing/card/start/", {"idempotency_key": "k-down"})
    assert reply["Location"] == "/console/billing/"
    assert enqueued == [] and not AuditEvent.objects.filter(action=REPLACED).exists()
    assert services.invoices_dunning_run() == []

    # and once Stripe answers again, the very same form saves the card
    settings.STRIPE_API_BASE = stripe_base
    with django_capture_on_commit_callbacks() as enqueued:
        reply = complete(client, seti)
    assert reply["Location"] == "/console/billing/"
    assert "Saved: invoices are now charged to the Visa ending in 4242" in client.get(
        "/console/billing/").content.decode()
    assert len(enqueued) == 1 and AuditEvent.objects.filter(action=REPLACED).count() == 1


def test_a_card_whose_form_never_came_back_is_saved_from_stripes_webhook(
        payer, client, stripe_webhook_inbox, django_capture_on_commit_callbacks):
    # given a card confirmed in the browser for the payer, and another one before it that
    # was saved through the console (its SetupIntent older than the one saved last)
    client.force_login(member(payer, Role.OWNER))
    older = start_setup(client, "k1")
    confirm(older, "pm_card_mastercard")
    seti = start_setup(client, "k2")
    confirm(seti)
    # the console's form for the newer one never comes back (the browser was closed)

    # when Stripe's signed setup_intent.succeeded for it arrives
    delivery = stripe_webhook_inbox.take("setup_intent.succeeded", object_id=seti)
    with django_capture_on_commit_callbacks() as enqueued:
        reply = client.post("/stripe/webhook/", delivery.body, content_type="application/json",
                            HTTP_STRIPE_SIGNATURE=delivery.signature)
    assert reply.status_code == 200
    assert StripeEvent.objects.get(stripe_id=delivery.event["id"]).outcome == (
        f"saving the card of {seti}")
    assert len(enqueued) == 1

    # then the save task (enqueued after commit) saves it, by the system, once
    from billing_platform.invoicing.tasks import payment_method_save_task

    with django_capture_on_commit_callbacks() as charges:
        assert payment_method_save_task.apply(args=(payer.id, seti)).get() == (
            "saved visa 4242, 1 invoice(s) due")
    assert len(charges) == 1
    (row,) = AuditEvent.objects.filter(action=REPLACED)
    assert (row.actor_user_id, row.after["setup_intent"]) == (None, seti)
    assert "<strong>Visa</strong> ending in" in client.get("/console/billing/").content.decode()
    assert payment_method_save_task.apply(args=(payer.id, seti)).get() == "already saved"

    # a late webhook of the older SetupIntent does not bring its card back
    assert payment_method_save_task.apply(args=(payer.id, older)).get() == (
        "ignored: a card saved since replaced it")
    # nor does a SetupIntent of another organization's customer
    other = make_billed_org(name="Other")
    client.force_login(member(other, Role.OWNER))
    theirs = start_setup(client, "k3")
    confirm(theirs)
    assert payment_method_save_task.apply(args=(payer.id, theirs)).get() == (
        "ignored: not a card setup of this organization")
    assert AuditEvent.objects.filter(action=REPLACED).count() == 1
    customer_id = BillingAccount.objects.get(organization=payer).stripe_customer_id
    assert stripe_client.payment_method_retrieve(
        stripe_client.default_payment_method(customer_id))["card"]["last4"] == "4242"
