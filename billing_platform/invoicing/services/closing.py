"""Close billing periods now, by hand, after a preview of the invoices it would create.

The beat closes ended periods every few minutes (``period_close_run``); finance can run the
same close now, for one organization or every one that is due. The preview is that close
itself, run inside a savepoint that is rolled back: the same builder, the same credits taken,
the same passes for an organization several periods behind, so its figures are the figures of
the invoices the close creates next (unless usage, credits or a concurrent closer change what
is due in between), and nothing of it persists: no invoice, number, credit taken, charge
enqueued or audit row. The close writes what ``period_close_run`` writes (one
``invoice.finalize`` row per invoice, by ``acting_user``) plus one ``period.close`` row with
the reason and what it did.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any

from django.db import transaction
from django.utils import timezone

from billing_platform.accounts.models import Organization
from billing_platform.audit.services import audit_record
from billing_platform.invoicing.models import Invoice
from billing_platform.invoicing.money import ZERO
from billing_platform.invoicing.services.periods import period_close_run


@dataclass(frozen=True, slots=True)
class ClosedLine:
    kind: str
    description: str
    quantity: Decimal
    unit: str
    unit_price: Decimal | None
    amount: Decimal


@dataclass(frozen=True, slots=True)
class ClosedInvoice:
    """One invoice a close created (or, in a preview, would create: no id, no number)."""

    organization: str  # public id
    organization_name: str
    invoice: str  # public id; "" in a preview
    number: str  # "" in a preview
    status: str
    currency: str
    period_start: datetime
    period_end: datetime
    subtotal: Decimal
    tax: Decimal
    credits_applied: Decimal
    total: Decimal
    amount_due: Decimal
    lines: tuple[ClosedLine, ...] = ()


@dataclass(frozen=True, slots=True)
class CloseResult:
    """What a close did (or a preview would do)."""

    dry_run: bool
    invoices: list[ClosedInvoice]
    failed_orgs: list[str] = field(default_factory=list)  # public ids, left open and logged
    skipped_locked: int = 0  # organizations a concurrent closer was closing

    @property
    def totals(self) -> dict[str, Decimal]:
        """Return the invoices' totals per currency (never summed across currencies)."""
        out: dict[str, Decimal] = {}
        for i in self.invoices:
            out[i.currency] = out.get(i.currency, ZERO) + i.total
        return out


def _close(organization: Organization | None, *, now: datetime, dry_run: bool,
           acting_user: Any) -> CloseResult:
    report = period_close_run(now=now, org_ids=None if organization is None else [organization.id],
                              enqueue_payments=not dry_run, acting_user=acting_user)
    rows = (Invoice.objects.filter(id__in=report.invoice_ids).select_related("organization")
            .order_by("organization_id", "period_start"))
    if organization is not None:  # one organization: with its lines; all: the totals only
        rows = rows.prefetch_related("lines")
    invoices = [ClosedInvoice(
        organization=i.organization.public_id, organization_name=i.organization.name,
        invoice="" if dry_run else i.public_id, number="" if dry_run else i.number or "",
        status=str(i.status), currency=i.currency, period_start=i.period_start,
        period_end=i.period_end, subtotal=i.subtotal, tax=i.tax,
        credits_applied=i.credits_applied, total=i.total, amount_due=i.amount_due,
        lines=tuple(ClosedLine(ln.kind, ln.description, ln.quantity, ln.unit, ln.unit_price,
                               ln.amount) for ln in i.lines.all())
        if organization is not None else ()) for i in rows]
    failed = list(Organization.objects.filter(id__in=report.failed_orgs)
                  .values_list("public_id", flat=True))
    return CloseResult(dry_run=dry_run, invoices=invoices, failed_orgs=failed,
                       skipped_locked=report.skipped_locked)


def period_close_preview(*, organization: Organization | None = None,
                         now: datetime | None = None) -> CloseResult:
    """Return the invoices closing now would create, creating nothing (see the docstring)."""
    now = now or timezone.now()
    with transaction.atomic():
        result = _close(organization, now=now, dry_run=True, acting_user=None)
        transaction.set_rollback(True)
    return result


def period_close_now(*, organization: Organization | None = None, reason: str,
                     acting_user: Any, now: datetime | None = None) -> CloseResult:
    """Close now every ended, unbilled period of ``organization`` (None: of every org due)."""
    now = now or timezone.now()
    result = _close(organization, now=now, dry_run=False, acting_user=acting_user)
    with transaction.atomic():
        audit_record(acting_user=acting_user, organization=organization, action="period.close",
                     target=organization.public_id if organization is not None else "",
                     after={"reason": reason[:500], "scope": "organization"
                            if organization is not None else "all due",
                            "invoices": len(result.invoices),  # each has its finalize row
                            "totals": {c: str(t) for c, t in result.totals.items()},
                            "failed_orgs": result.failed_orgs,
                            "skipped_locked": result.skipped_locked})
    return result
