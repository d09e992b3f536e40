"""One invoice at a time: finalize a draft made by hand, void.

A finalized invoice never changes; a correction is a void (credits it used granted back) or a
credit note (``corrections``). Each runs in one transaction under the invoice's row lock and
writes its audit row in it (``invoice.finalize``, ``invoice.void``), by ``acting_user``: the
action and its row commit or roll back together. A void does not give back the one-off items
the invoice billed (``items``). Numbers come from a gapless sequence per series and year
(``invoice_numbers_reserve``, which period close uses for its bulk numbering too).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from billing_platform.accounts.models import Organization
from billing_platform.audit.services import audit_record
from billing_platform.errors import Conflict
from billing_platform.invoicing.builder import (
    CREDITS_AFTER_TAX,
    CREDITS_BEFORE_TAX,
    DraftInvoice,
    Target,
)
from billing_platform.invoicing.choices import InvoiceKind, InvoiceStatus, LineKind
from billing_platform.invoicing.models import Invoice, InvoiceLine
from billing_platform.invoicing.money import ZERO, quantize_money
from billing_platform.invoicing.services.payments import (
    invoice_audit_state,
    invoice_charges_enqueue,
    organization_reactivate_if_settled,
)
from plans.choices import CreditGrantKind
from plans.services import credit_grant_create, credit_grants_apply


def invoice_numbers_reserve(*, series: str, count: int) -> int:
    """Reserve ``count`` consecutive numbers of ``series``; return the first (gapless: the row
    stays locked until the caller's transaction ends, and a rollback returns them)."""
    with connection.cursor() as cur:
        cur.execute("INSERT INTO invoicing_invoicesequence (series, next_number) VALUES (%s, 1) "
                    "ON CONFLICT (series) DO NOTHING", [series])
        cur.execute("UPDATE invoicing_invoicesequence SET next_number = next_number + %s "
                    "WHERE series = %s RETURNING next_number", [count, series])
        next_number: int = cur.fetchone()[0]
        return next_number - count


def draft_credits_apply(draft: DraftInvoice, *, organization: Organization, reference: str,
                        now: datetime) -> None:
    """Take the organization's credit for a draft: its discount credit before tax, then its
    credit balance after it (``DraftInvoice.add_credits``); once per ``reference``."""
    def take(kinds: frozenset[str], ref: str) -> Callable[[Decimal], Decimal]:
        def apply(amount: Decimal) -> Decimal:
            applied = credit_grants_apply(organization=organization, currency=draft.currency,
                                          amount=amount, reference=ref, at=now, kinds=kinds)
            return sum((a.amount for a in applied), ZERO)
        return apply

    draft.add_credits(before_tax=take(CREDITS_BEFORE_TAX, reference),
                      after_tax=take(CREDITS_AFTER_TAX, f"{reference}:balance"))


def invoice_series(*, kind: str, at: datetime) -> str:
    """Return the numbering series of ``kind`` for the year of ``at`` (``INV-2026``)."""
    return f"{'INV' if kind == InvoiceKind.INVOICE else 'CN'}-{at:%Y}"


def invoice_finalized_state(invoice: Invoice) -> dict[str, str]:
    """Return the audited view of a finalized invoice: its number, totals and payment state."""
    def text(value: Decimal) -> str:
        return str(quantize_money(value, invoice.currency))

    return {**invoice_audit_state(invoice), "number": invoice.number or "",
            "total": text(invoice.total), "credits_applied": text(invoice.credits_applied)}


@transaction.atomic
def invoice_finalize(*, invoice: Invoice, now: datetime | None = None,
                     enqueue_payment: bool = True, acting_user: Any = None) -> Invoice:
    """Finalize a draft made by hand (its charge lines already added): tax, credits, number.

    Period close finalizes its own invoices in bulk; this is the same rule for one draft.
    From here on the invoice never changes. Audited (``invoice.finalize``) by ``acting_user``,
    None for the system.
    """
    now = now or timezone.now()
    invoice = Invoice.objects.select_for_update().select_related("organization").get(
        pk=invoice.pk)
    if invoice.status != InvoiceStatus.DRAFT:
        raise Conflict(f"Invoice {invoice.number} is already finalized.", param="status")
    before = invoice_audit_state(invoice)
    org = invoice.organization
    target = Target(org.id, invoice.currency, org.tax_rate, invoice.period_start,
                    invoice.period_end)
    draft = DraftInvoice(target)
    lines = list(invoice.lines.exclude(kind__in=[LineKind.TAX, LineKind.CREDIT]))
    for ln in lines:
        draft.add(ln.kind, ln.description, ln.amount_precise)
    draft.add_tax()
    draft_credits_apply(draft, organization=org, reference=f"invoice:{invoice.id}", now=now)
    invoice.lines.filter(kind__in=[LineKind.TAX, LineKind.CREDIT]).delete()
    position = max((ln.position for ln in lines), default=0)
    for new in draft.lines[len(lines):]:
        position += 1
        InvoiceLine.objects.create(
            invoice=invoice, position=position, kind=new.kind, description=new.description,
            quantity=new.quantity, unit_price=new.unit_price, amount_precise=new.amount_precise,
            amount=new.amount, details=new.details)
    series = invoice_series(kind=InvoiceKind.INVOICE, at=now)
    invoice.number = f"{series}-{invoice_numbers_reserve(series=series, count=1):06d}"
    invoice.tax_rate = org.tax_rate
    invoice.subtotal, invoice.tax = draft.subtotal, draft.tax
    invoice.credits_applied, invoice.total = draft.credits_applied, draft.total
    invoice.amount_due = draft.total
    invoice.finalized_at = now
    if draft.total > 0:
        invoice.status = InvoiceStatus.OPEN
        invoice.due_at = now + timedelta(days=settings.INVOICING_NET_DAYS)
        if enqueue_payment:
            invoice_id = invoice.id
            transaction.on_commit(lambda: invoice_charges_enqueue([invoice_id]))
    else:
        invoice.status, invoice.due_at, invoice.paid_at = InvoiceStatus.PAID, now, now
    invoice.save()
    audit_record(acting_user=acting_user, organization=invoice.organization_id,
                 action="invoice.finalize", target=invoice.public_id, before=before,
                 after=invoice_finalized_state(invoice))
    return invoice


@transaction.atomic
def invoice_void(*, invoice: Invoice, reason: str = "", acting_user: Any) -> Invoice:
    """Void an unpaid finalized invoice; credits it used are granted back as a credit note."""
    invoice = Invoice.objects.select_for_update().get(pk=invoice.pk)
    if invoice.status not in (InvoiceStatus.OPEN, InvoiceStatus.UNCOLLECTIBLE):
        raise Conflict(f"A {invoice.status} invoice cannot be voided.", param="status")
    before = invoice_audit_state(invoice)
    invoice.status = InvoiceStatus.VOID
    invoice.voided_at = timezone.now()
    invoice.next_payment_attempt_at = None
    invoice.memo = reason[:500]
    invoice.save(update_fields=["status", "voided_at", "next_payment_attempt_at", "memo"])
    if invoice.credits_applied > 0:
        credit_grant_create(organization=invoice.organization, kind=CreditGrantKind.CREDIT_NOTE,
                            amount=invoice.credits_applied, currency=invoice.currency,
                            note=f"Credits returned from void invoice {invoice.number}",
                            acting_user=acting_user)
    audit_record(acting_user=acting_user, organization=invoice.organization_id,
                 action="invoice.void", target=invoice.public_id, before=before,
                 after={**invoice_audit_state(invoice), "reason": invoice.memo,
                        "credits_returned": str(quantize_money(invoice.credits_applied,
                                                               invoice.currency))})
    organization_reactivate_if_settled(invoice.organization)
    return invoice
