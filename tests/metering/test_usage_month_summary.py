"""The monthly usage summary (``UsageRollupMonthly``) the database keeps from the hourly rollups,
and what reads it: usage from an instant on (``usage_sums_since``), finance's accrued revenue.

The summary must equal the hourly rollups summed by calendar month whatever wrote them: the
usage API's ingest (new rollup rows and ``ON CONFLICT DO UPDATE`` of existing ones in one
statement), late events, cost attribution's updates, a delete, a truncate.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.db import connection
from django.db.models import Count, Sum
from django.db.models.functions import TruncMonth

from billing_platform.accounts.models import Organization
from billing_platform.invoicing import reports as invoicing_reports
from billing_platform.invoicing import services as invoicing_services
from billing_platform.invoicing.models import Invoice
from metering.models import UsageEvent, UsageRollupHourly, UsageRollupMonthly
from metering.selectors import usage_sums_since
from plans import services as plan_services
from plans.periods import add_months
from tests.factories import make_billed_org, make_price_book
from tests.invoicing.conftest import (  # noqa: F401 - the autouse invariant check
    billing_invariant_holds,
    record,
)

URL = "/api/v1/usage/events"
KEY = ("organization_id", "month", "model", "region", "service_tier", "capacity_source",
       "currency")
SUMS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "input_amount",
        "cached_input_amount", "output_amount")


def _rollups_by_month() -> dict[tuple, tuple]:
    rows = (UsageRollupHourly.objects.annotate(month=TruncMonth("hour", tzinfo=UTC))
            .values(*KEY).annotate(n=Count("id"), **{f"s_{c}": Sum(c) for c in SUMS}))
    return {tuple(r[k] for k in KEY): (r["n"], *(r[f"s_{c}"] for c in SUMS)) for r in rows}


def _summary() -> dict[tuple, tuple]:
    return {tuple(r[:len(KEY)]): tuple(r[len(KEY):]) for r in
            UsageRollupMonthly.objects.filter(rollups__gt=0)
            .values_list(*KEY, "rollups", *SUMS)}


def _post(api_client, tenant, events: list[dict]) -> dict:
    reply = api_client.post(URL, {"events": events}, format="json",
                            HTTP_AUTHORIZATION=f"Bearer {tenant.secret}")
    assert reply.status_code == 200, reply.content
    return reply.json()


def _event(event_id: str, when: datetime, **fields) -> dict:
    return {"id": event_id, "model": "test-model", "prompt_tokens": 1200, "cached_tokens": 200,
            "completion_tokens": 300, "event_time": when.isoformat(), **fields}


def test_the_month_summary_equals_the_hourly_rollups_summed_whatever_writes_them(
        api_client, tenant):
    now = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    months_ago = add_months(now, -3)
    Organization.objects.filter(id=tenant.org.id).update(created_at=add_months(now, -4))
    # given events through the usage API: two hours of this month, one of them in two batches
    # (the second batch updates its rollup row and inserts new ones in one statement), another
    # project's key, a late event three months back
    first = _post(api_client, tenant, [
        _event("a1", now - timedelta(minutes=50)),
        _event("a2", now - timedelta(hours=3), prompt_tokens=5000, cached_tokens=0),
    ])
    assert first["recorded"] == 2
    assert _summary() == _rollups_by_month() != {}
    second = _post(api_client, tenant, [
        _event("a3", now - timedelta(minutes=40), completion_tokens=7),  # same rollup as a1
        _event("a4", now - timedelta(minutes=30), api_key=tenant.key2.public_id),
        _event("late", months_ago + timedelta(minutes=5), model="big-model"),
        _event("a1", now - timedelta(minutes=50)),  # a duplicate: counted once
    ])
    assert (second["recorded"], second["duplicates"]) == (3, 1)
    # then every month's row is the sum of its hourly rows, the updated one included
    summary = _summary()
    assert summary == _rollups_by_month()
    this_month = datetime(now.year, now.month, 1, tzinfo=UTC)
    ours = {k: v for k, v in summary.items() if k[1] == this_month and k[2] == "test-model"}
    assert sum(v[1] for v in ours.values()) == 4  # a1, a2, a3, a4: requests
    late_month = datetime(months_ago.year, months_ago.month, 1, tzinfo=UTC)
    assert [v[1] for k, v in summary.items() if k[1] == late_month] == [1]

    # when cost attribution adds GPU time to rollups (no summed column moves)
    with connection.cursor() as cur:
        cur.execute("UPDATE usage_rollup_hourly SET gpu_seconds = gpu_seconds + 1, "
                    "cost_to_serve = cost_to_serve + 0.5")
    # then nothing changes; and a rollup row deleted leaves its key's other rows only
    assert _summary() == summary
    UsageRollupHourly.objects.filter(organization_id=tenant.org.id, model="big-model").delete()
    assert _summary() == _rollups_by_month() == {
        k: v for k, v in summary.items() if k[2] != "big-model"}
    with connection.cursor() as cur:
        cur.execute("TRUNCATE usage_rollup_hourly")
    assert not UsageRollupMonthly.objects.exists()


@pytest.fixture
def spread(db):
    """One org's events at the edges of hours and months, each amount a distinct digit."""
    make_price_book(prices=[{"model": "m-small", "input": "1.00", "output": "2.00"}])
    org = make_billed_org(name="Spread", created_at=datetime(2026, 8, 1, tzinfo=UTC))
    times = [datetime(2026, 9, 30, 23, 59, 59, 999_999, tzinfo=UTC),
             datetime(2026, 10, 1, tzinfo=UTC),
             datetime(2026, 10, 1, 0, 0, 0, 1, tzinfo=UTC),
             datetime(2026, 10, 15, 10, 29, 59, 999_999, tzinfo=UTC),
             datetime(2026, 10, 15, 10, 30, tzinfo=UTC),
             datetime(2026, 10, 15, 11, tzinfo=UTC),
             datetime(2026, 10, 31, 23, 59, 59, 999_999, tzinfo=UTC),
             datetime(2026, 11, 1, tzinfo=UTC),
             datetime(2026, 12, 2, 5, 45, tzinfo=UTC)]
    for i, when in enumerate(times):
        record(org, f"s{i}", when, prompt_tokens=10 ** i, completion_tokens=i)
    return org


@pytest.mark.parametrize("since", [
    datetime(2026, 9, 1, tzinfo=UTC),                       # a month start
    datetime(2026, 10, 1, 0, 0, 0, 1, tzinfo=UTC),          # a microsecond past one
    datetime(2026, 10, 15, 10, 30, tzinfo=UTC),             # mid-hour, mid-month
    datetime(2026, 10, 15, 10, 29, 59, 999_999, tzinfo=UTC),
    datetime(2026, 10, 15, 11, tzinfo=UTC),                 # on the hour, mid-month
    datetime(2026, 10, 31, 23, 59, 59, 999_999, tzinfo=UTC),  # the month's last microsecond
    datetime(2026, 12, 3, tzinfo=UTC),                      # after every event
])
def test_usage_since_an_instant_is_every_event_from_it_on_to_the_microsecond(spread, since):
    # when the usage from the instant on is summed (month rows, hours, events)
    rows = usage_sums_since(since={spread.id: since})
    # then it is exactly the events at or after it: nothing of an hour or month counted twice
    events = UsageEvent.objects.filter(organization_id=spread.id, event_time__gte=since)
    expected = events.aggregate(p=Sum("prompt_tokens"), c=Sum("completion_tokens"),
                                a=Sum("amount"))
    got_amount = sum((r.input_amount + r.cached_input_amount + r.output_amount for r in rows),
                     Decimal(0))
    assert sum(r.input_tokens for r in rows) == (expected["p"] or 0)
    assert sum(r.output_tokens for r in rows) == (expected["c"] or 0)
    assert got_amount == (expected["a"] or 0)
    assert {r.bucket for r in rows} <= {datetime(since.year, since.month, 1, tzinfo=UTC)}


def test_usage_since_many_orgs_and_instants_is_summed_per_bucket(spread):
    # given a second org with events of its own, and three orgs' instants: a month start, a
    # mid-hour mid-month instant, and one on the 1st at 00:00 of the same month as another
    other = make_billed_org(name="Other", created_at=datetime(2026, 8, 1, tzinfo=UTC))
    third = make_billed_org(name="Third", created_at=datetime(2026, 8, 1, tzinfo=UTC))
    for i, when in enumerate([datetime(2026, 10, 3, 7, 15, tzinfo=UTC),
                              datetime(2026, 10, 15, 10, 45, tzinfo=UTC),
                              datetime(2026, 11, 20, tzinfo=UTC)]):
        record(other, f"o{i}", when, prompt_tokens=7 * 10 ** i)
        record(third, f"t{i}", when, prompt_tokens=3 * 10 ** i)
    since = {spread.id: datetime(2026, 10, 15, 10, 30, tzinfo=UTC),
             other.id: datetime(2026, 10, 1, tzinfo=UTC),
             third.id: datetime(2026, 10, 15, 10, 30, tzinfo=UTC)}
    # when summed by day of each org's instant
    rows = usage_sums_since(since=since, unit="day")
    # then each bucket holds exactly its orgs' events from their instants on
    got: dict[datetime, int] = {}
    for r in rows:
        got[r.bucket] = got.get(r.bucket, 0) + r.input_tokens
    expected: dict[datetime, int] = {}
    for org_id, at in since.items():
        day = at.replace(hour=0, minute=0, second=0, microsecond=0)
        tokens = UsageEvent.objects.filter(organization_id=org_id, event_time__gte=at
                                           ).aggregate(p=Sum("prompt_tokens"))["p"]
        expected[day] = expected.get(day, 0) + tokens
    assert got == expected
    assert got[datetime(2026, 10, 15, tzinfo=UTC)] == (
        10 ** 4 + 10 ** 5 + 10 ** 6 + 10 ** 7 + 10 ** 8 + 30 + 300)


def test_accrued_revenue_of_a_mid_month_anchor_is_the_hand_computation(db):
    # given an org billed on a plan anchored mid-month, mid-hour, half a millisecond in
    make_price_book(prices=[{"model": "m-small", "input": "1.00", "output": "2.00"}])
    anchor = datetime(2026, 10, 15, 10, 30, 0, 500, tzinfo=UTC)
    org = make_billed_org(name="Anchored", created_at=add_months(anchor, -1))
    plan = plan_services.plan_create(code="od-mid", name="On demand", kind="on_demand")
    plan_services.subscription_create(organization=org, plan=plan,
                                      starts_at=add_months(anchor, -1),
                                      billing_anchor=add_months(anchor, -1))
    # its last microsecond before the anchor was invoiced by the close of that period
    record(org, "billed", anchor - timedelta(microseconds=1), prompt_tokens=1_000_000)
    assert invoicing_services.period_close_run(now=anchor + timedelta(hours=1),
                                               enqueue_payments=False,
                                               org_ids=[org.id]).invoices == 1
    assert Invoice.objects.get(organization=org).period_end == anchor
    # when usage arrives from the anchor on: its first partial hour (events), the rest of
    # October (hourly rollups), November and December (the month summary)
    for request_id, when, tokens in (
            ("at-anchor", anchor, 100_000),
            ("first-hour", anchor + timedelta(minutes=20), 20_000),
            ("next-hour", datetime(2026, 10, 15, 11, tzinfo=UTC), 3_000),
            ("october-last", datetime(2026, 10, 31, 23, 59, 59, 999_999, tzinfo=UTC), 400),
            ("november-first", datetime(2026, 11, 1, tzinfo=UTC), 50),
            ("period-last", add_months(anchor, 1) - timedelta(microseconds=1), 6),
            ("next-period", datetime(2026, 12, 2, tzinfo=UTC), 700_000)):
        record(org, request_id, when, prompt_tokens=tokens)
    # then the accrued revenue is the sum of those amounts, to the 10th place: 1.00 per 1M
    accrued = invoicing_reports.unbilled_usage(org_ids=[org.id])
    assert sum((u.input_amount + u.cached_input_amount + u.output_amount for u in accrued),
               Decimal(0)) == Decimal("0.823456")
    assert sum(u.input_tokens for u in accrued) == 823_456
    assert {(u.bucket, u.currency) for u in accrued} == {(datetime(2026, 10, 1, tzinfo=UTC),
                                                          "USD")}
