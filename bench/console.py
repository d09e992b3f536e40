"""Console dashboard benchmark: one organization with a year of hourly rollups, its dashboard
loaded 20 times through Django's test client (issue 19: under 300 ms server time).

Builds a fresh database (its name must contain "bench"), migrates it, signs up one owner and
organization (the real service), adds ``--projects`` projects with ``--keys`` API keys each
(the real services), a default price book for ``--models`` models and a monthly budget, then
writes a year of hourly rollups up to the current hour: every hour x model x key, two tiers
(a tenth of the hours priority), cached tokens on half the hours, an engine error now and then
(one ``INSERT ... SELECT generate_series``, as ``bench/finance_reports.py`` builds them, with
the rollup indexes rebuilt after the load). The dashboard reads only the current month, so the
year is there to prove the month's range reads are index ranges, not scans.

It then loads ``/console/`` ``--loads`` times as the signed-in owner after one warm-up load,
each timed around the test client's request (in process: server time, no network), checks
every answer is 200 with the charts in it, and prints one JSON line: ``dashboard_p50_ms``,
``dashboard_p90_ms``, ``dashboard_max_ms``, ``queries`` (of one load), the rollup rows in the
year, this month and last month, ``goal_ms`` (300), the load average, ``setup_seconds``.
Early in a month "this month" is a few hours of rollups, so it also times the same page for
the last instant of last month (a whole month of rollups: ``full_month_p50_ms``), its context
and template without the request around them.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/tollgate_bench_console \\
        .venv/bin/python bench/console.py
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import cast

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

GOAL_MS = 300


def build(*, models: int, projects: int, keys: int) -> tuple[object, int, int, int]:
    """Create the owner, org, projects, keys, prices, budget and a year of rollups; return
    (user, rollup rows, rollup rows this month, rollup rows last month)."""
    from django.db import connection
    from django.utils import timezone

    from billing_platform.accounts import services as accounts
    from plans import services as plan_services
    from plans.quotas import budget_set

    user, org = accounts.user_sign_up(email="owner@bench.example.com",
                                      password=secrets.token_urlsafe(16),
                                      org_name="Bench Co")
    key_ids = []
    for p in range(projects):
        project = (org.projects.get() if p == 0 and org.projects.count() == 1
                   else accounts.project_create(organization=org, name=f"Project {p}"))
        for k in range(keys):
            key, _ = accounts.api_key_create(project=project, name=f"key {p}.{k}",
                                             scopes=["inference"], acting_user=user)
            key_ids.append((project.id, key.id))
    now = timezone.now()
    first = now.replace(minute=0, second=0, microsecond=0) - timedelta(days=365)
    book = plan_services.price_book_create(code="bench-usd", name="USD bench", currency="USD",
                                           is_default=True)
    plan_services.price_version_create(
        price_book=book, effective_from=first - timedelta(days=1), allow_backdate=True,
        prices=[{"model": m, "input": "1.00", "cached_input": "0.10", "output": "2.00"}
                for m in MODELS[:models]])
    budget_set(organization=org, amount="5000")
    hours = int((now - first).total_seconds() // 3600) + 1
    with connection.cursor() as cur:
        rebuild = rollup_indexes_drop(cur)
        # hour h, model m, key k: token counts vary by hour and model; amounts are the rated
        # lines at the book's prices (input 1.00, cached 0.10, output 2.00 per 1M tokens)
        cur.execute(rollup_insert("""
            SELECT %s, k.p, k.k, (%s::text[])[m], 'us-east',
                   CASE WHEN h %% 10 = 0 THEN 'priority' ELSE 'default' END, 'on_demand', 'USD',
                   %s::timestamptz + make_interval(hours => h), x.n, (h %% 13 = 0)::int,
                   (h %% 17 = 0)::int, x.p, x.c, x.o, 0,
                   (x.p - x.c) * 0.000001 + x.c * 0.0000001 + x.o * 0.000002, 0, 0,
                   (x.p - x.c) * 0.000001, x.c * 0.0000001, x.o * 0.000002
              FROM generate_series(0, %s) AS h, generate_series(1, %s) AS m,
                   unnest(%s::bigint[], %s::bigint[]) AS k(p, k),
                   LATERAL (SELECT 1 + (h + m) %% 9 AS n,
                                   1000 * (1 + (h * 7 + m * 13) %% 97) AS p,
                                   CASE WHEN h %% 2 = 0 THEN 500 * ((h + m) %% 10) ELSE 0 END
                                       AS c,
                                   300 * (1 + (h * 3 + m) %% 31) AS o) x"""),
                    [org.id, list(MODELS[:models]), first, hours - 1, models,
                     [p for p, _ in key_ids], [k for _, k in key_ids]])
        rows = cur.rowcount
        rebuild()
        cur.execute("ANALYZE usage_rollup_hourly")
        month = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        cur.execute("""SELECT count(*) FILTER (WHERE hour >= %s),
                              count(*) FILTER (WHERE hour < %s AND hour >= %s)
                         FROM usage_rollup_hourly""",
                    [month, month, (month - timedelta(days=1)).replace(day=1)])
        this_month, last_month = cur.fetchone()
    return user, rows, this_month, last_month


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=3, choices=range(1, len(MODELS) + 1))
    parser.add_argument("--projects", type=int, default=3)
    parser.add_argument("--keys", type=int, default=2, help="API keys per project")
    parser.add_argument("--loads", type=int, default=20)
    parser.add_argument("--keep", action="store_true", help="keep the bench database")
    args = parser.parse_args()

    t0 = time.perf_counter()
    url = bench_django(os.environ.get(
        "DATABASE_URL", "postgres://postgres@127.0.0.1:5432/tollgate_bench_console"))
    from django.conf import settings
    from django.core.management import call_command
    from django.db import connection
    from django.template.loader import render_to_string
    from django.test import Client
    from django.utils import timezone

    from billing_platform.accounts.models import User
    from billing_platform.accounts.selectors import org_access, organizations_for_user
    from billing_platform.console.dashboard_views import dashboard_context

    call_command("migrate", verbosity=0)
    log(f"building a year of hourly rollups: {args.models} models x {args.projects} projects "
        f"x {args.keys} keys")
    user, rows, this_month, last_month = build(models=args.models, projects=args.projects,
                                               keys=args.keys)
    setup = time.perf_counter() - t0

    host = (settings.ALLOWED_HOSTS or ["localhost"])[0].lstrip(".").replace("*", "localhost")
    client = Client(SERVER_NAME=host)
    client.force_login(cast(User, user))

    def load() -> float:
        t = time.perf_counter()
        response = client.get("/console/")
        ms = (time.perf_counter() - t) * 1000
        body = response.content
        if response.status_code != 200 or b'id="tokens-data"' not in body:
            raise SystemExit(f"dashboard answered {response.status_code}: {body[:300]!r}")
        return ms

    statements: list[str] = []

    def count(execute, sql, params, many, context):
        statements.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(count):
        load()  # warm-up (and the statements of one load)
    timings = sorted(load() for _ in range(args.loads))

    # The loads above read this month up to now, which on the 1st is a few hours. The same
    # page for the last hour of last month reads a whole month of rollups: its context and
    # template, timed the same number of times (no request, so no session or middleware).
    org = organizations_for_user(user=cast(User, user)).get()
    access = org_access(user=user, principal=None, org_public_id=org.public_id)
    month_end = timezone.now().replace(day=1, hour=0, minute=0, second=0, microsecond=0)

    def full_month() -> float:
        t = time.perf_counter()
        ctx = dashboard_context(access, month_end - timedelta(microseconds=1))
        render_to_string("console/dashboard.html", {**ctx, "access": access, "org": org})
        return (time.perf_counter() - t) * 1000

    full_month()
    full = sorted(full_month() for _ in range(args.loads))
    print(json.dumps({
        "dashboard_p50_ms": round(statistics.median(timings), 1),
        "dashboard_p90_ms": round(timings[int(0.9 * (len(timings) - 1))], 1),
        "dashboard_max_ms": round(timings[-1], 1),
        "goal_ms": GOAL_MS, "loads": args.loads, "queries": len(statements),
        "full_month_p50_ms": round(statistics.median(full), 1),
        "full_month_max_ms": round(full[-1], 1),
        "rollup_rows_year": rows, "rollup_rows_this_month": this_month,
        "rollup_rows_last_month": last_month,
        "models": args.models, "keys": args.projects * args.keys,
        "loadavg_1m": round(os.getloadavg()[0], 2), "setup_seconds": round(setup, 1),
    }))
    if not args.keep:
        drop_database(url)


if __name__ == "__main__":
    main()
