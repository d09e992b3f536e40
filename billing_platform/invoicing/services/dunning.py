"""What finance does to an unpaid invoice's collection: hold and resume dunning, retry the
charge now, write it off.

Each is one transaction under the invoice's row lock with its audit row by ``acting_user`` and
the ``reason`` given (``invoice.dunning_pause``, ``invoice.dunning_resume``,
``invoice.retry_charge``, ``invoice.write_off``); a refusal (``Conflict``) writes nothing. A
held invoice keeps its schedule but the dunning run skips it (``invoices_dunning_run``), so no
retry and no reminder goes out; resumed, a retry whose time passed meanwhile runs at the next
dunning run. Retrying now makes the next attempt due at once and enqueues the charge after
commit: the charge itself (``invoice_charge``, its own attempt and key) never runs inside this
transaction. A write-off marks the invoice ``uncollectible`` as dunning's last step does, but
records that finance decided it (``written_off_at``) and leaves the organization's access as
it is: a write-off is a decision about the books, not about the customer's service.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db import transaction
from django.utils import timezone

from billing_platform.audit.services import audit_record
from billing_platform.errors import Conflict
from billing_platform.invoicing import stripe_client
from billing_platform.invoicing.choices import InvoiceKind, InvoiceStatus, PaymentStatus
from billing_platform.invoicing.models import Invoice
from billing_platform.invoicing.services.payments import (
    billing_account_ensure_customer,
    invoice_audit_state,
    invoice_charges_enqueue,
)


def _locked(invoice: Invoice, *statuses: str) -> Invoice:
    locked = Invoice.objects.select_for_update().select_related("organization").get(
        pk=invoice.pk)
    if locked.kind != InvoiceKind.INVOICE or locked.status not in statuses:
        raise Conflict(f"Invoice {locked.number} is {locked.status}; this applies to "
                       f"{' or '.join(statuses)} invoices.", param="status")
    return locked


def _state(invoice: Invoice) -> dict[str, str]:
    def at(value: datetime | None) -> str:
        return value.isoformat() if value else ""

    return {**invoice_audit_state(invoice), "dunning_paused_at": at(invoice.dunning_paused_at),
            "next_payment_attempt_at": at(invoice.next_payment_attempt_at),
            "written_off_at": at(invoice.written_off_at)}


def _audit(invoice: Invoice, action: str, before: dict[str, str], *, reason: str,
           acting_user: Any, **details: str) -> None:
    audit_record(acting_user=acting_user, organization=invoice.organization_id, action=action,
                 target=invoice.public_id, before=before,
                 after={**_state(invoice), "reason": reason[:500], **details})


@transaction.atomic
def invoice_dunning_pause(*, invoice: Invoice, reason: str, acting_user: Any,
                          now: datetime | None = None) -> Invoice:
    """Hold dunning of an open invoice: no automatic retry or reminder until resumed."""
    invoice = _locked(invoice, InvoiceStatus.OPEN)
    if invoice.dunning_paused_at is not None:
        raise Conflict(f"Dunning of invoice {invoice.number} is already paused.",
                       param="dunning")
    before = _state(invoice)
    invoice.dunning_paused_at = now or timezone.now()
    invoice.save(update_fields=["dunning_paused_at"])
    _audit(invoice, "invoice.dunning_pause", before, reason=reason, acting_user=acting_user)
    return invoice


@transaction.atomic
def invoice_dunning_resume(*, invoice: Invoice, reason: str, acting_user: Any) -> Invoice:
    """Resume dunning of a held invoice on its schedule."""
    invoice = _locked(invoice, InvoiceStatus.OPEN)
    if invoice.dunning_paused_at is None:
        raise Conflict(f"Dunning of invoice {invoice.number} is not paused.", param="dunning")
    before = _state(invoice)
    invoice.dunning_paused_at = None
    invoice.save(update_fields=["dunning_paused_at"])
    _audit(invoice, "invoice.dunning_resume", before, reason=reason, acting_user=acting_user)
    return invoice


def invoice_charge_retry(*, invoice: Invoice, reason: str, acting_user: Any,
                         now: datetime | None = None) -> Invoice:
    """Charge an open invoice now (after commit), ahead of its dunning schedule.

    Refused when nothing is due, a charge is already in flight, or the customer has no
    payment method on file (Stripe is asked before the invoice is locked).
    """
    now = now or timezone.now()
    account = billing_account_ensure_customer(organization=invoice.organization)
    if not stripe_client.default_payment_method(account.stripe_customer_id):
        raise Conflict(f"{invoice.organization.name} has no payment method on file; the "
                       "customer must add one, or record a payment made another way.",
                       param="payment_method")
    with transaction.atomic():
        invoice = _locked(invoice, InvoiceStatus.OPEN)
        if invoice.amount_due <= 0:
            raise Conflict(f"Invoice {invoice.number} has nothing due.", param="amount_due")
        last = invoice.payments.order_by("-number").first()
        if last is not None and last.status != PaymentStatus.FAILED:
            raise Conflict(f"Invoice {invoice.number} has a {last.status} charge; it is not "
                           "charged again.", param="invoice")
        before = _state(invoice)
        invoice.next_payment_attempt_at = now
        invoice.save(update_fields=["next_payment_attempt_at"])
        _audit(invoice, "invoice.retry_charge", before, reason=reason, acting_user=acting_user,
               attempt=str(last.number + 1 if last else 1))
        invoice_id = invoice.id
        transaction.on_commit(lambda: invoice_charges_enqueue([invoice_id]))
    return invoice


@transaction.atomic
def invoice_write_off(*, invoice: Invoice, reason: str, acting_user: Any,
                      now: datetime | None = None) -> Invoice:
    """Write an unpaid invoice off as uncollectible (finance's decision; dunning stops)."""
    invoice = _locked(invoice, InvoiceStatus.OPEN, InvoiceStatus.UNCOLLECTIBLE)
    if invoice.written_off_at is not None:
        raise Conflict(f"Invoice {invoice.number} is already written off.", param="status")
    before = _state(invoice)
    now = now or timezone.now()
    invoice.status = InvoiceStatus.UNCOLLECTIBLE
    invoice.marked_uncollectible_at = invoice.marked_uncollectible_at or now
    invoice.written_off_at = now
    invoice.next_payment_attempt_at = None
    invoice.save(update_fields=["status", "marked_uncollectible_at", "written_off_at",
                                "next_payment_attempt_at"])
    _audit(invoice, "invoice.write_off", before, reason=reason, acting_user=acting_user)
    return invoice
