"""Reads of invoicing: billing periods due or open, the upcoming invoice, an organization's
invoices, one invoice with its lines, CSV rows.

Periods: an organization's next period starts where its last invoice ended (or at the start of
the period that holds its creation) and runs to the next boundary of the billing anchor in
force then (a subscription's start, else calendar months). Period close
(``services.period_close_run``) and the billing invariant read them here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, NamedTuple

from django.db.models import BigIntegerField, Func, Max, Q, QuerySet, Sum
from django.utils import timezone
from django.utils.functional import cached_property

from billing_platform.accounts.choices import OrgStatus
from billing_platform.accounts.models import Organization
from billing_platform.db import reading_connection
from billing_platform.invoicing.builder import (
    CREDITS_AFTER_TAX,
    CREDITS_BEFORE_TAX,
    DraftInvoice,
    DraftLine,
    Target,
    build_drafts,
)
from billing_platform.invoicing.choices import InvoiceKind, InvoiceStatus
from billing_platform.invoicing.models import Invoice, InvoiceLine
from billing_platform.invoicing.money import ZERO
from plans.models import CreditGrant, Subscription
from plans.periods import from_epoch_us, period_bounds

CALENDAR_ANCHOR = datetime(2000, 1, 1, tzinfo=UTC)  # calendar months, for orgs on no plan


# --- periods ---------------------------------------------------------------------------------

def _anchor(subs: Iterable[Subscription], at: datetime) -> datetime:
    for sub in subs:
        if sub.covers(at):
            return sub.billing_anchor
    return CALENDAR_ANCHOR


class EpochUs(Func):
    """An instant as integer microseconds since the Unix epoch, exactly.

    For reads of an instant per organization across all of them: Django's time-zone-aware
    timestamp loader costs ~5 us a value (two instants of 10,000 orgs: 100 ms, measured on
    bench/finance_reports.py's database), an int almost nothing, and most values repeat.
    """

    template = "(extract(epoch FROM %(expressions)s) * 1000000)::bigint"
    output_field = BigIntegerField()

    @cached_property
    def convert_value(self) -> Any:
        # the database returns an int already: no int() per row (Django skips a noop; the
        # stubs lack it)
        return self._convert_value_noop  # type: ignore[attr-defined]


class EpochInstants(dict[int, datetime]):
    """``EpochUs`` values as aware UTC instants (``instants[us]``), each converted once."""

    def __missing__(self, us: int) -> datetime:
        at = self[us] = from_epoch_us(us)
        return at


class LastClose(NamedTuple):
    """An organization's newest finalized invoice (not credit note): its period, currency,
    and when it was closed (created, or finalized if that came first)."""

    period_start: datetime
    period_end: datetime
    currency: str
    closed_at: datetime


_US = EpochUs.template.replace("%(expressions)s", "{}")  # in raw SQL
# One probe of index invoice_org_last_final per org (a max or DISTINCT ON over every invoice
# grows with history: 184 ms against 45 ms at 10,000 orgs x 11 months), instants as EpochUs.
_LAST_CLOSES_SQL = f"""
SELECT {_US.format("l.period_start")}, {_US.format("l.period_end")}, l.currency,
       {_US.format("LEAST(l.created_at, COALESCE(l.finalized_at, l.created_at))")},
       string_agg(u.org::text, ',')
  FROM unnest(string_to_array(%s, ',')::bigint[]) AS u(org)
  CROSS JOIN LATERAL (
        SELECT i.period_start, i.period_end, i.currency, i.created_at, i.finalized_at
          FROM invoicing_invoice i
         WHERE i.organization_id = u.org AND i.kind = 'invoice' AND i.status <> 'draft'
         ORDER BY i.period_end DESC
         LIMIT 1) l
 GROUP BY 1, 2, 3, 4
"""  # noqa: S608 (only our own SQL fragments are interpolated)


def last_closes(*, org_ids: Iterable[int]) -> dict[LastClose, list[int]]:
    """Return the organizations (those with a finalized invoice) by their newest finalized
    invoice's close: most share one (a period close run), so a few rows come back, not one
    per organization. One query."""
    with reading_connection().cursor() as cur:
        cur.execute(_LAST_CLOSES_SQL, [",".join(map(str, org_ids))])
        rows = cur.fetchall()
    at = EpochInstants()
    return {LastClose(at[ps], at[pe], currency, at[closed]): list(map(int, orgs.split(",")))
            for ps, pe, currency, closed, orgs in rows}


def _org_rows(orgs: QuerySet[Organization]) -> tuple[list[tuple[Any, ...]],
                                                     dict[LastClose, list[int]]]:
    """Return (id, currency, tax rate, creation, end of the last invoiced period or None) of
    ``orgs`` by id, and their ``last_closes``: the end is its newest invoice's (not credit
    note's), a draft's included."""
    at = EpochInstants()
    rows = [(org, currency, tax_rate, at[created_us]) for org, currency, tax_rate, created_us
            in orgs.order_by("id").values_list("id", "currency", "tax_rate",
                                               EpochUs("created_at"))]
    closes = last_closes(org_ids=[r[0] for r in rows])
    end_of: dict[int, datetime] = {}
    for close, ids in closes.items():
        end_of.update(dict.fromkeys(ids, close.period_end))
    # drafts live inside period close's transaction only; index (status, ...) finds them
    for org, end in (Invoice.objects.filter(organization_id__in=orgs.values("id"),
                                            kind=InvoiceKind.INVOICE,
                                            status=InvoiceStatus.DRAFT)
                     .values("organization_id").annotate(end=Max("period_end"))
                     .values_list("organization_id", "end")):
        end_of[org] = max(end, end_of.get(org, end))
    return [(*row, end_of.get(row[0])) for row in rows], closes


def _targets(orgs: list[tuple[Any, ...]], *, subscriptions_of: Any, now: datetime,
             due_only: bool) -> list[Target]:
    """Return the targets of ``orgs`` (``_org_rows``' rows) in their order.

    ``subscriptions_of`` is the organizations' ids, or their ids' queryset (a subquery:
    10,000 ids bound one by one cost more than the read). Most organizations share a period
    start (calendar months), so each (anchor, instant)'s bounds are computed once.
    """
    subs: dict[int, list[Subscription]] = {}
    for sub in (Subscription.objects.filter(organization_id__in=subscriptions_of)
                .order_by("starts_at")):
        subs.setdefault(sub.organization_id, []).append(sub)
    known: dict[tuple[datetime, datetime], tuple[datetime, datetime]] = {}

    def bounds(anchor: datetime, at: datetime) -> tuple[datetime, datetime]:
        got = known.get((anchor, at))
        if got is None:
            got = known[(anchor, at)] = period_bounds(anchor, at)
        return got

    out = []
    for org_id, currency, tax_rate, created_at, last_end in orgs:
        org_subs = subs.get(org_id)
        start = last_end
        if org_subs is None:  # on no plan: calendar months (most orgs; the same bounds)
            if start is None:
                start = bounds(CALENDAR_ANCHOR, created_at)[0]
            end = bounds(CALENDAR_ANCHOR, start)[1]
        else:
            if start is None:
                start = bounds(_anchor(org_subs, created_at), created_at)[0]
            # to the next boundary of the anchor in force at its start
            end = bounds(_anchor(org_subs, start), start)[1]
        if due_only and end > now:
            continue
        out.append(Target(org_id, currency, tax_rate, start, end))
    return out


def periods_due(*, now: datetime | None = None, org_ids: Iterable[int] | None = None
                ) -> list[Target]:
    """Return, per organization, its oldest period that has ended and has no invoice yet."""
    orgs = Organization.objects.exclude(status=OrgStatus.CLOSED)
    if org_ids is not None:
        orgs = orgs.filter(id__in=list(org_ids))
    return _targets(_org_rows(orgs)[0], subscriptions_of=orgs.values("id"),
                    now=now or timezone.now(), due_only=True)


def periods_open_and_last_closes(*, org_ids: Iterable[int] | None = None
                                 ) -> tuple[list[Target], dict[LastClose, list[int]]]:
    """Return ``periods_open`` and the organizations' ``last_closes``, read once for both."""
    orgs = Organization.objects.all()
    if org_ids is not None:
        orgs = orgs.filter(id__in=list(org_ids))
    rows, closes = _org_rows(orgs)
    return _targets(rows, subscriptions_of=orgs.values("id"), now=timezone.now(),
                    due_only=False), closes


def periods_open(*, org_ids: Iterable[int] | None = None) -> list[Target]:
    """Return, per organization (closed ones too), its oldest period without an invoice.

    That is the period its draft bills: the current one, or an ended one not closed yet.
    """
    return periods_open_and_last_closes(org_ids=org_ids)[0]


def upcoming_invoice(*, organization: Organization, now: datetime | None = None
                     ) -> DraftInvoice:
    """Return the current period's invoice as it stands now (not stored; credits previewed)."""
    now = now or timezone.now()
    ((*_, last_end),) = _org_rows(Organization.objects.filter(id=organization.id))[0]
    (target,) = _targets([(organization.id, organization.currency, organization.tax_rate,
                           organization.created_at, last_end)],
                         subscriptions_of=[organization.id], now=now, due_only=False)
    draft = build_drafts([target])[organization.id]
    left = dict(CreditGrant.objects.filter(
        organization=organization, currency=draft.currency, remaining__gt=0,
        granted_at__lte=now).filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now))
        .values("kind").annotate(left=Sum("remaining")).values_list("kind", "left"))

    def preview(kinds: frozenset[str]) -> Callable[[Decimal], Decimal]:
        return lambda amount: min(amount, sum((v for k, v in left.items() if k in kinds), ZERO))

    if left:
        draft.add_credits(before_tax=preview(CREDITS_BEFORE_TAX),
                          after_tax=preview(CREDITS_AFTER_TAX))
    return draft


# --- invoices --------------------------------------------------------------------------------

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


def invoice_csv_rows(invoice: Invoice | DraftInvoice) -> Iterator[tuple[object, ...]]:
    """Yield the CSV header and one row per line; the amounts sum to the invoice total."""
    yield CSV_HEADER
    number = getattr(invoice, "number", None) or "upcoming"
    lines: Iterable[InvoiceLine | DraftLine] = (
        invoice.lines.all() if isinstance(invoice, Invoice) else invoice.lines)
    for pos, ln in enumerate(lines, start=1):
        yield (number, getattr(ln, "position", pos), ln.kind, ln.description, ln.model,
               ln.region, ln.service_tier, ln.capacity_source, ln.token_class, ln.quantity,
               ln.unit,
               "" if ln.unit_price is None else ln.unit_price, ln.amount_precise, ln.amount,
               invoice.currency)
