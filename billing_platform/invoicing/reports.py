"""Reads of invoicing's tables for finance's reports across organizations (raw SQL, its owner).

``billing_platform.finance.reports`` composes these into report rows; nothing here knows about
HTTP, CSV or organizations' names. What counts, once for every report:

- **Billed**: finalized invoices and credit notes (``open``, ``paid``, ``uncollectible``), by
  the start of the billing period they are for; a credit note carries its invoice's period, so
  it reduces the period it corrects. Drafts are not documents yet; a ``void`` invoice was
  cancelled and is no revenue. An ``uncollectible`` invoice stays billed revenue: the loss is
  the receivables report's (written off), not a correction of what was sold.
- **Unbilled** (accrued): the usage each organization's next invoice will bill, rated and not
  invoiced yet: its events from the start of its open period on (``periods_open``: the oldest
  period without an invoice), and late usage of its finalized periods that no invoice billed
  yet (the builder's own rule, so the report and the next invoice cannot disagree).
- **Receivable**: what finalized invoices still owe (``amount_due``), aged by days past
  ``due_at``.

Billed revenue across organizations is read off ``BilledRevenue``, the summary the database
writes as invoices are finalized and voided (``billed_lines``); ``billed_lines_summed`` is the
same sums off the lines themselves, the definition the summary is tested against.

Length: every report's query on invoicing's tables is here (STYLE.md: each app owns its
tables), one section per report; split it by report when another one joins.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any, NamedTuple

from django.db import transaction
from django.db.backends.utils import CursorWrapper

from billing_platform.db import reading_connection
from billing_platform.invoicing.builder import late_usage_of
from billing_platform.invoicing.models import Invoice
from billing_platform.invoicing.selectors import LastClose, periods_open_and_last_closes
from metering.selectors import (
    BUCKET_UNITS,
    usage_late_hours,
    usage_recorded_after,
    usage_sums_since,
)

# A report's aggregates hash every line or rollup row it reads; PostgreSQL's default 4 MB
# made them sort on disk instead (measured 2x slower at 1,000 orgs x 12 months).
REPORT_WORK_MEM = "64MB"


@contextlib.contextmanager
def _report_cursor() -> Iterator[CursorWrapper]:
    """Yield a cursor whose transaction lets a report's aggregate hash in memory, without JIT:
    a report across every organization is estimated costly enough for PostgreSQL to compile
    it, and compiling took 1.6 s of the accrued sums' 2.2 s (2,000 orgs in
    bench/finance_reports.py) for a query that runs once."""
    conn = reading_connection()
    with transaction.atomic(using=conn.alias), conn.cursor() as cur:
        cur.execute(f"SET LOCAL work_mem = '{REPORT_WORK_MEM}'")
        cur.execute("SET LOCAL jit = off")
        yield cur


# Statuses whose documents count as billed (drafts are not documents; void ones are cancelled)
BILLED_STATUSES = ("open", "paid", "uncollectible")
# Statuses that still owe money
RECEIVABLE_STATUSES = ("open", "uncollectible")
AGING_BUCKETS = ("current", "0-30", "31-60", "61-90", "90+")


@dataclass(frozen=True)
class LineFilter:
    """Which billed lines to sum: a billing-period range [start, end) and optional dimensions.

    ``org_id`` narrows to one organization; the other fields to one value of that column.
    """

    start: datetime
    end: datetime
    currency: str | None = None
    org_id: int | None = None
    model: str | None = None
    region: str | None = None
    service_tier: str | None = None
    token_class: str | None = None


class BilledLines(NamedTuple):
    """Sums of billed lines per bucket x document x line kind x dimensions x currency.

    ``kind`` is the line's kind, or ``credit_note`` for every line of a credit note.
    ``plan_code`` is the plan a plan-fee line charges ("" otherwise). ``amount`` is the sum
    of the lines' rounded amounts (what the documents say); ``tokens`` the usage lines'
    quantities.
    """

    bucket: datetime
    currency: str
    kind: str
    capacity_source: str
    plan_code: str
    model: str
    region: str
    service_tier: str
    token_class: str
    amount: Decimal
    tokens: Decimal


def _where(f: LineFilter, params: dict[str, Any], invoice: str = "i", line: str = "l") -> str:
    """Return the optional conditions of ``f`` (bound in ``params``) on the tables aliased
    ``invoice`` and ``line``."""
    conditions = []
    for table, column, value in (
            (invoice, "currency", f.currency), (invoice, "organization_id", f.org_id),
            (line, "model", f.model), (line, "region", f.region),
            (line, "service_tier", f.service_tier), (line, "token_class", f.token_class)):
        if value is not None:
            params[column] = value
            conditions.append(f" AND {table}.{column} = %({column})s")
    return "".join(conditions)


_BILLED_SQL = """
SELECT date_trunc(%(unit)s, i.period_start, 'UTC'), i.currency,
       CASE WHEN i.kind = 'credit_note' THEN 'credit_note' ELSE l.kind END,
       l.capacity_source,
       CASE WHEN l.kind = 'plan_fee' THEN COALESCE(l.details ->> 'plan', '') ELSE '' END,
       l.model, l.region, l.service_tier, l.token_class,
       SUM(l.amount), COALESCE(SUM(l.quantity) FILTER (WHERE l.unit = 'tokens'), 0)
  FROM invoicing_invoice i
  JOIN invoicing_invoiceline l ON l.invoice_id = i.id
 WHERE i.status IN ('open', 'paid', 'uncollectible')
   AND i.period_start >= %(start)s AND i.period_start < %(end)s{where}
 GROUP BY 1, 2, 3, 4, 5, 6, 7, 8, 9
"""


# The same sums off ``BilledRevenue``, which the database keeps per billing period start and
# key as invoices are finalized and voided (migration 0008): a few rows per period instead of
# every line. ``lines`` counts the billed lines of a key, so a key only voided invoices had
# is no row, as it is none of the lines'.
_SUMMARY_SQL = """
SELECT date_trunc(%(unit)s, s.period_start, 'UTC'), s.currency, s.kind, s.capacity_source,
       s.plan_code, s.model, s.region, s.service_tier, s.token_class, SUM(s.amount),
       SUM(s.tokens)
  FROM invoicing_billedrevenue s
 WHERE s.period_start >= %(start)s AND s.period_start < %(end)s{where}
 GROUP BY 1, 2, 3, 4, 5, 6, 7, 8, 9
HAVING SUM(s.lines) > 0
"""


def billed_lines(*, line_filter: LineFilter, unit: str = "month") -> list[BilledLines]:
    """Return the billed lines' sums per ``unit`` bucket of the period start and dimensions.

    Per bucket and currency the amounts add up to the billed documents' totals to the cent
    (an invoice's total is the sum of its lines, tax and credits applied included). One
    query, off the ``BilledRevenue`` summary (equal to ``billed_lines_summed``'s sums of the
    lines themselves), or off the lines for one organization (the summary is across
    organizations); rows in no particular order.
    """
    if line_filter.org_id is not None:
        return billed_lines_summed(line_filter=line_filter, unit=unit)
    return _billed(_SUMMARY_SQL, line_filter, unit, invoice="s", line="s")


def billed_lines_summed(*, line_filter: LineFilter, unit: str = "month") -> list[BilledLines]:
    """Return what ``billed_lines`` does, summed off every billed invoice line (the
    definition the summary keeps; a sort of every line by nine text columns would cost more
    than the rest of the query, so rows come in no particular order)."""
    return _billed(_BILLED_SQL, line_filter, unit, invoice="i", line="l")


def _billed(sql: str, f: LineFilter, unit: str, *, invoice: str, line: str
            ) -> list[BilledLines]:
    if unit not in BUCKET_UNITS:
        raise ValueError(f"unit must be one of {sorted(BUCKET_UNITS)}")
    params: dict[str, Any] = {"unit": unit, "start": f.start, "end": f.end}
    with _report_cursor() as cur:
        cur.execute(sql.format(where=_where(f, params, invoice, line)), params)
        return [BilledLines._make(row) for row in cur]


_TOTALS_SQL = """
SELECT date_trunc(%(unit)s, i.period_start, 'UTC'), i.currency, COUNT(*), SUM(i.total)
  FROM invoicing_invoice i
 WHERE i.status IN ('open', 'paid', 'uncollectible')
   AND i.period_start >= %(start)s AND i.period_start < %(end)s{where}
 GROUP BY 1, 2
 ORDER BY 1, 2
"""


def billed_totals(*, start: datetime, end: datetime, unit: str = "month",
                  currency: str | None = None, org_id: int | None = None
                  ) -> list[tuple[datetime, str, int, Decimal]]:
    """Return (bucket, currency, documents, sum of totals) of the billed documents."""
    if unit not in BUCKET_UNITS:
        raise ValueError(f"unit must be one of {sorted(BUCKET_UNITS)}")
    params: dict[str, Any] = {"unit": unit, "start": start, "end": end}
    sql = _TOTALS_SQL.format(where=_where(LineFilter(start, end, currency, org_id), params))
    with reading_connection().cursor() as cur:
        cur.execute(sql, params)
        return [(b, c, int(n), total) for b, c, n, total in cur]


# --- unbilled (accrued) usage ----------------------------------------------------------------

class UnbilledUsage(NamedTuple):
    """Usage rated and not invoiced yet, per bucket of the open period's start x dimensions.

    Exact amounts (10 places) per token class, as the next invoices will bill them.
    """

    bucket: datetime
    model: str
    region: str
    service_tier: str
    capacity_source: str
    currency: str
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    input_amount: Decimal
    cached_input_amount: Decimal
    output_amount: Decimal


def bucket_of(unit: str, at: datetime) -> datetime:
    """Return ``at`` truncated to ``unit`` in UTC, as ``date_trunc(unit, at, 'UTC')`` does."""
    at = at.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    if unit == "day":
        return at
    if unit == "month":
        return at.replace(day=1)
    if unit == "quarter":
        return at.replace(month=(at.month - 1) // 3 * 3 + 1, day=1)
    if unit == "year":
        return at.replace(month=1, day=1)
    raise ValueError(f"unit must be one of {sorted(BUCKET_UNITS)}")


def unbilled_usage(*, org_ids: Sequence[int] | None = None, unit: str = "month",
                   currency: str | None = None) -> list[UnbilledUsage]:
    """Return every organization's rated usage that no invoice billed yet, summed.

    Per bucket (the ``unit`` of the org's open period start) x model x region x tier x
    capacity source x currency. Its sum equals the rated amounts of the events no finalized
    invoice billed: events from the open period's start on (``usage_sums_since``: to the
    microsecond, however late they arrive) plus the late usage of finalized periods that the
    next invoice bills as "late usage" (periods ``_late_candidates`` finds, compared with the
    ledger by the builder's ``late_usage_of``, as period close does). Usage of the open period
    rated in another currency than the org's invoices is reported in its own currency (the
    builder leaves it off invoices and logs it; finance should see it).
    """
    targets, closes = periods_open_and_last_closes(org_ids=org_ids)
    if not targets:
        return []
    with _report_cursor():
        out = [UnbilledUsage(*row) for row in usage_sums_since(
            since={t.org_id: t.period_start for t in targets}, unit=unit, currency=currency)]
        late = late_usage_of(targets, _late_candidates(closes))
    if late:
        # the next invoice bills it, in that invoice's currency
        starts = {t.org_id: t.period_start for t in targets}
        currencies = {t.org_id: t.currency for t in targets}
        for org_id, sums in late.items():
            bucket = bucket_of(unit, starts[org_id])
            for _, u in sums:
                out.append(UnbilledUsage(
                    bucket, u.model, u.region, u.service_tier, u.capacity_source,
                    currencies[org_id], u.prompt_tokens - u.cached_tokens,
                    u.cached_tokens, u.completion_tokens, u.input_amount,
                    u.cached_input_amount, u.output_amount))
        if currency is not None:
            out = [u for u in out if u.currency == currency]
    return out


# How long an ingest transaction may run: an event committed after a close's snapshot was
# recorded (its transaction began) at most this long before it.
INGEST_TXN_MARGIN = timedelta(hours=1)
_HOUR = timedelta(hours=1)
def _late_candidates(closes: Mapping[LastClose, Sequence[int]]
                     ) -> list[tuple[int, datetime, datetime, str]]:
    """Return the finalized periods (org, start, end, currency) that may hold usage no invoice
    billed yet: those with an event recorded after the org's last close.

    Period close bills every event committed before its snapshot, and the next close looks
    again at the periods of its lookback and at every hour metering marked late (an event
    recorded over an hour after its hour ended: ``usage_late_hours``), so an unbilled event of
    a finalized period was recorded after the org's last close (at ``C``, its invoice's
    creation, no later than its snapshot, less ``INGEST_TXN_MARGIN``), and it is either in an
    hour marked late since then, in any finalized period, or unmarked, so recorded within an
    hour of its hour's end: an event time in the last closed period's final hours
    (``C - margin - 2h`` on). Both are looked up instead of summing every period of the
    lookback again as period close does (that was most of the revenue report's time); the
    periods found are then compared with the ledger by the builder's own ``late_usage_of``.
    """
    # per close (most orgs share one): its window and the orgs with an event recorded since
    since = {close: close.closed_at - INGEST_TXN_MARGIN for close in closes}
    recorded = usage_recorded_after(windows=[
        (orgs, max(close.period_start, since[close] - 2 * _HOUR), close.period_end,
         since[close]) for close, orgs in closes.items()])
    found = {(org, close.period_start, close.period_end, close.currency)
             for close, orgs in closes.items() for org in recorded.intersection(orgs)}
    since_of: dict[int, datetime] = {}
    for close, orgs in closes.items():
        since_of.update(dict.fromkeys(orgs, since[close]))
    marked = usage_late_hours(since=since_of)
    if marked:
        for org, ps, pe, currency in (
                Invoice.objects.filter(organization_id__in=list(marked), kind="invoice")
                .exclude(status="draft")
                .values_list("organization_id", "period_start", "period_end", "currency")):
            if any(hour < pe and hour + _HOUR > ps for hour in marked[org]):
                found.add((org, ps, pe, currency))
    return sorted(found)


# --- receivables -----------------------------------------------------------------------------

@dataclass(frozen=True)
class ReceivableFilter:
    """Which unpaid documents: issued (finalized) in [issued_from, issued_to), optionally of
    one currency, organization, aging bucket (``AGING_BUCKETS``) or dunning stage
    (``DUNNING_STAGES``), aged at ``as_of``."""

    as_of: datetime
    issued_from: datetime | None = None
    issued_to: datetime | None = None
    currency: str | None = None
    org_id: int | None = None
    bucket: str | None = None
    stage: str | None = None


# An unpaid invoice's dunning stage, from what payments and finance recorded on it:
# written off by finance, given up by dunning, held by finance, retry scheduled after failed
# charges, failed with no retry left scheduled, or not failed yet (charge pending, or no card:
# paid by transfer).
DUNNING_STAGES = ("awaiting_payment", "retrying", "failed", "paused", "uncollectible",
                  "written_off")
_STAGE_SQL = """CASE
    WHEN i.status = 'uncollectible' AND i.written_off_at IS NOT NULL THEN 'written_off'
    WHEN i.status = 'uncollectible' THEN 'uncollectible'
    WHEN i.dunning_paused_at IS NOT NULL THEN 'paused'
    WHEN i.payment_failures > 0 AND i.next_payment_attempt_at IS NOT NULL THEN 'retrying'
    WHEN i.payment_failures > 0 THEN 'failed'
    ELSE 'awaiting_payment' END"""
# Whole days past due at as_of (negative: not due yet), and the aging bucket of an open one.
_DAYS_SQL = "floor(extract(epoch FROM (%(as_of)s::timestamptz - i.due_at)) / 86400)::int"
_BUCKET_SQL = f"""CASE
    WHEN i.due_at IS NULL OR i.due_at > %(as_of)s THEN 'current'
    WHEN {_DAYS_SQL} <= 30 THEN '0-30'
    WHEN {_DAYS_SQL} <= 60 THEN '31-60'
    WHEN {_DAYS_SQL} <= 90 THEN '61-90'
    ELSE '90+' END"""
_RECEIVABLE_SQL = f"""
SELECT * FROM (
    SELECT i.id, i.public_id, i.number, i.organization_id, i.currency, i.status, i.total,
           i.amount_due, i.amount_paid, i.finalized_at, i.due_at, {_DAYS_SQL} AS days_past_due,
           {_BUCKET_SQL} AS bucket, {_STAGE_SQL} AS stage, i.payment_failures,
           i.next_payment_attempt_at, i.dunning_paused_at, i.marked_uncollectible_at,
           i.written_off_at
      FROM invoicing_invoice i
     WHERE i.status IN ('open', 'uncollectible') AND i.amount_due > 0
       AND i.finalized_at <= %(as_of)s{{where}}
) r
"""  # noqa: S608 (only our own SQL fragments are interpolated)


class ReceivableInvoice(NamedTuple):
    """An unpaid finalized invoice, aged at the filter's ``as_of``."""

    id: int
    public_id: str
    number: str
    org_id: int
    currency: str
    status: str
    total: Decimal
    amount_due: Decimal
    amount_paid: Decimal
    finalized_at: datetime
    due_at: datetime | None
    days_past_due: int | None
    bucket: str
    stage: str
    payment_failures: int
    next_payment_attempt_at: datetime | None
    dunning_paused_at: datetime | None
    marked_uncollectible_at: datetime | None
    written_off_at: datetime | None


def _receivable_where(f: ReceivableFilter, params: dict[str, Any]) -> tuple[str, str]:
    """Return (conditions inside, conditions on the derived bucket and stage) of ``f``."""
    params["as_of"] = f.as_of
    inner = []
    for condition, name, value in (("i.finalized_at >= %(issued_from)s", "issued_from",
                                    f.issued_from),
                                   ("i.finalized_at < %(issued_to)s", "issued_to", f.issued_to),
                                   ("i.currency = %(currency)s", "currency", f.currency),
                                   ("i.organization_id = %(org_id)s", "org_id", f.org_id)):
        if value is not None:
            params[name] = value
            inner.append(f" AND {condition}")
    outer = []
    if f.bucket is not None:
        params["bucket"] = f.bucket
        outer.append("r.bucket = %(bucket)s")
    if f.stage is not None:
        params["stage"] = f.stage
        outer.append("r.stage = %(stage)s")
    return "".join(inner), (" WHERE " + " AND ".join(outer)) if outer else ""


def receivable_invoices(*, receivable_filter: ReceivableFilter, limit: int, offset: int = 0
                        ) -> list[ReceivableInvoice]:
    """Return one page of the unpaid invoices: most days past due first, then largest (how
    many match is the sum of ``receivable_sums``' counts)."""
    params: dict[str, Any] = {"limit": limit, "offset": offset}
    inner, outer = _receivable_where(receivable_filter, params)
    base = _RECEIVABLE_SQL.format(where=inner) + outer
    with _report_cursor() as cur:
        cur.execute(f"{base} ORDER BY r.days_past_due DESC NULLS LAST, r.amount_due DESC, "
                    "r.id LIMIT %(limit)s OFFSET %(offset)s", params)
        return [ReceivableInvoice._make(row) for row in cur]


class ReceivableSums(NamedTuple):
    """What one currency's unpaid invoices owe, per status x bucket x stage."""

    currency: str
    status: str
    bucket: str
    stage: str
    invoices: int
    amount_due: Decimal


def receivable_sums(*, receivable_filter: ReceivableFilter) -> list[ReceivableSums]:
    """Return the unpaid invoices' counts and amounts due per currency x status x bucket x
    stage (the receivables summary is these added up). One query."""
    params: dict[str, Any] = {}
    inner, outer = _receivable_where(receivable_filter, params)
    base = _RECEIVABLE_SQL.format(where=inner) + outer
    with _report_cursor() as cur:
        cur.execute(f"SELECT r.currency, r.status, r.bucket, r.stage, count(*), "  # noqa: S608
                    f"SUM(r.amount_due) FROM ({base}) r GROUP BY 1, 2, 3, 4 ORDER BY 1, 2, 3, 4",
                    params)
        return [ReceivableSums._make(row) for row in cur]


_BILLED_BETWEEN_SQL = """
SELECT i.currency, SUM(i.total)
  FROM invoicing_invoice i
 WHERE i.status IN ('open', 'paid', 'uncollectible')
   AND i.finalized_at >= %(start)s AND i.finalized_at < %(end)s{where}
 GROUP BY 1
"""


def billed_between(*, start: datetime, end: datetime, currency: str | None = None,
                   org_id: int | None = None) -> dict[str, Decimal]:
    """Return the billed documents' totals per currency by finalization time in [start, end)
    (what DSO divides by)."""
    params: dict[str, Any] = {"start": start, "end": end}
    where = _where(LineFilter(start, end, currency, org_id), params)
    with reading_connection().cursor() as cur:
        cur.execute(_BILLED_BETWEEN_SQL.format(where=where), params)
        return dict(cur.fetchall())


# What Stripe reported after payment, per currency (the receivables summary's last columns):
# - refunded: ``amount_refunded`` (every refund Stripe reported by ``charge.refunded``) of the
#   billed invoices finalized in [start, end), the documents ``billed_between`` sums;
# - refunds_pending: per charge, what its credit-note ``Refund``s (not failed) created by
#   ``end`` send back beyond what Stripe's ``charge.refunded`` reported of that charge yet;
# - disputed: the amount of disputes open at ``end`` (opened by then, not closed by then);
# - charged_back: the amount of disputes lost (closed ``lost``) in [start, end).
_AFTER_PAYMENT_SQL = """
SELECT m.currency, SUM(m.refunded), SUM(m.pending), SUM(m.disputed), SUM(m.charged_back)
  FROM (
    SELECT i.currency, i.amount_refunded AS refunded, 0 AS pending, 0 AS disputed,
           0 AS charged_back
      FROM invoicing_invoice i
     WHERE i.status IN ('open', 'paid', 'uncollectible') AND i.amount_refunded > 0
       AND i.finalized_at >= %(start)s AND i.finalized_at < %(end)s{where}
    UNION ALL
    SELECT i.currency, 0, GREATEST(SUM(r.amount) - MAX(p.amount_refunded), 0), 0, 0
      FROM invoicing_refund r
      JOIN invoicing_paymentattempt p ON p.id = r.payment_id
      JOIN invoicing_invoice i ON i.id = r.invoice_id
     WHERE r.status <> 'failed' AND r.created_at <= %(end)s{where}
     GROUP BY i.currency, p.id
    UNION ALL
    SELECT i.currency, 0, 0,
           CASE WHEN d.closed_at IS NULL OR d.closed_at > %(end)s THEN d.amount ELSE 0 END,
           CASE WHEN d.status = 'lost' AND d.closed_at >= %(start)s
                 AND d.closed_at < %(end)s THEN d.amount ELSE 0 END
      FROM invoicing_dispute d
      JOIN invoicing_invoice i ON i.id = d.invoice_id
     WHERE d.opened_at <= %(end)s{where}
  ) m
 GROUP BY 1
 ORDER BY 1
"""


class AfterPayment(NamedTuple):
    """One currency's money Stripe moved back after payment (see ``_AFTER_PAYMENT_SQL``)."""

    currency: str
    refunded: Decimal
    refunds_pending: Decimal
    disputed: Decimal
    charged_back: Decimal


def receivable_after_payment(*, start: datetime, end: datetime, currency: str | None = None,
                             org_id: int | None = None) -> list[AfterPayment]:
    """Return, per currency with any, what Stripe refunded, what credit-note refunds still
    wait for Stripe's report, what is disputed at ``end`` and what disputes lost in [start,
    end) took back (each defined at ``_AFTER_PAYMENT_SQL``). One query; amounts are the
    documents' (already rounded to the currency)."""
    params: dict[str, Any] = {"start": start, "end": end}
    where = _where(LineFilter(start, end, currency, org_id), params)
    with reading_connection().cursor() as cur:
        cur.execute(_AFTER_PAYMENT_SQL.format(where=where), params)
        return [AfterPayment._make(row) for row in cur]


# --- customers -------------------------------------------------------------------------------

_ORG_MONTHS_SQL = """
SELECT date_trunc('month', i.period_start, 'UTC'), i.organization_id, i.currency, SUM(i.total)
  FROM invoicing_invoice i
 WHERE i.status IN ('open', 'paid', 'uncollectible')
   AND i.period_start >= %(start)s AND i.period_start < %(end)s{where}
 GROUP BY 1, 2, 3
"""
_FIRST_MONTH_SQL = """
SELECT organization_id, currency, MIN(month) FROM (
    SELECT i.organization_id, i.currency, date_trunc('month', i.period_start, 'UTC') AS month
      FROM invoicing_invoice i
     WHERE i.status IN ('open', 'paid', 'uncollectible') AND i.organization_id = ANY(%s)
     GROUP BY 1, 2, 3 HAVING SUM(i.total) > 0) m
 GROUP BY 1, 2
"""


def billed_by_org_month(*, start: datetime, end: datetime, currency: str | None = None
                        ) -> list[tuple[datetime, int, str, Decimal]]:
    """Return (month, org id, currency, billed) for the billing months starting in the range."""
    params: dict[str, Any] = {"start": start, "end": end}
    where = _where(LineFilter(start, end, currency), params)
    with reading_connection().cursor() as cur:
        cur.execute(_ORG_MONTHS_SQL.format(where=where), params)
        return list(cur.fetchall())


def first_billed_month(*, org_ids: Sequence[int]) -> dict[tuple[int, str], datetime]:
    """Return, per (org, currency), the first month its billed documents added up to > 0."""
    if not org_ids:
        return {}
    with reading_connection().cursor() as cur:
        cur.execute(_FIRST_MONTH_SQL, [list(org_ids)])
        return {(org, currency): month for org, currency, month in cur}
