"""Period close: invoice every organization whose billing period has ended, in bulk.

``period_close_run`` works on chunks of organizations, each chunk in one transaction: lock the
chunk's organizations (``FOR NO KEY UPDATE SKIP LOCKED``, so a second closer running at the
same time skips what the first holds), re-check under the lock that the period is still
unbilled, build every invoice with a fixed number of SQL queries (``builder.build_drafts``),
apply credit grants, take gapless numbers from a locked sequence row, insert invoices, lines,
the billed-usage ledger and one audit row per invoice (``invoice.finalize``, as a draft
finalized by hand writes) in bulk, mark the one-off items they bill as billed (each exactly
once), and mark them open. Charges are enqueued after commit. One
invoice per org per period is also a database constraint, so even a closer that ignored the
locks could not bill a period twice. Which periods are due is a read (``selectors``).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import InterfaceError, OperationalError, ProgrammingError, connection, transaction
from django.db.models import Max, Model, Q
from django.utils import timezone

from billing_platform.accounts.models import Organization, public_id
from billing_platform.audit.services import audit_record_many
from billing_platform.invoicing.builder import DraftInvoice, Target, build_drafts
from billing_platform.invoicing.choices import InvoiceKind, InvoiceStatus
from billing_platform.invoicing.models import (
    BilledUsage,
    Invoice,
    InvoiceLine,
    PendingInvoiceItem,
)
from billing_platform.invoicing.selectors import periods_due
from billing_platform.invoicing.services.invoices import (
    draft_credits_apply,
    invoice_finalized_state,
    invoice_numbers_reserve,
    invoice_series,
)
from billing_platform.invoicing.services.payments import invoice_charges_enqueue
from plans.models import CreditGrant

log = logging.getLogger(__name__)


@dataclass
class CloseReport:
    """What a period-close run did."""

    invoices: int = 0
    passes: int = 0
    skipped_locked: int = 0
    failed_orgs: list[int] = field(default_factory=list)  # left open, each logged with its error
    invoice_ids: list[int] = field(default_factory=list)  # the invoices created
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)


def _credit_reference(target: Target) -> str:
    return f"invoice:{target.org_id}:{target.period_start:%Y%m%dT%H%M%S}"


def _apply_credits(drafts: dict[int, DraftInvoice], *, now: datetime) -> None:
    with_credit = set(CreditGrant.objects.filter(
        organization_id__in=list(drafts), remaining__gt=0, granted_at__lte=now)
        .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now))
        .values_list("organization_id", flat=True))
    for org_id in sorted(with_credit):
        draft = drafts[org_id]
        if draft.total <= 0:
            continue
        draft_credits_apply(draft, organization=Organization(pk=org_id),
                            reference=_credit_reference(draft.target), now=now)


def _copy_sql(model: type[Model], columns: tuple[str, ...]) -> str:
    return f"COPY {model._meta.db_table} ({', '.join(columns)}) FROM STDIN"


# Lines and the billed-usage ledger go in by COPY: a close writes ~15 lines and ~5 ledger rows
# per invoice, and bulk_create spent more (building a model instance and preparing every field
# of each row, then quoting them into one statement) than the rest of the close together:
# 13 of 15 s for 1,000 orgs x 5 models (bench/invoice_run.py, cProfile). The values are those
# bulk_create sent (Django passes Decimal and aware datetimes through unchanged; ``details``
# is JSON as JSONField writes it without an encoder).
_LINE_COPY = _copy_sql(InvoiceLine, (
    "invoice_id", "position", "kind", "description", "model", "region", "service_tier",
    "capacity_source", "token_class", "source_period_start", "source_period_end", "quantity",
    "unit", "unit_price", "amount_precise", "amount", "details"))
_BILLED_COPY = _copy_sql(BilledUsage, (
    "invoice_id", "organization_id", "source_period_start", "model", "region",
    "service_tier", "capacity_source", "amount", "requests", "prompt_tokens", "cached_tokens",
    "completion_tokens", "input_amount", "cached_input_amount", "output_amount"))


def _copy_rows(sql: str, rows: Iterable[tuple[Any, ...]]) -> None:
    with connection.cursor() as cur, cur.copy(sql) as copy:
        for row in rows:
            copy.write_row(row)


# The chunk's drafts become finalized in one statement, keyed by id and bounded by the ids'
# range (one INSERT made them: a range of the primary key; they are this transaction's own
# drafts, so no status test: it made the planner read the status index, where every invoice
# the run finalized before left a draft entry). Two ``id IN (...)`` updates of 500
# were planned as scans of the whole invoice table, whose cost grew with every chunk closed
# before (28,000 rows read to update 500 at the end of a 30,000-org run). It sets the numbers
# too: the numbers' row lock is taken only for this statement and the commit,
# so the other closer's chunk builds and writes meanwhile instead of waiting on it.
_FINALIZE_SQL = f"""
UPDATE {Invoice._meta.db_table} AS i
   SET number = v.number, finalized_at = %s,
       status = CASE WHEN i.amount_due > 0 THEN %s ELSE %s END,
       due_at = CASE WHEN i.amount_due > 0 THEN %s ELSE %s END,
       paid_at = CASE WHEN i.amount_due > 0 THEN NULL ELSE %s END
  FROM unnest(%s::bigint[], %s::text[]) AS v(id, number)
 WHERE i.id = v.id AND i.id BETWEEN %s AND %s
"""  # noqa: S608 (only our own table name is interpolated)


def _persist(drafts: list[DraftInvoice], *, now: datetime, acting_user: Any) -> list[Invoice]:
    """Insert finalized invoices, their lines, billed-usage and audit rows; return the invoices.

    The invoices go in as drafts (the lines of a finalized invoice never change, a database
    rule), then are numbered and finalized together in one statement, last, so the series' row
    lock is held only from there to the commit.
    """
    if not drafts:
        return []
    net = timedelta(days=settings.INVOICING_NET_DAYS)
    invoices = Invoice.objects.bulk_create([
        Invoice(public_id=public_id("in"), organization_id=d.target.org_id,
                kind=InvoiceKind.INVOICE, number=None,
                status=InvoiceStatus.DRAFT, currency=d.currency,
                period_start=d.target.period_start, period_end=d.target.period_end,
                tax_rate=d.target.tax_rate, subtotal=d.subtotal, tax=d.tax,
                credits_applied=d.credits_applied, total=d.total, amount_due=d.total,
                created_at=now)
        for d in drafts], batch_size=2000)
    _copy_rows(_LINE_COPY, (
        (invoice.id, pos, ln.kind, ln.description, ln.model, ln.region, ln.service_tier,
         ln.capacity_source, ln.token_class, ln.source_period_start, ln.source_period_end,
         ln.quantity, ln.unit, ln.unit_price, ln.amount_precise, ln.amount,
         json.dumps(ln.details))
        for invoice, d in zip(invoices, drafts, strict=True)
        for pos, ln in enumerate(d.lines, start=1)))
    _copy_rows(_BILLED_COPY, (
        (invoice.id, d.target.org_id, u.source_period_start, u.model, u.region,
         u.service_tier, u.capacity_source, u.amount, u.requests, u.prompt_tokens,
         u.cached_tokens, u.completion_tokens, u.input_amount, u.cached_input_amount,
         u.output_amount)
        for invoice, d in zip(invoices, drafts, strict=True) for u in d.billed))
    _consume_items(invoices, drafts)
    series = invoice_series(kind=InvoiceKind.INVOICE, at=now)
    first = invoice_numbers_reserve(series=series, count=len(invoices))
    for i, invoice in enumerate(invoices):  # as the update leaves the rows
        invoice.number, invoice.finalized_at = f"{series}-{first + i:06d}", now
        if invoice.amount_due > 0:
            invoice.status, invoice.due_at = InvoiceStatus.OPEN, now + net
        else:  # nothing to pay (no usage, or credits covered it): settled at once, as Stripe
            invoice.status, invoice.due_at, invoice.paid_at = InvoiceStatus.PAID, now, now
    ids = [i.id for i in invoices]
    with connection.cursor() as cur:
        cur.execute(_FINALIZE_SQL, [now, InvoiceStatus.OPEN, InvoiceStatus.PAID, now + net, now,
                                    now, ids, [i.number for i in invoices], min(ids), max(ids)])
    audit_record_many(acting_user=acting_user, action="invoice.finalize", rows=[
        (i.organization_id, i.public_id, None, invoice_finalized_state(i)) for i in invoices])
    return invoices


_CONSUME_SQL = f"""
UPDATE {PendingInvoiceItem._meta.db_table} AS i SET invoice_id = v.invoice
  FROM unnest(%s::bigint[], %s::bigint[]) AS v(item, invoice)
 WHERE i.id = v.item AND i.invoice_id IS NULL
"""  # noqa: S608


def _consume_items(invoices: list[Invoice], drafts: list[DraftInvoice]) -> None:
    """Mark the pending items the drafts billed as billed by their invoice (one statement).

    Each item is read pending under the organization's lock and taken only while still
    pending; an item taken meanwhile would be billed twice, so the chunk is refused instead.
    """
    pairs = [(item, invoice.id) for invoice, d in zip(invoices, drafts, strict=True)
             for item in d.items]
    if not pairs:
        return
    with connection.cursor() as cur:
        cur.execute(_CONSUME_SQL, [[p[0] for p in pairs], [p[1] for p in pairs]])
        if cur.rowcount != len(pairs):
            raise RuntimeError("period close: a pending invoice item was billed meanwhile")


def _close_chunk(targets: list[Target], *, now: datetime, enqueue_payments: bool,
                 acting_user: Any) -> tuple[list[int], int]:
    """Close one chunk in one transaction; return (invoices created, orgs skipped as locked)."""
    by_org = {t.org_id: t for t in targets}
    with transaction.atomic():
        locked = list(Organization.objects.select_for_update(no_key=True, skip_locked=True)
                      .filter(id__in=list(by_org)).order_by("id").values_list("id", flat=True))
        # Re-check under the lock: another closer may have billed the period meanwhile.
        billed_until = dict(
            Invoice.objects.filter(organization_id__in=locked, kind=InvoiceKind.INVOICE)
            .values("organization_id").annotate(end=Max("period_end"))
            .values_list("organization_id", "end"))
        todo = [by_org[o] for o in locked
                if billed_until.get(o) is None or billed_until[o] <= by_org[o].period_start]
        drafts = build_drafts(todo)
        _apply_credits(drafts, now=now)
        invoices = _persist([drafts[t.org_id] for t in todo], now=now,
                            acting_user=acting_user)
        if enqueue_payments:
            due = [i.id for i in invoices if i.amount_due > 0]
            transaction.on_commit(lambda: invoice_charges_enqueue(due))
    return [i.id for i in invoices], len(targets) - len(locked)


MAX_FAILED_ORGS = 20


def _close_isolating(targets: list[Target], *, now: datetime, enqueue_payments: bool,
                     report: CloseReport, acting_user: Any) -> int:
    """Close a chunk; if it fails, close its halves, down to the organization at fault.

    One organization whose data cannot be invoiced (an amount past the columns' range, a
    constraint broken by hand) is logged and left for a person, and never holds back the
    invoices of the others. What no organization could get past fails the whole run: a
    database that is down (the task retries), a schema or query error (a bug), or more than
    ``MAX_FAILED_ORGS`` organizations failing (the fault is not theirs).
    """
    try:
        created, skipped = _close_chunk(targets, now=now, enqueue_payments=enqueue_payments,
                                        acting_user=acting_user)
    except (OperationalError, InterfaceError, ProgrammingError):
        raise
    except Exception:
        if len(report.failed_orgs) >= MAX_FAILED_ORGS:
            raise
        if len(targets) > 1:
            mid = len(targets) // 2
            return sum(_close_isolating(part, now=now, enqueue_payments=enqueue_payments,
                                        report=report, acting_user=acting_user)
                       for part in (targets[:mid], targets[mid:]))
        t = targets[0]
        log.exception("period close: organization %s, period %s to %s, could not be invoiced; "
                      "fix its data and the next run invoices it", t.org_id,
                      t.period_start.date(), t.period_end.date())
        with report.lock:
            report.failed_orgs.append(t.org_id)
        return 0
    with report.lock:
        report.skipped_locked += skipped
        report.invoice_ids.extend(created)
    return len(created)


def _close_chunks(chunks: list[list[Target]], *, now: datetime, enqueue_payments: bool,
                  report: CloseReport, acting_user: Any) -> list[int]:
    """Close the chunks, ``INVOICING_CLOSE_WORKERS`` at a time; return invoices per chunk.

    The usage query of a chunk runs on one PostgreSQL backend (one core), so chunks closed on
    separate connections at once use the database's other cores. Chunks hold disjoint orgs;
    the only lock they share is the invoice-number row, taken at the end of each, so numbers
    stay gapless.
    """
    workers = min(settings.INVOICING_CLOSE_WORKERS, len(chunks))

    def close(part: list[Target]) -> int:
        return _close_isolating(part, now=now, enqueue_payments=enqueue_payments,
                                report=report, acting_user=acting_user)

    if workers <= 1 or connection.in_atomic_block:  # inside a transaction: stay in it
        return [close(part) for part in chunks]

    def close_in_thread(part: list[Target]) -> int:
        try:
            return close(part)
        finally:
            connection.close()  # this thread's own connection

    with ThreadPoolExecutor(workers, thread_name_prefix="period-close") as pool:
        return list(pool.map(close_in_thread, chunks))


MIN_PARALLEL_CHUNK = 50  # fewer organizations than this a chunk are not worth a connection


def _split(targets: list[Target], most: int) -> list[list[Target]]:
    """Split ``targets`` into chunks of at most ``most``, of even sizes, as many as a multiple
    of the workers where each gets ``MIN_PARALLEL_CHUNK`` organizations or more, so no worker
    idles while another closes the last chunk (300 orgs were one chunk on one connection, the
    other idle: two thirds of the speed of a larger run)."""
    workers = 1 if connection.in_atomic_block else max(1, settings.INVOICING_CLOSE_WORKERS)
    count = -(-len(targets) // most)
    if count % workers:
        count = min(-(-count // workers) * workers,
                    max(count, len(targets) // MIN_PARALLEL_CHUNK))
    size = -(-len(targets) // count)
    return [targets[i:i + size] for i in range(0, len(targets), size)]


def period_close_run(*, now: datetime | None = None, org_ids: Iterable[int] | None = None,
                     enqueue_payments: bool = True, chunk: int | None = None,
                     acting_user: Any = None) -> CloseReport:
    """Invoice every organization whose period ended; safe to run twice or concurrently.

    Each pass closes the oldest unbilled period of every organization, so an organization
    several periods behind gets one invoice per period, in order. Each invoice is audited
    (``invoice.finalize``) by ``acting_user``, None for the system (the beat task).
    """
    now = now or timezone.now()
    chunk = chunk or settings.INVOICING_CLOSE_CHUNK
    report = CloseReport()
    ids = list(org_ids) if org_ids is not None else None
    while True:
        failed = set(report.failed_orgs)
        targets = [t for t in periods_due(now=now, org_ids=ids) if t.org_id not in failed]
        if not targets:
            break
        report.passes += 1
        chunks = _split(targets, chunk)
        created = sum(_close_chunks(chunks, now=now, enqueue_payments=enqueue_payments,
                                    report=report, acting_user=acting_user))
        report.invoices += created
        if created == 0:  # everything left is held by a concurrent closer
            break
    return report
