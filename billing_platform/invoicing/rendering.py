"""HTML, PDF and CSV of an invoice (or of the upcoming draft), from one template.

The PDF is the HTML rendered by xhtml2pdf (pure Python, no browser), so the two can never
show different numbers.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from django.template.loader import render_to_string

from billing_platform.accounts.models import Organization
from billing_platform.csv_export import csv_writer
from billing_platform.invoicing.builder import DraftInvoice, DraftLine
from billing_platform.invoicing.choices import InvoiceKind
from billing_platform.invoicing.models import Invoice, InvoiceLine
from billing_platform.invoicing.money import minor_units
from billing_platform.invoicing.selectors import invoice_csv_rows

TEMPLATE = "invoicing/invoice.html"


@dataclass
class InvoiceDocument:
    """What the template shows: the same fields for a stored invoice and a draft."""

    title: str
    number: str
    status: str
    org_name: str
    billing_email: str
    currency: str
    period_start: datetime
    period_end: datetime
    finalized_at: datetime | None
    due_at: datetime | None
    lines: list[dict[str, Any]]
    subtotal: str
    tax: str
    credits_applied: str
    total: str
    amount_due: str


def _fmt(value: Decimal, places: int) -> str:
    return f"{value:,.{places}f}"


def document_of(invoice: Invoice | DraftInvoice, organization: Organization) -> InvoiceDocument:
    """Return the template's view of an invoice or of the upcoming draft."""
    currency = invoice.currency
    places = minor_units(currency)
    lines: list[InvoiceLine | DraftLine]
    if isinstance(invoice, Invoice):
        lines = list(invoice.lines.all())
        title = "Credit note" if invoice.kind == InvoiceKind.CREDIT_NOTE else "Invoice"
        number, status = invoice.number or "", invoice.status
        period_start, period_end = invoice.period_start, invoice.period_end
        finalized_at, due_at = invoice.finalized_at, invoice.due_at
        amount_due = invoice.amount_due
    else:
        lines = list(invoice.lines)
        title, number, status = "Upcoming invoice", "(draft)", "draft"
        period_start, period_end = invoice.target.period_start, invoice.target.period_end
        finalized_at = due_at = None
        amount_due = invoice.total
    rows = [{
        "description": ln.description, "unit": ln.unit, "details": ln.details or {},
        "quantity_text": f"{ln.quantity.normalize():,f}" if ln.quantity else "",
        "unit_price_text": "" if ln.unit_price is None else f"{ln.unit_price.normalize():f}",
        "amount_text": _fmt(ln.amount, places),
    } for ln in lines]
    total = invoice.total
    return InvoiceDocument(
        title=title, number=number, status=status,
        org_name=organization.name, billing_email=organization.billing_email,
        currency=currency,
        period_start=period_start, period_end=period_end, finalized_at=finalized_at,
        due_at=due_at, lines=rows,
        subtotal=_fmt(invoice.subtotal, places), tax=_fmt(invoice.tax, places),
        credits_applied=_fmt(invoice.credits_applied, places), total=_fmt(total, places),
        amount_due=_fmt(amount_due, places),
    )


def invoice_html(invoice: Invoice | DraftInvoice, organization: Organization, *,
                 csp_nonce: str = "") -> str:
    """Return the invoice as an HTML page (its inline style carries ``csp_nonce`` when served)."""
    return render_to_string(TEMPLATE, {"doc": document_of(invoice, organization),
                                       "csp_nonce": csp_nonce})


def invoice_pdf(invoice: Invoice | DraftInvoice, organization: Organization) -> bytes:
    """Return the invoice as a PDF rendered from the same HTML."""
    from xhtml2pdf import pisa

    out = io.BytesIO()
    result = pisa.CreatePDF(invoice_html(invoice, organization), dest=out, encoding="utf-8")
    if result.err:
        raise RuntimeError(f"PDF rendering failed with {result.err} error(s)")
    return out.getvalue()


def invoice_csv(invoice: Invoice | DraftInvoice) -> str:
    """Return the invoice's lines as CSV (header first; no cell a spreadsheet runs)."""
    buf = io.StringIO()
    writer = csv_writer(buf)
    writer.writerows(invoice_csv_rows(invoice))
    return buf.getvalue()
