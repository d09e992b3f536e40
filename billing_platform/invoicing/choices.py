"""Enumerations of the invoicing app."""

from django.db import models


class InvoiceKind(models.TextChoices):
    INVOICE = "invoice", "Invoice"
    CREDIT_NOTE = "credit_note", "Credit note"


class InvoiceStatus(models.TextChoices):
    DRAFT = "draft", "Draft"
    OPEN = "open", "Open"
    PAID = "paid", "Paid"
    VOID = "void", "Void"
    UNCOLLECTIBLE = "uncollectible", "Uncollectible"


class LineKind(models.TextChoices):
    USAGE = "usage", "Usage"
    LATE_USAGE = "late_usage", "Late usage"
    PLAN_FEE = "plan_fee", "Plan fee"
    RESERVATION_FEE = "reservation_fee", "Reservation fee"
    CREDIT_PACK = "credit_pack", "Credit pack"
    TAX = "tax", "Tax"
    CREDIT = "credit", "Credit applied"
    ADJUSTMENT = "adjustment", "Adjustment"
    ONE_OFF = "one_off", "One-off item"


class CreditOutcome(models.TextChoices):
    """What a credit note did with its amount (as Stripe's pre- and post-payment notes)."""

    AMOUNT_DUE = "amount_due", "Reduced the amount due"  # an unpaid invoice
    REFUND = "refund", "Refunded through Stripe"  # a paid invoice, finance's choice
    CREDIT_BALANCE = "credit_balance", "Credit balance"  # a paid invoice, finance's choice


class RefundStatus(models.TextChoices):
    PENDING = "pending", "Pending"  # committed; sent to Stripe after commit (task)
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"  # Stripe refused it: left for finance


class PaymentStatus(models.TextChoices):
    PENDING = "pending", "Pending"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"
    # Stripe reports money that does not settle the invoice as charged (a different amount or
    # currency): nothing is booked and no further charge is made until finance decides.
    NEEDS_REVIEW = "needs_review", "Needs review"


# Lines that are charges (the subtotal tax is computed on).
CHARGE_KINDS = frozenset({LineKind.USAGE, LineKind.LATE_USAGE, LineKind.PLAN_FEE,
                          LineKind.RESERVATION_FEE, LineKind.CREDIT_PACK, LineKind.ADJUSTMENT,
                          LineKind.ONE_OFF})
