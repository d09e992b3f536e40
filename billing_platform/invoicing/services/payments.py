"""Payments of invoices: charges, dunning, and payments recorded by hand.

The platform is the system of record. A charge creates one ``PaymentAttempt`` per try, keyed
``invoice:<id>:charge:<n>`` (the Stripe idempotency key), committed under the invoice's row
lock before Stripe is called (no lock is held across the call); a task that runs twice finds
the attempt and does not charge again, and an attempt whose answer was lost is sent again with
its key, so Stripe replays the first result. The invoice becomes ``paid`` when Stripe says so
(``webhooks``: a verified webhook, or ``payments_sync`` reading the PaymentIntent). A declined
charge starts dunning: retries after ``INVOICING_DUNNING_DAYS``, an email each time, then
``uncollectible`` and the organization suspended until it pays.

Every step that moves money writes its audit row in its own transaction: a new charge attempt
(``invoice.charge``), a payment (``invoice.pay``, ``invoice.mark_paid``) and the write-off at the
end of dunning (``invoice.mark_uncollectible``). The helpers that book an outcome on a locked
invoice (``invoice_settle``, ``payment_failure_book``) are shared with ``webhooks``, periods and
corrections of this package.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

import stripe
from django.conf import settings
from django.core.mail import send_mail
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from billing_platform.accounts.choices import OrgStatus
from billing_platform.accounts.models import Organization
from billing_platform.accounts.services import organization_update
from billing_platform.audit.services import audit_record
from billing_platform.errors import Conflict
from billing_platform.invoicing import stripe_client
from billing_platform.invoicing.choices import InvoiceStatus, PaymentStatus
from billing_platform.invoicing.models import BillingAccount, Invoice, PaymentAttempt
from billing_platform.invoicing.money import minor_units, quantize_money, to_minor_units

log = logging.getLogger(__name__)


def invoice_audit_state(invoice: Invoice) -> dict[str, str]:
    """Return the audited view of an invoice's payment state (money as decimal strings)."""
    def text(value: Decimal) -> str:
        return str(quantize_money(value, invoice.currency))

    return {"status": str(invoice.status), "amount_due": text(invoice.amount_due),
            "amount_paid": text(invoice.amount_paid), "currency": invoice.currency}


def organization_reactivate_if_settled(organization: Organization) -> None:
    """Lift a suspension for non-payment once the organization has no uncollectible invoice."""
    account = BillingAccount.objects.filter(organization=organization).first()
    if account is None or not account.suspended_for_nonpayment:
        return
    if Invoice.objects.filter(organization=organization,
                              status=InvoiceStatus.UNCOLLECTIBLE).exists():
        return
    account.suspended_for_nonpayment = False
    account.save(update_fields=["suspended_for_nonpayment"])
    if organization.status == OrgStatus.SUSPENDED:
        organization_update(organization=organization, status=OrgStatus.ACTIVE)


def invoice_charges_enqueue(invoice_ids: list[int]) -> None:
    """Enqueue a charge task for each invoice (call it on commit)."""
    from billing_platform.invoicing.tasks import invoice_charge_task  # tasks import services

    for invoice_id in invoice_ids:
        invoice_charge_task.delay(invoice_id)


def open_invoices_charge_now(*, organization_id: int, now: datetime) -> list[int]:
    """Make an organization's open invoices due for a charge now and enqueue each on commit
    (a new default payment method: a first card, or a new one after a decline); return their
    ids. Not those whose dunning finance paused (finance resumes or retries them), nor one
    already due. Call it inside the transaction that records why; the charges are
    ``invoice_charge``'s, one attempt and key each, never made here."""
    due = list(Invoice.objects.select_for_update()
               .filter(organization_id=organization_id, status=InvoiceStatus.OPEN,
                       amount_due__gt=0, dunning_paused_at__isnull=True)  # held by finance
               .filter(Q(next_payment_attempt_at__isnull=True)
                       | Q(next_payment_attempt_at__gt=now)))
    for invoice in due:
        invoice.next_payment_attempt_at = now
        invoice.save(update_fields=["next_payment_attempt_at"])
    ids = [i.id for i in due]
    transaction.on_commit(lambda: invoice_charges_enqueue(ids))
    return ids


def billing_account_ensure_customer(*, organization: Organization) -> BillingAccount:
    """Return the org's billing account with a Stripe customer, creating it exactly once."""
    BillingAccount.objects.bulk_create([BillingAccount(organization=organization)],
                                       ignore_conflicts=True)
    with transaction.atomic():
        account = BillingAccount.objects.select_for_update().get(organization=organization)
        if not account.stripe_customer_id:
            account.stripe_customer_id = stripe_client.customer_create(
                email=organization.billing_email, name=organization.name,
                org_public_id=organization.public_id)
            account.save(update_fields=["stripe_customer_id"])
    return account


def _notify(invoice: Invoice, subject: str, body: str) -> None:
    email = invoice.organization.billing_email
    transaction.on_commit(lambda: send_mail(subject=subject, message=body, from_email=None,
                                            recipient_list=[email]))


def _money_text(invoice: Invoice, value: Decimal) -> str:
    return f"{value:.{minor_units(invoice.currency)}f} {invoice.currency}"


def payment_failure_book(invoice: Invoice, attempt: PaymentAttempt, *, now: datetime) -> None:
    """Book one failed attempt (invoice locked): schedule a retry, or give up and suspend.

    Giving up writes the invoice off (``uncollectible``): an audit row by the system, whose
    dunning rule decided it.
    """
    schedule = settings.INVOICING_DUNNING_DAYS
    invoice.payment_failures += 1
    amount = _money_text(invoice, invoice.amount_due)
    if invoice.payment_failures <= len(schedule):
        invoice.next_payment_attempt_at = now + timedelta(
            days=schedule[invoice.payment_failures - 1])
        invoice.save(update_fields=["payment_failures", "next_payment_attempt_at"])
        _notify(invoice, f"Payment failed for invoice {invoice.number}",
                f"We could not charge {amount} for invoice {invoice.number} "
                f"({attempt.failure_message or attempt.failure_code}). We will try again on "
                f"{invoice.next_payment_attempt_at:%Y-%m-%d}. Please check your payment method.")
        return
    before = invoice_audit_state(invoice)
    invoice.status = InvoiceStatus.UNCOLLECTIBLE
    invoice.marked_uncollectible_at = now
    invoice.next_payment_attempt_at = None
    invoice.save(update_fields=["payment_failures", "status", "marked_uncollectible_at",
                                "next_payment_attempt_at"])
    audit_record(acting_user=None, organization=invoice.organization_id,
                 action="invoice.mark_uncollectible", target=invoice.public_id, before=before,
                 after={**invoice_audit_state(invoice),
                        "payment_failures": str(invoice.payment_failures)})
    organization = invoice.organization
    BillingAccount.objects.filter(organization=organization).update(
        suspended_for_nonpayment=True)
    if organization.status == OrgStatus.ACTIVE:
        organization_update(organization=organization, status=OrgStatus.SUSPENDED)
    _notify(invoice, f"Service suspended: invoice {invoice.number} is unpaid",
            f"After {invoice.payment_failures} failed attempts invoice {invoice.number} "
            f"({amount}) is marked uncollectible and API access is suspended until it is paid.")


def invoice_settle(invoice: Invoice, *, amount: Decimal, now: datetime, acting_user: Any,
                   action: str, details: dict[str, str]) -> bool:
    """Mark a (locked) invoice paid and audit it; return whether it changed."""
    if invoice.status not in (InvoiceStatus.OPEN, InvoiceStatus.UNCOLLECTIBLE):
        return False
    before = invoice_audit_state(invoice)
    invoice.status = InvoiceStatus.PAID
    invoice.amount_paid = amount
    invoice.paid_at = now
    invoice.next_payment_attempt_at = None
    invoice.save(update_fields=["status", "amount_paid", "paid_at", "next_payment_attempt_at"])
    audit_record(acting_user=acting_user, organization=invoice.organization_id, action=action,
                 target=invoice.public_id, before=before,
                 after={**invoice_audit_state(invoice), **details})
    organization_reactivate_if_settled(invoice.organization)
    return True


def invoice_charge(*, invoice_id: int, now: datetime | None = None,
                   acting_user: Any = None) -> str:
    """Charge an open invoice's amount due once; return what happened.

    Outcomes: ``not_due`` (paid, void, nothing due, or a retry not due yet),
    ``no_payment_method`` (left open for manual payment), ``in_progress`` (an attempt is
    pending or succeeded already: never a second charge), ``pending``, ``succeeded``,
    ``failed``. Stripe network errors propagate (the task retries with backoff and the same
    idempotency key).

    Two short transactions around the Stripe call, never a row lock held across it: the
    attempt (with its idempotency key) is committed first, then sent, then its answer
    recorded. An attempt committed but never answered here (a network error, a worker killed
    mid-call) is sent again with the same key on the next run, and Stripe replays its first
    answer instead of charging again. A new attempt is audited (``invoice.charge``) by
    ``acting_user``, None for the system (the charge task, dunning, ``payments_sync``).
    """
    now = now or timezone.now()
    invoice = Invoice.objects.select_related("organization").get(pk=invoice_id)
    if invoice.status != InvoiceStatus.OPEN or invoice.amount_due <= 0:
        return "not_due"
    account = billing_account_ensure_customer(organization=invoice.organization)
    payment_method = stripe_client.default_payment_method(account.stripe_customer_id)
    if not payment_method:
        return "no_payment_method"
    attempt = _charge_attempt_begin(invoice_id=invoice_id, now=now, acting_user=acting_user)
    if isinstance(attempt, str):
        return attempt
    return _charge_attempt_send(attempt, customer_id=account.stripe_customer_id,
                                payment_method=payment_method, now=now)


@transaction.atomic
def _charge_attempt_begin(*, invoice_id: int, now: datetime, acting_user: Any = None
                          ) -> PaymentAttempt | str:
    """Commit the attempt to send (a new one, audited, or one sent before whose answer was
    lost: the same charge, sent again with its key)."""
    invoice = Invoice.objects.select_for_update().get(pk=invoice_id)
    if invoice.status != InvoiceStatus.OPEN:
        return "not_due"
    last = invoice.payments.order_by("-number").first()
    if last is not None and last.status == PaymentStatus.PENDING and \
            not last.stripe_payment_intent_id:
        return last  # sent, answer never recorded: send again with the same key
    if last is not None and last.status != PaymentStatus.FAILED:
        return "in_progress"
    if last is not None and (invoice.next_payment_attempt_at is None
                             or invoice.next_payment_attempt_at > now):
        return "not_due"
    number = last.number + 1 if last else 1
    attempt = PaymentAttempt.objects.create(
        invoice=invoice, number=number, idempotency_key=f"invoice:{invoice.id}:charge:{number}",
        amount=invoice.amount_due, currency=invoice.currency, created_at=now, updated_at=now)
    audit_record(acting_user=acting_user, organization=invoice.organization_id,
                 action="invoice.charge", target=invoice.public_id,
                 after={"attempt": attempt.idempotency_key,
                        "amount": str(quantize_money(attempt.amount, attempt.currency)),
                        "currency": attempt.currency})
    return attempt


def _charge_attempt_send(attempt: PaymentAttempt, *, customer_id: str, payment_method: str,
                         now: datetime) -> str:
    """Send one attempt to Stripe (no lock held), then record its answer."""
    invoice = attempt.invoice
    try:
        intent = stripe_client.payment_intent_create(
            amount=to_minor_units(attempt.amount, attempt.currency), currency=attempt.currency,
            customer_id=customer_id, payment_method=payment_method,
            idempotency_key=attempt.idempotency_key,
            metadata={"invoice_id": str(invoice.id), "invoice": invoice.number or "",
                      "attempt": str(attempt.number)})
    except stripe.CardError as exc:
        error = exc.error
        with transaction.atomic():
            # attempt, then invoice: the order webhooks lock them in
            attempt = PaymentAttempt.objects.select_for_update().get(pk=attempt.pk)
            invoice = (Invoice.objects.select_for_update().select_related("organization")
                       .get(pk=invoice.pk))
            if attempt.status != PaymentStatus.PENDING:
                return str(attempt.status)  # a webhook recorded it meanwhile
            attempt.status = PaymentStatus.FAILED
            attempt.failure_code = (getattr(error, "code", None) or "card_declined")[:100]
            attempt.failure_message = (getattr(error, "message", None) or str(exc))[:500]
            charge = getattr(error, "payment_intent", None)
            if charge is not None:
                attempt.stripe_payment_intent_id = charge.get("id", "")
            attempt.updated_at = now
            attempt.save()
            if invoice.status == InvoiceStatus.OPEN:
                invoice.next_payment_attempt_at = None
                payment_failure_book(invoice, attempt, now=now)
        return "failed"
    with transaction.atomic():
        attempt = PaymentAttempt.objects.select_for_update().get(pk=attempt.pk)
        attempt.stripe_payment_intent_id = intent.id
        if attempt.status == PaymentStatus.PENDING and intent.status == "succeeded":
            attempt.status = PaymentStatus.SUCCEEDED
        attempt.updated_at = now
        attempt.save(update_fields=["stripe_payment_intent_id", "status", "updated_at"])
    return str(attempt.status)


def invoices_dunning_run(*, now: datetime | None = None) -> list[int]:
    """Return the open invoices whose retry is due (the task enqueues a charge for each).

    Invoices whose dunning finance paused are skipped until resumed (``dunning``).
    """
    now = now or timezone.now()
    return list(Invoice.objects.filter(status=InvoiceStatus.OPEN,
                                       next_payment_attempt_at__lte=now,
                                       dunning_paused_at__isnull=True)
                .order_by("next_payment_attempt_at").values_list("id", flat=True))


@transaction.atomic
def invoice_mark_paid(*, invoice: Invoice, amount: Decimal | None = None,
                      reference: str = "", reason: str = "", now: datetime | None = None,
                      acting_user: Any) -> Invoice:
    """Record a payment made outside Stripe (bank transfer) for an open/uncollectible invoice.

    ``reference`` (the transfer's reference) is kept on the invoice and, with ``reason``, in
    the audit row.
    """
    invoice = Invoice.objects.select_for_update().select_related("organization").get(
        pk=invoice.pk)
    details = {"method": "out_of_band", "reference": reference[:200], "reason": reason[:500]}
    if not invoice_settle(invoice, amount=invoice.amount_due if amount is None else amount,
                          now=now or timezone.now(), acting_user=acting_user,
                          action="invoice.mark_paid", details=details):
        raise Conflict(f"A {invoice.status} invoice cannot be paid.", param="status")
    if reference:
        invoice.payment_reference = reference[:200]
        invoice.save(update_fields=["payment_reference"])
    return invoice
