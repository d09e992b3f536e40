"""Plan-advisor benchmark: advise one organization with 1,000,000 events in a month.

Builds a fresh database (its name must contain "bench"), migrates it, seeds a catalog (the
default USD book with two models, a blocking and an overage token plan, a provisioned
offering), one organization and ``--events`` usage events in October 2026, generated with a
fixed seed: a daily cycle, in time order as the gateway appends them; prompts from three
system prompts (70 % of them cached) plus a lognormal user part; lognormal completions; 85 %
default tier, 10 % batch, 5 % priority; two models. They are loaded with one ``COPY``, plus
the hourly rollups summed in SQL for "what was billed" (the events' stored amounts are the list
price computed in SQL here, bench data only: the advisor prices every event itself). Then it
times ``plans.advisor.plan_advice`` for the month, as the API computes it.

Prints one JSON line: ``{"events", "seconds", "cpu_seconds", "load_average", "alternatives",
"cheapest", "setup_seconds"}`` (``cpu_seconds``: this process's CPU time for the advice, which
a busy shared machine inflates less than the wall time; ``load_average``: the 1-minute load
when it finished). The goal is under 5 s for 1,000,000 events.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/tollgate_bench_advisor \\
        .venv/bin/python bench/plan_advisor.py
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.invoice_run import bench_django, drop_database, log, rollup_insert

PERIOD_START = datetime(2026, 10, 1, tzinfo=UTC)
PERIOD_END = datetime(2026, 11, 1, tzinfo=UTC)
SMALL, LARGE = "llama-3.1-8b-instruct", "llama-3.1-70b-instruct"
PRICES = {SMALL: ("0.10", "0.40"), LARGE: ("0.60", "2.40")}  # input, output per 1M
SYSTEM_PROMPTS = (300, 1_200, 2_500)


def catalog() -> None:
    from plans import services

    book = services.price_book_create(code="bench-usd", name="Bench prices", currency="USD",
                                      is_default=True)
    services.price_version_create(
        price_book=book, effective_from=PERIOD_START - timedelta(days=60), allow_backdate=True,
        prices=[{"model": m, "input": i, "output": o} for m, (i, o) in PRICES.items()])
    coefficients = [{"model": m, "token_class": c, "coefficient": v}
                    for m, scale in ((SMALL, 1), (LARGE, 6))
                    for c, v in (("input", str(scale)), ("cached_input", str(scale / 10)),
                                 ("output", str(4 * scale)))]
    services.plan_create(code="builder", name="Builder", kind="token_plan",
                         monthly_fee="200.00", credits_per_period="2000000000",
                         window_credits="40000000", cap_policy="block",
                         coefficients=coefficients)
    services.plan_create(code="scale", name="Scale", kind="token_plan", monthly_fee="500.00",
                         credits_per_period="5000000000", window_credits="60000000",
                         cap_policy="overage", coefficients=coefficients)
    services.provisioned_offering_create(
        code="small-units", name="8B units", model=SMALL, region="us-east",
        tokens_per_minute_per_unit=20_000, output_burndown="4", hourly_unit_price="0.40",
        monthly_unit_price="240.00")


def events(org_id: int, project_id: int, n: int, seed: int) -> None:
    """COPY ``n`` generated events of the organization into ``usage_event``."""
    from django.db import connection

    from metering.partitions import ensure_for

    ensure_for([PERIOD_START, PERIOD_END - timedelta(seconds=1)])
    rng = random.Random(seed)
    span = (PERIOD_END - PERIOD_START).total_seconds()
    columns = ("request_id", "organization_id", "project_id", "model", "region", "data_zone",
               "service_tier", "capacity_source", "prompt_tokens", "cached_tokens",
               "completion_tokens", "ttft_ms", "total_ms", "status", "event_time", "batch_id",
               "amount", "currency", "rating_breakdown")
    connection.ensure_connection()
    offsets = []
    while len(offsets) < n:  # a daily cycle: three times the traffic at 15:00 UTC as at 03:00
        offset = rng.random() * span
        hour = (offset / 3600) % 24
        if rng.random() < (2 + math.sin((hour - 9) / 24 * 2 * math.pi)) / 3:
            offsets.append(offset)
    offsets.sort()  # events are appended as they happen: the heap is in time order
    with connection.connection.cursor() as raw, raw.copy(
            f"COPY usage_event ({', '.join(columns)}) FROM STDIN") as copy:
        for i, offset in enumerate(offsets):
            system = rng.choice(SYSTEM_PROMPTS)
            prompt = system + min(int(rng.lognormvariate(5, 1)), 30_000)
            cached = system if rng.random() < 0.7 else 0
            completion = max(1, min(int(rng.lognormvariate(5.3, 0.9)), 4_000))
            model = LARGE if rng.random() < 0.2 else SMALL
            roll = rng.random()
            tier = "batch" if roll < 0.10 else "priority" if roll < 0.15 else "default"
            ttft = 80 + int(rng.expovariate(1 / 200))
            total = ttft + completion * rng.choice((12, 20, 35))
            p_in, p_out = (float(p) for p in PRICES[model])
            mult = {"batch": 0.5, "priority": 2.0}.get(tier, 1.0)
            amount = ((prompt - cached) * p_in + cached * p_in / 10 + completion * p_out) \
                * mult / 1e6
            copy.write_row((
                f"req_bench{i:07d}", org_id, project_id, model, "us-east", "global", tier,
                "on_demand", prompt, cached, completion, ttft, total,
                "client_aborted" if rng.random() < 0.01 else "ok",
                PERIOD_START + timedelta(seconds=offset),
                f"batch_{i // 5000}" if tier == "batch" else None, f"{amount:.10f}", "USD",
                "{}"))
    with connection.cursor() as cur:
        # bench rollups: the events summed per hour (stored amounts are bench data, see above)
        cur.execute(rollup_insert("""
            SELECT organization_id, project_id, NULL, model, region, service_tier,
                   capacity_source, currency, date_trunc('hour', event_time, 'UTC'), count(*),
                   0, count(*) FILTER (WHERE status = 'client_aborted'), sum(prompt_tokens),
                   sum(cached_tokens), sum(completion_tokens), 0, sum(amount), 0, 0,
                   sum(amount), 0, 0
              FROM usage_event GROUP BY 1, 2, 4, 5, 6, 7, 8, 9"""))
        cur.execute("ANALYZE usage_event")
        cur.execute("ANALYZE usage_rollup_hourly")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=18)
    parser.add_argument("--keep", action="store_true", help="keep the bench database")
    parser.add_argument("--reuse", action="store_true",
                        help="time the advice on a database kept by --keep")
    args = parser.parse_args()

    url = os.environ.get("DATABASE_URL", "")
    if "bench" not in url:
        url = "postgres://postgres@127.0.0.1:5432/tollgate_bench_advisor"
    t0 = time.perf_counter()
    bench_django(url, fresh=not args.reuse)
    from billing_platform.accounts.models import Organization, Project

    if not args.reuse:
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        catalog()
        org = Organization.objects.create(name="Bench org", slug="bench-org",
                                          billing_email="billing@bench.example.com",
                                          created_at=PERIOD_START)
        project = Project.objects.create(organization=org, name="Bench project")
        log(f"loading {args.events:,} events")
        events(org.id, project.id, args.events, args.seed)
    org = Organization.objects.get(slug="bench-org")
    setup = time.perf_counter() - t0

    from billing_platform.invoicing.money import quantize_money
    from plans.advisor import plan_advice

    start, cpu = time.perf_counter(), time.process_time()
    advice = plan_advice(organization=org, period_start=PERIOD_START, period_end=PERIOD_END,
                         round_money=quantize_money)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    result = {"events": advice.events, "seconds": round(seconds, 2),
              "cpu_seconds": round(cpu, 2), "load_average": round(os.getloadavg()[0], 1),
              "alternatives": len(advice.alternatives),
              "cheapest": f"{advice.cheapest.kind}:{advice.cheapest.code}",
              "setup_seconds": round(setup, 1)}
    log(json.dumps({a.kind + ":" + a.code: str(a.total) for a in
                    (advice.current, *advice.alternatives)}))
    if not args.keep:
        drop_database(url)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
