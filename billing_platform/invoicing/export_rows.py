"""Reads of invoicing for the warehouse export (``billing_platform.finance.exports``): the
invoices and invoice lines of one UTC day as plain rows, in a fixed column order, each column
with the type a warehouse loads it as.

Which rows a day holds:

- invoices (and credit notes) *touched* that day: finalized, paid, voided, marked
  uncollectible, written off or refunded within it, each as it stands when read (its
  current status and bookkeeping).
  A warehouse upserts them by ``public_id``; a later day's file carries the newer state of an
  invoice that was, say, finalized one day and paid the next.
- the lines of the invoices *finalized* that day. A finalized invoice's lines never change
  (database triggers, see ``invoicing.models``), so each line is exported exactly once.

Drafts are never exported: they are not documents yet. Rows come in id order (lines by
invoice and position), so the same data always gives the same file.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime

from django.db.models import Q

from billing_platform.invoicing.choices import InvoiceStatus
from billing_platform.invoicing.models import Invoice, InvoiceLine

# (column, warehouse type): the order of the columns in the file
INVOICE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("public_id", "string"), ("number", "string"), ("kind", "string"),
    ("status", "string"), ("organization", "string"), ("currency", "string"),
    ("period_start", "timestamp"), ("period_end", "timestamp"), ("tax_rate", "decimal(7,4)"),
    ("subtotal", "decimal(24,4)"), ("tax", "decimal(24,4)"),
    ("credits_applied", "decimal(24,4)"), ("total", "decimal(24,4)"),
    ("amount_due", "decimal(24,4)"), ("amount_paid", "decimal(24,4)"),
    ("corrects", "string"), ("finalized_at", "timestamp"), ("due_at", "timestamp"),
    ("paid_at", "timestamp"), ("voided_at", "timestamp"),
    ("marked_uncollectible_at", "timestamp"), ("payment_failures", "integer"),
    ("credit_outcome", "string"), ("payment_reference", "string"),
    ("amount_refunded", "decimal(24,4)"), ("refunded_at", "timestamp"),
    ("amount_disputed", "decimal(24,4)"), ("amount_charged_back", "decimal(24,4)"),
    ("dunning_paused_at", "timestamp"), ("written_off_at", "timestamp"),
)
_INVOICE_FIELDS = (
    "public_id", "number", "kind", "status", "organization__public_id", "currency",
    "period_start", "period_end", "tax_rate", "subtotal", "tax", "credits_applied", "total",
    "amount_due", "amount_paid", "corrects__public_id", "finalized_at", "due_at", "paid_at",
    "voided_at", "marked_uncollectible_at", "payment_failures", "credit_outcome",
    "payment_reference", "amount_refunded", "refunded_at", "amount_disputed",
    "amount_charged_back", "dunning_paused_at", "written_off_at",
)

LINE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("invoice", "string"), ("invoice_number", "string"), ("position", "integer"),
    ("kind", "string"), ("description", "string"), ("model", "string"), ("region", "string"),
    ("service_tier", "string"), ("capacity_source", "string"), ("token_class", "string"),
    ("source_period_start", "timestamp"), ("source_period_end", "timestamp"),
    ("quantity", "decimal(30,6)"), ("unit", "string"), ("unit_price", "decimal(30,10)"),
    ("amount_precise", "decimal(30,10)"), ("amount", "decimal(24,4)"), ("currency", "string"),
    ("details", "json"),
)
_LINE_FIELDS = (
    "invoice__public_id", "invoice__number", "position", "kind", "description", "model",
    "region", "service_tier", "capacity_source", "token_class", "source_period_start",
    "source_period_end", "quantity", "unit", "unit_price", "amount_precise", "amount",
    "invoice__currency", "details",
)

# the instants that put an invoice in a day's file
TOUCHED_AT = ("finalized_at", "paid_at", "voided_at", "marked_uncollectible_at",
              "written_off_at", "refunded_at")
CHUNK = 2000  # rows fetched per round trip (a server-side cursor)


def _within(field: str, start: datetime, end: datetime) -> Q:
    return Q(**{f"{field}__gte": start, f"{field}__lt": end})


def invoice_rows_touched(*, start: datetime, end: datetime) -> Iterator[tuple[object, ...]]:
    """Yield, in id order, every non-draft invoice finalized, paid, voided, marked
    uncollectible, written off or refunded in [start, end), one tuple per
    ``INVOICE_COLUMNS``."""
    touched = Q()
    for field in TOUCHED_AT:
        touched |= _within(field, start, end)
    rows = (Invoice.objects.exclude(status=InvoiceStatus.DRAFT).filter(touched)
            .order_by("id").values_list(*_INVOICE_FIELDS))
    yield from rows.iterator(chunk_size=CHUNK)


def invoice_line_rows_finalized(*, start: datetime, end: datetime
                                ) -> Iterator[tuple[object, ...]]:
    """Yield the lines of every invoice finalized in [start, end), by invoice id and position,
    one tuple per ``LINE_COLUMNS``."""
    rows = (InvoiceLine.objects.exclude(invoice__status=InvoiceStatus.DRAFT)
            .filter(_within("invoice__finalized_at", start, end))
            .order_by("invoice_id", "position").values_list(*_LINE_FIELDS))
    yield from rows.iterator(chunk_size=CHUNK)
