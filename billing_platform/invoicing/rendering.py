"""HTML, PDF and CSV of an invoice (or of the upcoming draft), from one template.

The PDF is the HTML rendered by xhtml2pdf (pure Python, no browser), so the two can never
show different numbers. ``document_of`` turns an invoice into what the template shows, laid
out as a real invoice: the seller (settings ``SELLER_*``, from ``TOLLGATE_SELLER_*``) and the
buyer (the organization's billing profile), number and dates, then the lines. Usage lines are
grouped by model, then by tier, region and capacity source (named once, with the request
count), one row per token class, its unit price per 1M tokens; other lines (plan fees,
reserved units, credit packs, one-off items) follow as they are. Tax and credit lines are not
rows but the totals: subtotal, credits applied before tax, the tax line with its rate, credits
applied after tax, total, what credit notes took off it, what is paid, and what is left
due. Every figure is the stored line's or the
invoice's; nothing is recomputed here but the sums of the credit lines on each side of tax.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from datetime import datetime, time, timedelta
from decimal import ROUND_HALF_UP, Decimal

from django.conf import settings
from django.template.loader import render_to_string

from billing_platform.accounts.models import Organization
from billing_platform.csv_export import csv_writer
from billing_platform.invoicing.builder import (
    CLASS_LABELS,
    SOURCE_LABELS,
    TIER_LABELS,
    DraftInvoice,
    DraftLine,
)
from billing_platform.invoicing.choices import InvoiceKind, LineKind
from billing_platform.invoicing.models import Invoice, InvoiceLine
from billing_platform.invoicing.money import ZERO, minor_units
from billing_platform.invoicing.selectors import invoice_csv_rows

TEMPLATE = "invoicing/invoice.html"
USAGE_KINDS = frozenset({LineKind.USAGE, LineKind.LATE_USAGE})
UNIT_PRICE_PLACES = 6  # shown; the stored unit price keeps 10 places and the amount is exact


@dataclass
class Party:
    """A seller or buyer as printed: name, address lines, tax id, email."""

    name: str
    address: list[str]
    tax_id: str
    email: str


@dataclass
class Row:
    """One row of the lines table; ``style`` is ``model``, ``dims``, ``usage`` or ``item``."""

    style: str
    label: str
    quantity_text: str = ""
    unit_price_text: str = ""
    amount_text: str = ""


@dataclass
class InvoiceDocument:
    """What the template shows: the same fields for a stored invoice and a draft."""

    title: str
    number: str
    status: str
    seller: Party
    buyer: Party
    currency: str
    period_text: str
    finalized_at: datetime | None
    due_at: datetime | None
    corrects: str
    rows: list[Row]
    subtotal: str
    credits_before_tax: str
    tax_label: str
    tax: str
    credits_after_tax: str
    total: str
    credited: str
    amount_paid: str
    amount_due: str
    notes: list[str] = field(default_factory=list)


def _fmt(value: Decimal, places: int) -> str:
    return f"{value:,.{places}f}"


def _unit_price_text(price: Decimal) -> str:
    """A per-1M-token price to at most 6 places, at least 2 (display only)."""
    shown = price.quantize(Decimal(1).scaleb(-UNIT_PRICE_PLACES), rounding=ROUND_HALF_UP)
    text = f"{shown:,f}".rstrip("0")
    whole, _, frac = text.partition(".")
    return f"{whole}.{frac.ljust(2, '0')}"


def _quantity_text(quantity: Decimal, unit: str) -> str:
    if not quantity:
        return ""
    number = f"{quantity:,.0f}" if quantity == quantity.to_integral_value() else (
        f"{quantity.normalize():,f}")
    return f"{number} {unit}".strip()


def _period_text(start: datetime, end: datetime) -> str:
    """The service period as people read it: whole days inclusive, else instants (UTC)."""
    if start.time() == time(0) and end.time() == time(0):
        return f"{start:%Y-%m-%d} to {end - timedelta(days=1):%Y-%m-%d}"
    return f"{start:%Y-%m-%d %H:%M} to {end:%Y-%m-%d %H:%M} UTC"


def seller() -> Party:
    """Return the seller printed on invoices (settings ``SELLER_*``)."""
    return Party(name=settings.SELLER_NAME, address=list(settings.SELLER_ADDRESS),
                 tax_id=settings.SELLER_TAX_ID, email=settings.SELLER_EMAIL)


def buyer(organization: Organization) -> Party:
    """Return the organization as its billing profile addresses it."""
    town = " ".join(p for p in (organization.postal_code, organization.city) if p)
    lines = [organization.address_line1, organization.address_line2, town,
             organization.region, organization.country]
    return Party(name=organization.legal_name or organization.name,
                 address=[ln for ln in lines if ln], tax_id=organization.tax_id,
                 email=organization.billing_email)


def _usage_group(ln: InvoiceLine | DraftLine) -> tuple[str, str]:
    """The model heading of a usage line (late usage names its period), and its dimensions."""
    heading = ln.model or "Usage"
    if ln.kind == LineKind.LATE_USAGE and ln.source_period_start and ln.source_period_end:
        heading = (f"{heading}: late usage from {ln.source_period_start:%Y-%m-%d} to "
                   f"{ln.source_period_end:%Y-%m-%d}")
    dims = [TIER_LABELS.get(ln.service_tier, ln.service_tier), ln.region,
            SOURCE_LABELS.get(ln.capacity_source, ln.capacity_source)]
    return heading, " · ".join(d for d in dims if d)


def _rows(lines: list[InvoiceLine] | list[DraftLine], places: int) -> list[Row]:
    """Usage grouped by model, then dimensions (once each), one row per token class; then the
    other charges in their order. Tax and credit lines are the totals, not rows."""
    groups: dict[str, dict[str, list[InvoiceLine | DraftLine]]] = {}
    items: list[Row] = []
    for ln in lines:
        if ln.kind in USAGE_KINDS:
            heading, dims = _usage_group(ln)
            groups.setdefault(heading, {}).setdefault(dims, []).append(ln)
        elif ln.kind not in (LineKind.TAX, LineKind.CREDIT):
            items.append(Row("item", ln.description, _quantity_text(ln.quantity, ln.unit),
                             "" if ln.unit_price is None else _fmt(ln.unit_price, places),
                             _fmt(ln.amount, places)))
    rows: list[Row] = []
    for heading, by_dims in groups.items():
        rows.append(Row("model", heading))
        for dims, class_lines in by_dims.items():
            requests = (class_lines[0].details or {}).get("requests")
            counted = (f"{requests:,} request{'' if requests == 1 else 's'}"
                       if isinstance(requests, int) else "")
            rows.append(Row("dims", " · ".join(p for p in (dims, counted) if p)))
            rows.extend(Row(
                "usage", CLASS_LABELS.get(ln.token_class, "other usage"),
                _quantity_text(ln.quantity, "tokens"),
                "" if ln.unit_price is None else _unit_price_text(ln.unit_price),
                _fmt(ln.amount, places)) for ln in class_lines)
    return rows + items


def _credits(lines: list[InvoiceLine] | list[DraftLine]) -> tuple[Decimal, Decimal]:
    """Credits applied before the tax line (they reduce what is taxed) and after it."""
    before = after = ZERO
    taxed = False
    for ln in lines:
        if ln.kind == LineKind.TAX:
            taxed = True
        elif ln.kind == LineKind.CREDIT:
            if taxed or (ln.details or {}).get("applied") == "after_tax":
                after -= ln.amount
            else:
                before -= ln.amount
    return before, after


def document_of(invoice: Invoice | DraftInvoice, organization: Organization) -> InvoiceDocument:
    """Return the template's view of an invoice or of the upcoming draft."""
    currency = invoice.currency
    places = minor_units(currency)
    lines: list[InvoiceLine] | list[DraftLine]
    if isinstance(invoice, Invoice):
        lines = list(invoice.lines.all())
        title = "Credit note" if invoice.kind == InvoiceKind.CREDIT_NOTE else "Invoice"
        number, status = invoice.number or "", invoice.status
        period_start, period_end = invoice.period_start, invoice.period_end
        finalized_at, due_at = invoice.finalized_at, invoice.due_at
        amount_paid, amount_due = invoice.amount_paid, invoice.amount_due
        tax_rate = invoice.tax_rate
        corrects = (invoice.corrects.number or "") if invoice.corrects is not None else ""
    else:
        lines = list(invoice.lines)
        title, number, status = "Upcoming invoice", "(draft)", "draft"
        period_start, period_end = invoice.target.period_start, invoice.target.period_end
        finalized_at = due_at = None
        amount_paid, amount_due = ZERO, invoice.total
        tax_rate, corrects = invoice.target.tax_rate, ""
    before, after = _credits(lines)
    rate_text = f"{(tax_rate * 100).normalize():f}"
    notes = []
    if isinstance(invoice, Invoice) and invoice.amount_refunded:
        notes.append(f"Refunded: {_fmt(invoice.amount_refunded, places)} {currency}")
    if isinstance(invoice, Invoice) and invoice.amount_disputed:
        notes.append(f"Under dispute: {_fmt(invoice.amount_disputed, places)} {currency}")
    return InvoiceDocument(
        title=title, number=number, status=status, seller=seller(), buyer=buyer(organization),
        currency=currency, period_text=_period_text(period_start, period_end),
        finalized_at=finalized_at, due_at=due_at, corrects=corrects, rows=_rows(lines, places),
        subtotal=_fmt(invoice.subtotal, places),
        credits_before_tax=_fmt(before, places) if before else "",
        tax_label=f"Tax {rate_text} % on {_fmt(invoice.subtotal - before, places)}",
        tax=_fmt(invoice.tax, places),
        credits_after_tax=_fmt(after, places) if after else "",
        total=_fmt(invoice.total, places),
        credited=_fmt(invoice.total - amount_due, places) if invoice.total > amount_due else "",
        amount_paid=_fmt(amount_paid, places) if amount_paid else "",
        amount_due=_fmt(max(amount_due - amount_paid, ZERO), places), notes=notes,
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

