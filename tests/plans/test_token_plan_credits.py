"""Token plans: credits, the rolling 5-hour cap, the period cap, packs, block vs overage.

Every test uses the same book and plan (hand computations refer to them):

- prices per 1M: input 1.00, cached 0.10 (default 0.1 x input), output 2.00;
- coefficients (credits per token): input 1, cached 0.1, output 3;
- caps: 1,000 credits per period (monthly from the subscription start), 300 in any rolling
  5 hours.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from plans import services
from plans.models import TokenPlanPeriod, TokenPlanUsage
from plans.rating import rate_usage_batch
from plans.selectors import token_plan_status
from tests.factories import make_price_book, make_token_plan
from tests.plans.helpers import usage

D = Decimal
START = datetime(2025, 1, 15, 10, 0, tzinfo=UTC)
T10 = datetime(2025, 1, 20, 10, 0, tzinfo=UTC)


@pytest.fixture
def book(db):
    return make_price_book(prices=[{"model": "test-model", "input": "1.00", "output": "2.00"}])


def _subscribe(org, **plan_fields):
    plan = make_token_plan(**plan_fields)
    return services.subscription_create(organization=org, plan=plan, starts_at=START)


def test_inside_the_plan_costs_nothing_and_records_credits(book, org):
    """100 in (20 cached) + 50 out: credits = 80 x 1 + 20 x 0.1 + 50 x 3 = 80 + 2 + 150 = 232.

    Inside both caps (232 <= 300, <= 1,000): amount 0, source "plan", 232 credits recorded in
    the ledger and the period.
    """
    sub = _subscribe(org)
    [r] = rate_usage_batch([usage(org, prompt_tokens=100, cached_tokens=20,
                                  completion_tokens=50, event_time=T10)])
    assert (r.amount, r.capacity_source, r.credits_consumed) == (D("0"), "plan", D("232"))
    assert r.rating_kind == "token_plan"
    assert r.subscription_id == sub.pk
    assert TokenPlanPeriod.objects.get(subscription=sub).plan_credits == D("232")
    status = token_plan_status(subscription=sub, at=T10)
    assert status.window_used == D("232")
    assert status.plan_credits_left == D("68")  # min(1,000 - 232, 300 - 232)


def test_crossing_the_five_hour_cap_with_overage(book, org):
    """Window cap 300, policy overage.

    10:00  e1: 100 in + 50 out = 100 + 150 = 250 credits -> plan (window 250).
    11:00  e2: 50 in + 50 out = 50 + 150 = 200 credits; room min(1,000 - 250, 300 - 250) = 50
           -> 50 plan, 150 overage = 3/4 of the event at on-demand prices:
           on-demand 50 x 1.00 + 50 x 2.00 = 150 / 1e6 = 0.00015; x 0.75 = 0.0001125
           (input 0.0000375, output 0.000075). Source "overage".
    14:59:59  e3: 100 in = 100 credits; window (09:59:59, 14:59:59] holds 250 + 50 = 300 -> no
           room -> all overage: 100 x 1.00 / 1e6 = 0.0001.
    15:00:01  e4: 100 in; window (10:00:01, 15:00:01] no longer holds e1: 50 used -> room 250
           -> plan, amount 0.
    """
    _subscribe(org)
    e1, e2, e3, e4 = rate_usage_batch([
        usage(org, prompt_tokens=100, completion_tokens=50, event_time=T10),
        usage(org, prompt_tokens=50, completion_tokens=50, event_time=T10 + timedelta(hours=1)),
        usage(org, prompt_tokens=100, event_time=T10 + timedelta(hours=5, seconds=-1)),
        usage(org, prompt_tokens=100, event_time=T10 + timedelta(hours=5, seconds=1)),
    ])
    assert (e1.amount, e1.capacity_source, e1.credits_consumed) == (D("0"), "plan", D("250"))
    assert e2.capacity_source == "overage"
    assert (e2.credits_consumed, e2.overage_credits) == (D("50"), D("150"))
    assert e2.amount == D("0.0001125")
    assert e2.breakdown == {"input": D("0.0000375"), "cached_input": D("0"),
                            "output": D("0.000075")}
    assert (e3.amount, e3.capacity_source, e3.overage_credits) == (D("0.0001"), "overage",
                                                                   D("100"))
    assert (e4.amount, e4.capacity_source, e4.credits_consumed) == (D("0"), "plan", D("100"))


def test_crossing_the_five_hour_cap_with_block(book, org):
    """Same events under ``block``: nothing is ever billed; the cap shows as exhausted.

    e1 250 credits (plan). e2 200 credits with 50 of room: the request admission let through is
    covered by the plan (amount 0) and all 200 counted, so the window holds 450 and the status
    says 0 left - the next request is refused by admission (429 plan_quota_exhausted).
    """
    sub = _subscribe(org, cap_policy="block")
    e1, e2 = rate_usage_batch([
        usage(org, prompt_tokens=100, completion_tokens=50, event_time=T10),
        usage(org, prompt_tokens=50, completion_tokens=50, event_time=T10 + timedelta(hours=1)),
    ])
    assert (e1.amount, e1.credits_consumed) == (D("0"), D("250"))
    assert (e2.amount, e2.capacity_source, e2.credits_consumed) == (D("0"), "plan", D("200"))
    assert e2.overage_credits == D("0")
    status = token_plan_status(subscription=sub, at=T10 + timedelta(hours=1))
    assert status.window_used == D("450")
    assert status.plan_credits_left == D("0")
    # five hours after e2 the window is empty again: 300 left (period: 1,000 - 450 = 550)
    later = token_plan_status(subscription=sub, at=T10 + timedelta(hours=6, seconds=1))
    assert later.plan_credits_left == D("300")


def test_crossing_the_period_cap_with_overage_and_the_next_period(book, org):
    """No window cap; 1,000 credits per period anchored at Jan 15 10:00 UTC, overage.

    e1 600 in -> 600 plan. e2 500 in: room 400 -> 400 plan + 100 overage = 1/5 of
    500 x 1.00 / 1e6 = 0.0005 -> 0.0001. e3 at Feb 15 09:59:59 (same period): 10 in, no room:
    0.00001. e4 at Feb 15 10:00:00: a new period, 1,000 fresh credits -> plan, 0.
    """
    sub = _subscribe(org, window_credits=None)
    feb15 = datetime(2025, 2, 15, 10, 0, tzinfo=UTC)
    e1, e2, e3, e4 = rate_usage_batch([
        usage(org, prompt_tokens=600, event_time=T10),
        usage(org, prompt_tokens=500, event_time=T10 + timedelta(days=1)),
        usage(org, prompt_tokens=10, event_time=feb15 - timedelta(seconds=1)),
        usage(org, prompt_tokens=10, event_time=feb15),
    ])
    assert (e1.amount, e1.credits_consumed) == (D("0"), D("600"))
    assert (e2.amount, e2.credits_consumed, e2.overage_credits) == (D("0.0001"), D("400"),
                                                                    D("100"))
    assert (e3.amount, e3.capacity_source) == (D("0.00001"), "overage")
    assert (e4.amount, e4.capacity_source, e4.credits_consumed) == (D("0"), "plan", D("10"))
    periods = {p.period_start: p for p in TokenPlanPeriod.objects.filter(subscription=sub)}
    assert periods[START].plan_credits == D("1000")
    assert periods[START].overage_credits == D("110")
    assert periods[feb15].plan_credits == D("10")


def test_crossing_the_period_cap_with_block(book, org):
    """Block at the period cap: 600 + 500 = 1,100 credits, all covered, none billed; 0 left."""
    sub = _subscribe(org, window_credits=None, cap_policy="block")
    e1, e2 = rate_usage_batch([
        usage(org, prompt_tokens=600, event_time=T10),
        usage(org, prompt_tokens=500, event_time=T10 + timedelta(days=1)),
    ])
    assert e1.amount == e2.amount == D("0")
    assert e2.capacity_source == "plan"
    status = token_plan_status(subscription=sub, at=T10 + timedelta(days=1))
    assert status.period_used == D("1100")
    assert status.credits_left == D("0")


def test_credit_packs_are_used_after_plan_credits_and_before_overage(book, org):
    """A 150-credit pack; period cap 1,000, no window, overage.

    e1 600 plan. e2 500: 400 plan, 100 from the pack, 0 overage -> amount 0. e3 100: pack has
    50 left -> 50 pack + 50 overage = half of 100 x 1.00 / 1e6 -> 0.00005.
    """
    sub = _subscribe(org, window_credits=None)
    pack = services.credit_pack_create(plan=sub.plan, code="p150", name="150", credits="150",
                                       price="1.00")
    purchase = services.credit_pack_purchase(subscription=sub, pack=pack, at=T10)
    e1, e2, e3 = rate_usage_batch([
        usage(org, prompt_tokens=600, event_time=T10 + timedelta(minutes=1)),
        usage(org, prompt_tokens=500, event_time=T10 + timedelta(minutes=2)),
        usage(org, prompt_tokens=100, event_time=T10 + timedelta(minutes=3)),
    ])
    assert (e1.credits_consumed, e1.pack_credits) == (D("600"), D("0"))
    assert (e2.amount, e2.credits_consumed, e2.pack_credits) == (D("0"), D("500"), D("100"))
    assert e2.capacity_source == "plan"
    assert (e3.pack_credits, e3.overage_credits, e3.amount) == (D("50"), D("50"),
                                                                D("0.00005"))
    purchase.refresh_from_db()
    assert purchase.credits_used == D("150")


def test_rerating_the_same_events_counts_credits_once(book, org):
    """The same batch rated twice (a redelivery): identical ratings, counters moved once.

    e1 250 credits, e2 200 (50 plan + 150 overage, 0.0001125) as in the 5-hour example; the
    second pass returns the same split from the ledger instead of consuming again (which would
    have put e1 into overage).
    """
    sub = _subscribe(org)
    batch = [usage(org, prompt_tokens=100, completion_tokens=50, event_time=T10),
             usage(org, prompt_tokens=50, completion_tokens=50,
                   event_time=T10 + timedelta(hours=1))]
    first = rate_usage_batch(batch)
    again = rate_usage_batch(batch)
    assert again == first
    assert [r.amount for r in again] == [D("0"), D("0.0001125")]
    assert TokenPlanUsage.objects.filter(subscription=sub).count() == 2
    assert TokenPlanPeriod.objects.get(subscription=sub).plan_credits == D("300")


def test_models_outside_the_plan_and_unsubscribed_times_are_on_demand(db, org):
    """A model without coefficients, and an event before the subscription, rate on-demand.

    other-model in 5.00 per 1M: 1,000 in -> 0.005. test-model before START: 1,000 x 1.00 ->
    0.001.
    """
    make_price_book(prices=[{"model": "test-model", "input": "1.00", "output": "2.00"},
                            {"model": "other-model", "input": "5.00", "output": "5.00"}])
    _subscribe(org)
    other, before = rate_usage_batch([
        usage(org, model="other-model", prompt_tokens=1_000, event_time=T10),
        usage(org, prompt_tokens=1_000, event_time=START - timedelta(seconds=1)),
    ])
    assert (other.amount, other.capacity_source, other.rating_kind) == (D("0.005"), "on_demand",
                                                                         "on_demand")
    assert (before.amount, before.subscription_id) == (D("0.001"), None)


def test_token_plan_quote_reads_state_and_writes_nothing(book, org):
    """After 250 credits, a quote of 100 in + 0 out shows 50 plan + 50 overage = 0.00005."""
    from plans.rating import quote

    sub = _subscribe(org)
    rate_usage_batch([usage(org, prompt_tokens=100, completion_tokens=50, event_time=T10)])
    q = quote(org_id=org.pk, model="test-model", prompt_tokens=100, completion_tokens=0,
              at=T10 + timedelta(minutes=1))
    assert (q.credits_consumed, q.overage_credits, q.amount) == (D("50"), D("50"), D("0.00005"))
    assert TokenPlanUsage.objects.filter(subscription=sub).count() == 1
    assert TokenPlanPeriod.objects.get(subscription=sub).plan_credits == D("250")
