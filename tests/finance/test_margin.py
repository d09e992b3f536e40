"""The margin report (issue 18 item 2): revenue against cost-to-serve, computed by hand here.

Seeded: usage recorded through metering's record path (rated, rolled up) on engine
``pool-a-0``, then that engine's GPU time as ``metering.costs`` stores it (intervals, shares,
the rollups' GPU-seconds and cost), with round numbers so every figure is checked by hand:

- pool-a: 2 GPUs at 1.80 USD per GPU-hour = 0.001 USD per GPU-second. Interval 1 (100 s =
  200 GPU-s, 0.20): a1 100 GPU-s (0.10), b1 50 GPU-s (0.05), idle 50 (0.05). Interval 2
  (200 GPU-s, 0.20): e1 20 GPU-s (0.02), idle 180 (0.18).
- pool-b: 1 GPU at 3.60 = 0.001 per GPU-second; one interval of 100 s, all idle (0.10).
- Prices per 1M: USD input 1.00, cached 0.10, output 2.00; EUR 0.90, 0.09, 1.80.
  a1 (Alpha, USD) 1,000,000 in + 500,000 out = 2.00; b1 (Beta, USD, priority tier: the
  default 2.0 multiplier) 2,000,000 in = 4.00; e1 (Epsilon, EUR) 1,000,000 in + 1,000,000 out
  = 2.70 EUR. List prices (the break-even's) are the base ones: b1 is 2.00 at list.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal

import pytest
from django.db.models import F, Sum
from django.utils import timezone
from rest_framework.test import APIClient

from billing_platform.finance import reports
from engine_adapter.models import EngineInstance, Pool
from metering.models import UsageCostInterval, UsageCostShare, UsageEvent, UsageRollupHourly
from tests.factories import make_billed_org, make_price_book
from tests.finance.test_report_apis import _outsiders
from tests.invoicing.conftest import OCT, record

D = Decimal
T0 = OCT + timedelta(days=3, hours=10)
START, END = OCT, OCT + timedelta(days=31)


@dataclass
class Seeded:
    a: object
    b: object
    e: object


def _engine(name: str, gpus: int, price: str) -> None:
    pool = Pool.objects.create(name=name, model="m-small", region="us-east", zone="us",
                               gpus_per_replica=gpus, gpu_hourly_cost=D(price), launch="sim")
    EngineInstance.objects.create(pool=pool, engine_id=f"{name}-0", replica=0,
                                  url="http://127.0.0.1:1")


def _interval(engine: str, pool: str, start, gpus: int, price: str,
              shares: dict[str, int]) -> None:
    """Store one engine-interval of 100 s with ``shares`` (request id -> GPU-seconds) at
    0.001 USD per GPU-second, and add them to the events' rollups, as metering.costs does."""
    capacity = 100 * gpus
    used = sum(shares.values())
    iv = UsageCostInterval.objects.create(
        engine=engine, pool=pool, start=start, seconds=100, gpus=gpus,
        gpu_hourly_cost=D(price), capacity_us=capacity * 10**6, attributed_us=used * 10**6,
        idle_us=(capacity - used) * 10**6, capacity_cost=D(capacity) / 1000,
        attributed_cost=D(used) / 1000, idle_cost=D(capacity - used) / 1000,
        requests=len(shares), prefill_tokens_per_s=D(10_000), decode_tokens_per_s=D(100),
        throughput_source="measured", fingerprint="seeded", computed_at=timezone.now())
    for request_id, gpu_s in shares.items():
        event = UsageEvent.objects.get(request_id=request_id)
        UsageCostShare.objects.create(interval=iv, event_id=event.id,
                                      event_time=event.event_time,
                                      organization_id=event.organization_id,
                                      gpu_us=gpu_s * 10**6, cost=D(gpu_s) / 1000)
        updated = UsageRollupHourly.objects.filter(
            organization_id=event.organization_id, model=event.model,
            hour=event.event_time.replace(minute=0, second=0, microsecond=0)).update(
            gpu_seconds=F("gpu_seconds") + gpu_s, cost_to_serve=F("cost_to_serve")
            + D(gpu_s) / 1000)
        assert updated == 1


@pytest.fixture
def seeded(db) -> Seeded:
    make_price_book(prices=[{"model": "m-small", "input": "1.00", "output": "2.00"}])
    make_price_book(currency="EUR", prices=[{"model": "m-small", "input": "0.90",
                                             "output": "1.80"}])
    a = make_billed_org(name="Alpha", created_at=OCT)
    b = make_billed_org(name="Beta", created_at=OCT)
    e = make_billed_org(name="Epsilon", created_at=OCT, currency="EUR")
    _engine("pool-a", 2, "1.80")
    _engine("pool-b", 1, "3.60")
    record(a, "a1", T0 + timedelta(seconds=10), engine="pool-a-0", prompt_tokens=1_000_000,
           completion_tokens=500_000)
    record(b, "b1", T0 + timedelta(seconds=20), engine="pool-a-0", prompt_tokens=2_000_000,
           service_tier="priority")
    record(e, "e1", T0 + timedelta(seconds=150), engine="pool-a-0", prompt_tokens=1_000_000,
           completion_tokens=1_000_000)
    _interval("pool-a-0", "pool-a", T0, 2, "1.80", {"a1": 100, "b1": 50})
    _interval("pool-a-0", "pool-a", T0 + timedelta(seconds=100), 2, "1.80", {"e1": 20})
    _interval("pool-b-0", "pool-b", T0, 1, "3.60", {})
    return Seeded(a, b, e)


def _report(**kw) -> reports.MarginReport:
    return reports.margin_report(report_filter=reports.MarginFilter(start=START, end=END, **kw))


def _cells(row) -> tuple:
    return (row.key, row.currency, row.revenue, row.cost_to_serve, row.margin, row.margin_ratio)


def test_margin_per_organization_is_revenue_minus_cost_and_never_mixes_currencies(seeded):
    report = _report()
    assert [_cells(r) for r in report.rows] == [
        (seeded.a.public_id, "USD", D("2.00"), D("0.10"), D("1.90"), D("0.95")),
        (seeded.b.public_id, "USD", D("4.00"), D("0.05"), D("3.95"), D("0.9875")),
        # EUR revenue against USD cost: both shown, no margin (no exchange rate applied)
        (seeded.e.public_id, "EUR", D("2.70"), D("0.02"), None, None),
    ]
    assert [r.label for r in report.rows] == ["Alpha", "Beta", "Epsilon"]
    assert [r.gpu_seconds for r in report.rows] == [D(100), D(50), D(20)]
    assert [_cells(t) for t in report.totals] == [
        ("", "EUR", D("2.70"), D("0.02"), None, None),
        ("", "USD", D("6.00"), D("0.15"), D("5.85"), D("0.975"))]


@pytest.mark.parametrize(("by", "expected"), [
    ("model", [("m-small", "EUR", D("2.70"), D("0.02")), ("m-small", "USD", D("6.00"),
                                                          D("0.15"))]),
    ("plan_kind", [("on_demand", "EUR", D("2.70"), D("0.02")),
                   ("on_demand", "USD", D("6.00"), D("0.15"))]),
    ("service_tier", [("default", "EUR", D("2.70"), D("0.02")),
                      ("default", "USD", D("2.00"), D("0.10")),
                      ("priority", "USD", D("4.00"), D("0.05"))]),
    ("pool", [("pool-a", "EUR", D("2.70"), D("0.02")), ("pool-a", "USD", D("6.00"),
                                                        D("0.15"))]),
])
def test_margin_per_model_plan_kind_tier_and_pool(seeded, by, expected):
    rows = _report(by=by).rows
    assert [(r.key, r.currency, r.revenue, r.cost_to_serve) for r in rows] == expected


def test_filters_narrow_the_groups_and_the_requests(seeded):
    only_a = _report(org_id=seeded.a.id)
    assert [(r.key, r.revenue) for r in only_a.rows] == [(seeded.a.public_id, D("2.00"))]
    assert [r.request_id for r in only_a.requests] == ["a1"]
    assert [r.key for r in _report(service_tier="priority").rows] == [seeded.b.public_id]
    assert [r.currency for r in _report(currency="EUR").totals] == ["EUR"]
    assert _report(model="other").rows == []


def test_requests_costliest_first_with_their_margin(seeded):
    got = [(r.request_id, r.pool, r.plan_kind, r.revenue, r.cost_to_serve, r.gpu_seconds,
            r.margin) for r in _report(limit=2).requests]
    assert got == [("a1", "pool-a", "on_demand", D("2.00"), D("0.10"), D(100), D("1.90")),
                   ("b1", "pool-a", "on_demand", D("4.00"), D("0.05"), D(50), D("3.95"))]


def test_pool_idle_cost_cost_per_million_and_break_even_by_hand(seeded):
    pools = {p.pool: p for p in _report().pools}
    a = pools["pool-a"]
    # 400 GPU-s of capacity (0.40), 170 attributed (0.17), 230 idle (0.23)
    assert (a.capacity_gpu_seconds, a.attributed_gpu_seconds, a.idle_gpu_seconds) == (
        D(400), D(170), D(230))
    assert (a.capacity_cost, a.attributed_cost, a.idle_cost) == (D("0.4"), D("0.17"),
                                                                 D("0.23"))
    assert a.utilization == D("0.425000")
    # GPU-hour 0.40 x 3600 / 400 = 3.60 (2 GPUs x 1.80); tokens 1.5M + 2M + 2M = 5.5M;
    # per GPU-hour 5.5M x 3600 / 400 = 49,500,000; per 1M: 3.60 / 49.5 = 0.0727272727
    assert a.gpu_hour_cost == D("3.6")
    assert a.tokens == 5_500_000 and a.tokens_per_gpu_hour == D(49_500_000)
    assert a.cost_per_1m_tokens == D("0.0727272727")
    # at full utilization: 0.17 / 5.5 = 0.0309090909 per 1M
    assert a.busy_cost_per_1m_tokens == D("0.0309090909")
    # list value at USD list prices: a1 1.00 + 1.00, b1 2.00, e1 1.00 + 2.00 = 7.00 -> per 1M
    # 7 / 5.5 = 1.2727272727; break-even at 0.17 / 7.00 = 0.0242857 (= 0.0309/1.2727)
    assert a.list_price_per_1m_tokens == D("1.2727272727")
    assert a.break_even_utilization == D("0.024286")
    assert a.break_even_utilization < a.utilization  # the pool covers its cost at list price
    assert a.models == "m-small" and a.engines == 1
    b = pools["pool-b"]
    assert (b.capacity_cost, b.idle_cost, b.utilization, b.tokens) == (
        D("0.1"), D("0.1"), D("0"), 0)
    assert b.cost_per_1m_tokens is None and b.break_even_utilization is None
    assert b.gpu_hour_cost == D("3.6")


# --- over HTTP ----------------------------------------------------------------------------------

URL = "/api/v1/finance/margin/"
RANGE = {"start": "2026-10-01", "end": "2026-11-01"}


def test_the_api_answers_the_reports_figures_and_the_csv_is_each_table(seeded, analyst_client):
    body = analyst_client.get(URL, RANGE).json()
    assert body["report"] == "margin" and body["cost_currency"] == "USD"
    assert [(r["key"], r["revenue"], r["cost_to_serve"], r["margin"]) for r in body["data"]] == [
        (seeded.a.public_id, "2.0000000000", "0.1000000000", "1.9000000000"),
        (seeded.b.public_id, "4.0000000000", "0.0500000000", "3.9500000000"),
        (seeded.e.public_id, "2.7000000000", "0.0200000000", None)]
    assert {p["pool"] for p in body["pools"]} == {"pool-a", "pool-b"}
    assert [r["request_id"] for r in body["requests"]] == ["a1", "b1", "e1"]
    for table, key in (("groups", "key"), ("pools", "pool"), ("requests", "request_id")):
        as_json = analyst_client.get(URL, {**RANGE, "table": table}).json()["data"]
        reply = analyst_client.get(URL, {**RANGE, "table": table, "format": "csv"})
        assert reply["Content-Type"].startswith("text/csv")
        rows = list(csv.DictReader(io.StringIO(reply.content.decode())))
        assert [r[key] for r in rows] == [j[key] for j in as_json]
        assert [{k: v or None for k, v in r.items()} for r in rows] == [
            {k: (None if v in (None, "") else str(v)) for k, v in j.items()} for j in as_json]


def test_by_pool_and_organization_filter_over_http(seeded, analyst_client):
    body = analyst_client.get(URL, {**RANGE, "by": "pool",
                                    "organization": seeded.b.public_id}).json()
    assert [(r["key"], r["revenue"], r["cost_to_serve"]) for r in body["data"]] == [
        ("pool-a", "4.0000000000", "0.0500000000")]


def test_everyone_but_platform_finance_gets_404(seeded):
    for who, client in _outsiders().items():
        for query in ({}, {"format": "csv"}, {"by": "pool"}):
            reply = client.get(URL, query)
            assert reply.status_code == 404, (who, query, reply.status_code)
            assert b"cost" not in reply.content


@pytest.mark.parametrize(("query", "field"), [
    ({"by": "engine"}, "by"), ({"start": "2026-13-01"}, "start"),
    ({"start": "2026-11-01", "end": "2026-10-01"}, "end"), ({"limit": "0"}, "limit"),
    ({"limit": "100000"}, "limit"), ({"service_tier": "gold"}, "service_tier"),
    ({"organization": "org_forged"}, "organization"), ({"currency": "EURO"}, "currency"),
    ({"table": "secrets"}, "table"), ({"model": "m" * 201}, "model"),
    ({"start": "1990-01-01"}, "start"),
])
def test_malformed_filters_are_drf_400s_naming_the_parameter(analyst_client, query, field):
    for fmt in ({}, {"format": "csv"}):
        reply = analyst_client.get(URL, {**query, **fmt})
        assert reply.status_code == 400, (query, reply.content)
        assert field in reply.json(), reply.json()


# --- customers never see cost -------------------------------------------------------------------

COST_WORDS = ("cost", "gpu_seconds", "gpu-seconds", "margin")


def test_customer_usage_api_and_console_usage_page_show_no_cost(seeded):
    from billing_platform.accounts.choices import Role
    from tests.factories import MembershipFactory

    owner = MembershipFactory(organization=seeded.a, role=Role.OWNER)
    client = APIClient()
    client.force_login(owner.user)
    for params in ({"start": "2026-10-01T00:00:00Z", "end": "2026-11-01T00:00:00Z"},
                   {"start": "2026-10-01T00:00:00Z", "end": "2026-11-01T00:00:00Z",
                    "group_by": "day,model,service_tier,region"}):
        reply = client.get("/api/v1/usage", {"organization": seeded.a.public_id, **params})
        assert reply.status_code == 200, reply.content
        text = json.dumps(reply.json()).lower()
        assert "2.0000000000" in text or "2.00" in text  # the usage (and its amount) is there
        assert not [w for w in COST_WORDS if w in text], text
    page = client.get("/console/usage/").content.decode().lower()
    csv_page = b"".join(client.get("/console/usage/?format=csv").streaming_content
                        ).decode().lower()  # the explorer streams its CSV
    for body in (page, csv_page):
        assert not [w for w in ("cost_to_serve", "cost to serve", "gpu_seconds", "gpu-seconds",
                                "margin") if w in body]
    # and the seeded cost is real: finance sees it for the same organization
    assert UsageRollupHourly.objects.filter(organization=seeded.a).aggregate(
        c=Sum("cost_to_serve"))["c"] == D("0.1")


# --- real traffic: a simulator behind the live gateway, the attribution task run -------------

def test_real_traffic_margin_is_revenue_minus_attributed_cost_on_the_rollups(
        transactional_db, tmp_path, settings, metering_stream):
    from engine_adapter.sim.testing import start_sim
    from metering.tasks import cost_attribute
    from tests.finance.conftest import finance_user
    from tests.gateway.conftest import drain_usage
    from tests.metering.engine_stack import engine_stack, scrape

    settings.METERING_COST_INTERVAL_S = 1
    settings.METERING_COST_SETTLE_S = 0
    sim = start_sim(served_model_name="small", prefill_tokens_per_s=50_000,
                    decode_tokens_per_s=400)
    try:
        with engine_stack(tmp_path, metering_stream, model="small",
                          engines={"solo": (sim, 2, "3.60")}) as stack:
            # given three requests served by one engine, scraped before and after
            scrape()
            ids = [stack.chat(tokens=n) for n in (60, 120, 180)]
            scrape()
            drain_usage()
    finally:
        sim.stop()
    events = list(UsageEvent.objects.filter(request_id__in=ids))
    assert len(events) == 3
    org_id = events[0].organization_id

    # when the beat's cost attribution task runs
    result = cost_attribute.apply().get()
    assert result["shares"] >= 3, result

    # then finance's margin for the org is its rollups' revenue minus their cost-to-serve
    sums = UsageRollupHourly.objects.filter(organization_id=org_id).aggregate(
        amount=Sum("amount"), cost=Sum("cost_to_serve"), gpu=Sum("gpu_seconds"))
    shares = UsageCostShare.objects.filter(organization_id=org_id).aggregate(c=Sum("cost"))
    assert sums["cost"] == shares["c"] > 0  # the attributed cost is on the rollups
    client = APIClient()
    client.force_authenticate(finance_user())
    today = timezone.now().date()
    body = client.get(URL, {"start": today.isoformat(),
                            "end": (today + timedelta(days=1)).isoformat()}).json()
    (row,) = [r for r in body["data"] if r["requests"] == 3]
    assert D(row["revenue"]) == sums["amount"] > 0
    assert D(row["cost_to_serve"]) == sums["cost"]
    assert D(row["gpu_seconds"]) == sums["gpu"]
    assert D(row["margin"]) == sums["amount"] - sums["cost"]
    (pool,) = [p for p in body["pools"] if p["pool"] == "solo"]
    assert D(pool["attributed_cost"]) + D(pool["idle_cost"]) == D(pool["capacity_cost"])
    assert D(pool["attributed_cost"]) == sums["cost"]
    assert pool["tokens"] == sum(e.prompt_tokens + e.completion_tokens for e in events)
    assert D(pool["break_even_utilization"]) > 0
