"""Billing periods to the second: no usage falls off an invoice, none lands on the wrong one.

A subscription's billing anchor is its start to the second (08:37:18), as Stripe's is, while
usage is rolled up by clock hour. Usage is appended through the real path (the Redis usage
stream, drained by the ingest consumer: dedup, rating, rollups) and invoiced by the real period
close; the billing invariant (rated = billed, per organization) is checked after each step.
"""

from __future__ import annotations

import logging
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from billing_platform.celery import app
from billing_platform.invoicing import services
from billing_platform.invoicing.choices import LineKind
from billing_platform.invoicing.invariants import billing_invariant_check
from billing_platform.invoicing.models import Invoice
from billing_platform.invoicing.tasks import billing_invariant_task
from metering import services as metering_services
from metering.ingest import Ingestor
from metering.models import UsageEvent
from plans import services as plan_services
from tests.factories import make_billed_org, make_price_book

ANCHOR = datetime(2026, 10, 3, 8, 37, 18, tzinfo=UTC)  # a subscription started by a customer
SECOND = datetime(2026, 11, 3, 8, 37, 18, tzinfo=UTC)  # the next anchor: period 1 ends here
THIRD = datetime(2026, 12, 3, 8, 37, 18, tzinfo=UTC)
LATER = datetime(2027, 1, 3, 8, 37, 18, tzinfo=UTC)


@pytest.fixture
def anchored(db, metering_stream):
    """An org that signed up at 08:37:18 on an on-demand plan anchored there (m-small 1.00/1M
    input tokens), with a private usage stream."""
    make_price_book(prices=[{"model": "m-small", "input": "1.00", "output": "2.00"}])
    org = make_billed_org(name="Second-precise", created_at=ANCHOR)
    plan = plan_services.plan_create(code=f"od-{uuid.uuid4().hex[:8]}", name="Pay as you go",
                                     kind="on_demand")
    plan_services.subscription_create(organization=org, plan=plan, starts_at=ANCHOR)
    return org


def ingest(org, *usage: tuple[datetime, int]) -> list[str]:
    """Append events (event time, prompt tokens) to the usage stream, drain it; return ids."""
    ids = []
    for when, prompt_tokens in usage:
        request_id = f"req_{uuid.uuid4().hex}"
        path = metering_services.usage_event_append({
            "request_id": request_id, "org_id": org.id, "project_id": org.projects.first().id,
            "model": "m-small", "region": "us-east", "engine": "sim-0", "event_time": when,
            "prompt_tokens": prompt_tokens, "cached_tokens": 0, "completion_tokens": 0})
        assert path == "redis"
        ids.append(request_id)
    stats = Ingestor(batch_size=100, block_ms=100, writers=1).run(drain=True)
    assert stats.recorded == len(usage)
    return ids


def close(until: datetime) -> None:
    services.period_close_run(now=until + timedelta(minutes=30), enqueue_payments=False)


def billed_tokens(org) -> dict[tuple[datetime, str], int]:
    """Input tokens on each invoice of the org, by (period start, line kind)."""
    out: dict[tuple[datetime, str], int] = {}
    for invoice in Invoice.objects.filter(organization=org).order_by("period_start"):
        for ln in invoice.lines.filter(kind__in=[LineKind.USAGE, LineKind.LATE_USAGE]):
            key = (invoice.period_start, ln.kind)
            out[key] = out.get(key, 0) + int(ln.quantity)
    return out


def test_usage_seconds_after_a_non_hour_anchor_is_on_exactly_one_invoice(anchored):
    org = anchored
    # given a request 5 s after the anchor, in the hour the first period starts part-way into
    (request_id,) = ingest(org, (ANCHOR + timedelta(seconds=5), 180_000))
    event = UsageEvent.objects.get(organization_id=org.id, request_id=request_id)
    assert event.amount == Decimal("0.18") and event.currency == "USD"
    # and the draft shows it
    draft = services.upcoming_invoice(organization=org)
    assert (draft.target.period_start, draft.target.period_end) == (ANCHOR, SECOND)
    assert draft.total == Decimal("0.18")

    # when the first period closes, and the next one
    close(SECOND)
    close(THIRD)

    # then it is billed once, on the invoice of the period it happened in
    first = Invoice.objects.get(organization=org, period_start=ANCHOR)
    assert first.period_end == SECOND
    (line,) = first.lines.filter(kind=LineKind.USAGE)
    assert (line.quantity, line.amount) == (180_000, Decimal("0.18"))
    assert first.total == Decimal("0.18")
    assert billed_tokens(org) == {(ANCHOR, LineKind.USAGE): 180_000}
    assert Invoice.objects.filter(organization=org).count() == 2
    assert billing_invariant_check(org_ids=[org.id]) == []


def test_usage_in_the_hour_a_period_boundary_cuts_goes_to_its_own_period(anchored):
    org = anchored
    # given usage on both sides of the boundary at 08:37:18, inside the same clock hour
    ingest(org,
           (SECOND - timedelta(minutes=32), 1),           # 08:05:18: period 1
           (SECOND - timedelta(seconds=8), 20),           # 08:37:10: period 1
           (SECOND, 300),                                 # 08:37:18 exactly: period 2 starts
           (SECOND + timedelta(minutes=22, seconds=41), 4_000),  # 08:59:59: period 2
           (SECOND + timedelta(minutes=23), 50_000))      # 09:00:18: period 2

    # when both periods close
    close(SECOND)
    assert billing_invariant_check(org_ids=[org.id]) == []
    close(THIRD)

    # then each event is billed once, in the period that holds its time
    assert billed_tokens(org) == {(ANCHOR, LineKind.USAGE): 21,
                                  (SECOND, LineKind.USAGE): 54_300}
    assert billing_invariant_check(org_ids=[org.id]) == []


def test_late_usage_in_a_cut_hour_goes_on_the_next_invoice_once(anchored, settings):
    org = anchored
    settings.INVOICING_LATE_LOOKBACK_DAYS = 40  # period 1 is rescanned for the second close only
    close(SECOND)
    assert billed_tokens(org) == {}

    # given events of period 1, in the hours its start and its end cut, arriving after it closed
    ingest(org, (ANCHOR + timedelta(seconds=30), 7), (SECOND - timedelta(seconds=1), 80),
           (SECOND + timedelta(minutes=10), 900))  # and period 2's own usage
    assert billing_invariant_check(org_ids=[org.id]) == []
    close(THIRD)

    # then period 2's invoice bills them as late usage from period 1, and its own usage
    assert billed_tokens(org) == {(SECOND, LineKind.USAGE): 900,
                                  (SECOND, LineKind.LATE_USAGE): 87}
    late = Invoice.objects.get(organization=org, period_start=SECOND).lines.get(
        kind=LineKind.LATE_USAGE)
    assert (late.source_period_start, late.source_period_end) == (ANCHOR, SECOND)

    # given another period-1 event from the hour its start cut, months late (past the
    # lookback: found through the hour metering marks late)
    ingest(org, (ANCHOR + timedelta(minutes=1), 6_000))
    close(LATER)

    # then the third invoice bills it, and nothing is billed twice
    assert billed_tokens(org) == {(SECOND, LineKind.USAGE): 900,
                                  (SECOND, LineKind.LATE_USAGE): 87,
                                  (THIRD, LineKind.LATE_USAGE): 6_000}
    assert billing_invariant_check(org_ids=[org.id]) == []


def test_the_invariant_task_reports_usage_that_no_invoice_bills(anchored, client, caplog):
    org = anchored
    # given usage billed properly, and usage rated in EUR for an org invoiced in USD (a plan's
    # price book in another currency): it can never be on the org's invoices
    ingest(org, (ANCHOR + timedelta(hours=2), 1_000_000))
    eur = make_price_book(currency="EUR", is_default=False,
                          prices=[{"model": "m-small", "input": "1.00", "output": "2.00"}])
    plan = plan_services.plan_create(code=f"eur-{uuid.uuid4().hex[:8]}", name="EUR plan",
                                     kind="on_demand", currency="EUR", price_book=eur)
    plan_services.subscription_create(organization=org, plan=plan,
                                      starts_at=ANCHOR + timedelta(days=2))
    ingest(org, (ANCHOR + timedelta(days=2, hours=1), 2_000_000))
    assert set(UsageEvent.objects.filter(organization_id=org.id)
               .values_list("currency", flat=True)) == {"EUR", "USD"}
    close(SECOND)

    # when the periodic check runs
    with caplog.at_level(logging.ERROR, logger="billing_platform.invoicing.invariants"):
        result = billing_invariant_task.apply().get()

    # then it names the org and the amount nobody bills: in its result, its log and /metrics
    assert result["orgs"] == 1
    assert result["differences"] == [
        {"org_id": org.id, "currency": "EUR", "difference": "2.0000000000"}]
    assert f"organization {org.id} rated 2.0000000000 EUR" in caplog.text
    metrics = client.get("/metrics").content.decode()
    assert "tollgate_billing_invariant_orgs 1.0" in metrics
    assert 'tollgate_billing_invariant_difference{currency="EUR"} 2.0' in metrics


def test_the_invariant_check_runs_periodically_on_the_billing_queue():
    entry = next(e for e in app.conf.beat_schedule.values()
                 if e["task"] == "invoicing.billing_invariant")
    assert entry["schedule"] <= 24 * 3600
    assert "invoicing.billing_invariant" in app.tasks
    assert app.amqp.router.route({}, "invoicing.billing_invariant")["queue"].name == "billing"
