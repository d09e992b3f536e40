"""Writes of invoicing: period close, finalize, void, credit notes, charges, webhooks, dunning.

Period close (``period_close_run``) works on chunks of organizations, each chunk in one
transaction: lock the chunk's organizations (``FOR NO KEY UPDATE SKIP LOCKED``, so a second
closer running at the same time skips what the first holds), re-check under the lock that the
period is still unbilled, build every invoice with a fixed number of SQL queries
(``builder.build_drafts``), apply credit grants, take gapless numbers from a locked sequence
row, insert invoices, lines and the billed-usage ledger in bulk, and mark them open. Charges
are enqueued after commit. One invoice per org per period is also a database constraint, so
even a closer that ignored the locks could not bill a period twice.

Payments: the platform is the system of record. A charge creates one ``PaymentAttempt`` per
try, keyed ``invoice:<id>:charge:<n>`` (the Stripe idempotency key), committed under the
invoice's row lock before Stripe is called (no lock is held across the call); a task that runs
twice finds the attempt and does not charge again, and an attempt whose answer was lost is
sent again with its key, so Stripe replays the first result. The invoice becomes
``paid`` when Stripe says so (a verified webhook, or ``payments_sync`` reading the
PaymentIntent), and only for a PaymentIntent found by the id recorded on our attempt that
received exactly the amount due; any other payment is left for finance (``needs_review``, an
audit row). A webhook is refused outright while ``STRIPE_WEBHOOK_SECRET`` is unset. A
declined charge starts dunning: retries after ``INVOICING_DUNNING_DAYS``, an email each time,
then ``uncollectible`` and the organization suspended until it pays.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import stripe
from django.conf import settings
from django.core.mail import send_mail
from django.db import (
    IntegrityError,
    InterfaceError,
    OperationalError,
    ProgrammingError,
    connection,
    transaction,
)
from django.db.models import Max, Q
from django.utils import timezone

from billing_platform.accounts.choices import OrgStatus
from billing_platform.accounts.models import Organization
from billing_platform.accounts.services import organization_update
from billing_platform.audit.services import audit_record
from billing_platform.errors import Conflict, DomainError, InvalidRequest
from billing_platform.invoicing import stripe_client
from billing_platform.invoicing.builder import DraftInvoice, Target, build_drafts
from billing_platform.invoicing.choices import InvoiceKind, InvoiceStatus, LineKind, PaymentStatus
from billing_platform.invoicing.models import (
    BilledUsage,
    BillingAccount,
    Invoice,
    InvoiceLine,
    PaymentAttempt,
    StripeEvent,
)
from billing_platform.invoicing.money import ZERO, minor_units, quantize_money, to_minor_units
from plans.choices import CreditGrantKind
from plans.models import CreditGrant, Subscription
from plans.periods import period_bounds
from plans.services import credit_grant_create, credit_grants_apply

log = logging.getLogger(__name__)

CALENDAR_ANCHOR = datetime(2000, 1, 1, tzinfo=UTC)  # calendar months, for orgs on no plan


# --- periods ---------------------------------------------------------------------------------

def _anchor(subs: Iterable[Subscription], at: datetime) -> datetime:
    for sub in subs:
        if sub.covers(at):
            return sub.billing_anchor
    return CALENDAR_ANCHOR


def _next_period(subs: list[Subscription], start: datetime) -> tuple[datetime, datetime]:
    """Return [start, end): from ``start`` to the next boundary of the anchor in force."""
    _, end = period_bounds(_anchor(subs, start), start)
    return start, end


def _targets(orgs: Iterable[tuple], *, now: datetime, due_only: bool) -> list[Target]:
    orgs = list(orgs)
    ids = [o[0] for o in orgs]
    last_end = dict(Invoice.objects.filter(organization_id__in=ids, kind=InvoiceKind.INVOICE)
                    .values("organization_id").annotate(end=Max("period_end"))
                    .values_list("organization_id", "end"))
    subs: dict[int, list[Subscription]] = {}
    for sub in Subscription.objects.filter(organization_id__in=ids).order_by("starts_at"):
        subs.setdefault(sub.organization_id, []).append(sub)
    out = []
    for org_id, currency, tax_rate, created_at in orgs:
        org_subs = subs.get(org_id, [])
        start = last_end.get(org_id)
        if start is None:
            start = period_bounds(_anchor(org_subs, created_at), created_at)[0]
        start, end = _next_period(org_subs, start)
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
    return _targets(orgs.order_by("id").values_list("id", "currency", "tax_rate", "created_at"),
                    now=now or timezone.now(), due_only=True)


def periods_open(*, org_ids: Iterable[int] | None = None) -> list[Target]:
    """Return, per organization (closed ones too), its oldest period without an invoice.

    That is the period its draft bills: the current one, or an ended one not closed yet.
    """
    orgs = Organization.objects.all()
    if org_ids is not None:
        orgs = orgs.filter(id__in=list(org_ids))
    return _targets(orgs.order_by("id").values_list("id", "currency", "tax_rate", "created_at"),
                    now=timezone.now(), due_only=False)


# --- period close ------------------------------------------------------------------------------

@dataclass
class CloseReport:
    """What a period-close run did."""

    invoices: int = 0
    passes: int = 0
    skipped_locked: int = 0
    failed_orgs: list[int] = field(default_factory=list)  # left open, each logged with its error
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)


def _take_numbers(series: str, count: int) -> int:
    """Reserve ``count`` consecutive numbers of ``series``; return the first (gapless: the row
    stays locked until the caller's transaction ends, and a rollback returns them)."""
    with connection.cursor() as cur:
        cur.execute("INSERT INTO invoicing_invoicesequence (series, next_number) VALUES (%s, 1) "
                    "ON CONFLICT (series) DO NOTHING", [series])
        cur.execute("UPDATE invoicing_invoicesequence SET next_number = next_number + %s "
                    "WHERE series = %s RETURNING next_number", [count, series])
        return cur.fetchone()[0] - count


def _series(kind: str, at: datetime) -> str:
    return f"{'INV' if kind == InvoiceKind.INVOICE else 'CN'}-{at:%Y}"


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
        applications = credit_grants_apply(
            organization=Organization(pk=org_id), currency=draft.currency, amount=draft.total,
            reference=_credit_reference(draft.target), at=now)
        draft.add_credit(sum((a.amount for a in applications), ZERO))


def _persist(drafts: list[DraftInvoice], *, now: datetime) -> list[Invoice]:
    """Insert finalized invoices, their lines and billed-usage rows; return the invoices."""
    if not drafts:
        return []
    series = _series(InvoiceKind.INVOICE, now)
    first = _take_numbers(series, len(drafts))
    net = timedelta(days=settings.INVOICING_NET_DAYS)
    invoices = Invoice.objects.bulk_create([
        Invoice(public_id=_public_id("in"), organization_id=d.target.org_id,
                kind=InvoiceKind.INVOICE, number=f"{series}-{first + i:06d}",
                status=InvoiceStatus.DRAFT, currency=d.currency,
                period_start=d.target.period_start, period_end=d.target.period_end,
                tax_rate=d.target.tax_rate, subtotal=d.subtotal, tax=d.tax,
                credits_applied=d.credits_applied, total=d.total, amount_due=d.total,
                created_at=now)
        for i, d in enumerate(drafts)], batch_size=2000)
    lines, billed = [], []
    for invoice, d in zip(invoices, drafts, strict=True):
        for pos, ln in enumerate(d.lines, start=1):
            lines.append(InvoiceLine(
                invoice_id=invoice.id, position=pos, kind=ln.kind, description=ln.description,
                model=ln.model, region=ln.region, service_tier=ln.service_tier,
                capacity_source=ln.capacity_source, token_class=ln.token_class,
                source_period_start=ln.source_period_start,
                source_period_end=ln.source_period_end, quantity=ln.quantity, unit=ln.unit,
                unit_price=ln.unit_price, amount_precise=ln.amount_precise, amount=ln.amount,
                details=ln.details))
        for u in d.billed:
            billed.append(BilledUsage(
                invoice_id=invoice.id, organization_id=d.target.org_id,
                source_period_start=u.source_period_start, model=u.model, region=u.region,
                service_tier=u.service_tier, capacity_source=u.capacity_source,
                amount=u.amount, requests=u.requests, prompt_tokens=u.prompt_tokens,
                cached_tokens=u.cached_tokens, completion_tokens=u.completion_tokens,
                input_amount=u.input_amount, cached_input_amount=u.cached_input_amount,
                output_amount=u.output_amount))
    InvoiceLine.objects.bulk_create(lines, batch_size=5000)
    BilledUsage.objects.bulk_create(billed, batch_size=5000)
    ids = [i.id for i in invoices]
    Invoice.objects.filter(id__in=ids, amount_due__gt=0).update(
        status=InvoiceStatus.OPEN, finalized_at=now, due_at=now + net)
    # Nothing to pay (no usage, or credits covered it): settled at once, as Stripe does.
    Invoice.objects.filter(id__in=ids, amount_due__lte=0).update(
        status=InvoiceStatus.PAID, finalized_at=now, due_at=now, paid_at=now)
    return invoices


def _public_id(prefix: str) -> str:
    from billing_platform.accounts.models import public_id

    return public_id(prefix)


def _close_chunk(targets: list[Target], *, now: datetime, enqueue_payments: bool
                 ) -> tuple[int, int]:
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
        invoices = _persist([drafts[t.org_id] for t in todo], now=now)
        if enqueue_payments:
            due = [i.id for i in invoices if i.amount_due > 0]
            transaction.on_commit(lambda: _enqueue_charges(due))
    return len(invoices), len(targets) - len(locked)


MAX_FAILED_ORGS = 20


def _close_isolating(targets: list[Target], *, now: datetime, enqueue_payments: bool,
                     report: CloseReport) -> int:
    """Close a chunk; if it fails, close its halves, down to the organization at fault.

    One organization whose data cannot be invoiced (an amount past the columns' range, a
    constraint broken by hand) is logged and left for a person, and never holds back the
    invoices of the others. What no organization could get past fails the whole run: a
    database that is down (the task retries), a schema or query error (a bug), or more than
    ``MAX_FAILED_ORGS`` organizations failing (the fault is not theirs).
    """
    try:
        created, skipped = _close_chunk(targets, now=now, enqueue_payments=enqueue_payments)
    except (OperationalError, InterfaceError, ProgrammingError):
        raise
    except Exception:
        if len(report.failed_orgs) >= MAX_FAILED_ORGS:
            raise
        if len(targets) > 1:
            mid = len(targets) // 2
            return sum(_close_isolating(part, now=now, enqueue_payments=enqueue_payments,
                                        report=report)
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
    return created


def _close_chunks(chunks: list[list[Target]], *, now: datetime, enqueue_payments: bool,
                  report: CloseReport) -> list[int]:
    """Close the chunks, ``INVOICING_CLOSE_WORKERS`` at a time; return invoices per chunk.

    The usage query of a chunk runs on one PostgreSQL backend (one core), so chunks closed on
    separate connections at once use the database's other cores. Chunks hold disjoint orgs;
    the only lock they share is the invoice-number row, taken at the end of each, so numbers
    stay gapless.
    """
    workers = min(settings.INVOICING_CLOSE_WORKERS, len(chunks))

    def close(part: list[Target]) -> int:
        return _close_isolating(part, now=now, enqueue_payments=enqueue_payments,
                                report=report)

    if workers <= 1 or connection.in_atomic_block:  # inside a transaction: stay in it
        return [close(part) for part in chunks]

    def close_in_thread(part: list[Target]) -> int:
        try:
            return close(part)
        finally:
            connection.close()  # this thread's own connection

    with ThreadPoolExecutor(workers, thread_name_prefix="period-close") as pool:
        return list(pool.map(close_in_thread, chunks))


def _enqueue_charges(invoice_ids: list[int]) -> None:
    from billing_platform.invoicing.tasks import invoice_charge_task

    for invoice_id in invoice_ids:
        invoice_charge_task.delay(invoice_id)


def period_close_run(*, now: datetime | None = None, org_ids: Iterable[int] | None = None,
                     enqueue_payments: bool = True, chunk: int | None = None) -> CloseReport:
    """Invoice every organization whose period ended; safe to run twice or concurrently.

    Each pass closes the oldest unbilled period of every organization, so an organization
    several periods behind gets one invoice per period, in order.
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
        chunks = [targets[i:i + chunk] for i in range(0, len(targets), chunk)]
        created = sum(_close_chunks(chunks, now=now, enqueue_payments=enqueue_payments,
                                    report=report))
        report.invoices += created
        if created == 0:  # everything left is held by a concurrent closer
            break
    return report


def upcoming_invoice(*, organization: Organization, now: datetime | None = None
                     ) -> DraftInvoice:
    """Return the current period's invoice as it stands now (not stored; credits previewed)."""
    now = now or timezone.now()
    (target,) = _targets([(organization.id, organization.currency, organization.tax_rate,
                           organization.created_at)], now=now, due_only=False)
    draft = build_drafts([target])[organization.id]
    left = sum((g.remaining for g in CreditGrant.objects.filter(
        organization=organization, currency=draft.currency, remaining__gt=0,
        granted_at__lte=now).filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now))), ZERO)
    if draft.total > 0 and left > 0:
        draft.add_credit(min(left, draft.total))
    return draft


@transaction.atomic
def invoice_finalize(*, invoice: Invoice, now: datetime | None = None,
                     enqueue_payment: bool = True) -> Invoice:
    """Finalize a draft made by hand (its charge lines already added): tax, credits, number.

    Period close finalizes its own invoices in bulk; this is the same rule for one draft.
    From here on the invoice never changes.
    """
    now = now or timezone.now()
    invoice = Invoice.objects.select_for_update().select_related("organization").get(
        pk=invoice.pk)
    if invoice.status != InvoiceStatus.DRAFT:
        raise Conflict(f"Invoice {invoice.number} is already finalized.", param="status")
    org = invoice.organization
    target = Target(org.id, invoice.currency, org.tax_rate, invoice.period_start,
                    invoice.period_end)
    draft = DraftInvoice(target)
    lines = list(invoice.lines.exclude(kind__in=[LineKind.TAX, LineKind.CREDIT]))
    for ln in lines:
        draft.add(ln.kind, ln.description, ln.amount_precise)
    draft.add_tax()
    if draft.total > 0:
        applied = credit_grants_apply(organization=org, currency=invoice.currency,
                                      amount=draft.total, reference=f"invoice:{invoice.id}",
                                      at=now)
        draft.add_credit(sum((a.amount for a in applied), ZERO))
    invoice.lines.filter(kind__in=[LineKind.TAX, LineKind.CREDIT]).delete()
    position = max((ln.position for ln in lines), default=0)
    for ln in draft.lines[len(lines):]:
        position += 1
        InvoiceLine.objects.create(
            invoice=invoice, position=position, kind=ln.kind, description=ln.description,
            quantity=ln.quantity, unit_price=ln.unit_price, amount_precise=ln.amount_precise,
            amount=ln.amount)
    series = _series(InvoiceKind.INVOICE, now)
    invoice.number = f"{series}-{_take_numbers(series, 1):06d}"
    invoice.tax_rate = org.tax_rate
    invoice.subtotal, invoice.tax = draft.subtotal, draft.tax
    invoice.credits_applied, invoice.total = draft.credits_applied, draft.total
    invoice.amount_due = draft.total
    invoice.finalized_at = now
    if draft.total > 0:
        invoice.status = InvoiceStatus.OPEN
        invoice.due_at = now + timedelta(days=settings.INVOICING_NET_DAYS)
        if enqueue_payment:
            invoice_id = invoice.id
            transaction.on_commit(lambda: _enqueue_charges([invoice_id]))
    else:
        invoice.status, invoice.due_at, invoice.paid_at = InvoiceStatus.PAID, now, now
    invoice.save()
    return invoice


# --- corrections -------------------------------------------------------------------------------

def _reactivate_if_settled(organization: Organization) -> None:
    account = BillingAccount.objects.filter(organization=organization).first()
    if account is None or not account.suspended_for_nonpayment:
        return
    if Invoice.objects.filter(organization=organization,
                              status=InvoiceStatus.UNCOLLECTIBLE).exists():
        return
    account.suspended_for_nonpayment = False
    account.save(update_fields=["suspended_for_nonpayment"])
    if organization.status == OrgStatus.SUSPENDED:
        organization_update(organization=organization, status=OrgStatus.ACTIVE)


def _invoice_state(invoice: Invoice) -> dict[str, str]:
    """The audited view of an invoice's payment state (money as decimal strings)."""
    def text(value: Decimal) -> str:
        return str(quantize_money(value, invoice.currency))

    return {"status": str(invoice.status), "amount_due": text(invoice.amount_due),
            "amount_paid": text(invoice.amount_paid), "currency": invoice.currency}


@transaction.atomic
def invoice_void(*, invoice: Invoice, reason: str = "", acting_user) -> Invoice:
    """Void an unpaid finalized invoice; credits it used are granted back as a credit note."""
    invoice = Invoice.objects.select_for_update().get(pk=invoice.pk)
    if invoice.status not in (InvoiceStatus.OPEN, InvoiceStatus.UNCOLLECTIBLE):
        raise Conflict(f"A {invoice.status} invoice cannot be voided.", param="status")
    before = _invoice_state(invoice)
    invoice.status = InvoiceStatus.VOID
    invoice.voided_at = timezone.now()
    invoice.next_payment_attempt_at = None
    invoice.memo = reason[:500]
    invoice.save(update_fields=["status", "voided_at", "next_payment_attempt_at", "memo"])
    if invoice.credits_applied > 0:
        credit_grant_create(organization=invoice.organization, kind=CreditGrantKind.CREDIT_NOTE,
                            amount=invoice.credits_applied, currency=invoice.currency,
                            note=f"Credits returned from void invoice {invoice.number}",
                            acting_user=acting_user)
    audit_record(acting_user=acting_user, organization=invoice.organization_id,
                 action="invoice.void", target=invoice.public_id, before=before,
                 after={**_invoice_state(invoice), "reason": invoice.memo,
                        "credits_returned": str(quantize_money(invoice.credits_applied,
                                                               invoice.currency))})
    _reactivate_if_settled(invoice.organization)
    return invoice


@transaction.atomic
def credit_note_create(*, invoice: Invoice, amount: Decimal, reason: str,
                       acting_user) -> Invoice:
    """Issue a credit note against a finalized invoice; its amount becomes a credit grant."""
    invoice = Invoice.objects.select_for_update().get(pk=invoice.pk)
    if invoice.kind != InvoiceKind.INVOICE or invoice.status in (InvoiceStatus.DRAFT,
                                                                 InvoiceStatus.VOID):
        raise Conflict("Credit notes correct finalized, non-void invoices.", param="invoice")
    if not isinstance(amount, Decimal) or amount <= 0 or quantize_money(
            amount, invoice.currency) != amount:
        raise InvalidRequest("amount must be a positive Decimal in minor units.", param="amount")
    credited = sum((cn.total for cn in invoice.credit_notes.all()), ZERO)
    if amount > invoice.total + credited:  # credited is negative
        raise InvalidRequest("A credit note cannot exceed what the invoice charged.",
                             param="amount")
    now = timezone.now()
    series = _series(InvoiceKind.CREDIT_NOTE, now)
    note = Invoice.objects.create(
        organization=invoice.organization, kind=InvoiceKind.CREDIT_NOTE,
        number=f"{series}-{_take_numbers(series, 1):06d}", status=InvoiceStatus.DRAFT,
        currency=invoice.currency, period_start=invoice.period_start,
        period_end=invoice.period_end, subtotal=-amount, total=-amount, amount_due=ZERO,
        corrects=invoice, memo=reason[:500])
    InvoiceLine.objects.create(invoice=note, position=1, kind=LineKind.ADJUSTMENT,
                               description=f"Credit for {invoice.number}: {reason}"[:300],
                               quantity=Decimal(1), amount_precise=-amount, amount=-amount)
    note.status, note.finalized_at, note.paid_at = InvoiceStatus.PAID, now, now
    note.save(update_fields=["status", "finalized_at", "paid_at"])
    credit_grant_create(organization=invoice.organization, kind=CreditGrantKind.CREDIT_NOTE,
                        amount=amount, currency=invoice.currency,
                        note=f"Credit note {note.number} for {invoice.number}",
                        acting_user=acting_user)
    audit_record(acting_user=acting_user, organization=invoice.organization_id,
                 action="credit_note.create", target=note.public_id,
                 after={"number": note.number, "corrects": invoice.public_id,
                        "amount": str(amount), "currency": note.currency, "reason": note.memo})
    return note


# --- payments ----------------------------------------------------------------------------------

def billing_account_ensure_customer(*, organization: Organization) -> BillingAccount:
    """Return the org's billing account with a Stripe customer, creating it exactly once."""
    BillingAccount.objects.bulk_create([BillingAccount(organization=organization)],
                                       ignore_conflicts=True)
    with transaction.atomic():
        account = BillingAccount.objects.select_for_update().get(organization=organization)
        if not account.stripe_customer_id:
            account.stripe_customer_id = stripe_client.customer_create(
                email=organization.billing_email, name=organization.name,
                org_public_id=organization.public_id)
            account.save(update_fields=["stripe_customer_id"])
    return account


def _notify(invoice: Invoice, subject: str, body: str) -> None:
    email = invoice.organization.billing_email
    transaction.on_commit(lambda: send_mail(subject=subject, message=body, from_email=None,
                                            recipient_list=[email]))


def _money_text(invoice: Invoice, value: Decimal) -> str:
    return f"{value:.{minor_units(invoice.currency)}f} {invoice.currency}"


def _payment_failed(invoice: Invoice, attempt: PaymentAttempt, *, now: datetime) -> None:
    """Book one failed attempt (invoice locked): schedule a retry, or give up and suspend."""
    schedule = settings.INVOICING_DUNNING_DAYS
    invoice.payment_failures += 1
    amount = _money_text(invoice, invoice.amount_due)
    if invoice.payment_failures <= len(schedule):
        invoice.next_payment_attempt_at = now + timedelta(
            days=schedule[invoice.payment_failures - 1])
        invoice.save(update_fields=["payment_failures", "next_payment_attempt_at"])
        _notify(invoice, f"Payment failed for invoice {invoice.number}",
                f"We could not charge {amount} for invoice {invoice.number} "
                f"({attempt.failure_message or attempt.failure_code}). We will try again on "
                f"{invoice.next_payment_attempt_at:%Y-%m-%d}. Please check your payment method.")
        return
    invoice.status = InvoiceStatus.UNCOLLECTIBLE
    invoice.marked_uncollectible_at = now
    invoice.next_payment_attempt_at = None
    invoice.save(update_fields=["payment_failures", "status", "marked_uncollectible_at",
                                "next_payment_attempt_at"])
    organization = invoice.organization
    BillingAccount.objects.filter(organization=organization).update(
        suspended_for_nonpayment=True)
    if organization.status == OrgStatus.ACTIVE:
        organization_update(organization=organization, status=OrgStatus.SUSPENDED)
    _notify(invoice, f"Service suspended: invoice {invoice.number} is unpaid",
            f"After {invoice.payment_failures} failed attempts invoice {invoice.number} "
            f"({amount}) is marked uncollectible and API access is suspended until it is paid.")


def _payment_succeeded(invoice: Invoice, *, amount: Decimal, now: datetime, acting_user,
                       action: str, details: dict[str, str]) -> bool:
    """Mark a (locked) invoice paid and audit it; return whether it changed."""
    if invoice.status not in (InvoiceStatus.OPEN, InvoiceStatus.UNCOLLECTIBLE):
        return False
    before = _invoice_state(invoice)
    invoice.status = InvoiceStatus.PAID
    invoice.amount_paid = amount
    invoice.paid_at = now
    invoice.next_payment_attempt_at = None
    invoice.save(update_fields=["status", "amount_paid", "paid_at", "next_payment_attempt_at"])
    audit_record(acting_user=acting_user, organization=invoice.organization_id, action=action,
                 target=invoice.public_id, before=before,
                 after={**_invoice_state(invoice), **details})
    _reactivate_if_settled(invoice.organization)
    return True


def invoice_charge(*, invoice_id: int, now: datetime | None = None) -> str:
    """Charge an open invoice's amount due once; return what happened.

    Outcomes: ``not_due`` (paid, void, nothing due, or a retry not due yet),
    ``no_payment_method`` (left open for manual payment), ``in_progress`` (an attempt is
    pending or succeeded already: never a second charge), ``pending``, ``succeeded``,
    ``failed``. Stripe network errors propagate (the task retries with backoff and the same
    idempotency key).

    Two short transactions around the Stripe call, never a row lock held across it: the
    attempt (with its idempotency key) is committed first, then sent, then its answer
    recorded. An attempt committed but never answered here (a network error, a worker killed
    mid-call) is sent again with the same key on the next run, and Stripe replays its first
    answer instead of charging again.
    """
    now = now or timezone.now()
    invoice = Invoice.objects.select_related("organization").get(pk=invoice_id)
    if invoice.status != InvoiceStatus.OPEN or invoice.amount_due <= 0:
        return "not_due"
    account = billing_account_ensure_customer(organization=invoice.organization)
    payment_method = stripe_client.default_payment_method(account.stripe_customer_id)
    if not payment_method:
        return "no_payment_method"
    attempt = _charge_attempt_begin(invoice_id=invoice_id, now=now)
    if isinstance(attempt, str):
        return attempt
    return _charge_attempt_send(attempt, customer_id=account.stripe_customer_id,
                                payment_method=payment_method, now=now)


@transaction.atomic
def _charge_attempt_begin(*, invoice_id: int, now: datetime) -> PaymentAttempt | str:
    """Commit the attempt to send (a new one, or one sent before whose answer was lost)."""
    invoice = Invoice.objects.select_for_update().get(pk=invoice_id)
    if invoice.status != InvoiceStatus.OPEN:
        return "not_due"
    last = invoice.payments.order_by("-number").first()
    if last is not None and last.status == PaymentStatus.PENDING and \
            not last.stripe_payment_intent_id:
        return last  # sent, answer never recorded: send again with the same key
    if last is not None and last.status != PaymentStatus.FAILED:
        return "in_progress"
    if last is not None and (invoice.next_payment_attempt_at is None
                             or invoice.next_payment_attempt_at > now):
        return "not_due"
    number = last.number + 1 if last else 1
    return PaymentAttempt.objects.create(
        invoice=invoice, number=number, idempotency_key=f"invoice:{invoice.id}:charge:{number}",
        amount=invoice.amount_due, currency=invoice.currency, created_at=now, updated_at=now)


def _charge_attempt_send(attempt: PaymentAttempt, *, customer_id: str, payment_method: str,
                         now: datetime) -> str:
    """Send one attempt to Stripe (no lock held), then record its answer."""
    invoice = attempt.invoice
    try:
        intent = stripe_client.payment_intent_create(
            amount=to_minor_units(attempt.amount, attempt.currency), currency=attempt.currency,
            customer_id=customer_id, payment_method=payment_method,
            idempotency_key=attempt.idempotency_key,
            metadata={"invoice_id": str(invoice.id), "invoice": invoice.number or "",
                      "attempt": str(attempt.number)})
    except stripe.CardError as exc:
        error = exc.error
        with transaction.atomic():
            # attempt, then invoice: the order webhooks lock them in
            attempt = PaymentAttempt.objects.select_for_update().get(pk=attempt.pk)
            invoice = (Invoice.objects.select_for_update().select_related("organization")
                       .get(pk=invoice.pk))
            if attempt.status != PaymentStatus.PENDING:
                return str(attempt.status)  # a webhook recorded it meanwhile
            attempt.status = PaymentStatus.FAILED
            attempt.failure_code = (getattr(error, "code", None) or "card_declined")[:100]
            attempt.failure_message = (getattr(error, "message", None) or str(exc))[:500]
            charge = getattr(error, "payment_intent", None)
            if charge is not None:
                attempt.stripe_payment_intent_id = charge.get("id", "")
            attempt.updated_at = now
            attempt.save()
            if invoice.status == InvoiceStatus.OPEN:
                invoice.next_payment_attempt_at = None
                _payment_failed(invoice, attempt, now=now)
        return "failed"
    with transaction.atomic():
        attempt = PaymentAttempt.objects.select_for_update().get(pk=attempt.pk)
        attempt.stripe_payment_intent_id = intent.id
        if attempt.status == PaymentStatus.PENDING and intent.status == "succeeded":
            attempt.status = PaymentStatus.SUCCEEDED
        attempt.updated_at = now
        attempt.save(update_fields=["stripe_payment_intent_id", "status", "updated_at"])
    return str(attempt.status)


def invoices_dunning_run(*, now: datetime | None = None) -> list[int]:
    """Return the open invoices whose retry is due (the task enqueues a charge for each)."""
    now = now or timezone.now()
    return list(Invoice.objects.filter(status=InvoiceStatus.OPEN,
                                       next_payment_attempt_at__lte=now)
                .order_by("next_payment_attempt_at").values_list("id", flat=True))


def _money_minor_text(minor: object, currency: str) -> str:
    if not isinstance(minor, int) or isinstance(minor, bool):
        return f"{minor!r} (not an amount)"
    return f"{Decimal(minor).scaleb(-minor_units(currency)):.{minor_units(currency)}f} {currency}"


def _review(*, organization_id: int | None, target: str, reason: str,
            details: dict[str, str]) -> str:
    """Record a payment that settles nothing for finance (an audit row); return the outcome."""
    audit_record(acting_user=None, organization=organization_id, action="payment.review",
                 target=target, after={"reason": reason, **details})
    log.warning("payment left for finance review: %s (%s)", reason, target)
    return f"review: {reason}"[:300]


def _unknown_payment_intent(intent: dict, *, pi_id: str) -> str:
    """A PaymentIntent no charge attempt of ours recorded: believe nothing it says."""
    if intent.get("status") != "succeeded":
        return "ignored: not a payment this platform created"
    metadata = intent.get("metadata") or {}
    claimed, number = str(metadata.get("invoice_id") or ""), str(metadata.get("attempt") or "")
    # The answer to our own charge can still be on its way here: an attempt is committed before
    # Stripe is called and its PaymentIntent id recorded after the answer. Such an attempt is
    # settled by payments_sync, which sends it again with its key and reads Stripe's answer; this
    # event pays nothing either way.
    if claimed.isdigit() and number.isdigit() and PaymentAttempt.objects.filter(
            invoice_id=int(claimed), number=int(number), status=PaymentStatus.PENDING,
            stripe_payment_intent_id="").exists():
        return "deferred: the charge's answer is not recorded yet; payments_sync settles it"
    return _review(
        organization_id=None, target=pi_id[:80],
        reason="a PaymentIntent this platform did not create"
               + (f" claims invoice id {claimed[:40]}" if claimed else ""),
        details={"payment_intent": pi_id, "claimed_invoice_id": claimed[:40],
                 "amount_received": str(intent.get("amount_received")),
                 "currency": str(intent.get("currency") or "")[:8]})


def _payment_intent_succeeded(intent: dict, *, attempt: PaymentAttempt, invoice: Invoice,
                              now: datetime) -> str:
    """Pay the (locked) invoice if the PaymentIntent received exactly its amount due."""
    if attempt.status == PaymentStatus.NEEDS_REVIEW:
        return "no change: held for finance review"
    if invoice.status == InvoiceStatus.PAID and attempt.status == PaymentStatus.SUCCEEDED:
        return "no change"  # a replay, or the sync and the webhook both reporting it
    received = intent.get("amount_received")
    currency = str(intent.get("currency") or "").upper()
    due = to_minor_units(invoice.amount_due, invoice.currency)
    def minor(value: object) -> str:
        return _money_minor_text(value, invoice.currency)

    code, problem = "", ""
    if currency != invoice.currency.upper():
        code = "currency_mismatch"
        problem = f"received {currency or 'no currency'}, the invoice is in {invoice.currency}"
    elif received != due or isinstance(received, bool):
        code, problem = "amount_mismatch", f"received {minor(received)} of {minor(due)} due"
    elif invoice.status not in (InvoiceStatus.OPEN, InvoiceStatus.UNCOLLECTIBLE,
                                InvoiceStatus.PAID):
        code = "invoice_not_payable"
        problem = f"received the amount due of a {invoice.status} invoice"
    if problem:
        attempt.status = PaymentStatus.NEEDS_REVIEW
        attempt.failure_code = code
        attempt.failure_message = problem[:500]
        attempt.updated_at = now
        attempt.save(update_fields=["status", "failure_code", "failure_message", "updated_at"])
        return _review(organization_id=invoice.organization_id, target=invoice.public_id,
                       reason=f"invoice {invoice.number}: {problem}",
                       details={"payment_intent": attempt.stripe_payment_intent_id,
                                "attempt": attempt.idempotency_key})
    if attempt.status != PaymentStatus.SUCCEEDED:
        attempt.status, attempt.updated_at = PaymentStatus.SUCCEEDED, now
        attempt.save(update_fields=["status", "updated_at"])
    paid = _payment_succeeded(
        invoice, amount=invoice.amount_due, now=now, acting_user=None, action="invoice.pay",
        details={"method": "stripe", "payment_intent": attempt.stripe_payment_intent_id})
    return "paid" if paid else "no change"


def _apply_payment_intent(intent: dict, *, now: datetime) -> str:
    """Apply a PaymentIntent's state (from a verified webhook or a sync) to our invoice.

    Only a PaymentIntent this platform created is believed: it is found by the id recorded on
    our charge attempt, never by its metadata (whoever can create a PaymentIntent on the Stripe
    account writes what metadata they like). It pays the invoice only when it received exactly
    the amount due, in the invoice's currency. Anything else books nothing, marks the attempt
    ``needs_review`` (no further charge is made) and returns ``review: <reason>``, with an
    audit row, for finance. Idempotent.
    """
    pi_id = str(intent.get("id") or "")
    attempt = (PaymentAttempt.objects.select_for_update().filter(stripe_payment_intent_id=pi_id)
               .first() if pi_id else None)
    if attempt is None:
        return _unknown_payment_intent(intent, pi_id=pi_id)
    invoice = (Invoice.objects.select_for_update().select_related("organization")
               .get(pk=attempt.invoice_id))
    status = intent.get("status")
    if status == "succeeded":
        return _payment_intent_succeeded(intent, attempt=attempt, invoice=invoice, now=now)
    if status in ("requires_payment_method", "canceled"):
        if attempt.status in (PaymentStatus.FAILED, PaymentStatus.NEEDS_REVIEW):
            return "no change"
        error = intent.get("last_payment_error") or {}
        attempt.status = PaymentStatus.FAILED
        attempt.failure_code = (error.get("code") or status)[:100]
        attempt.failure_message = (error.get("message") or "")[:500]
        attempt.updated_at = now
        attempt.save()
        if invoice.status == InvoiceStatus.OPEN:
            _payment_failed(invoice, attempt, now=now)
        return "failed"
    return "no change"


def _customer_updated(customer: dict, *, now: datetime) -> str:
    """A customer with a default payment method (a new card after a decline, or a first one):
    retry the org's open invoices now instead of at the next dunning date, as Stripe does."""
    if not (customer.get("invoice_settings") or {}).get("default_payment_method"):
        return "no change: no default payment method"
    customer_id = customer.get("id")
    account = (BillingAccount.objects.filter(stripe_customer_id=customer_id).first()
               if customer_id else None)
    if account is None:
        return "ignored: not one of our customers"
    due = list(Invoice.objects.select_for_update()
               .filter(organization_id=account.organization_id, status=InvoiceStatus.OPEN,
                       amount_due__gt=0)
               .filter(Q(next_payment_attempt_at__isnull=True)
                       | Q(next_payment_attempt_at__gt=now)))
    for invoice in due:
        invoice.next_payment_attempt_at = now
        invoice.save(update_fields=["next_payment_attempt_at"])
    ids = [i.id for i in due]
    transaction.on_commit(lambda: _enqueue_charges(ids))
    return f"retrying {len(ids)} open invoice(s)"


PAYMENT_INTENT_EVENTS = frozenset({"payment_intent.succeeded", "payment_intent.payment_failed",
                                   "payment_intent.canceled"})


# Stripe's events are a few kB (lists inside them are truncated); a body past this is refused
# unread, before its signature is even computed.
STRIPE_WEBHOOK_MAX_BYTES = 1024 * 1024


class WebhookNotConfigured(DomainError):
    """The endpoint has no signing secret, so no delivery can be told from a forgery."""

    code = "webhook_not_configured"
    status = 503


class PayloadTooLarge(DomainError):
    code = "payload_too_large"
    status = 413


def stripe_webhook_receive(*, payload: bytes, signature: str) -> StripeEvent:
    """Verify a webhook's signature, then store its raw body and apply it exactly once.

    Nothing the sender wrote is believed or stored before the signature verifies against
    ``STRIPE_WEBHOOK_SECRET``. With no secret set nothing is accepted
    (``WebhookNotConfigured``, naming the setting); a body over ``STRIPE_WEBHOOK_MAX_BYTES``
    is refused unread (``PayloadTooLarge``); a bad signature is recorded by its size only
    (``InvalidRequest``). A verified event that pays nothing it claims is ``needs_review``.
    """
    if not settings.STRIPE_WEBHOOK_SECRET.strip():
        raise WebhookNotConfigured(
            "Stripe webhooks are refused: STRIPE_WEBHOOK_SECRET is not set. Set it to this "
            "endpoint's signing secret (whsec_...) from Stripe's webhook settings.",
            param="STRIPE_WEBHOOK_SECRET")
    if len(payload) > STRIPE_WEBHOOK_MAX_BYTES:
        raise PayloadTooLarge(f"A Stripe webhook body is at most {STRIPE_WEBHOOK_MAX_BYTES} "
                              "bytes.", param="body")
    try:
        event = stripe_client.webhook_event(payload, signature)
    except (stripe.SignatureVerificationError, ValueError) as exc:
        StripeEvent.objects.create(payload="", payload_bytes=len(payload),
                                   signature=signature[:500],
                                   outcome=f"rejected: {type(exc).__name__}"[:300])
        raise InvalidRequest("Invalid Stripe signature.", param="Stripe-Signature") from exc
    body = event.to_dict()
    obj = (body.get("data") or {}).get("object") or {}
    now = timezone.now()
    with transaction.atomic():
        raw = StripeEvent(stripe_id=body.get("id") or None, type=str(body.get("type") or "")[:100],
                          payload=payload.decode("utf-8", errors="replace"),
                          payload_bytes=len(payload), signature=signature[:500], verified=True,
                          received_at=now)
        try:
            with transaction.atomic():  # waits for a concurrent delivery of the same event
                raw.save()
        except IntegrityError:
            raw.stripe_id = None
            raw.outcome, raw.processed_at = "duplicate: already processed", now
            raw.save()
            return raw
        if raw.stripe_id is None:
            raw.outcome = "ignored: no event id"
        elif raw.type in PAYMENT_INTENT_EVENTS:
            raw.outcome = _apply_payment_intent(obj, now=now)
        elif raw.type == "customer.updated":
            raw.outcome = _customer_updated(obj, now=now)
        else:
            raw.outcome = "ignored: event type not handled"
        raw.outcome = raw.outcome[:300]
        raw.needs_review = raw.outcome.startswith("review:")
        raw.processed_at = now
        raw.save(update_fields=["outcome", "needs_review", "processed_at"])
    return raw


def payments_sync(*, older_than: timedelta = timedelta(minutes=30),
                  now: datetime | None = None) -> int:
    """Settle attempts still unsettled here; return how many invoices moved.

    Attempts whose answer never arrived (the worker died mid-call, retries ran out) are sent
    again with their key; attempts Stripe answered are read back from Stripe (a webhook lost).
    """
    now = now or timezone.now()
    moved: set[int] = set()
    for invoice_id in (PaymentAttempt.objects
                       .filter(invoice__status=InvoiceStatus.OPEN, status=PaymentStatus.PENDING,
                               stripe_payment_intent_id="", updated_at__lte=now - older_than)
                       .values_list("invoice_id", flat=True)):
        if invoice_charge(invoice_id=invoice_id, now=now) in ("succeeded", "failed"):
            moved.add(invoice_id)
    for attempt_id, invoice_id, pi_id in (
            PaymentAttempt.objects
            .filter(invoice__status=InvoiceStatus.OPEN,
                    status__in=[PaymentStatus.PENDING, PaymentStatus.SUCCEEDED],
                    updated_at__lte=now - older_than)
            .exclude(stripe_payment_intent_id="")
            .values_list("id", "invoice_id", "stripe_payment_intent_id")):
        intent = stripe_client.payment_intent_retrieve(pi_id).to_dict()
        with transaction.atomic():
            if _apply_payment_intent(intent, now=now) in ("paid", "failed"):
                moved.add(invoice_id)
        log.info("payment attempt %s synced from Stripe", attempt_id)
    return len(moved)


@transaction.atomic
def invoice_mark_paid(*, invoice: Invoice, amount: Decimal | None = None,
                      now: datetime | None = None, acting_user) -> Invoice:
    """Record a payment made outside Stripe (bank transfer) for an open/uncollectible invoice."""
    invoice = Invoice.objects.select_for_update().select_related("organization").get(
        pk=invoice.pk)
    if not _payment_succeeded(invoice, amount=invoice.amount_due if amount is None else amount,
                              now=now or timezone.now(), acting_user=acting_user,
                              action="invoice.mark_paid", details={"method": "out_of_band"}):
        raise Conflict(f"A {invoice.status} invoice cannot be paid.", param="status")
    return invoice
