"""The billing page in a real headless Chromium, under the console's CSP, against a live web
process, a real Celery worker (the billing queue) and the Stripe stand-in.

An owner whose October invoice is open and who holds credit opens the page from the
navigation, adds a card (the SetupIntent is confirmed with a test card through Stripe's API,
as Stripe.js would in production), saves it, sees the card on the page, and sees the open
invoice charged by the worker's charge task and then paid. Screenshots of the page and of the
card form at 1280 and 375 px go to tests/console/screenshots/ (not committed).
"""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from django.utils import timezone

from billing_platform.accounts.choices import Role
from billing_platform.invoicing import services, stripe_client
from billing_platform.invoicing.choices import InvoiceStatus, PaymentStatus
from billing_platform.invoicing.models import Invoice, PaymentAttempt
from plans import services as plan_services
from tests.conftest import wait_until
from tests.console.browser import (
    BROWSER_MARKS,
    in_thread,
    member_who_signs_in,
    open_october_invoice,
    shoot,
    sign_in,
    stripe_env,
)
from tests.gateway.conftest import start_gateway, stop_gateway

pytestmark = BROWSER_MARKS


@pytest.fixture
def web_env() -> dict[str, str]:
    """More environment of the web process (a test overrides it)."""
    return {}


@pytest.fixture
def billing_world(stripe_settings, localstripe_url, celery_worker_process, tmp_path, web_env):
    """An org with a 200.00 October invoice open and 25.00 of credit, its owner, a worker for
    the charge task and the web process. Yields (base URL, the invoice)."""
    env = stripe_env(localstripe_url)
    invoice = open_october_invoice("Card Co")
    org = invoice.organization
    plan_services.credit_grant_create(organization=org, kind="promotional", amount="25.00",
                                      expires_at=timezone.now() + timedelta(days=30),
                                      note="welcome credit")
    member_who_signs_in("owner@cardco.example.com", organization=org, role=Role.OWNER)
    celery_worker_process(queues="billing", env=env)
    server = start_gateway(tmp_path, env={**env, **web_env})
    yield server.url, invoice
    stop_gateway(server)


def _attempt_succeeded(invoice_id: int) -> bool:
    return PaymentAttempt.objects.filter(invoice_id=invoice_id,
                                         status=PaymentStatus.SUCCEEDED).exists()


def test_an_owner_adds_a_card_and_sees_the_open_invoice_charged(billing_world, page):
    base, invoice = billing_world

    # the owner opens the billing page from the navigation: credit, no card, the open invoice
    sign_in(page, base, "owner@cardco.example.com")
    page.click("header nav >> text=Billing")
    page.wait_for_url(f"{base}/console/billing/")
    assert page.inner_text("#credit-balance").startswith("25.00 USD")
    assert page.inner_text("#card-on-file").startswith("No card on file.")
    assert f"{invoice.number} (200.00 USD due)" in page.inner_text("#open-due")
    shoot(page, "billing")

    # adds a card: the card page is for a SetupIntent of the org's Stripe customer
    page.click("#card-start button")
    page.wait_for_selector("#card-setup")
    seti = page.inner_text("#setup-intent-id")
    assert seti.startswith("seti_")
    shoot(page, "billing-card")

    # the card is confirmed with Stripe (what Stripe.js does with the card in production)
    confirmed = stripe_client.client().v1.setup_intents.confirm(
        seti, {"payment_method": "pm_card_visa"})
    assert confirmed.status == "succeeded"
    page.click("#card-complete button[type=submit]")
    page.wait_for_url(f"{base}/console/billing/")
    assert "Saved: invoices are now charged to the Visa ending in 4242 (expires 12/2030). " \
           "1 open invoice will be charged now." in page.inner_text(".messages")
    assert page.inner_text("#card-on-file") == "Visa ending in 4242, expires 12/2030"
    assert page.inner_text("#card-start button") == "Replace card"

    # the worker's charge task charges the open invoice to that card, once
    wait_until(lambda: in_thread(_attempt_succeeded, invoice.id), timeout=60,
               what="the charge task to charge the open invoice")
    (attempt,) = in_thread(lambda: list(PaymentAttempt.objects.filter(invoice_id=invoice.id)))
    intent = stripe_client.payment_intent_retrieve(attempt.stripe_payment_intent_id)
    assert (intent.status, intent.amount, intent.payment_method) == (
        "succeeded", 20000, confirmed.payment_method)
    # and once Stripe's answer is in (the sync the beat runs, as a lost webhook's stand-in),
    # the page shows it paid and nothing open
    assert in_thread(lambda: services.payments_sync(older_than=timedelta(0))) == 1
    paid = in_thread(lambda: Invoice.objects.get(pk=invoice.pk))
    assert (paid.status, paid.amount_paid) == (InvoiceStatus.PAID, Decimal("200.00"))
    page.reload()
    row = page.locator("#recent-invoices tbody tr").first
    assert row.locator("td").nth(1).inner_text() == "paid"
    assert page.locator("#open-due").count() == 0
    shoot(page, "billing-card-saved")

    # the links to the billing profile and the invoices lead there
    page.click("#invoices-link")
    page.wait_for_url(f"{base}/console/invoices/")
    page.go_back()
    page.click("#profile-link")
    page.wait_for_url(f"{base}/console/settings/#billing-profile")


# --- Stripe Elements: the card form of production, against the stand-in ----------------------
# Chromium here cannot reach js.stripe.com or api.stripe.com. Both addresses are answered by
# the stand-in, from the browser's network layer: Stripe.js by localstripe's own stand-in for
# it (localstripe-v3.js: an Elements card field of plain inputs, confirmCardSetup), told
# that Stripe's API is at https://api.stripe.com, and that address by the Stripe stand-in
# (each request forwarded to it over HTTP). The page, its CSP and billing_card.js are the
# production ones: only the two Stripe origins are answered by stand-ins.

def _stripe_js_stand_in() -> str:
    import re

    import localstripe

    source = (Path(localstripe.__file__).parent / "localstripe-v3.js").read_text()
    return re.sub(r"const LOCALSTRIPE_BASE_API = \(function \(\) \{.*?\}\)\(\);",
                  'const LOCALSTRIPE_BASE_API = "https://api.stripe.com";', source, count=1,
                  flags=re.S)


def _answer_stripe_origins(page, localstripe_url: str) -> list[str]:
    """Answer js.stripe.com and api.stripe.com from the stand-ins; return the API paths
    the browser called."""
    script, called = _stripe_js_stand_in(), []
    page.route("https://js.stripe.com/v3/",
               lambda route: route.fulfill(body=script, content_type="application/javascript"))

    def api(route) -> None:
        path = route.request.url.removeprefix("https://api.stripe.com")
        called.append(f"{route.request.method} {path}")
        route.fulfill(response=route.fetch(url=localstripe_url + path))

    page.route("https://api.stripe.com/**", api)
    return called


@pytest.mark.parametrize("web_env", [{"STRIPE_PUBLISHABLE_KEY": "pk_test_tollgate"}])
def test_the_card_entered_in_stripe_elements_is_saved_and_charged(
        billing_world, page, localstripe_url):
    base, invoice = billing_world
    called = _answer_stripe_origins(page, localstripe_url)
    sign_in(page, base, "owner@cardco.example.com")
    page.goto(f"{base}/console/billing/")

    # the card page loads Stripe.js (allowed by its CSP) and mounts the card field
    page.click("#card-start button")
    page.wait_for_selector("#card-element input")
    assert page.locator("#no-stripe-js").count() == 0
    shoot(page, "billing-card-elements")

    # the owner types a test card and saves it: Stripe.js confirms the SetupIntent with its
    # client secret, then billing_card.js posts the completion form
    for placeholder, value in (("number", "4242424242424242"), ("exp_month", "12"),
                               ("exp_year", "30"), ("cvc", "123"),
                               ("postal_code", "10115")):
        page.fill(f"#card-element input[placeholder={placeholder}]", value)
    page.click("#card-submit")
    page.wait_for_url(f"{base}/console/billing/")
    assert [c for c in called if c.endswith("/confirm")] and all(
        c.startswith("POST /v1/setup_intents/seti_") for c in called)
    assert page.inner_text("#card-on-file") == "Visa ending in 4242, expires 12/2030"
    wait_until(lambda: in_thread(_attempt_succeeded, invoice.id), timeout=60,
               what="the charge task to charge the open invoice")

    # a declined card is Stripe's message on the form, and nothing is posted
    page.click("#card-start button")
    page.wait_for_selector("#card-element input")
    for placeholder, value in (("number", "4000000000000002"), ("exp_month", "12"),
                               ("exp_year", "30"), ("cvc", "123"),
                               ("postal_code", "10115")):
        page.fill(f"#card-element input[placeholder={placeholder}]", value)
    page.click("#card-submit")
    page.wait_for_selector("#card-errors:not(:empty)")
    assert page.inner_text("#card-errors") == "Your card was declined."
    assert "/console/billing/card/" in page.url
    assert not page.is_disabled("#card-submit")
