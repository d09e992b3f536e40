"""The only code that talks to Stripe: a configured ``StripeClient`` and the calls we make.

The official library retries network errors itself (``max_network_retries``, exponential
backoff with jitter) and resends the same ``Idempotency-Key`` on each retry, so a request that
reached Stripe before the connection broke is not applied twice. Keys are built from our rows
(``invoice:<id>:charge:<n>``), so a task that runs again sends the same key again.
"""

from __future__ import annotations

from typing import Any

import stripe
from django.conf import settings

from billing_platform.invoicing.metrics import stripe_call


def client() -> stripe.StripeClient:
    """Return a client for the configured Stripe (or localstripe) endpoint."""
    return stripe.StripeClient(
        settings.STRIPE_API_KEY or "sk_test_unset",
        base_addresses={"api": settings.STRIPE_API_BASE},
        max_network_retries=settings.STRIPE_MAX_NETWORK_RETRIES,
    )


@stripe_call("customer_create")
def customer_create(*, email: str, name: str, org_public_id: str) -> str:
    """Create a Stripe customer for an organization; return its id."""
    customer = client().v1.customers.create(
        params={"email": email, "name": name, "metadata": {"organization": org_public_id}},
        options={"idempotency_key": f"org:{org_public_id}:customer"},
    )
    return customer.id


@stripe_call("customer_retrieve")
def default_payment_method(customer_id: str) -> str | None:
    """Return the customer's default payment method id, if any."""
    customer = client().v1.customers.retrieve(customer_id).to_dict()
    return (customer.get("invoice_settings") or {}).get("default_payment_method") or None


@stripe_call("payment_intent_create")
def payment_intent_create(*, amount: int, currency: str, customer_id: str, payment_method: str,
                          idempotency_key: str, metadata: dict[str, str]) -> Any:
    """Create and confirm an off-session PaymentIntent; raise ``stripe.CardError`` on decline."""
    return client().v1.payment_intents.create(
        params={"amount": amount, "currency": currency.lower(), "customer": customer_id,
                "payment_method": payment_method, "confirm": True, "off_session": True,
                "metadata": metadata},
        options={"idempotency_key": idempotency_key},
    )


@stripe_call("payment_intent_retrieve")
def payment_intent_retrieve(payment_intent_id: str) -> Any:
    """Return a PaymentIntent as Stripe has it now."""
    return client().v1.payment_intents.retrieve(payment_intent_id)


def webhook_event(payload: bytes, signature: str) -> stripe.Event:
    """Verify a webhook's signature (Stripe's scheme) and parse it; raise on a bad signature."""
    event: stripe.Event = stripe.Webhook.construct_event(
        payload, signature, settings.STRIPE_WEBHOOK_SECRET,
        tolerance=settings.STRIPE_WEBHOOK_TOLERANCE_S)
    return event
