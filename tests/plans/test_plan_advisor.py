"""The plan advisor (issue 18 item 4): a past period priced under every plan kind.

Usage is recorded through metering's real record path (rated by plans, rolled up) and periods
are closed by the real period close, so "what was billed" and the invoice are the platform's
own. Every expected figure is computed by hand in the test's docstring: prices per 1M tokens,
``amount = tier x (uncached x p_in + cached x p_cached + out x p_out) / 1e6``, each class
rounded to 10 places per request, each invoice line rounded once to the cent.
"""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import numpy as np
import pytest

from billing_platform.accounts.choices import Role
from billing_platform.invoicing import services as invoicing
from billing_platform.invoicing.choices import LineKind
from billing_platform.invoicing.models import Invoice
from billing_platform.invoicing.money import quantize_money
from plans import services as plan_services
from plans.advisor import plan_advice
from plans.credits import MICRO, CreditReplay, TokenPlanLedger
from plans.models import Subscription
from plans.periods import epoch_us
from plans.pricing import (
    ModelPricing,
    PriceSet,
    TokenCounts,
    class_units,
    exact_lines,
    normalized_tokens,
    normalizer,
    rounded_lines,
    units_in_last_places,
)
from tests.factories import (
    MembershipFactory,
    UserFactory,
    make_billed_org,
    make_offering,
    make_price_book,
    make_token_plan,
)
from tests.finance.conftest import finance_user
from tests.invoicing.conftest import NOV, OCT, record

D = Decimal
SMALL = {"model": "m-small", "input": "1.00", "output": "2.00"}  # cached: 0.10 (0.1 x input)
BIG = {"model": "m-big", "input": "3.00", "cached_input": "0.30", "output": "15.00"}
COEFFICIENTS = [{"model": "m-small", "token_class": "input", "coefficient": "1"},
                {"model": "m-small", "token_class": "cached_input", "coefficient": "0.1"},
                {"model": "m-small", "token_class": "output", "coefficient": "3"}]


def _by_kind(advice) -> dict[tuple[str, str], object]:
    return {(a.kind, a.code): a for a in advice.alternatives}


def _advise(org, start=OCT, end=NOV):
    return plan_advice(organization=org, period_start=start, period_end=end,
                       round_money=quantize_money)


@pytest.fixture
def token_plan_month(db):
    return october_on_token_plan_o()


def october_on_token_plan_o():
    """October 2026: an org on token plan O (overage) with four m-small requests, a second
    catalog plan B (block), and October closed by the real period close; return the org.

    Plan O: 10.00 a month, 3,000,000 credits a period, 2,000,000 per rolling 5 hours,
    overage. Plan B: 1.00 a month, 2,000,000 credits, no window, block. Credits per token:
    input 1, cached 0.1, output 3.
    """
    make_price_book(prices=[SMALL, BIG])
    plan_o = make_token_plan(code="tp-o", name="Plan O", monthly_fee="10.00",
                             credits_per_period="3000000", window_credits="2000000",
                             cap_policy="overage", coefficients=COEFFICIENTS)
    make_token_plan(code="tp-b", name="Plan B", monthly_fee="1.00",
                             credits_per_period="2000000", window_credits=None,
                             cap_policy="block", coefficients=COEFFICIENTS)
    org = make_billed_org(name="Tokens Co")
    plan_services.subscription_create(organization=org, plan=plan_o, starts_at=OCT)
    day = OCT + timedelta(days=1)
    # e1 10:00 (1,600,000 credits; took 30 s: batch-eligible), e2 12:00 (800,000),
    # e3 18:00 (1,400,000), e4 Oct 20 (1,000,000)
    record(org, "e1", day + timedelta(hours=10), prompt_tokens=1_000_000,
           completion_tokens=200_000, total_ms=30_000, status="ok")
    record(org, "e2", day + timedelta(hours=12), prompt_tokens=500_000,
           completion_tokens=100_000)
    record(org, "e3", day + timedelta(hours=18), prompt_tokens=2_000_000,
           cached_tokens=1_000_000, completion_tokens=100_000)
    record(org, "e4", OCT + timedelta(days=19, hours=9), prompt_tokens=1_000_000)
    invoicing.period_close_run(now=NOV + timedelta(hours=1), enqueue_payments=False)
    return org


def test_a_token_plan_org_sees_each_alternative_computed_by_hand(token_plan_month):
    """On-demand per request: e1 1.00 + 0.40 = 1.40, e2 0.50 + 0.20 = 0.70, e3 1.00 (1,000,000
    uncached) + 0.10 (1,000,000 cached) + 0.20 = 1.30, e4 1.00. Lines: input 3,500,000 tokens
    3.50, cached 0.10, output 400,000 tokens 0.80: usage 4.40.

    Plan O (replayed; the org's own plan, so it equals what was billed):
    e1 1,600,000 in the plan. e2 at 12:00: the window (07:00, 12:00] holds 1,600,000, so
    400,000 fit and 400,000 are overage: half of 0.70 = input 0.25 + output 0.10. e3 at 18:00:
    the window is empty again, the period has 1,000,000 left: 1,000,000 in, 400,000 overage,
    2/7 of 1.30: input 0.2857142857, cached 0.0285714286, output 0.0571428571 (10 places,
    half-even). e4: the period is used up, all of it overage: input 1.00. Overage lines: input
    1.5357142857 -> 1.54, cached 0.0285714286 -> 0.03, output 0.1571428571 -> 0.16: usage
    1.73, plus the fee 10.00 = 11.73.

    Plan B (block, 2,000,000 credits): e1 1,600,000; e2 finds 400,000 left and is let through
    (the ledger counts its 800,000 against the plan); e3 and e4 find nothing left: refused,
    not priced. Usage 0, fee 1.00: total 1.00, 2 refused: never the recommendation.

    Batch/flex: e1 (default tier, ok, 30 s) is eligible: at the batch tier x0.5 it costs
    0.50 + 0.20; the rest stays: input 2,500,000 2.50, cached 0.10, output 200,000 0.40. Usage
    3.70: the cheapest; the saving 11.73 - 3.70 = 8.03.
    """
    org = token_plan_month

    advice = _advise(org)

    by_kind = _by_kind(advice)
    assert advice.events == 4
    on_demand = by_kind[("on_demand", "")]
    assert (on_demand.usage, on_demand.fees, on_demand.total) == (D("4.40"), 0, D("4.40"))
    assert {(ln.token_class, ln.tokens, ln.amount_precise) for ln in on_demand.lines} == {
        ("input", 3_500_000, D("3.5")), ("cached_input", 1_000_000, D("0.1")),
        ("output", 400_000, D("0.8"))}

    o = by_kind[("token_plan", "tp-o")]
    overage = {ln.token_class: (ln.amount_precise, ln.amount) for ln in o.lines
               if ln.capacity_source == "overage"}
    assert overage == {"input": (D("1.5357142857"), D("1.54")),
                       "cached_input": (D("0.0285714286"), D("0.03")),
                       "output": (D("0.1571428571"), D("0.16"))}
    assert (o.usage, o.fees, o.total, o.requests, o.refused_requests) == (
        D("1.73"), D("10.00"), D("11.73"), 4, 0)
    assert (o.detail["plan_credits"], o.detail["overage_credits"]) == (D(3_000_000),
                                                                       D(1_800_000))

    b = by_kind[("token_plan", "tp-b")]
    assert (b.usage, b.fees, b.total, b.requests, b.refused_requests) == (
        D("0"), D("1.00"), D("1.00"), 2, 2)

    batch = by_kind[("batch_flex", "")]
    assert batch.detail["eligible_requests"] == 1
    assert {(ln.service_tier, ln.token_class, ln.amount_precise) for ln in batch.lines} == {
        ("default", "input", D("2.5")), ("default", "cached_input", D("0.1")),
        ("default", "output", D("0.4")), ("batch", "input", D("0.5")),
        ("batch", "output", D("0.2"))}
    assert batch.total == D("3.70")

    # what was billed is October's invoice: its usage lines and the plan fee
    invoice = Invoice.objects.get(organization=org)
    assert advice.current.total == invoice.subtotal == D("11.73")
    assert (advice.cheapest.kind, advice.cheapest.total) == ("batch_flex", D("3.70"))
    assert advice.saving == D("8.03")


@pytest.fixture
def steady_day(db):
    """Oct 5 2026, an on-demand org: one m-big request every minute (prompt 4,000, output
    1,000), a second one in each of the day's first 60 minutes; an offering of m-big in
    us-east: 10,000 normalized tokens a minute per unit, output burndown 4, 50.00 a month or
    1.00 an hour."""
    make_price_book(prices=[SMALL, BIG])
    offering = make_offering(model="m-big", tokens_per_minute_per_unit=10_000,
                             output_burndown="4", monthly_unit_price="50.00",
                             hourly_unit_price="1.00")
    org = make_billed_org(name="Steady Co")
    day = OCT + timedelta(days=4)
    from metering import events, services

    batch = []
    for minute in range(24 * 60):
        for k in range(2 if minute < 60 else 1):
            batch.append(events.normalize({
                "request_id": f"s{minute}-{k}", "org_id": org.id,
                "project_id": org.projects.first().id, "model": "m-big", "region": "us-east",
                "event_time": day + timedelta(minutes=minute, seconds=10 + 20 * k),
                "prompt_tokens": 4_000, "completion_tokens": 1_000}))
    assert len(services.usage_events_record(batch, origin="test").recorded) == 1_500
    return org, offering, day


def test_steady_load_makes_one_provisioned_unit_the_cheapest(steady_day):
    """Each request: 4,000 x 3.00 + 1,000 x 15.00 = 27,000 / 1e6 = 0.027 on-demand, and
    4,000 + 4 x 1,000 = 8,000 normalized tokens. 1,500 requests on-demand: 40.50.

    For the day the hourly term is cheaper: 24 h x 1.00 = 24.00 a unit (monthly: 50.00).
    1 unit (10,000 a minute) takes each minute's first request; the 60 second ones spill over:
    60 x 0.027 = 1.62, total 25.62. 2 units take everything but cost 48.00. So 1 unit is the
    cheapest, saving 40.50 - 25.62 = 14.88 on what was billed (on-demand).
    """
    org, offering, day = steady_day

    advice = _advise(org, day, day + timedelta(days=1))

    by_kind = _by_kind(advice)
    assert by_kind[("on_demand", "")].total == advice.current.total == D("40.50")
    units = by_kind[("provisioned", offering.code)]
    assert (units.detail["units"], units.detail["term"], units.detail["unit_fee"]) == (
        1, "hourly", D("24"))
    assert units.detail["spillover_requests"] == 60
    assert units.detail["peak_minute_normalized_tokens"] == 16_000
    assert (units.usage, units.fees, units.total) == (D("1.62"), D("24.00"), D("25.62"))
    assert {(ln.capacity_source, ln.token_class, ln.tokens, ln.amount) for ln in units.lines} == {
        ("provisioned", "input", 1_440 * 4_000, D("0.00")),
        ("provisioned", "output", 1_440 * 1_000, D("0.00")),
        ("spillover", "input", 60 * 4_000, D("0.72")),
        ("spillover", "output", 60 * 1_000, D("0.90"))}
    assert (advice.cheapest.kind, advice.cheapest.code) == ("provisioned", offering.code)
    assert advice.saving == D("14.88")


@pytest.fixture
def on_demand_month(db):
    """October 2026, an on-demand org in the EU zone (x1.1) with cached, priority, flex and
    batch-tier requests of two models, one of them at prices whose per-token amounts have more
    than 10 places (so its lines round per request), closed by the real period close."""
    make_price_book(prices=[SMALL, BIG, {"model": "m-odd", "input": "0.123456789",
                                         "output": "0.987654321"}])
    org = make_billed_org(name="Mixed Co", data_zone="eu")
    rng = random.Random(18)
    for i in range(60):
        prompt = rng.randrange(1, 3_000_000)
        record(org, f"m{i}", OCT + timedelta(hours=7 * i, minutes=rng.randrange(60)),
               region="eu-west",
               model=rng.choice(["m-small", "m-big", "m-odd"]),
               service_tier=rng.choice(["default", "default", "priority", "flex", "batch"]),
               data_zone="eu", prompt_tokens=prompt, cached_tokens=rng.randrange(prompt),
               completion_tokens=rng.randrange(400_000))
    invoicing.period_close_run(now=NOV + timedelta(hours=1), enqueue_payments=False)
    return org


def test_on_demand_figure_equals_the_closed_invoice_to_the_cent(on_demand_month, api_client):
    # given October's invoice of an on-demand org, and its owner
    org = on_demand_month
    invoice = Invoice.objects.get(organization=org)
    usage_lines = invoice.lines.filter(kind=LineKind.USAGE)
    owner = UserFactory()
    MembershipFactory(user=owner, organization=org, role=Role.OWNER)
    api_client.force_authenticate(owner)

    # when the owner asks for advice without a period (the last closed one: October)
    reply = api_client.get(f"/api/v1/organizations/{org.public_id}/plan_advice")

    # then the on-demand figure is the invoice's usage lines, line by line, to the cent
    assert reply.status_code == 200, reply.content
    body = reply.json()
    assert (body["period_start"], body["period_end"]) == ("2026-10-01T00:00:00Z",
                                                          "2026-11-01T00:00:00Z")
    assert body["events"] == 60
    on_demand = next(a for a in body["alternatives"] if a["kind"] == "on_demand")
    assert D(on_demand["usage"]) == sum(ln.amount for ln in usage_lines) > 0
    got = {(ln["model"], ln["service_tier"], ln["token_class"]): (D(ln["amount_precise"]),
                                                                  D(ln["amount"]))
           for ln in on_demand["lines"]}
    assert got == {(ln.model, ln.service_tier, ln.token_class): (ln.amount_precise, ln.amount)
                   for ln in usage_lines}
    assert D(body["current"]["total"]) == invoice.subtotal


def test_on_demand_figure_follows_the_plan_book_its_versions_and_context_bands(db):
    """An org on an on-demand plan with its own book for the first half of October (context
    bands above 100,000 and 1,000,000 prompt tokens, a new version on the 10th, a model whose
    per-token amounts round), then on the default book: the advisor prices each event with
    the book and version in force at its time and the band its prompt falls in, so its
    on-demand figure is the closed invoice's usage lines, line by line."""
    make_price_book(prices=[SMALL, {"model": "m-odd", "input": "0.3", "output": "0.7"}])
    banded = {"model": "m-small", "input": "0.50", "output": "1.00", "bands": [
        {"above_prompt_tokens": 100_000, "input": "1.00", "output": "3.00"},
        {"above_prompt_tokens": 1_000_000, "input": "2.00", "output": "5.00"}]}
    odd = {"model": "m-odd", "input": "0.123456789", "output": "0.987654321"}
    book = make_price_book(code="private", prices=[banded, odd], is_default=False)
    plan_services.price_version_create(
        price_book=book, effective_from=OCT + timedelta(days=9), allow_backdate=True,
        prices=[{**banded, "input": "0.40"}, odd])
    plan = plan_services.plan_create(code="od-private", name="Private prices",
                                     kind="on_demand", price_book=book)
    org = make_billed_org(name="Banded Co")
    plan_services.subscription_create(organization=org, plan=plan, starts_at=OCT,
                                      ends_at=OCT + timedelta(days=15))
    rng = random.Random(21)
    for i in range(48):
        prompt = rng.choice((50_000, 100_000, 100_001, 999_999, 1_000_000, 1_500_000))
        record(org, f"b{i}", OCT + timedelta(hours=15 * i, minutes=rng.randrange(60)),
               model=rng.choice(["m-small", "m-small", "m-odd"]),
               service_tier=rng.choice(["default", "priority", "batch"]),
               prompt_tokens=prompt, cached_tokens=rng.randrange(prompt // 2),
               completion_tokens=rng.randrange(200_000))
    invoicing.period_close_run(now=NOV + timedelta(hours=1), enqueue_payments=False)
    usage_lines = Invoice.objects.get(organization=org).lines.filter(kind=LineKind.USAGE)

    on_demand = _by_kind(_advise(org))[("on_demand", "")]

    want = {(ln.model, ln.service_tier, ln.token_class): (ln.amount_precise, ln.amount)
            for ln in usage_lines}
    assert {(ln.model, ln.service_tier, ln.token_class): (ln.amount_precise, ln.amount)
            for ln in on_demand.lines} == want
    assert on_demand.usage == sum(ln.amount for ln in usage_lines) > 0
    assert len({ln.model for ln in usage_lines}) == 2


def test_the_int_path_equals_rating_each_line():
    """Per-token amounts in whole 1e-10 give what ``rounded_lines(exact_lines(...))`` gives,
    for any counts; amounts with more places are refused (rated line by line instead)."""
    rng = random.Random(4)
    exact = PriceSet(D("0.15"), D("0.0375"), D("0.60"), D("0.15"))
    odd = PriceSet(D("0.123456789"), D("0.0123456789"), D("0.987654321"), D("0.1"))
    for prices, tier, zone in ((exact, "priority", "global"), (exact, "batch", "eu"),
                               (odd, "default", "global")):
        pricing = ModelPricing(1, "USD", "m", prices, (), {"priority": D("2"), "batch": D("0.5")},
                               {"eu": D("1.1")})
        units = units_in_last_places(class_units(pricing, 10, tier, zone)[:3])
        for _ in range(200):
            prompt = rng.randrange(0, 5_000_000)
            cached, out = rng.randrange(prompt + 1), rng.randrange(1_000_000)
            lines, _ = rounded_lines(exact_lines(pricing, TokenCounts(prompt, cached, out, 0,
                                                                      tier, zone)))
            expected = [lines[c].scaleb(10) for c in ("input", "cached_input", "output")]
            if units is None:
                continue
            assert [(prompt - cached) * units[0], cached * units[1], out * units[2]] == expected
        assert (units is None) == (prices is odd or zone == "eu")  # 0.0375 x 0.5 x 1.1 e-6


def test_normalizer_equals_normalized_tokens():
    rng = random.Random(7)
    for cb, ob in ((D("0"), D("4")), (D("0.25"), D("1.5")), (D("0.123456"), D("3.000001")),
                   (D("0.1234567"), D("2"))):  # the last: over 6 places, one by one
        norm = normalizer(cache_burndown=cb, output_burndown=ob)
        prompt = [rng.randrange(100_000) for _ in range(300)]
        cached = [rng.randrange(p + 1) for p in prompt]
        out = [rng.randrange(50_000) for _ in prompt]
        got = norm(*(np.array(v, dtype=np.int64) for v in (prompt, cached, out)))
        assert got.tolist() == [normalized_tokens(
            prompt_tokens=p, cached_tokens=c, completion_tokens=o, cache_burndown=cb,
            output_burndown=ob) for p, c, o in zip(prompt, cached, out, strict=True)]


def test_credit_replay_books_what_the_ledger_books(db):
    """A replay of random events over two periods splits each one as the ledger does."""
    org = make_billed_org()
    plan = make_token_plan(credits_per_period="50000", window_credits="9000",
                           cap_policy="overage")
    sub = Subscription(id=-1, organization=org, plan=plan, starts_at=OCT, billing_anchor=OCT)
    rng = random.Random(11)
    t, stream = OCT, []
    while t < NOV + timedelta(days=10):
        t += timedelta(minutes=rng.randrange(1, 400))
        stream.append((f"r{len(stream)}", t, D(rng.randrange(0, 3_000_000)) / MICRO))
    ledger = TokenPlanLedger([(rid, t, sub) for rid, t, _ in stream], record=False)
    replay = CreditReplay(plan, anchor=OCT)
    for rid, t, credits in stream:
        split = ledger.consume(sub, rid, t, credits)
        assert replay.consume(epoch_us(t), int(credits * MICRO)) == (
            int(split.plan * MICRO), int(split.overage * MICRO)), rid
    assert sum(1 for *_, c in stream if c) > 100


# --- who may ask, and what they may ask ----------------------------------------------------

def test_other_orgs_roles_without_billing_and_malformed_periods(token_plan_month, api_client):
    org = token_plan_month
    url = f"/api/v1/organizations/{org.public_id}/plan_advice"
    # another organization's owner: 404, as if it did not exist; a forged id too
    outsider = UserFactory()
    MembershipFactory(user=outsider, organization=make_billed_org(), role=Role.OWNER)
    api_client.force_authenticate(outsider)
    assert api_client.get(url).status_code == 404
    assert api_client.get("/api/v1/organizations/org_forged/plan_advice").status_code == 404
    # a developer or viewer of the org: 403 (no billing.read), as for its invoices
    for role in (Role.DEVELOPER, Role.VIEWER):
        member = UserFactory()
        MembershipFactory(user=member, organization=org, role=role)
        api_client.force_authenticate(member)
        reply = api_client.get(url)
        assert reply.status_code == 403, role
        assert "billing.read" in reply.json()["detail"]
    # its finance member reads it
    finance = UserFactory()
    MembershipFactory(user=finance, organization=org, role=Role.FINANCE)
    api_client.force_authenticate(finance)
    assert api_client.get(url, {"start": "2026-10-01T00:00:00Z",
                                "end": "2026-10-02T00:00:00Z"}).status_code == 200
    # malformed, one-sided, inverted, too long or unfinished periods: 400 naming the field
    for params, field in (({"start": "last month", "end": "2026-11-01T00:00:00Z"}, "start"),
                          ({"start": "2026-10-01T00:00:00Z"}, "end"),
                          ({"end": "2026-11-01T00:00:00Z"}, "start"),
                          ({"start": "2026-11-01T00:00:00Z", "end": "2026-10-01T00:00:00Z"},
                           "end"),
                          ({"start": "2026-08-01T00:00:00Z", "end": "2026-11-01T00:00:00Z"},
                           "end"),
                          ({"start": "2099-01-01T00:00:00Z", "end": "2099-01-02T00:00:00Z"},
                           "end"),
                          ({"start": "9" * 5000, "end": "2026-11-01T00:00:00Z"}, "start")):
        reply = api_client.get(url, params)
        assert reply.status_code == 400, params
        assert field in reply.json(), (params, reply.json())


def test_no_closed_period_yet_is_a_clear_400(db, api_client):
    org = make_billed_org()
    owner = UserFactory()
    MembershipFactory(user=owner, organization=org, role=Role.OWNER)
    api_client.force_authenticate(owner)
    reply = api_client.get(f"/api/v1/organizations/{org.public_id}/plan_advice/")
    assert reply.status_code == 400
    assert "closed" in reply.json()["detail"]


def test_finance_reads_any_orgs_advice_and_nobody_else_does(token_plan_month, api_client):
    org = token_plan_month
    url = f"/api/v1/finance/organizations/{org.public_id}/plan_advice"
    # platform finance (not a member of the org) gets the same answer as its owner
    api_client.force_authenticate(finance_user())
    reply = api_client.get(url)
    assert reply.status_code == 200, reply.content
    assert D(reply.json()["current"]["total"]) == D("11.73")
    assert reply.json()["cheapest"]["kind"] == "batch_flex"
    assert api_client.get("/api/v1/finance/organizations/org_forged/plan_advice"
                          ).status_code == 404
    assert api_client.get(url, {"start": "yesterday"}).status_code == 400
    # the org's own owner and finance member, and staff without the permission: 404
    for user in (MembershipFactory(organization=org, role=Role.OWNER).user,
                 MembershipFactory(organization=org, role=Role.FINANCE).user,
                 UserFactory(is_staff=True)):
        api_client.force_authenticate(user)
        assert api_client.get(url).status_code == 404, user


def test_a_later_period_without_usage_prices_nothing(token_plan_month):
    org = token_plan_month
    start = datetime(2026, 11, 1, tzinfo=UTC)
    advice = _advise(org, start, start + timedelta(days=1))
    assert advice.events == 0
    assert all(a.usage == 0 for a in advice.alternatives)
