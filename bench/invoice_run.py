"""Period-close benchmark: invoice N organizations from 30 days of hourly rollups.

Builds a fresh database (its name must contain "bench"), migrates it, creates ``--orgs``
organizations and ``--days`` x 24 hourly rollup rows per organization and model (``--models``)
with one ``INSERT ... SELECT generate_series`` per slice of organizations (SQL, not the ORM),
then times ``invoicing.services.period_close_run`` closing the month for all of them, exactly
as the beat task does (without enqueueing charges unless ``--enqueue``). It then checks the
result: one invoice per organization, and the invoices' total equals the rollups' amounts
rounded once per (org, model, region, tier, source, token class) line.

``--orgs`` takes one size or several, comma-separated (``--orgs 3000,30000``): each size is
built and closed in a database of its own, so the cost per organization can be compared as
organizations grow. Prints one JSON line: ``{"orgs", "seconds", "orgs_per_s", "rollup_rows",
"invoices_created", "invoices", "lines", "check", "setup_seconds"}`` of the largest size and,
with several sizes, ``orgs_per_s_by_orgs`` (each size's orgs/s), ``runs`` (each size's line)
and ``orgs_per_s_ratio_<largest>_vs_<smallest>`` (e.g. ``orgs_per_s_ratio_30k_vs_3k``: 1.0 is a
flat cost per organization).

The rollup table of the bench database is UNLOGGED (no WAL for ~3,600 rows an organization:
seeding 30,000 organizations writes ~100M rows); the close reads it, and writes invoices,
exactly as it would a logged one.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/tollgate_bench_invoice \\
        .venv/bin/python bench/invoice_run.py --orgs 10000
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlparse, urlunparse

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODELS = ("llama-3.1-8b-instruct", "qwen2.5-7b-instruct", "mistral-7b-instruct",
          "llama-3.1-70b-instruct", "deepseek-v3")
PERIOD_START = datetime(2026, 10, 1, tzinfo=UTC)
PERIOD_END = datetime(2026, 11, 1, tzinfo=UTC)

ROLLUP_COLUMNS = """organization_id, project_id, api_key_id, model, region, service_tier,
    capacity_source, currency, hour, requests, error_requests, aborted_requests, prompt_tokens,
    cached_tokens, completion_tokens, normalized_tokens, amount, credits_consumed,
    cost_to_serve, input_amount, cached_input_amount, output_amount"""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def fresh_database(url: str) -> None:
    import psycopg

    parsed = urlparse(url)
    name = parsed.path.lstrip("/")
    if "bench" not in name:
        raise SystemExit(f"refusing to recreate {name!r}: the name must contain 'bench'")
    admin = urlunparse(parsed._replace(path="/postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')


def rollup_insert(select: str) -> str:
    """The bulk load of rollups ``select`` gives: every column of ROLLUP_COLUMNS, in order."""
    # the SQL is this module's constant and the caller's literal: nothing from outside
    return f"INSERT INTO usage_rollup_hourly ({ROLLUP_COLUMNS}) {select}"


def bench_django(url: str, *, fresh: bool = True) -> str:
    """Point Django at the bench database ``url`` (recreated first where ``fresh``) and set
    it up; return ``url``."""
    os.environ["DATABASE_URL"] = url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "billing_platform.settings")
    if fresh:
        fresh_database(url)
    import django

    django.setup()
    return url


def drop_database(url: str) -> None:
    """Close Django's connections and drop the bench database ``url`` names."""
    import psycopg
    from django.db import connections

    connections.close_all()
    parsed = urlparse(url)
    with psycopg.connect(urlunparse(parsed._replace(path="/postgres")), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{parsed.path.lstrip("/")}" WITH (FORCE)')


def rollup_indexes_drop(cur: Any) -> Callable[..., None]:
    """Drop usage_rollup_hourly's unique constraints and indexes; return what rebuilds them.

    Bench databases only: a sort-built index is many times faster than millions of single-row
    index inserts, and the rebuilt ones are exactly the ones dropped (the unique constraints
    too unless ``constraints=False``: for a bench that never reads them).
    """
    cur.execute("""SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint
                    WHERE conrelid = 'usage_rollup_hourly'::regclass AND contype = 'u'""")
    constraints = cur.fetchall()
    cur.execute("""SELECT indexname, indexdef FROM pg_indexes
                    WHERE tablename = 'usage_rollup_hourly' AND indexname NOT IN (
                        SELECT conname FROM pg_constraint
                         WHERE conrelid = 'usage_rollup_hourly'::regclass)""")
    indexes = cur.fetchall()
    for name, _ in constraints:
        cur.execute(f'ALTER TABLE usage_rollup_hourly DROP CONSTRAINT "{name}"')
    for name, _ in indexes:
        cur.execute(f'DROP INDEX "{name}"')

    def rebuild(*, constraints_too: bool = True) -> None:
        log("  rebuilding the rollup indexes")
        cur.execute("SET maintenance_work_mem = '1GB'")
        for name, definition in constraints if constraints_too else ():
            cur.execute(f'ALTER TABLE usage_rollup_hourly ADD CONSTRAINT "{name}" {definition}')
        for _, definition in indexes:
            cur.execute(definition)

    return rebuild


LOAD_CONNECTIONS = 2  # rollup slices loaded at once, each on its own connection


def _load_slice(start: int, end: int, *, models: list[str], start_at: datetime,
                last_hour: int, n_models: int) -> tuple[int, int]:
    """Insert the rollups of orgs ``start`` to ``end`` on a connection of its own."""
    import psycopg

    with psycopg.connect(os.environ["DATABASE_URL"], autocommit=True) as conn:
        cur = conn.execute(rollup_insert("""
            SELECT o, o, NULL, (%s::text[])[m], 'us-east', 'default', 'on_demand', 'USD',
                   %s::timestamptz + make_interval(hours => h),
                   1 + (o + h + m) %% 7, 0, 0,
                   1000 * (1 + (o * 7 + h * 13 + m) %% 97), 100 * ((o + h) %% 10),
                   300 * (1 + (o + h * 3 + m) %% 31), 0,
                   ((o * 7 + h * 13 + m * 17) %% 1000) * 0.0001234567, 0, 0,
                   ((o * 7 + h * 13 + m * 17) %% 1000) * 0.0000234567, 0,
                   ((o * 7 + h * 13 + m * 17) %% 1000) * 0.0001
              FROM generate_series(%s::int, %s::int) AS o,
                   generate_series(0, %s::int) AS h,
                   generate_series(1, %s::int) AS m"""),
            [models, start_at, start, end, last_hour, n_models])
        return cur.rowcount, end


def build(orgs: int, days: int, models: int, slice_orgs: int) -> int:
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("""
            INSERT INTO accounts_organization
                (public_id, name, slug, billing_email, currency, data_zone, tax_rate, status,
                 created_at, legal_name, address_line1, address_line2, postal_code, city,
                 region, country, tax_id)
            SELECT 'org_bench' || g, 'Bench org ' || g, 'bench-' || g,
                   'billing+' || g || '@bench.example.com', 'USD', 'global', 0, 'active', %s,
                   '', '', '', '', '', '', '', ''
              FROM generate_series(1, %s) AS g""", [PERIOD_START, orgs])
        # Bulk load without the rollup table's secondary indexes, then rebuild them exactly
        # as they were (the bench database only): a sort-built index is many times faster
        # than 36M single-row index inserts, and the close reads the same indexes either way.
        rebuild_indexes = rollup_indexes_drop(cur)
        cur.execute("ALTER TABLE usage_rollup_hourly SET UNLOGGED")  # the bench database only
        cur.execute("SELECT min(id), max(id) FROM accounts_organization")
        lo, hi = cur.fetchone()
        slices = [(start, min(start + slice_orgs - 1, hi))
                  for start in range(lo, hi + 1, slice_orgs)]
        params = {"models": list(MODELS[:models]), "start_at": PERIOD_START,
                  "last_hour": days * 24 - 1, "n_models": models}
        rows = 0
        with ThreadPoolExecutor(LOAD_CONNECTIONS) as pool:
            for n, end in pool.map(lambda s: _load_slice(*s, **params), slices):
                rows += n
                log(f"  rollups: {rows:,} rows (a slice up to org {end - lo + 1:,})")
        # Not the unique key (9 columns, the largest index by far: a third of the setup at
        # 10,000 orgs): only ingest's upsert reads it, never the close or the check.
        rebuild_indexes(constraints_too=False)
        cur.execute("ANALYZE usage_rollup_hourly")
        cur.execute("ANALYZE usage_rollup_monthly")
        cur.execute("ANALYZE accounts_organization")
    settle_writes()
    return rows


def settle_writes() -> None:
    """Write the seeding out before the close is timed: a checkpoint, then the kernel's dirty
    pages (the bench database's gigabytes of rollups just loaded).

    Otherwise the close may run while the disk writes them back, each chunk's commit waiting
    for its WAL flush behind that: a cost of having seeded ~100M rows a minute before, which
    a production close (the rollups written over the month) never meets, and which weighs
    most on the smallest size (its whole close can lie inside the write-back). On the shared
    2-core machine of issue 22 (load 10 to 17 from other benchmarks) its effect was within
    the noise: 3,000 orgs closed at 434 orgs/s without it, 481 with it, and a close of the
    same size on a copy of a database seeded minutes earlier at 441 and 506.
    """
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("CHECKPOINT")
    os.sync()


def check(orgs: int) -> dict:
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("""
            SELECT sum(line) FROM (
                SELECT round(sum(input_amount), 2) + round(sum(cached_input_amount), 2)
                       + round(sum(output_amount), 2) AS line FROM usage_rollup_hourly
                 WHERE hour >= %s AND hour < %s
                 GROUP BY organization_id, model, region, service_tier, capacity_source) x""",
                    [PERIOD_START, PERIOD_END])
        expected = cur.fetchone()[0]
        cur.execute("SELECT count(*), sum(total) FROM invoicing_invoice")
        invoices, total = cur.fetchone()
        cur.execute("SELECT count(*) FROM invoicing_invoiceline")
        lines = cur.fetchone()[0]
    return {"invoices": invoices, "lines": lines,
            "check": invoices == orgs and total == expected}


def run_size(url: str, orgs: int, args: argparse.Namespace) -> dict[str, Any]:
    """Build a fresh bench database of ``orgs`` organizations, close the month; its result."""
    from django.core.management import call_command
    from django.db import connections

    t0 = time.perf_counter()
    connections.close_all()
    fresh_database(url)
    call_command("migrate", verbosity=0)
    log(f"building {orgs:,} orgs x {args.days} days x {args.models} models of rollups")
    rows = build(orgs, args.days, args.models, args.slice)
    setup = time.perf_counter() - t0

    from billing_platform.invoicing.services import period_close_run

    start = time.perf_counter()
    report = period_close_run(now=PERIOD_END + timedelta(hours=1),
                              enqueue_payments=args.enqueue)
    seconds = time.perf_counter() - start
    result = {"orgs": orgs, "seconds": round(seconds, 2),
              "orgs_per_s": round(orgs / seconds, 1), "rollup_rows": rows,
              "invoices_created": report.invoices, **check(orgs),
              "setup_seconds": round(setup, 1)}
    log(json.dumps(result))
    return result


def _k(n: int) -> str:
    return f"{n // 1000}k" if n % 1000 == 0 else str(n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--orgs", default="10000",
                        help="organizations; several sizes comma-separated: 3000,30000")
    parser.add_argument("--days", type=int, default=30)
    parser.add_argument("--models", type=int, default=5, choices=range(1, len(MODELS) + 1))
    parser.add_argument("--slice", type=int, default=1000, help="orgs per rollup INSERT")
    parser.add_argument("--enqueue", action="store_true", help="enqueue charge tasks too")
    parser.add_argument("--keep", action="store_true", help="keep the bench database")
    args = parser.parse_args()
    sizes = sorted({int(n) for n in args.orgs.split(",")})

    url = bench_django(os.environ.get(
        "DATABASE_URL", "postgres://postgres@127.0.0.1:5432/tollgate_bench_invoice"),
        fresh=False)  # each size recreates it
    runs = [run_size(url, n, args) for n in sizes]
    result: dict[str, Any] = dict(runs[-1])
    if len(runs) > 1:
        lo, hi = runs[0], runs[-1]
        result["orgs_per_s_by_orgs"] = {str(r["orgs"]): r["orgs_per_s"] for r in runs}
        result[f"orgs_per_s_ratio_{_k(hi['orgs'])}_vs_{_k(lo['orgs'])}"] = round(
            hi["orgs_per_s"] / lo["orgs_per_s"], 3)
        result["check"] = all(r["check"] for r in runs)
        result["runs"] = runs
    if not args.keep:
        drop_database(url)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
