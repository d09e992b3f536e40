"""``stripe_client.refund_create`` through the official library against the Stripe stand-in.

A refund is made once per idempotency key however often it is sent, never beyond what is left
of the charge, never in another currency than the charge's, and Stripe reports it with a signed
``charge.refunded`` carrying the charge's cumulative ``amount_refunded``.
"""

from __future__ import annotations

import pytest
import stripe

from billing_platform.errors import InvalidRequest
from billing_platform.invoicing import stripe_client


def paid_intent(amount: int = 10000, currency: str = "usd", card: str = "pm_card_visa"):
    """A PaymentIntent charged through Stripe directly (not through the platform)."""
    client = stripe_client.client()
    customer = client.v1.customers.create({"email": "refunds@example.com"})
    method = client.v1.payment_methods.attach(card, {"customer": customer.id})
    intent = client.v1.payment_intents.create({
        "amount": amount, "currency": currency, "customer": customer.id,
        "payment_method": method.id, "confirm": True, "off_session": True})
    assert intent.status == "succeeded"
    return intent


def _charge(intent_id: str):
    (charge,) = stripe_client.client().v1.charges.list(
        {"customer": stripe_client.payment_intent_retrieve(intent_id).customer}).data
    return charge


def test_a_refund_is_made_once_per_key_and_never_past_the_charge(stripe_settings):
    intent = paid_intent()

    # a partial refund, sent twice with one key (a retry after a lost answer)
    first = stripe_client.refund_create(payment_intent_id=intent.id, amount_minor=3000,
                                        currency="USD", idempotency_key="test:refund:1",
                                        metadata={"credit_note": "cn_1"})
    again = stripe_client.refund_create(payment_intent_id=intent.id, amount_minor=3000,
                                        currency="USD", idempotency_key="test:refund:1",
                                        metadata={"credit_note": "cn_1"})
    assert again["id"] == first["id"]
    assert (first["object"], first["status"], first["amount"], first["currency"]) == (
        "refund", "succeeded", 3000, "usd")
    assert first["payment_intent"] == intent.id and first["metadata"] == {"credit_note": "cn_1"}
    charge = _charge(intent.id)
    assert (charge.amount_refunded, charge.refunded) == (3000, False)

    # more than is left: Stripe's 400, nothing refunded
    with pytest.raises(stripe.InvalidRequestError) as too_much:
        stripe_client.refund_create(payment_intent_id=intent.id, amount_minor=7001,
                                    currency="usd", idempotency_key="test:refund:2",
                                    metadata={})
    assert (too_much.value.code, too_much.value.param) == ("amount_too_large", "amount")
    assert _charge(intent.id).amount_refunded == 3000

    # the rest, then nothing is left to refund
    stripe_client.refund_create(payment_intent_id=intent.id, amount_minor=7000, currency="usd",
                                idempotency_key="test:refund:3", metadata={})
    charge = _charge(intent.id)
    assert (charge.amount_refunded, charge.refunded) == (10000, True)
    with pytest.raises(stripe.InvalidRequestError) as done:
        stripe_client.refund_create(payment_intent_id=intent.id, amount_minor=1,
                                    currency="usd", idempotency_key="test:refund:4",
                                    metadata={})
    assert done.value.code == "charge_already_refunded"
    refunds = stripe_client.client().v1.refunds.list({"payment_intent": intent.id}).data
    assert sorted(r.amount for r in refunds) == [3000, 7000]


@pytest.mark.parametrize(("amount", "currency", "param"), [
    (500, "eur", "currency"), (0, "usd", "amount_minor"), (-5, "usd", "amount_minor")])
def test_a_refund_in_another_currency_or_of_no_amount_is_refused_before_stripe(
        stripe_settings, amount, currency, param):
    intent = paid_intent()
    with pytest.raises(InvalidRequest) as refused:
        stripe_client.refund_create(payment_intent_id=intent.id, amount_minor=amount,
                                    currency=currency, idempotency_key=f"test:bad:{intent.id}",
                                    metadata={})
    assert refused.value.param == param
    assert stripe_client.client().v1.refunds.list({"payment_intent": intent.id}).data == []


def test_a_refund_is_reported_by_a_signed_charge_refunded_webhook(
        stripe_settings, stripe_webhook_inbox):
    intent = paid_intent(amount=2500)
    stripe_client.refund_create(payment_intent_id=intent.id, amount_minor=1000, currency="usd",
                                idempotency_key=f"test:webhook:{intent.id}", metadata={})
    charge_id = _charge(intent.id).id

    delivery = stripe_webhook_inbox.take("charge.refunded", object_id=charge_id)

    event = stripe_client.webhook_event(delivery.body, delivery.signature)
    charge = event.to_dict()["data"]["object"]
    assert (charge["payment_intent"], charge["amount_refunded"], charge["refunded"]) == (
        intent.id, 1000, False)
    with pytest.raises(stripe.SignatureVerificationError):
        stripe.Webhook.construct_event(delivery.body, delivery.signature, "whsec_other")
