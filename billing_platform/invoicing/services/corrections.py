"""Credit notes: correct a finalized invoice by an amount or by its lines.

What the note's amount does depends on the invoice, as Stripe's credit notes do:

- unpaid (``open``, ``uncollectible``): it reduces the invoice's ``amount_due`` (a pre-payment
  note); brought to zero, the invoice is settled (``paid``, with nothing received). Refused
  while a charge of the invoice is in flight, since Stripe would collect the old amount;
- ``paid``: finance chooses. ``refund`` sends the money back through Stripe to the card that
  paid (a ``Refund`` committed with the note, sent after commit by a task with the key
  ``credit_note:<id>:refund``: see ``services.refunds``); ``credit_balance`` grants it as credit
  that later invoices use (a ``credit_note`` credit grant).

A note never exceeds what remains creditable: the invoice's total less every earlier note; by
lines, no line more than what is left of it (its amount less earlier notes' credits of it),
and the tax on the credited lines at the invoice's rate, rounded once. A refund never exceeds
what Stripe collected less earlier refunds. Everything (the note, its lines, the invoice's new
amount due, the grant or the refund row, the audit row ``credit_note.create`` by
``acting_user`` with the corrected invoice's state before and after) commits or rolls back
together, under the invoice's row lock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from django.db import transaction
from django.db.models import Sum
from django.utils import timezone

from billing_platform.audit.services import audit_record
from billing_platform.errors import Conflict, InvalidRequest
from billing_platform.invoicing.choices import (
    CHARGE_KINDS,
    CreditOutcome,
    InvoiceKind,
    InvoiceStatus,
    LineKind,
    PaymentStatus,
    RefundStatus,
)
from billing_platform.invoicing.models import Invoice, InvoiceLine, PaymentAttempt, Refund
from billing_platform.invoicing.money import EXACT, ZERO, quantize_money
from billing_platform.invoicing.services.invoices import invoice_numbers_reserve, invoice_series
from billing_platform.invoicing.services.payments import (
    invoice_audit_state,
    organization_reactivate_if_settled,
)
from plans.choices import CreditGrantKind
from plans.services import credit_grant_create

UNPAID = (InvoiceStatus.OPEN, InvoiceStatus.UNCOLLECTIBLE)


@dataclass(frozen=True, slots=True)
class LineCredit:
    """Credit ``amount`` of the invoice's line at ``position`` (None: all that is left of it)."""

    position: int
    amount: Decimal | None = None


def _money(value: Any, currency: str, param: str) -> Decimal:
    if not isinstance(value, Decimal) or not value.is_finite() or value <= 0 or quantize_money(
            value, currency) != value:
        raise InvalidRequest(f"{param} must be a positive amount in {currency}'s minor unit.",
                             param=param)
    return value


def _text(value: Decimal, currency: str) -> str:
    return f"{quantize_money(value, currency)} {currency}"


def _line_credits(invoice: Invoice, lines: Sequence[LineCredit]) -> list[InvoiceLine]:
    """Return the note's lines (unsaved, negative) crediting the invoice's lines, tax last."""
    if not lines:
        raise InvalidRequest("lines must name at least one line.", param="lines")
    positions = [c.position for c in lines]
    if len(set(positions)) != len(positions):
        raise InvalidRequest("Each line may be credited once per credit note.", param="lines")
    found = {ln.position: ln for ln in invoice.lines.filter(position__in=positions)}
    credited = dict(InvoiceLine.objects.filter(corrects_line__in=list(found.values()))
                    .values("corrects_line").annotate(total=Sum("amount"))
                    .values_list("corrects_line", "total"))
    out: list[InvoiceLine] = []
    for credit in lines:
        line = found.get(credit.position)
        if line is None or line.kind not in CHARGE_KINDS or line.amount <= 0:
            raise InvalidRequest(f"Invoice {invoice.number} has no creditable line "
                                 f"{credit.position}.", param="lines")
        left = line.amount + credited.get(line.id, ZERO)  # earlier credits are negative
        amount = left if credit.amount is None else quantize_money(
            _money(credit.amount, invoice.currency, "lines"), invoice.currency)
        if amount <= 0 or amount > left:
            raise InvalidRequest(f"Line {line.position} has {_text(left, invoice.currency)} "
                                 "left to credit.", param="lines")
        out.append(InvoiceLine(
            kind=line.kind, description=f"Credit: {line.description}"[:300], model=line.model,
            region=line.region, service_tier=line.service_tier,
            capacity_source=line.capacity_source, token_class=line.token_class,
            corrects_line=line, quantity=Decimal(1), amount_precise=-amount, amount=-amount))
    subtotal = sum((ln.amount for ln in out), ZERO)
    if invoice.tax_rate:
        tax = EXACT.multiply(subtotal, invoice.tax_rate)
        out.append(InvoiceLine(kind=LineKind.TAX,
                               description=f"Tax ({invoice.tax_rate * 100:.2f} %)",
                               quantity=Decimal(1), unit_price=invoice.tax_rate,
                               amount_precise=tax, amount=quantize_money(tax, invoice.currency)))
    return out


def _refunded_payment(invoice: Invoice, amount: Decimal) -> PaymentAttempt:
    """Return the Stripe payment a refund of ``amount`` goes back to, or refuse."""
    payment = (invoice.payments.filter(status=PaymentStatus.SUCCEEDED)
               .exclude(stripe_payment_intent_id="").order_by("-number").first())
    if payment is None:
        raise Conflict(f"Invoice {invoice.number} was not paid through Stripe, so nothing can "
                       "be refunded there; issue the credit as a credit balance instead.",
                       param="outcome")
    ours = (Refund.objects.filter(payment=payment).exclude(status=RefundStatus.FAILED)
            .aggregate(total=Sum("amount"))["total"]) or ZERO
    # what Stripe reported refunded (webhooks) includes ours once sent, and any made in its
    # dashboard; the larger of the two is the least that is gone
    refunded = max(ours, payment.amount_refunded)
    if amount > payment.amount - refunded:
        raise InvalidRequest(f"Only {_text(payment.amount - refunded, invoice.currency)} of "
                             "the payment is left to refund.", param="amount")
    return payment


def _outcome(invoice: Invoice, outcome: str | None) -> str:
    if invoice.status in UNPAID:
        if outcome not in (None, CreditOutcome.AMOUNT_DUE):
            raise InvalidRequest(f"A credit note on a {invoice.status} invoice reduces its "
                                 "amount due; refund or credit balance is for paid invoices.",
                                 param="outcome")
        if invoice.payments.exclude(status=PaymentStatus.FAILED).exists():
            raise Conflict(f"A charge of invoice {invoice.number} is in progress or awaiting "
                           "Stripe's confirmation; credit it once the charge has settled.",
                           param="invoice")
        return CreditOutcome.AMOUNT_DUE
    if outcome is None:  # what a note on a paid invoice always did here: a credit balance
        return CreditOutcome.CREDIT_BALANCE
    if outcome not in (CreditOutcome.REFUND, CreditOutcome.CREDIT_BALANCE):
        raise InvalidRequest("A credit note on a paid invoice is a refund or a credit "
                             "balance.", param="outcome")
    return outcome


@transaction.atomic
def credit_note_create(*, invoice: Invoice, amount: Decimal | None = None,
                       lines: Sequence[LineCredit] | None = None, outcome: str | None = None,
                       reason: str, acting_user: Any) -> Invoice:
    """Issue a credit note against a finalized invoice, by ``amount`` or by ``lines``.

    ``outcome`` (``choices.CreditOutcome``) applies to a paid invoice: ``refund`` or
    ``credit_balance`` (the default); an unpaid invoice's note always reduces its amount due.
    """
    invoice = Invoice.objects.select_for_update().select_related("organization").get(
        pk=invoice.pk)
    if invoice.kind != InvoiceKind.INVOICE or invoice.status not in (*UNPAID,
                                                                     InvoiceStatus.PAID):
        raise Conflict("Credit notes correct finalized, non-void invoices.", param="invoice")
    if (amount is None) == (lines is None):
        raise InvalidRequest("Give either an amount or lines to credit.", param="amount")
    currency = invoice.currency
    if lines is not None:
        note_lines = _line_credits(invoice, lines)
        total = -sum((ln.amount for ln in note_lines), ZERO)
        param = "lines"
    else:
        total, param = quantize_money(_money(amount, currency, "amount"), currency), "amount"
        note_lines = []
    credited = sum((cn.total for cn in invoice.credit_notes.all()), ZERO)  # negative
    if total > invoice.total + credited:
        raise InvalidRequest(f"A credit note cannot exceed what remains creditable on invoice "
                             f"{invoice.number} ({_text(invoice.total + credited, currency)}).",
                             param=param)
    outcome = _outcome(invoice, outcome)
    payment = _refunded_payment(invoice, total) if outcome == CreditOutcome.REFUND else None
    before = invoice_audit_state(invoice)
    reason = reason[:500]
    now = timezone.now()
    series = invoice_series(kind=InvoiceKind.CREDIT_NOTE, at=now)
    tax = sum((ln.amount for ln in note_lines if ln.kind == LineKind.TAX), ZERO)  # negative
    note = Invoice.objects.create(
        organization=invoice.organization, kind=InvoiceKind.CREDIT_NOTE,
        number=f"{series}-{invoice_numbers_reserve(series=series, count=1):06d}",
        status=InvoiceStatus.DRAFT, currency=currency, period_start=invoice.period_start,
        period_end=invoice.period_end, tax_rate=invoice.tax_rate if tax else ZERO,
        subtotal=-total - tax, tax=tax, total=-total, amount_due=ZERO, corrects=invoice,
        memo=reason, credit_outcome=outcome)
    if not note_lines:
        note_lines = [InvoiceLine(kind=LineKind.ADJUSTMENT, quantity=Decimal(1),
                                  description=f"Credit for {invoice.number}: {reason}"[:300],
                                  amount_precise=-total, amount=-total)]
    for position, line in enumerate(note_lines, start=1):
        line.invoice, line.position = note, position
    InvoiceLine.objects.bulk_create(note_lines)
    note.status, note.finalized_at, note.paid_at = InvoiceStatus.PAID, now, now
    note.save(update_fields=["status", "finalized_at", "paid_at"])
    _apply(invoice, note, outcome=outcome, payment=payment, now=now, acting_user=acting_user)
    audit_record(acting_user=acting_user, organization=invoice.organization_id,
                 action="credit_note.create", target=note.public_id, before=before,
                 after={**invoice_audit_state(invoice), "number": note.number or "",
                        "corrects": invoice.public_id, "amount": str(total),
                        "outcome": outcome, "reason": note.memo,
                        "lines": [str(ln.corrects_line.position) for ln in note_lines
                                  if ln.corrects_line is not None]})
    return note


def _apply(invoice: Invoice, note: Invoice, *, outcome: str, payment: PaymentAttempt | None,
           now: Any, acting_user: Any) -> None:
    """Do what the note's outcome says with its amount (inside the note's transaction)."""
    amount = -note.total
    if outcome == CreditOutcome.AMOUNT_DUE:
        invoice.amount_due -= amount
        fields = ["amount_due"]
        if invoice.amount_due == 0:  # nothing left to pay: settled, as Stripe does
            invoice.status, invoice.paid_at, invoice.next_payment_attempt_at = (
                InvoiceStatus.PAID, now, None)
            fields += ["status", "paid_at", "next_payment_attempt_at"]
        invoice.save(update_fields=fields)
        organization_reactivate_if_settled(invoice.organization)
    elif outcome == CreditOutcome.CREDIT_BALANCE:
        credit_grant_create(organization=invoice.organization, kind=CreditGrantKind.CREDIT_NOTE,
                            amount=amount, currency=invoice.currency,
                            note=f"Credit note {note.number} for {invoice.number}",
                            acting_user=acting_user)
    else:
        if payment is None:  # _refunded_payment found it, or refused the note
            raise RuntimeError("a refund needs the payment it goes back to")
        refund = Refund.objects.create(
            credit_note=note, invoice=invoice, payment=payment, amount=amount,
            currency=invoice.currency, idempotency_key=f"credit_note:{note.id}:refund",
            created_at=now, updated_at=now)
        refund_id = refund.id
        transaction.on_commit(lambda: _refund_enqueue(refund_id))


def _refund_enqueue(refund_id: int) -> None:
    from billing_platform.invoicing.tasks import refund_send_task  # tasks import services

    refund_send_task.delay(refund_id)
