"""Reads of invoicing for the platform finance workspace (``/finance/`` pages): invoices of
every organization, found by organization, status or number, and one invoice with what
finance acts on (its lines, credit notes, payments and refunds).

Unlike ``selectors.invoices_of`` these are not scoped to one organization: only the finance
workspace, behind ``finance.view_reports``, calls them. Drafts are never shown (they are not
documents yet).
"""

from __future__ import annotations

from django.db.models import Q

from billing_platform.invoicing.choices import InvoiceStatus
from billing_platform.invoicing.models import Invoice

MAX_LIST = 200


def invoices_find(*, organization_public_id: str | None = None, status: str | None = None,
                  kind: str | None = None, number: str | None = None, limit: int = 100
                  ) -> list[Invoice]:
    """Return finalized invoices and credit notes, newest first, matching what is given
    (``number``: a part of the number, case-insensitive)."""
    qs = Invoice.objects.exclude(status=InvoiceStatus.DRAFT).select_related("organization")
    if organization_public_id:
        qs = qs.filter(organization__public_id=organization_public_id)
    if status:
        qs = qs.filter(status=status)
    if kind:
        qs = qs.filter(kind=kind)
    if number:
        qs = qs.filter(Q(number__icontains=number) | Q(public_id=number))
    return list(qs.order_by("-finalized_at", "-id")[:min(limit, MAX_LIST)])


def invoice_find(*, public_id: str) -> Invoice | None:
    """Return one finalized invoice or credit note of any organization, with its lines,
    credit notes, payments and refunds; None when there is none."""
    return (Invoice.objects.exclude(status=InvoiceStatus.DRAFT).filter(public_id=public_id)
            .select_related("organization", "corrects")
            .prefetch_related("lines", "credit_notes", "payments", "refunds").first())
