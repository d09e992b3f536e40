"""Finance reports benchmark: revenue and receivables for N organizations over 12 months.

Builds a fresh database (its name must contain "bench"), migrates it, creates ``--orgs``
organizations (every fifth invoiced in EUR, the rest USD) and 12 months of hourly rollups
(``--models`` models x ``--hours`` hours a day per organization, one ``INSERT ... SELECT
generate_series`` per slice of organizations, as ``bench/invoice_run.py`` builds them), closes
the first 11 months with the real period close (so invoices, lines and the billed-usage ledger
are what production writes) and leaves the current month open (its usage is accrued revenue).
Payment states are then set in bulk: invoices older than two months paid except a tenth of
the organizations' (overdue, some with failed charges) and a fiftieth's (uncollectible).

Then it times ``finance.reports.revenue_report`` over the 12 months (billed and accrued, every
dimension) and ``finance.reports.receivables_report`` (every unpaid invoice aged now, the first
page of 100 and the per-currency sums with DSO), ``--runs`` times each, alternating, after one
warm-up run each. Prints one JSON line: ``revenue_p50_ms``, ``revenue_p99_ms``,
``receivables_p50_ms``, ``receivables_p99_ms``, and what was measured (orgs, rollup rows,
invoices, lines, unpaid invoices, report rows, a reconciliation check: the revenue report's
billed totals equal the invoices' totals per month and currency), the time of the revenue
report's billed and accrued halves once each (the billed half off the ``BilledRevenue``
summary; ``revenue_billed_from_lines_once_ms`` the same sums off every line, and
``billed_summary_equals_lines`` whether the two agree row for row), the accrued half's parts
once each (``accrued_periods_once_ms``: open periods and last closes;
``accrued_usage_since_once_ms``: the usage since the periods' starts;
``accrued_late_once_ms``: late-usage candidates compared with the ledger), the load average
when it
ended, plus ``setup_seconds``. ``--keep`` then ``--reuse`` times the reports again without
rebuilding.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/tollgate_bench_finance \\
        .venv/bin/python bench/finance_reports.py --orgs 10000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.invoice_run import (
    MODELS,
    bench_django,
    drop_database,
    log,
    rollup_indexes_drop,
    rollup_insert,
)

MONTHS = 12


def month_start(at: datetime, back: int = 0) -> datetime:
    index = at.year * 12 + at.month - 1 - back
    return datetime(index // 12, index % 12 + 1, 1, tzinfo=UTC)


def build(orgs: int, first: datetime, end: datetime, models: int, hours: int,
          slice_orgs: int) -> int:
    """Create the organizations and their rollups; return the number of rollup rows."""
    from django.db import connection

    from billing_platform.accounts.models import Organization
    from plans import services as plan_services

    # rated in both currencies: the default price book of each (the rollups are written
    # directly, but an org's invoices are in its currency and the builder checks it)
    for currency in ("USD", "EUR"):
        book = plan_services.price_book_create(code=f"bench-{currency.lower()}",
                                               name=f"{currency} bench", currency=currency,
                                               is_default=True)
        plan_services.price_version_create(
            price_book=book, effective_from=first, allow_backdate=True,
            prices=[{"model": m, "input": "1.00", "output": "2.00"} for m in MODELS])
    # the ORM (not SQL) for the organizations, so their fields' defaults stay the model's
    Organization.objects.bulk_create([
        Organization(public_id=f"org_bench{g}", name=f"Bench org {g}", slug=f"bench-{g}",
                     billing_email=f"billing+{g}@bench.example.com",
                     currency="EUR" if g % 5 == 0 else "USD",
                     tax_rate=Decimal("0.2") if g % 3 == 0 else Decimal(0), created_at=first)
        for g in range(1, orgs + 1)], batch_size=5000)
    with connection.cursor() as cur:
        rebuild_indexes = rollup_indexes_drop(cur)
        cur.execute("SELECT min(id), max(id) FROM accounts_organization")
        lo, hi = cur.fetchone()
        days = (end - first).days
        rows = 0
        for start in range(lo, hi + 1, slice_orgs):
            stop = min(start + slice_orgs - 1, hi)
            # hour h of day d at 09:00 + 5h * h; token counts and amounts vary by org and hour
            cur.execute(rollup_insert("""
                SELECT o.id, o.id, NULL, (%s::text[])[m], 'us-east',
                       CASE WHEN (o.id + d) %% 4 = 0 THEN 'priority' ELSE 'default' END,
                       'on_demand', o.currency,
                       %s::timestamptz + make_interval(days => d, hours => 9 + 5 * h),
                       1 + (o.id + d + m) %% 7, 0, 0, 10000 * (1 + (o.id * 7 + d * 13) %% 97),
                       1000 * ((o.id + d) %% 10), 3000 * (1 + (o.id + d * 3 + m) %% 31), 0,
                       x.i + x.c + x.o, 0, 0, x.i, x.c, x.o
                  FROM accounts_organization o,
                       generate_series(0, %s) AS d,
                       generate_series(0, %s) AS h,
                       generate_series(1, %s) AS m,
                       LATERAL (SELECT (10000 * (1 + (o.id * 7 + d * 13) %% 97)
                                        - 1000 * ((o.id + d) %% 10)) * 0.000001 AS i,
                                       1000 * ((o.id + d) %% 10) * 0.0000001 AS c,
                                       3000 * (1 + (o.id + d * 3 + m) %% 31) * 0.000002 AS o
                               ) x
                 WHERE o.id BETWEEN %s AND %s"""),
                        [list(MODELS[:models]), first, days - 1, hours - 1, models, start,
                         stop])
            rows += cur.rowcount
            log(f"  rollups: {rows:,} rows (orgs up to {stop - lo + 1:,})")
        rebuild_indexes()
        cur.execute("ANALYZE usage_rollup_hourly")
        cur.execute("ANALYZE accounts_organization")
    return rows


def close_months(first: datetime, months: int) -> int:
    """Close the first ``months`` months with the real period close; return invoices made."""
    from billing_platform.invoicing.services import period_close_run

    made = 0
    for k in range(months):
        t = time.perf_counter()
        report = period_close_run(now=month_start(first, -(k + 1)) + timedelta(hours=1),
                                  enqueue_payments=False)
        made += report.invoices
        log(f"  closed month {k + 1}: {report.invoices:,} invoices "
            f"({time.perf_counter() - t:.1f} s)")
    return made


def settle(now: datetime) -> None:
    """Set payment states in bulk (status and payment bookkeeping only, which finalized
    invoices allow): older than two months paid, except org ids divisible by 10 (unpaid,
    failed charges on every other one) and by 50 (uncollectible)."""
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("""
            UPDATE invoicing_invoice SET status = 'paid', amount_paid = amount_due,
                   paid_at = finalized_at + interval '3 days'
             WHERE status = 'open' AND organization_id %% 10 <> 0
               AND period_end <= %s::timestamptz - interval '2 months'""", [now])
        cur.execute("""
            UPDATE invoicing_invoice SET payment_failures = 1 + organization_id %% 3,
                   next_payment_attempt_at = %s::timestamptz + interval '2 days'
             WHERE status = 'open' AND organization_id %% 20 = 0""", [now])
        cur.execute("""
            UPDATE invoicing_invoice SET status = 'uncollectible',
                   marked_uncollectible_at = due_at + interval '30 days',
                   next_payment_attempt_at = NULL
             WHERE status = 'open' AND organization_id %% 50 = 0
               AND due_at < %s::timestamptz - interval '30 days'""", [now])
        cur.execute("ANALYZE invoicing_invoice")
        cur.execute("ANALYZE invoicing_invoiceline")
        cur.execute("ANALYZE invoicing_billedusage")


def counts() -> dict[str, int]:
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("""SELECT (SELECT count(*) FROM invoicing_invoice),
                              (SELECT count(*) FROM invoicing_invoiceline),
                              (SELECT count(*) FROM invoicing_invoice
                                WHERE status IN ('open', 'uncollectible'))""")
        invoices, lines, unpaid = cur.fetchone()
    return {"invoices": invoices, "lines": lines, "unpaid_invoices": unpaid}


def reconciles(report) -> bool:
    """The revenue report's billed totals equal the invoices' totals per month and currency."""
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("""SELECT date_trunc('month', period_start, 'UTC')::date, currency,
                              sum(total) FROM invoicing_invoice
                        WHERE status IN ('open', 'paid', 'uncollectible') GROUP BY 1, 2""")
        expected = {(m, c): t for m, c, t in cur.fetchall()}
    got = {(t.period, t.currency): t.billed for t in report.totals if t.billed}
    return bool(expected) and got == expected


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--orgs", type=int, default=10_000)
    parser.add_argument("--models", type=int, default=2, choices=range(1, len(MODELS) + 1))
    parser.add_argument("--hours", type=int, default=1, choices=range(1, 4),
                        help="rollup hours a day per organization and model")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--slice", type=int, default=1000, help="orgs per rollup INSERT")
    parser.add_argument("--keep", action="store_true", help="keep the bench database")
    parser.add_argument("--reuse", action="store_true",
                        help="time the reports on a database kept by --keep")
    args = parser.parse_args()

    t0 = time.perf_counter()
    url = bench_django(os.environ.get(
        "DATABASE_URL", "postgres://postgres@127.0.0.1:5432/tollgate_bench_finance"),
        fresh=not args.reuse)
    from django.core.management import call_command
    from django.utils import timezone

    from billing_platform.finance import reports

    now = timezone.now()
    first, end = month_start(now, MONTHS - 1), month_start(now, -1)
    call_command("migrate", verbosity=0)
    rows = None
    if not args.reuse:
        log(f"building {args.orgs:,} orgs x {MONTHS} months x {args.models} models x "
            f"{args.hours} h/day of rollups")
        rows = build(args.orgs, first, end, args.models, args.hours, args.slice)
        close_months(first, MONTHS - 1)
        settle(now)
    setup = time.perf_counter() - t0

    def revenue() -> reports.RevenueReport:
        return reports.revenue_report(report_filter=reports.RevenueFilter(start=first, end=end))

    def receivables() -> reports.ReceivablesReport:
        return reports.receivables_report(
            report_filter=reports.ReceivablesFilter(as_of=timezone.now()), limit=100)

    timings: dict[str, list[float]] = {"revenue": [], "receivables": []}
    results = {"revenue": revenue(), "receivables": receivables()}  # warm-up
    for _ in range(args.runs):
        for name, run in (("revenue", revenue), ("receivables", receivables)):
            t = time.perf_counter()
            run()
            timings[name].append((time.perf_counter() - t) * 1000)
    # where the revenue report's time goes: its billed and its accrued half, once each
    from billing_platform.invoicing import reports as invoicing_reports

    for name, run in (
            ("revenue_billed_once_ms", lambda: invoicing_reports.billed_lines(
                line_filter=invoicing_reports.LineFilter(start=first, end=end))),
            ("revenue_accrued_once_ms", invoicing_reports.unbilled_usage)):
        t = time.perf_counter()
        run()
        timings[name] = [(time.perf_counter() - t) * 1000]
    # and the accrued half's parts, once each: the open periods (with the last closes), the
    # usage since their starts, the late-usage candidates and their comparison with the ledger
    from billing_platform.invoicing.builder import late_usage_of
    from billing_platform.invoicing.selectors import periods_open_and_last_closes
    from metering.selectors import usage_sums_since

    t = time.perf_counter()
    targets, closes = periods_open_and_last_closes()
    timings["accrued_periods_once_ms"] = [(time.perf_counter() - t) * 1000]
    with invoicing_reports._report_cursor():
        t = time.perf_counter()
        usage_sums_since(since={x.org_id: x.period_start for x in targets})
        timings["accrued_usage_since_once_ms"] = [(time.perf_counter() - t) * 1000]
        t = time.perf_counter()
        late_usage_of(targets, invoicing_reports._late_candidates(closes))
        timings["accrued_late_once_ms"] = [(time.perf_counter() - t) * 1000]
    out: dict[str, object] = {}
    for name, values in list(timings.items())[:2]:
        out[f"{name}_p50_ms"] = round(statistics.median(values), 1)
        out[f"{name}_p99_ms"] = round(percentile(values, 0.99), 1)
    out.update({k: round(v[0], 1) for k, v in list(timings.items())[2:]})
    # the billed half reads the summary invoicing keeps; it equals the lines summed, row for row
    line_filter = invoicing_reports.LineFilter(start=first, end=end)
    summed = getattr(invoicing_reports, "billed_lines_summed", None)
    if summed is not None:
        t = time.perf_counter()
        from_lines = sorted(summed(line_filter=line_filter))
        out["revenue_billed_from_lines_once_ms"] = round((time.perf_counter() - t) * 1000, 1)
        out["billed_summary_equals_lines"] = sorted(
            invoicing_reports.billed_lines(line_filter=line_filter)) == from_lines
    out["load_average"] = os.getloadavg()[0]
    out.update({"orgs": args.orgs, "months": MONTHS, "rollup_rows": rows, **counts(),
                "revenue_rows": len(results["revenue"].rows),
                "receivables_count": results["receivables"].count,
                "check": reconciles(results["revenue"]), "runs": args.runs,
                "setup_seconds": round(setup, 1)})
    if not args.keep:
        drop_database(url)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
