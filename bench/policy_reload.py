"""Quota policy reload benchmark: the CPU a gateway process spends re-reading one key's policy.

Each gateway process re-reads a (key, model) policy from PostgreSQL about every
``TOLLGATE_QUOTA_POLICY_TTL_S`` (2 s) while the key is used, in a thread beside the requests
(``plans.admission.loading.quota_policy_load``). A tenant that sends less often than that pays
one reload per request, so with many quiet tenants the reloads, not the requests, are most of
a gateway's CPU (``bench/scale.py`` runs that case end to end).

Builds a fresh database (its name must contain "bench"), creates ``--orgs`` organizations,
each with a project, an organization budget (hard), a project budget on every other one and an
organization limits row (with ``--token-plan-every N``, every Nth also on a token plan that
blocks at its cap, with ledger rows in its window, the period's totals and a credit pack), then
loads every organization's policy ``--rounds`` times:

- ``policy_load_cpu_ms``: this process's CPU per policy load, as the gateway runs it (the
  reads compiled once, ``billing_platform.compiled_sql.CompiledQuery``);
- ``orm_load_cpu_ms``: the same loads with every query built and compiled by the ORM at each
  load (``CompiledQuery.built_each_time``), the baseline, run in turns with the first;
- ``postgres_cpu_ms``: the PostgreSQL backend's CPU per load (the queries' own cost, what a
  load cannot go below), from ``/proc`` of the backend serving this process;
- ``speedup_vs_orm`` and ``cpu_per_postgres_cpu`` (this process's CPU over PostgreSQL's).

Both ways are checked to read equal policies. DEBUG is off, as in production. Prints one JSON
line.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/tollgate_bench_policy \\
        .venv/bin/python bench/policy_reload.py --orgs 1000
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.invoice_run import bench_django, drop_database, log
from bench.procs import process_cpu_seconds


def _token_plan():
    """A token plan that blocks at its cap: 1,000 credits a period, 300 per 5-hour window."""
    from plans import services

    return services.plan_create(
        code="bench-tokens", name="Bench token plan", kind="token_plan", monthly_fee="10.00",
        credits_per_period="1000", window_credits="300", window_hours=5, cap_policy="block",
        coefficients=[{"model": "bench-model", "token_class": c, "coefficient": k}
                      for c, k in (("input", "1"), ("cached_input", "0.1"), ("output", "3"))])


def _subscribe(org, plan) -> None:
    """Put ``org`` on ``plan`` with a period's totals, ledger rows in the window (and one
    before it) and a credit pack in force: what a busy token-plan tenant's reload reads."""
    from django.utils import timezone

    from plans import services
    from plans.models import CreditPackPurchase, TokenPlanPeriod, TokenPlanUsage
    from plans.periods import period_bounds

    now = timezone.now()
    sub = services.subscription_create(organization=org, plan=plan,
                                       starts_at=now - timedelta(days=3))
    start, end = period_bounds(sub.billing_anchor, now)
    TokenPlanUsage.objects.bulk_create(
        TokenPlanUsage(subscription=sub, request_id=f"req-{m}", event_time=now - timedelta(
            minutes=m), period_start=start, plan_credits=Decimal("2"), pack_credits=Decimal(0),
            overage_credits=Decimal(0)) for m in (1, 2, 3, 30, 90, 400))
    TokenPlanPeriod.objects.create(subscription=sub, period_start=start, period_end=end,
                                   plan_credits=Decimal("12"))
    CreditPackPurchase.objects.create(subscription=sub, credits=Decimal("100"),
                                      price=Decimal("5"), currency=org.currency,
                                      expires_at=now + timedelta(days=30))


def build(orgs: int, token_plan_every: int) -> list[dict[str, int]]:
    from billing_platform.accounts.models import Organization, Project
    from plans.models import Budget, QuotaLimit

    plan = _token_plan() if token_plan_every else None
    keys = []
    for i in range(orgs):
        org = Organization.objects.create(name=f"Bench {i}", slug=f"bench-{i}",
                                          billing_email=f"b{i}@bench.example.com")
        project = Project.objects.create(organization=org, name="default")
        Budget.objects.create(organization=org, amount=Decimal("100"), hard=True,
                              currency=org.currency)
        if i % 2:
            Budget.objects.create(organization=org, project=project, amount=Decimal("10"),
                                  hard=True, currency=org.currency)
        QuotaLimit.objects.create(organization=org, usage_tier="tier-2")
        if plan is not None and i % token_plan_every == 0:
            _subscribe(org, plan)
        keys.append({"organization_id": org.id, "project_id": project.id,
                     "key_id": 10_000_000 + i})
        if (i + 1) % 250 == 0:
            log(f"  {i + 1:,} of {orgs:,} organizations")
    return keys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--orgs", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3, help="turns of each way")
    parser.add_argument("--token-plan-every", type=int, default=0, metavar="N",
                        help="put every Nth organization on a token plan that blocks at its "
                             "cap (0: none)")
    parser.add_argument("--keep", action="store_true", help="keep the bench database")
    args = parser.parse_args()

    os.environ["DEBUG"] = "0"  # as in production: no query log
    url = bench_django(os.environ.get(
        "DATABASE_URL", "postgres://postgres@127.0.0.1:5432/tollgate_bench_policy"))
    from django.core.management import call_command
    from django.db import connection

    from billing_platform.compiled_sql import CompiledQuery
    from plans.admission.loading import quota_policy_load

    call_command("migrate", verbosity=0)
    log(f"building {args.orgs:,} organizations")
    keys = build(args.orgs, args.token_plan_every)
    with connection.cursor() as cur:
        cur.execute("ANALYZE")
        cur.execute("SELECT pg_backend_pid()")
        backend = cur.fetchone()[0]

    def one_way() -> tuple[float, float, list]:
        cpu, pg = time.process_time(), process_cpu_seconds(backend)
        policies = [quota_policy_load(**k, model="bench-model") for k in keys]
        return time.process_time() - cpu, process_cpu_seconds(backend) - pg, policies

    one_way()  # warm: compiled SQL, the pricing read, the connection's catalog caches
    compiled = [0.0, 0.0]
    orm = [0.0, 0.0]
    same = True
    for r in range(args.rounds):
        cpu, pg, mine = one_way()
        compiled[0] += cpu
        compiled[1] += pg
        with CompiledQuery.built_each_time():
            cpu, pg, theirs = one_way()
        orm[0] += cpu
        orm[1] += pg
        same = same and mine == theirs
        per_load = 1000 / (r + 1) / len(keys)
        log(f"  round {r + 1} of {args.rounds}: compiled {compiled[0] * per_load:.2f} ms a load,"
            f" ORM {orm[0] * per_load:.2f}")
    loads = args.rounds * len(keys)
    result = {
        "orgs": len(keys), "loads": loads, "token_plan_every": args.token_plan_every,
        "policy_load_cpu_ms": round(compiled[0] * 1000 / loads, 3),
        "orm_load_cpu_ms": round(orm[0] * 1000 / loads, 3),
        "postgres_cpu_ms": round(compiled[1] * 1000 / loads, 3),
        "postgres_cpu_ms_orm": round(orm[1] * 1000 / loads, 3),
        "speedup_vs_orm": round(orm[0] / compiled[0], 2),
        "cpu_per_postgres_cpu": round(compiled[0] / compiled[1], 2) if compiled[1] else None,
        "same_policies": same,
    }
    if not args.keep:
        drop_database(url)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
