"""Finance operations whose Stripe call goes out after commit, end to end through a real
Celery worker: a refund note's refund and a charge retried now reach Stripe (the stand-in,
read back with the official library) once."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from billing_platform.finance.permissions import CONTROLLER_GROUP
from billing_platform.invoicing import stripe_client
from billing_platform.invoicing.choices import PaymentStatus, RefundStatus
from billing_platform.invoicing.models import PaymentAttempt, Refund
from tests.conftest import wait_until
from tests.finance.conftest import finance_user
from tests.finance.operations_setup import (
    pay_through_stripe,
    post,
    price_book,
    reserved_invoice,
    set_default_card,
)
from tests.invoicing.conftest import billing_invariant_holds  # noqa: F401 - autouse check


@pytest.mark.django_db(transaction=True)
def test_the_worker_refunds_a_note_and_charges_a_retry_once(stripe_settings,
                                                            celery_worker_process):
    price_book()
    paid = pay_through_stripe(reserved_invoice("Refund Co"))
    unpaid = reserved_invoice("Retry Co")
    customer_id = set_default_card(unpaid.organization)
    client = APIClient()
    client.force_authenticate(finance_user(CONTROLLER_GROUP, email="books@platform.example"))
    worker = celery_worker_process(queues="billing", env={
        "STRIPE_API_BASE": stripe_settings.STRIPE_API_BASE,
        "STRIPE_API_KEY": stripe_settings.STRIPE_API_KEY})

    # when finance refunds 80.00 of the paid invoice and retries the unpaid one's charge
    note = post(client, f"invoices/{paid.public_id}/credit-notes/",
                {"reason": "overcharged", "amount": "80.00", "outcome": "refund"})
    retry = post(client, f"invoices/{unpaid.public_id}/retry-charge/", {"reason": "asked"})
    assert (note.status_code, retry.status_code) == (201, 202), (note.content, retry.content)

    # then the worker sends each once
    def refunded():
        refund = Refund.objects.get(invoice=paid)
        return refund if refund.status != RefundStatus.PENDING else None

    refund = wait_until(refunded, timeout=60, what=f"the refund (log: {worker.log_path})")
    assert refund.status == RefundStatus.SUCCEEDED, refund.failure_message
    intent = PaymentAttempt.objects.get(invoice=paid).stripe_payment_intent_id
    found = stripe_client.client().v1.refunds.list({"payment_intent": intent}).data
    assert [(r.id, r.amount) for r in found] == [(refund.stripe_refund_id, 8000)]

    def charged():
        attempt = PaymentAttempt.objects.filter(invoice=unpaid).first()
        return attempt if attempt and attempt.status != PaymentStatus.PENDING else None

    attempt = wait_until(charged, timeout=60, what=f"the charge (log: {worker.log_path})")
    assert attempt.status == PaymentStatus.SUCCEEDED
    charges = stripe_client.client().v1.charges.list({"customer": customer_id}).data
    assert [c.amount for c in charges] == [20000]
