"""Quota policy reload benchmark: the CPU a gateway process spends re-reading one key's policy.

Each gateway process re-reads a (key, model) policy from PostgreSQL about every
``TOLLGATE_QUOTA_POLICY_TTL_S`` (2 s) while the key is used, in a thread beside the requests
(``plans.admission.loading.quota_policy_load``). A tenant that sends less often than that pays
one reload per request, so with many quiet tenants the reloads, not the requests, are most of
a gateway's CPU (``bench/scale.py`` runs that case end to end).

Builds a fresh database (its name must contain "bench"), creates ``--orgs`` organizations,
each with a project, an organization budget (hard), a project budget on every other one and an
organization limits row, then loads every organization's policy ``--rounds`` times:

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
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.invoice_run import bench_django, drop_database, log


def build(orgs: int) -> list[dict[str, int]]:
    from billing_platform.accounts.models import Organization, Project
    from plans.models import Budget, QuotaLimit

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
        keys.append({"organization_id": org.id, "project_id": project.id,
                     "key_id": 10_000_000 + i})
        if (i + 1) % 250 == 0:
            log(f"  {i + 1:,} of {orgs:,} organizations")
    return keys


def _backend_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--orgs", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3, help="turns of each way")
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
    keys = build(args.orgs)
    with connection.cursor() as cur:
        cur.execute("ANALYZE")
        cur.execute("SELECT pg_backend_pid()")
        backend = cur.fetchone()[0]

    def one_way() -> tuple[float, float, list]:
        cpu, pg = time.process_time(), _backend_cpu_s(backend)
        policies = [quota_policy_load(**k, model="bench-model") for k in keys]
        return time.process_time() - cpu, _backend_cpu_s(backend) - pg, policies

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
        "orgs": len(keys), "loads": loads,
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
