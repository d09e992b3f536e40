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

from billing_platform.errors import InvalidRequest
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


@stripe_call("refund_create")
def refund_create(*, payment_intent_id: str, amount_minor: int, currency: str,
                  idempotency_key: str, metadata: dict[str, str]) -> dict[str, Any]:
    """Refund ``amount_minor`` of a PaymentIntent's charge; return Stripe's Refund as a dict.

    ``currency`` is the currency the caller means to refund in; a Refund takes its charge's
    currency, so a mismatch is refused (``InvalidRequest``) before any money moves, as is an
    amount that is not a positive integer. Stripe's own refusals (more than is left to refund,
    a charge already refunded or disputed) are ``stripe.InvalidRequestError`` with its
    ``code``. Build ``idempotency_key`` from our own rows (``credit_note:<id>:refund``), so a
    retry never refunds twice; Stripe sends ``charge.refunded`` when the refund is made.
    """
    if not isinstance(amount_minor, int) or isinstance(amount_minor, bool) or amount_minor <= 0:
        raise InvalidRequest("A refund's amount is a positive whole number of minor units.",
                             param="amount_minor")
    charged_in = str(payment_intent_retrieve(payment_intent_id).currency or "").lower()
    if charged_in != currency.lower():
        raise InvalidRequest(f"PaymentIntent {payment_intent_id} was charged in "
                             f"{charged_in.upper() or 'no currency'}, not {currency.upper()}.",
                             param="currency")
    refund = client().v1.refunds.create(
        params={"payment_intent": payment_intent_id, "amount": amount_minor,
                "metadata": metadata},
        options={"idempotency_key": idempotency_key},
    )
    result: dict[str, Any] = refund.to_dict()
    return result


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


# --- payment methods: a card saved through a SetupIntent (invoicing.payment_methods) ---------

@stripe_call("setup_intent_create")
def setup_intent_create(*, customer_id: str, idempotency_key: str,
                        metadata: dict[str, str]) -> dict[str, Any]:
    """Create a SetupIntent to save a card for off-session charges; return it as a dict.

    The browser confirms it (Stripe.js with the client secret); the card never reaches us.
    Which payment method types it offers is the Stripe account's setting (cards here).
    """
    intent = client().v1.setup_intents.create(
        params={"customer": customer_id, "usage": "off_session", "metadata": metadata},
        options={"idempotency_key": idempotency_key},
    )
    result: dict[str, Any] = intent.to_dict()
    return result


@stripe_call("setup_intent_retrieve")
def setup_intent_retrieve(setup_intent_id: str) -> dict[str, Any]:
    """Return a SetupIntent as Stripe has it now (``stripe.InvalidRequestError`` if unknown)."""
    result: dict[str, Any] = client().v1.setup_intents.retrieve(setup_intent_id).to_dict()
    return result


@stripe_call("customer_retrieve")
def default_payment_method_expanded(customer_id: str) -> dict[str, Any] | None:
    """Return the customer's default PaymentMethod itself (one request), if any."""
    customer = client().v1.customers.retrieve(
        customer_id, params={"expand": ["invoice_settings.default_payment_method"]}).to_dict()
    method = (customer.get("invoice_settings") or {}).get("default_payment_method")
    return method if isinstance(method, dict) else None


@stripe_call("payment_method_retrieve")
def payment_method_retrieve(payment_method_id: str) -> dict[str, Any]:
    """Return a PaymentMethod (for a card: brand, last4, expiry) as a dict."""
    result: dict[str, Any] = client().v1.payment_methods.retrieve(payment_method_id).to_dict()
    return result


@stripe_call("customer_update")
def customer_default_payment_method_set(*, customer_id: str, payment_method_id: str,
                                        idempotency_key: str) -> None:
    """Make an attached PaymentMethod the one the customer's invoices are charged to."""
    client().v1.customers.update(
        customer_id,
        params={"invoice_settings": {"default_payment_method": payment_method_id}},
        options={"idempotency_key": idempotency_key},
    )
