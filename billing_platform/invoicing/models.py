"""Invoices, their lines, what each invoice billed, payments and Stripe's webhook events.

Money: ``amount_precise`` keeps the exact sum (10 places, as usage events do); ``amount`` is
that rounded once to the currency's minor unit (``money.quantize_money``). An invoice's
``total`` is the sum of its lines' ``amount`` (tax and credits are lines too), and
``amount_due`` is what is left to pay.

A finalized invoice never changes: database triggers (migrations 0002, 0005) refuse any change
to a line of a non-draft invoice and to the money, period and number of a non-draft invoice;
only its status and payment bookkeeping move, and its ``amount_due`` may only fall (a credit
note on an unpaid invoice reduces what is owed, as Stripe's pre-payment credit notes do).
Corrections are credit notes (``kind=credit_note``) or a void.

``PendingInvoiceItem`` is a one-off charge (an onboarding fee) that finance adds to an
organization's next invoice; period close bills it once and records which invoice did.
``Refund`` is money sent back through Stripe for a credit note on a paid invoice. What Stripe
reports after payment is kept on the invoice: ``amount_refunded`` (every refund of its charges,
however made, from ``charge.refunded``), ``amount_disputed`` (open ``Dispute``s) and
``amount_charged_back`` (disputes lost).

``BilledUsage`` records, per invoice, the exact usage sums it billed for each source period and
dimension. Late events are whatever the rollups hold for a closed period beyond what was
billed for it; the next invoice bills the difference as "late usage from <period>".

``BilledRevenue`` is billed revenue summed across organizations (finance's revenue report),
written by a database trigger in the transaction that finalizes or voids.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from django.db import models
from django.db.models import Q
from django.utils import timezone

from billing_platform.accounts.models import Organization, public_id
from billing_platform.invoicing.choices import (
    CreditOutcome,
    InvoiceKind,
    InvoiceStatus,
    LineKind,
    PaymentStatus,
    RefundStatus,
)
from billing_platform.model_fields import decimal_field_maker
from plans.choices import TokenClass

ZERO = Decimal("0")


_precise = decimal_field_maker(max_digits=30, decimal_places=10)
# 4 places hold every ISO minor unit (0, 2 or 3); values are always quantize_money'd.
_money = decimal_field_maker(max_digits=24, decimal_places=4)


class InvoiceSequence(models.Model):
    """The next number of a gapless series (taken under a row lock in the finalizing txn)."""

    series = models.CharField(max_length=32, primary_key=True)
    next_number = models.PositiveBigIntegerField(default=1)

    def __str__(self) -> str:
        return f"{self.series} next {self.next_number}"


class BillingAccount(models.Model):
    """An organization's payment side: its Stripe customer and whether dunning suspended it."""

    organization = models.OneToOneField(Organization, on_delete=models.CASCADE,
                                        related_name="billing_account")
    stripe_customer_id = models.CharField(max_length=100, blank=True, default="")
    suspended_for_nonpayment = models.BooleanField(default=False)
    created_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"{self.organization} ({self.stripe_customer_id or 'no customer'})"


class Invoice(models.Model):
    """An invoice (or credit note) of one organization for [period_start, period_end)."""

    public_id = models.CharField(max_length=40, unique=True, editable=False)
    organization = models.ForeignKey(Organization, on_delete=models.PROTECT,
                                     related_name="invoices")
    kind = models.CharField(max_length=16, choices=InvoiceKind.choices,
                            default=InvoiceKind.INVOICE)
    number = models.CharField(max_length=40, null=True, blank=True, unique=True)
    status = models.CharField(max_length=16, choices=InvoiceStatus.choices,
                              default=InvoiceStatus.DRAFT)
    currency = models.CharField(max_length=3)
    period_start = models.DateTimeField()
    period_end = models.DateTimeField()
    tax_rate = models.DecimalField(max_digits=7, decimal_places=4, default=ZERO)
    subtotal = _money(default=ZERO)
    tax = _money(default=ZERO)
    credits_applied = _money(default=ZERO)
    total = _money(default=ZERO)
    amount_due = _money(default=ZERO)
    amount_paid = _money(default=ZERO)
    corrects = models.ForeignKey("self", null=True, blank=True, on_delete=models.PROTECT,
                                 related_name="credit_notes",
                                 help_text="For a credit note: the invoice it corrects.")
    memo = models.CharField(max_length=500, blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)
    finalized_at = models.DateTimeField(null=True, blank=True)
    due_at = models.DateTimeField(null=True, blank=True)
    paid_at = models.DateTimeField(null=True, blank=True)
    voided_at = models.DateTimeField(null=True, blank=True)
    marked_uncollectible_at = models.DateTimeField(null=True, blank=True)
    payment_failures = models.PositiveIntegerField(default=0)
    next_payment_attempt_at = models.DateTimeField(null=True, blank=True)
    # What Stripe reported after payment (webhooks): money sent back, disputed, charged back.
    amount_refunded = _money(default=ZERO, help_text="Refunded through Stripe, in total.")
    refunded_at = models.DateTimeField(
        null=True, blank=True, help_text="When a paid invoice's payment was refunded in full.")
    amount_disputed = _money(
        default=ZERO, help_text="Under open disputes (chargebacks the bank has not decided).")
    amount_charged_back = _money(
        default=ZERO, help_text="Lost to disputes: taken back by the cardholder's bank.")
    dunning_paused_at = models.DateTimeField(
        null=True, blank=True, help_text="Set while finance holds dunning: no automatic retry.")
    written_off_at = models.DateTimeField(
        null=True, blank=True, help_text="When finance wrote it off as uncollectible.")
    payment_reference = models.CharField(
        max_length=200, blank=True, default="",
        help_text="A payment made outside Stripe: the bank transfer's reference.")
    credit_outcome = models.CharField(
        max_length=16, blank=True, default="", choices=CreditOutcome.choices,
        help_text="For a credit note: what its amount did.")

    class Meta:
        ordering = ["-period_start", "-id"]
        indexes = [
            models.Index(fields=["organization", "period_start"]),
            models.Index(fields=["status", "next_payment_attempt_at"]),
            # finance's reports across organizations (invoicing.reports): unpaid invoices by
            # due date (receivables), billed documents by finalization (DSO) and by period
            # (revenue of a range), each org's newest finalized invoice (accrued late usage)
            models.Index(fields=["due_at"], name="invoice_unpaid_due",
                         condition=Q(status__in=["open", "uncollectible"])),
            models.Index(fields=["finalized_at"], name="invoice_billed_finalized",
                         condition=Q(status__in=["open", "paid", "uncollectible"])),
            models.Index(fields=["period_start"], name="invoice_billed_period",
                         condition=Q(status__in=["open", "paid", "uncollectible"])),
            models.Index(fields=["organization", "-period_end"], name="invoice_org_last_final",
                         condition=Q(kind="invoice") & ~Q(status="draft")),
        ]
        constraints = [
            models.UniqueConstraint(fields=["organization", "period_start"],
                                    condition=Q(kind=InvoiceKind.INVOICE),
                                    name="one_invoice_per_org_period"),
            models.CheckConstraint(condition=Q(period_end__gt=models.F("period_start")),
                                   name="invoice_period_ordered"),
            models.CheckConstraint(condition=Q(status=InvoiceStatus.DRAFT)
                                   | Q(number__isnull=False),
                                   name="finalized_invoice_has_number"),
        ]

    def __str__(self) -> str:
        return self.number or f"draft {self.public_id}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self.public_id:
            self.public_id = public_id("in" if self.kind == InvoiceKind.INVOICE else "cn")
        super().save(*args, **kwargs)

    @property
    def is_final(self) -> bool:
        return self.status != InvoiceStatus.DRAFT


class InvoiceLine(models.Model):
    """One line: quantity x unit price (informative), exact amount, amount rounded once.

    Usage lines are per model x region x service tier x capacity source x token class
    (uncached input, cached input, output): ``quantity`` tokens at ``unit_price`` per 1M
    tokens; ``details`` holds the request count.
    """

    invoice = models.ForeignKey(Invoice, on_delete=models.CASCADE, related_name="lines")
    position = models.PositiveIntegerField()
    kind = models.CharField(max_length=20, choices=LineKind.choices)
    description = models.CharField(max_length=300)
    model = models.CharField(max_length=200, blank=True, default="")
    region = models.CharField(max_length=64, blank=True, default="")
    service_tier = models.CharField(max_length=16, blank=True, default="")
    capacity_source = models.CharField(max_length=16, blank=True, default="")
    token_class = models.CharField(max_length=16, blank=True, default="",
                                   choices=TokenClass.choices)
    source_period_start = models.DateTimeField(null=True, blank=True)
    source_period_end = models.DateTimeField(null=True, blank=True)
    corrects_line = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.PROTECT, related_name="credits",
        help_text="On a credit note: the invoice line this line credits.")
    quantity = models.DecimalField(max_digits=30, decimal_places=6, default=ZERO)
    unit = models.CharField(max_length=32, blank=True, default="")
    unit_price = _precise(null=True, blank=True)
    amount_precise = _precise()
    amount = _money()
    details = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["invoice", "position"]
        constraints = [
            models.UniqueConstraint(fields=["invoice", "position"], name="one_line_per_position"),
        ]

    def __str__(self) -> str:
        return f"{self.description}: {self.amount}"


class BilledUsage(models.Model):
    """What one invoice billed of one source period's usage, per dimension (exact sums)."""

    invoice = models.ForeignKey(Invoice, on_delete=models.CASCADE, related_name="billed_usage")
    organization_id = models.BigIntegerField()
    source_period_start = models.DateTimeField()
    model = models.CharField(max_length=200)
    region = models.CharField(max_length=64)
    service_tier = models.CharField(max_length=16)
    capacity_source = models.CharField(max_length=16)
    amount = _precise()
    requests = models.BigIntegerField(default=0)
    prompt_tokens = models.BigIntegerField(default=0)
    cached_tokens = models.BigIntegerField(default=0)
    completion_tokens = models.BigIntegerField(default=0)
    input_amount = _precise(default=ZERO)
    cached_input_amount = _precise(default=ZERO)
    output_amount = _precise(default=ZERO)

    class Meta:
        indexes = [models.Index(fields=["organization_id", "source_period_start"])]

    def __str__(self) -> str:
        return f"{self.model} {self.source_period_start:%Y-%m}: {self.amount}"


class BilledRevenue(models.Model):
    """Billed revenue summed across organizations, per billing period start x currency x line
    kind x dimensions: what finance's revenue report reads instead of every invoice line.

    Written only by the database (migration 0008's trigger), in the statement that moves
    invoices in or out of the billed statuses (``open``, ``paid``, ``uncollectible``): their
    lines summed, positive when they become billed (finalize, a credit note issued), negative
    when they stop being billed (a void). A finalized invoice's lines, period, currency and
    kind never change (0002, 0005), so the summary is append-only and cannot drift; its sums
    per key are what ``invoicing.reports.billed_lines`` reads off the lines (``lines`` counts
    them, so a key only voided invoices had is no row). ``kind`` is ``credit_note`` for every
    line of a credit note; ``plan_code`` the plan a plan-fee line charges.
    """

    period_start = models.DateTimeField()
    currency = models.CharField(max_length=3)
    kind = models.CharField(max_length=20)
    capacity_source = models.CharField(max_length=16)
    plan_code = models.TextField()
    model = models.CharField(max_length=200)
    region = models.CharField(max_length=64)
    service_tier = models.CharField(max_length=16)
    token_class = models.CharField(max_length=16)
    lines = models.BigIntegerField()
    amount = _money()
    tokens = models.DecimalField(max_digits=30, decimal_places=6)

    class Meta:
        indexes = [models.Index(fields=["period_start"], name="billed_revenue_period")]

    def __str__(self) -> str:
        return f"{self.period_start:%Y-%m} {self.kind} {self.model}: {self.amount}"


class PaymentAttempt(models.Model):
    """One charge of an invoice through Stripe; its idempotency key is built from our ids."""

    invoice = models.ForeignKey(Invoice, on_delete=models.PROTECT, related_name="payments")
    number = models.PositiveIntegerField()
    idempotency_key = models.CharField(max_length=100, unique=True)
    amount = _money()
    currency = models.CharField(max_length=3)
    status = models.CharField(max_length=16, choices=PaymentStatus.choices,
                              default=PaymentStatus.PENDING)
    stripe_payment_intent_id = models.CharField(max_length=100, blank=True, default="",
                                                db_index=True)
    amount_refunded = _money(default=ZERO,
                             help_text="Of this charge, refunded (Stripe's amount_refunded).")
    failure_code = models.CharField(max_length=100, blank=True, default="")
    failure_message = models.CharField(max_length=500, blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["invoice", "number"]
        constraints = [
            models.UniqueConstraint(fields=["invoice", "number"], name="one_attempt_number"),
        ]

    def __str__(self) -> str:
        return f"{self.idempotency_key} {self.status}"


class PendingInvoiceItem(models.Model):
    """A one-off charge (an onboarding fee) for an organization's next invoice.

    ``amount`` is in the currency's minor unit, before tax (the invoice taxes it with its other
    charges). Pending while ``invoice`` is null; the period close that creates the next
    invoice bills it as a line and sets ``invoice`` in the same transaction, so it is billed
    exactly once. A void of that invoice does not release it (see ``services.items``).
    """

    public_id = models.CharField(max_length=40, unique=True, editable=False)
    organization = models.ForeignKey(Organization, on_delete=models.PROTECT,
                                     related_name="pending_invoice_items")
    description = models.CharField(max_length=300)
    amount = _money()
    currency = models.CharField(max_length=3)
    created_at = models.DateTimeField(default=timezone.now)
    invoice = models.ForeignKey(Invoice, null=True, blank=True, on_delete=models.PROTECT,
                                related_name="one_off_items")

    class Meta:
        ordering = ["created_at", "id"]
        indexes = [models.Index(fields=["organization"], condition=Q(invoice__isnull=True),
                                name="pending_item_by_org")]
        constraints = [models.CheckConstraint(condition=Q(amount__gt=0),
                                              name="pending_item_positive")]

    def __str__(self) -> str:
        return f"{self.description}: {self.amount} {self.currency}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self.public_id:
            self.public_id = public_id("ii")
        super().save(*args, **kwargs)


class Refund(models.Model):
    """Money sent back through Stripe for a credit note on a paid invoice.

    Committed (``pending``) with the credit note, then sent after commit by a task with the
    idempotency key ``credit_note:<id>:refund``, built from our row, so a task that runs twice
    refunds once.
    """

    credit_note = models.OneToOneField(Invoice, on_delete=models.PROTECT, related_name="refund")
    invoice = models.ForeignKey(Invoice, on_delete=models.PROTECT, related_name="refunds")
    payment = models.ForeignKey(PaymentAttempt, on_delete=models.PROTECT,
                                related_name="refunds")
    amount = _money()
    currency = models.CharField(max_length=3)
    idempotency_key = models.CharField(max_length=100, unique=True)
    status = models.CharField(max_length=16, choices=RefundStatus.choices,
                              default=RefundStatus.PENDING)
    stripe_refund_id = models.CharField(max_length=100, blank=True, default="", db_index=True)
    failure_message = models.CharField(max_length=500, blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.CheckConstraint(condition=Q(amount__gt=0),
                                              name="refund_positive")]

    def __str__(self) -> str:
        return f"{self.idempotency_key} {self.status}"


class Dispute(models.Model):
    """A dispute (chargeback) of one of our charges, as Stripe's webhooks report it.

    ``amount`` (the disputed amount, in the currency's unit) counts in its invoice's
    ``amount_disputed`` while the dispute is open; once closed it leaves it, and a lost one
    counts in ``amount_charged_back``. ``status`` is Stripe's (``needs_response``,
    ``under_review``, ``won``, ``lost``, and the ``warning_*`` of inquiries).
    """

    stripe_id = models.CharField(max_length=100, unique=True)
    invoice = models.ForeignKey(Invoice, on_delete=models.PROTECT, related_name="disputes")
    payment = models.ForeignKey(PaymentAttempt, on_delete=models.PROTECT,
                                related_name="disputes")
    amount = _money()
    currency = models.CharField(max_length=3)
    reason = models.CharField(max_length=64, blank=True, default="")
    status = models.CharField(max_length=32)
    opened_at = models.DateTimeField(default=timezone.now)
    closed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-opened_at", "-id"]

    def __str__(self) -> str:
        return f"{self.stripe_id} {self.status}"

    @property
    def is_open(self) -> bool:
        return self.closed_at is None


class StripeEvent(models.Model):
    """A webhook delivery: verified first, then stored with its raw body and processed once.

    A delivery whose signature does not verify is recorded without its body (``payload`` empty,
    ``payload_bytes`` its size): nothing an unauthenticated sender writes is kept. An event
    that verified but does not settle what it claims (a PaymentIntent this platform did not
    create for the invoice, an amount that is not the amount due) is ``needs_review``: left for
    finance, with the reason in ``outcome``.
    """

    stripe_id = models.CharField(max_length=100, null=True, blank=True, unique=True)
    type = models.CharField(max_length=100, blank=True, default="")
    payload = models.TextField(blank=True, default="")
    payload_bytes = models.PositiveIntegerField(default=0)
    signature = models.CharField(max_length=500, blank=True, default="")
    verified = models.BooleanField(default=False)
    received_at = models.DateTimeField(default=timezone.now)
    processed_at = models.DateTimeField(null=True, blank=True)
    outcome = models.CharField(max_length=300, blank=True, default="")
    needs_review = models.BooleanField(default=False, db_index=True)

    def __str__(self) -> str:
        return f"{self.stripe_id or 'unverified'} {self.type}"
