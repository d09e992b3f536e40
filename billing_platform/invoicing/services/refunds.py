"""Refunds through Stripe: send a committed ``Refund`` once, record what Stripe answered.

A credit note on a paid invoice whose outcome is ``refund`` commits its ``Refund`` (pending)
with the note (``corrections``); after commit a task calls ``refund_send``, which sends it with
the key built from the note (``credit_note:<id>:refund``) and no lock held, then records the
answer. A task that runs twice, or again after an answer was lost, sends the same key, and
Stripe replays its first refund instead of making a second. Stripe's network errors propagate
(the task retries with backoff); a refusal (more than is left to refund, a disputed charge)
marks the refund ``failed`` with Stripe's message and leaves it for finance. The outcome is
audited (``credit_note.refund``) by the system; the decision was audited with the note.
"""

from __future__ import annotations

import logging

import stripe
from django.db import transaction
from django.utils import timezone

from billing_platform.audit.services import audit_record
from billing_platform.errors import InvalidRequest
from billing_platform.invoicing import stripe_client
from billing_platform.invoicing.choices import RefundStatus
from billing_platform.invoicing.models import Refund
from billing_platform.invoicing.money import quantize_money, to_minor_units

log = logging.getLogger(__name__)

# Stripe's Refund statuses that are final; any other (pending, requires_action) stays pending
_FINAL = {"succeeded": RefundStatus.SUCCEEDED, "failed": RefundStatus.FAILED,
          "canceled": RefundStatus.FAILED}


def refund_send(*, refund_id: int) -> str:
    """Send one pending refund to Stripe (once per key); return its status."""
    refund = Refund.objects.select_related("payment", "invoice", "credit_note").get(
        pk=refund_id)
    if refund.status != RefundStatus.PENDING:
        return str(refund.status)
    try:
        answer = stripe_client.refund_create(
            payment_intent_id=refund.payment.stripe_payment_intent_id,
            amount_minor=to_minor_units(refund.amount, refund.currency),
            currency=refund.currency, idempotency_key=refund.idempotency_key,
            metadata={"invoice": refund.invoice.public_id,
                      "credit_note": refund.credit_note.public_id,
                      "refund": refund.idempotency_key})
    except (stripe.InvalidRequestError, InvalidRequest) as exc:
        log.error("refund %s of invoice %s refused by Stripe: %s", refund.idempotency_key,
                  refund.invoice.number, exc)
        return _record(refund_id, status=RefundStatus.FAILED, stripe_id="",
                       message=(getattr(exc, "user_message", None) or str(exc))[:500])
    # (a domain error here is refund_create refusing before Stripe: a currency mismatch)
    return _record(refund_id, status=_FINAL.get(str(answer.get("status")),
                                                RefundStatus.PENDING),
                   stripe_id=str(answer.get("id") or ""),
                   message=str(answer.get("failure_reason") or "")[:500])


@transaction.atomic
def _record(refund_id: int, *, status: str, stripe_id: str, message: str) -> str:
    refund = Refund.objects.select_for_update().select_related("invoice").get(pk=refund_id)
    if refund.status != RefundStatus.PENDING:
        return str(refund.status)  # recorded meanwhile (a second task, a webhook)
    before = {"status": str(refund.status), "stripe_refund_id": refund.stripe_refund_id}
    refund.status = status
    refund.stripe_refund_id = stripe_id or refund.stripe_refund_id
    refund.failure_message = message
    refund.updated_at = timezone.now()
    refund.save(update_fields=["status", "stripe_refund_id", "failure_message", "updated_at"])
    audit_record(acting_user=None, organization=refund.invoice.organization_id,
                 action="credit_note.refund", target=refund.invoice.public_id, before=before,
                 after={"status": str(refund.status), "stripe_refund_id": refund.stripe_refund_id,
                        "refund": refund.idempotency_key, "currency": refund.currency,
                        "amount": str(quantize_money(refund.amount, refund.currency)),
                        "failure": refund.failure_message})
    return str(refund.status)
