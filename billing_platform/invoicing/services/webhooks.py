"""What Stripe tells us about payments: signed webhooks, and the sync for webhooks lost.

Only a PaymentIntent this platform created is believed, found by the id recorded on our charge
attempt (never by its metadata), and the invoice becomes ``paid`` only when that PaymentIntent
received exactly the amount due; any other payment is left for finance (``needs_review``, an
audit row). A webhook is refused outright while ``STRIPE_WEBHOOK_SECRET`` is unset; a verified
one is stored raw first and applied exactly once (a replay changes nothing). ``payments_sync``
settles what no webhook reported, by sending an unanswered attempt again with its key or
reading the PaymentIntent back. Outcomes are booked with ``payments``' helpers, so a payment
and its audit row are the same whether a webhook, the sync or a person recorded it.

After payment, Stripe reports money moving back: ``charge.refunded`` (the charge's running
``amount_refunded``, recorded on the attempt and summed on the invoice) and
``charge.dispute.created``/``.updated``/``.closed`` (the invoice's ``amount_disputed`` while a
dispute is open; a lost one moves to ``amount_charged_back``). They are believed only for a
charge our attempt recorded and that settled its invoice, each with an audit row; anything
else is left for finance review, like a payment.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

import stripe
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Sum
from django.utils import timezone

from billing_platform import errors
from billing_platform.audit.selectors import audit_events
from billing_platform.audit.services import audit_record
from billing_platform.errors import DomainError, InvalidRequest
from billing_platform.invoicing import stripe_client
from billing_platform.invoicing.choices import InvoiceStatus, PaymentStatus
from billing_platform.invoicing.models import (
    BillingAccount,
    Dispute,
    Invoice,
    PaymentAttempt,
    StripeEvent,
)
from billing_platform.invoicing.money import (
    from_minor_units,
    minor_units,
    quantize_money,
    to_minor_units,
)
from billing_platform.invoicing.services.payments import (
    invoice_charge,
    invoice_settle,
    open_invoices_charge_now,
    payment_failure_book,
)

log = logging.getLogger(__name__)


def _money_minor_text(minor: object, currency: str) -> str:
    if not isinstance(minor, int) or isinstance(minor, bool):
        return f"{minor!r} (not an amount)"
    return f"{Decimal(minor).scaleb(-minor_units(currency)):.{minor_units(currency)}f} {currency}"


def _review(*, organization_id: int | None, target: str, reason: str,
            details: dict[str, str]) -> str:
    """Record a payment that settles nothing for finance (an audit row); return the outcome."""
    audit_record(acting_user=None, organization=organization_id, action="payment.review",
                 target=target, after={"reason": reason, **details})
    log.warning("payment left for finance review: %s (%s)", reason, target)
    return f"review: {reason}"[:300]


def _unknown_payment_intent(intent: dict[str, Any], *, pi_id: str) -> str:
    """A PaymentIntent no charge attempt of ours recorded: believe nothing it says."""
    if intent.get("status") != "succeeded":
        return "ignored: not a payment this platform created"
    metadata = intent.get("metadata") or {}
    claimed, number = str(metadata.get("invoice_id") or ""), str(metadata.get("attempt") or "")
    # The answer to our own charge can still be on its way here: an attempt is committed before
    # Stripe is called and its PaymentIntent id recorded after the answer. Such an attempt is
    # settled by payments_sync, which sends it again with its key and reads Stripe's answer; this
    # event pays nothing either way.
    if claimed.isdigit() and number.isdigit() and PaymentAttempt.objects.filter(
            invoice_id=int(claimed), number=int(number), status=PaymentStatus.PENDING,
            stripe_payment_intent_id="").exists():
        return "deferred: the charge's answer is not recorded yet; payments_sync settles it"
    return _review(
        organization_id=None, target=pi_id[:80],
        reason="a PaymentIntent this platform did not create"
               + (f" claims invoice id {claimed[:40]}" if claimed else ""),
        details={"payment_intent": pi_id, "claimed_invoice_id": claimed[:40],
                 "amount_received": str(intent.get("amount_received")),
                 "currency": str(intent.get("currency") or "")[:8]})


def _payment_intent_succeeded(intent: dict[str, Any], *, attempt: PaymentAttempt, invoice: Invoice,
                              now: datetime) -> str:
    """Pay the (locked) invoice if the PaymentIntent received exactly its amount due."""
    if attempt.status == PaymentStatus.NEEDS_REVIEW:
        return "no change: held for finance review"
    if invoice.status == InvoiceStatus.PAID and attempt.status == PaymentStatus.SUCCEEDED:
        return "no change"  # a replay, or the sync and the webhook both reporting it
    received = intent.get("amount_received")
    currency = str(intent.get("currency") or "").upper()
    due = to_minor_units(invoice.amount_due, invoice.currency)
    def minor(value: object) -> str:
        return _money_minor_text(value, invoice.currency)

    code, problem = "", ""
    if currency != invoice.currency.upper():
        code = "currency_mismatch"
        problem = f"received {currency or 'no currency'}, the invoice is in {invoice.currency}"
    elif received != due or isinstance(received, bool):
        code, problem = "amount_mismatch", f"received {minor(received)} of {minor(due)} due"
    elif invoice.status not in (InvoiceStatus.OPEN, InvoiceStatus.UNCOLLECTIBLE,
                                InvoiceStatus.PAID):
        code = "invoice_not_payable"
        problem = f"received the amount due of a {invoice.status} invoice"
    if problem:
        attempt.status = PaymentStatus.NEEDS_REVIEW
        attempt.failure_code = code
        attempt.failure_message = problem[:500]
        attempt.updated_at = now
        attempt.save(update_fields=["status", "failure_code", "failure_message", "updated_at"])
        return _review(organization_id=invoice.organization_id, target=invoice.public_id,
                       reason=f"invoice {invoice.number}: {problem}",
                       details={"payment_intent": attempt.stripe_payment_intent_id,
                                "attempt": attempt.idempotency_key})
    if attempt.status != PaymentStatus.SUCCEEDED:
        attempt.status, attempt.updated_at = PaymentStatus.SUCCEEDED, now
        attempt.save(update_fields=["status", "updated_at"])
    paid = invoice_settle(
        invoice, amount=invoice.amount_due, now=now, acting_user=None, action="invoice.pay",
        details={"method": "stripe", "payment_intent": attempt.stripe_payment_intent_id})
    return "paid" if paid else "no change"


def _apply_payment_intent(intent: dict[str, Any], *, now: datetime) -> str:
    """Apply a PaymentIntent's state (from a verified webhook or a sync) to our invoice.

    Only a PaymentIntent this platform created is believed: it is found by the id recorded on
    our charge attempt, never by its metadata (whoever can create a PaymentIntent on the Stripe
    account writes what metadata they like). It pays the invoice only when it received exactly
    the amount due, in the invoice's currency. Anything else books nothing, marks the attempt
    ``needs_review`` (no further charge is made) and returns ``review: <reason>``, with an
    audit row, for finance. Idempotent.
    """
    pi_id = str(intent.get("id") or "")
    attempt = (PaymentAttempt.objects.select_for_update().filter(stripe_payment_intent_id=pi_id)
               .first() if pi_id else None)
    if attempt is None:
        return _unknown_payment_intent(intent, pi_id=pi_id)
    invoice = (Invoice.objects.select_for_update().select_related("organization")
               .get(pk=attempt.invoice_id))
    status = intent.get("status")
    if status == "succeeded":
        return _payment_intent_succeeded(intent, attempt=attempt, invoice=invoice, now=now)
    if status in ("requires_payment_method", "canceled"):
        if attempt.status in (PaymentStatus.FAILED, PaymentStatus.NEEDS_REVIEW):
            return "no change"
        error = intent.get("last_payment_error") or {}
        attempt.status = PaymentStatus.FAILED
        attempt.failure_code = (error.get("code") or status)[:100]
        attempt.failure_message = (error.get("message") or "")[:500]
        attempt.updated_at = now
        attempt.save()
        if invoice.status == InvoiceStatus.OPEN:
            payment_failure_book(invoice, attempt, now=now)
        return "failed"
    return "no change"


def _customer_updated(customer: dict[str, Any], *, now: datetime) -> str:
    """A customer with a default payment method (a new card after a decline, or a first one):
    retry the org's open invoices now instead of at the next dunning date, as Stripe does
    (not those whose dunning finance paused: finance resumes or retries them)."""
    payment_method = (customer.get("invoice_settings") or {}).get("default_payment_method")
    if not payment_method:
        return "no change: no default payment method"
    customer_id = customer.get("id")
    account = (BillingAccount.objects.select_related("organization")
               .filter(stripe_customer_id=customer_id).first() if customer_id else None)
    if account is None:
        return "ignored: not one of our customers"
    # A card saved in the console made the open invoices due itself (invoicing.payment_methods);
    # retrying them again on its webhook would charge a declining card twice in a row.
    latest = audit_events(organization=account.organization,
                          action="billing.payment_method_replace",
                          target=account.organization.public_id).first()
    if latest is not None and (latest.after or {}).get("payment_method") == payment_method:
        return "no change: the console saved this card and charged the open invoices"
    ids = open_invoices_charge_now(organization_id=account.organization_id, now=now)
    return f"retrying {len(ids)} open invoice(s)"


def _setup_intent_succeeded(intent: dict[str, Any]) -> str:
    """A card set up for one of our customers: save it after commit, in case the console's
    form that does so never came back (``payment_methods.payment_method_save_reported``
    reads the SetupIntent back from Stripe; this payload is not believed)."""
    from billing_platform.invoicing.payment_methods import payment_method_save_enqueue

    customer_id, setup_intent_id = intent.get("customer"), str(intent.get("id") or "")
    account = (BillingAccount.objects.filter(stripe_customer_id=customer_id).first()
               if customer_id and setup_intent_id.startswith("seti_") else None)
    if account is None:
        return "ignored: not a card setup of one of our customers"
    organization_id = account.organization_id
    transaction.on_commit(lambda: payment_method_save_enqueue(organization_id, setup_intent_id))
    return f"saving the card of {setup_intent_id[:80]}"


def _text(value: Decimal, currency: str) -> str:
    return str(quantize_money(value, currency))


def _our_settled_charge(obj: dict[str, Any], *, what: str, target: str
                        ) -> tuple[PaymentAttempt, Invoice] | str:
    """Find (locked) the attempt and invoice a charge or dispute is about, or review it.

    As for payments, only a charge of ours is believed: found by the PaymentIntent id our
    attempt recorded, never by metadata; and only one that settled its invoice (an attempt
    that succeeded) moves money on it. Anything else is ``review: <reason>``, never applied.
    """
    pi_id = str(obj.get("payment_intent") or "")
    attempt = (PaymentAttempt.objects.select_for_update().filter(stripe_payment_intent_id=pi_id)
               .first() if pi_id else None)
    currency = str(obj.get("currency") or "").upper()
    details = {"object": target, "payment_intent": pi_id[:80],
               "amount": str(obj.get("amount"))[:40], "currency": currency[:8]}
    if attempt is None:
        return _review(organization_id=None, target=target,
                       reason=f"{what} of a charge this platform did not create",
                       details=details)
    invoice = (Invoice.objects.select_for_update().select_related("organization")
               .get(pk=attempt.invoice_id))
    problem = ""
    if attempt.status != PaymentStatus.SUCCEEDED:
        problem = f"{what} of a {attempt.status} payment (it settled nothing here)"
    elif currency != attempt.currency.upper():
        problem = f"{what} in {currency or 'no currency'}, the charge is in {attempt.currency}"
    if problem:
        return _review(organization_id=invoice.organization_id, target=invoice.public_id,
                       reason=f"invoice {invoice.number}: {problem}", details=details)
    return attempt, invoice


def _minor_amount(value: object, *, at_most: object) -> int | None:
    """Stripe's integer amount, if it is one within [0, at_most]."""
    if (not isinstance(value, int) or isinstance(value, bool) or value < 0
            or not isinstance(at_most, int) or value > at_most):
        return None
    return value


def _charge_refunded(charge: dict[str, Any], *, now: datetime) -> str:
    """Record what Stripe refunded of one of our charges on its attempt and invoice.

    ``amount_refunded`` is the charge's running total, so the newest figure wins and an older
    or replayed event (a lower or equal total) changes nothing. A paid invoice whose payments
    are refunded in full gets ``refunded_at``; its status stays ``paid`` (it was issued and
    paid; the refund is money sent back, as Stripe keeps its invoice ``paid``).
    """
    found = _our_settled_charge(charge, what="a refund", target=str(charge.get("id"))[:80])
    if isinstance(found, str):
        return found
    attempt, invoice = found
    refunded_minor = _minor_amount(charge.get("amount_refunded"),
                                   at_most=to_minor_units(attempt.amount, attempt.currency))
    if refunded_minor is None:
        claimed = _money_minor_text(charge.get("amount_refunded"), invoice.currency)
        return _review(organization_id=invoice.organization_id, target=invoice.public_id,
                       reason=f"invoice {invoice.number}: a refund of {claimed} on a charge "
                              f"of {attempt.amount} {attempt.currency}",
                       details={"payment_intent": attempt.stripe_payment_intent_id})
    refunded = from_minor_units(refunded_minor, attempt.currency)
    if refunded <= attempt.amount_refunded:
        return "no change"
    before = {"amount_refunded": _text(invoice.amount_refunded, invoice.currency)}
    attempt.amount_refunded, attempt.updated_at = refunded, now
    attempt.save(update_fields=["amount_refunded", "updated_at"])
    invoice.amount_refunded = quantize_money(
        PaymentAttempt.objects.filter(invoice_id=invoice.id)
        .aggregate(total=Sum("amount_refunded"))["total"], invoice.currency)
    in_full = (invoice.status == InvoiceStatus.PAID
               and invoice.amount_refunded >= invoice.amount_paid > 0)
    if in_full and invoice.refunded_at is None:
        invoice.refunded_at = now
    invoice.save(update_fields=["amount_refunded", "refunded_at"])
    audit_record(acting_user=None, organization=invoice.organization_id, action="invoice.refund",
                 target=invoice.public_id, before=before,
                 after={"amount_refunded": _text(invoice.amount_refunded, invoice.currency),
                        "currency": invoice.currency, "in_full": str(in_full).lower(),
                        "charge": str(charge.get("id"))[:80],
                        "payment_intent": attempt.stripe_payment_intent_id})
    return ("refunded in full" if in_full
            else f"refunded {_text(invoice.amount_refunded, invoice.currency)} in total")


DISPUTE_CLOSED = frozenset({"won", "lost", "warning_closed"})


def _dispute(obj: dict[str, Any], *, now: datetime) -> str:
    """Apply a dispute's news (opened, or closed won/lost) to its invoice, once.

    An open dispute counts in the invoice's ``amount_disputed``; once closed it leaves it, and
    a lost one is added to ``amount_charged_back`` (the loss finance sees). A closure whose
    opening never arrived opens and closes it at once; news of a dispute already closed, or
    opened twice, changes nothing.
    """
    dispute_id = str(obj.get("id") or "")[:100]
    found = _our_settled_charge(obj, what="a dispute", target=dispute_id[:80])
    if isinstance(found, str):
        return found
    attempt, invoice = found
    amount_minor = _minor_amount(obj.get("amount"),
                                 at_most=to_minor_units(attempt.amount, attempt.currency))
    if amount_minor is None or not dispute_id:
        return _review(organization_id=invoice.organization_id, target=invoice.public_id,
                       reason=f"invoice {invoice.number}: a dispute "
                              f"{dispute_id or 'without an id'} of "
                              f"{_money_minor_text(obj.get('amount'), invoice.currency)}",
                       details={"payment_intent": attempt.stripe_payment_intent_id})
    status = str(obj.get("status") or "")[:32]
    outcomes = []
    dispute = Dispute.objects.select_for_update().filter(stripe_id=dispute_id).first()
    if dispute is None:
        dispute = Dispute.objects.create(
            stripe_id=dispute_id, invoice=invoice, payment=attempt,
            amount=from_minor_units(amount_minor, attempt.currency), currency=attempt.currency,
            reason=str(obj.get("reason") or "")[:64], status=status, opened_at=now)
        invoice.amount_disputed += dispute.amount
        _dispute_audit(invoice, dispute, action="invoice.dispute_open")
        outcomes.append(f"disputed {_text(dispute.amount, dispute.currency)} {dispute.currency}")
    if status in DISPUTE_CLOSED and dispute.is_open:
        dispute.status, dispute.closed_at = status, now
        dispute.save(update_fields=["status", "closed_at"])
        invoice.amount_disputed -= dispute.amount
        lost = status == "lost"
        if lost:
            invoice.amount_charged_back += dispute.amount
        _dispute_audit(invoice, dispute,
                       action="invoice.dispute_lost" if lost else "invoice.dispute_won")
        outcomes.append(f"dispute {'lost' if lost else 'won'}")
    elif dispute.is_open and status != dispute.status:
        dispute.status = status
        dispute.save(update_fields=["status"])
    if not outcomes:
        return "no change"
    invoice.save(update_fields=["amount_disputed", "amount_charged_back"])
    return ", ".join(outcomes)


def _dispute_audit(invoice: Invoice, dispute: Dispute, *, action: str) -> None:
    audit_record(acting_user=None, organization=invoice.organization_id, action=action,
                 target=invoice.public_id,
                 after={"dispute": dispute.stripe_id,
                        "amount": _text(dispute.amount, invoice.currency),
                        "currency": dispute.currency, "reason": dispute.reason,
                        "status": dispute.status,
                        "amount_disputed": _text(invoice.amount_disputed, invoice.currency),
                        "amount_charged_back": _text(invoice.amount_charged_back,
                                                     invoice.currency)})


DISPUTE_EVENTS = frozenset({"charge.dispute.created", "charge.dispute.updated",
                            "charge.dispute.closed"})
PAYMENT_INTENT_EVENTS = frozenset({"payment_intent.succeeded", "payment_intent.payment_failed",
                                   "payment_intent.canceled"})


# Stripe's events are a few kB (lists inside them are truncated); a body past this is refused
# unread, before its signature is even computed.
STRIPE_WEBHOOK_MAX_BYTES = 1024 * 1024


class WebhookNotConfigured(DomainError):
    """The endpoint has no signing secret, so no delivery can be told from a forgery."""

    code = "webhook_not_configured"
    status = 503


class PayloadTooLarge(errors.PayloadTooLarge):
    """The platform's 413, under the code this endpoint has always answered with."""

    code = "payload_too_large"


def stripe_webhook_receive(*, payload: bytes, signature: str) -> StripeEvent:
    """Verify a webhook's signature, then store its raw body and apply it exactly once.

    Nothing the sender wrote is believed or stored before the signature verifies against
    ``STRIPE_WEBHOOK_SECRET``. With no secret set nothing is accepted
    (``WebhookNotConfigured``, naming the setting); a body over ``STRIPE_WEBHOOK_MAX_BYTES``
    is refused unread (``PayloadTooLarge``); a bad signature is recorded by its size only
    (``InvalidRequest``). A verified event that pays nothing it claims is ``needs_review``.
    """
    if not settings.STRIPE_WEBHOOK_SECRET.strip():
        raise WebhookNotConfigured(
            "Stripe webhooks are refused: STRIPE_WEBHOOK_SECRET is not set. Set it to this "
            "endpoint's signing secret (whsec_...) from Stripe's webhook settings.",
            param="STRIPE_WEBHOOK_SECRET")
    if len(payload) > STRIPE_WEBHOOK_MAX_BYTES:
        raise PayloadTooLarge(f"A Stripe webhook body is at most {STRIPE_WEBHOOK_MAX_BYTES} "
                              "bytes.", param="body")
    try:
        event = stripe_client.webhook_event(payload, signature)
    except (stripe.SignatureVerificationError, ValueError) as exc:
        StripeEvent.objects.create(payload="", payload_bytes=len(payload),
                                   signature=signature[:500],
                                   outcome=f"rejected: {type(exc).__name__}"[:300])
        raise InvalidRequest("Invalid Stripe signature.", param="Stripe-Signature") from exc
    body = event.to_dict()
    obj = (body.get("data") or {}).get("object") or {}
    now = timezone.now()
    with transaction.atomic():
        raw = StripeEvent(stripe_id=body.get("id") or None, type=str(body.get("type") or "")[:100],
                          payload=payload.decode("utf-8", errors="replace"),
                          payload_bytes=len(payload), signature=signature[:500], verified=True,
                          received_at=now)
        try:
            with transaction.atomic():  # waits for a concurrent delivery of the same event
                raw.save()
        except IntegrityError:
            raw.stripe_id = None
            raw.outcome, raw.processed_at = "duplicate: already processed", now
            raw.save()
            return raw
        if raw.stripe_id is None:
            raw.outcome = "ignored: no event id"
        elif raw.type in PAYMENT_INTENT_EVENTS:
            raw.outcome = _apply_payment_intent(obj, now=now)
        elif raw.type == "charge.refunded":
            raw.outcome = _charge_refunded(obj, now=now)
        elif raw.type in DISPUTE_EVENTS:
            raw.outcome = _dispute(obj, now=now)
        elif raw.type == "customer.updated":
            raw.outcome = _customer_updated(obj, now=now)
        elif raw.type == "setup_intent.succeeded":
            raw.outcome = _setup_intent_succeeded(obj)
        else:
            raw.outcome = "ignored: event type not handled"
        raw.outcome = raw.outcome[:300]
        raw.needs_review = raw.outcome.startswith("review:")
        raw.processed_at = now
        raw.save(update_fields=["outcome", "needs_review", "processed_at"])
    return raw


def payments_sync(*, older_than: timedelta = timedelta(minutes=30),
                  now: datetime | None = None) -> int:
    """Settle attempts still unsettled here; return how many invoices moved.

    Attempts whose answer never arrived (the worker died mid-call, retries ran out) are sent
    again with their key; attempts Stripe answered are read back from Stripe (a webhook lost).
    """
    now = now or timezone.now()
    moved: set[int] = set()
    for invoice_id in (PaymentAttempt.objects
                       .filter(invoice__status=InvoiceStatus.OPEN, status=PaymentStatus.PENDING,
                               stripe_payment_intent_id="", updated_at__lte=now - older_than)
                       .values_list("invoice_id", flat=True)):
        if invoice_charge(invoice_id=invoice_id, now=now) in ("succeeded", "failed"):
            moved.add(invoice_id)
    for attempt_id, invoice_id, pi_id in (
            PaymentAttempt.objects
            .filter(invoice__status=InvoiceStatus.OPEN,
                    status__in=[PaymentStatus.PENDING, PaymentStatus.SUCCEEDED],
                    updated_at__lte=now - older_than)
            .exclude(stripe_payment_intent_id="")
            .values_list("id", "invoice_id", "stripe_payment_intent_id")):
        intent = stripe_client.payment_intent_retrieve(pi_id).to_dict()
        with transaction.atomic():
            if _apply_payment_intent(intent, now=now) in ("paid", "failed"):
                moved.add(invoice_id)
        log.info("payment attempt %s synced from Stripe", attempt_id)
    return len(moved)
