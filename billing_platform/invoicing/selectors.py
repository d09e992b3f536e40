"""Reads of invoicing: an organization's invoices, one invoice with its lines, CSV rows."""

from __future__ import annotations

from collections.abc import Iterator

from django.db.models import QuerySet

from billing_platform.accounts.models import Organization
from billing_platform.invoicing.builder import DraftInvoice
from billing_platform.invoicing.models import Invoice

CSV_HEADER = ("invoice", "position", "kind", "description", "model", "region", "service_tier",
              "capacity_source", "token_class", "quantity", "unit", "unit_price",
              "amount_precise", "amount", "currency")


def invoices_of(*, organization: Organization) -> QuerySet[Invoice]:
    """Return an organization's finalized invoices and credit notes, newest first."""
    return (Invoice.objects.filter(organization=organization).exclude(status="draft")
            .order_by("-period_start", "-id"))


def invoice_get(*, organization: Organization, public_id: str) -> Invoice | None:
    """Return one finalized invoice of the organization with its lines.

    None when it is not theirs or still a draft: a stored draft (a correction being prepared,
    a credit note being issued) is not a document yet, and its numbers may still change. The
    current period's draft is shown through ``upcoming_invoice`` instead.
    """
    return (invoices_of(organization=organization).filter(public_id=public_id)
            .prefetch_related("lines").first())


def invoice_csv_rows(invoice: Invoice | DraftInvoice) -> Iterator[tuple]:
    """Yield the CSV header and one row per line; the amounts sum to the invoice total."""
    yield CSV_HEADER
    number = getattr(invoice, "number", None) or "upcoming"
    lines = invoice.lines.all() if isinstance(invoice, Invoice) else invoice.lines
    for pos, ln in enumerate(lines, start=1):
        yield (number, getattr(ln, "position", pos), ln.kind, ln.description, ln.model,
               ln.region, ln.service_tier, ln.capacity_source, ln.token_class, ln.quantity,
               ln.unit,
               "" if ln.unit_price is None else ln.unit_price, ln.amount_precise, ln.amount,
               invoice.currency)
