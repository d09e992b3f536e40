"""Console dashboard (issue 19 item 1): spend against budget with a forecast, tokens by model
per day, the cache hit rate and what caching saved, requests by tier and outcome, top projects
and keys, the upcoming invoice; each figure equal to a hand computation and to /api/v1/usage
for the same range. Roles and other organizations see only what they may."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

import pytest

from billing_platform.accounts.selectors import OrgAccess
from billing_platform.console.dashboard_views import dashboard_context, month_range
from billing_platform.console.templatetags.money import usage_money
from metering import events, services
from plans.quotas import budget_set
from tests.factories import MembershipFactory, ProjectFactory, make_key, make_price_book

pytestmark = pytest.mark.django_db(transaction=True)

NOV = datetime(2026, 11, 1, tzinfo=UTC)
MID_NOV = datetime(2026, 11, 16, tzinfo=UTC)  # 15 of November's 30 days elapsed


def _world(when: list[datetime]):
    """An org with two projects and keys, priced usage at ``when`` (three events), a 100 USD
    budget, and another org's usage. Returns (member, org, projects, keys)."""
    make_price_book(prices=[{"model": "dash-model", "input": "2.00", "cached_input": "0.50",
                             "output": "8.00"},
                            {"model": "dash-mini", "input": "1.00", "output": "4.00"}],
                    tier_multipliers={"priority": "2"})
    member = MembershipFactory()
    org = member.organization
    p1 = ProjectFactory(organization=org, name="Alpha")
    p2 = ProjectFactory(organization=org, name="Beta")
    k1, _ = make_key(p1, name="alpha-key")
    k2, _ = make_key(p2, name="beta-key")
    rows = [
        # 0.785 = (250,000 x 2.00 + 250,000 x 0.50 + 20,000 x 8.00) / 1e6
        {"request_id": "r1", "project_id": p1.id, "api_key_id": k1.id, "model": "dash-model",
         "event_time": when[0], "prompt_tokens": 500_000, "cached_tokens": 250_000,
         "completion_tokens": 20_000},
        # 0.86 = 2 x (150,000 x 2.00 + 100,000 x 0.50 + 10,000 x 8.00) / 1e6 (priority)
        {"request_id": "r2", "project_id": p2.id, "api_key_id": k2.id, "model": "dash-model",
         "service_tier": "priority", "event_time": when[1], "prompt_tokens": 250_000,
         "cached_tokens": 100_000, "completion_tokens": 10_000},
        # 0.002 = (1,000 x 1.00 + 250 x 4.00) / 1e6, an engine error (still billed as rated)
        {"request_id": "r3", "project_id": p1.id, "api_key_id": k1.id, "model": "dash-mini",
         "status": "engine_error", "event_time": when[2], "prompt_tokens": 1_000,
         "completion_tokens": 250},
    ]
    batch = [events.normalize({"org_id": org.id, "region": "us-east", **r}, check_age=False)
             for r in rows]
    assert len(services.usage_events_record(batch, origin="test").recorded) == 3
    budget_set(organization=org, amount="100")
    other = MembershipFactory()
    op = ProjectFactory(organization=other.organization)
    assert services.usage_events_record([events.normalize(
        {"request_id": "x1", "org_id": other.organization.id, "project_id": op.id,
         "model": "dash-model", "region": "us-east", "event_time": when[0],
         "prompt_tokens": 9_999_999, "completion_tokens": 0}, check_age=False)],
        origin="test").recorded
    return member, org, (p1, p2), (k1, k2)


def test_figures_equal_hand_computations_and_the_usage_api(client):
    # given November usage on the 3rd, 10th and 15th, read on the 16th at 00:00
    member, org, _, _ = _world([NOV.replace(day=3, hour=10), NOV.replace(day=10, hour=12),
                                NOV.replace(day=15, hour=23, minute=59)])

    # when the dashboard is computed for the 16th
    ctx = dashboard_context(OrgAccess(org, member.role), MID_NOV)

    # then spend is 0.785 + 0.86 + 0.002, and at 15 of 30 days the month ends at twice that
    assert ctx["spent"] == Decimal("1.647")
    assert ctx["forecast"].per_day == Decimal("1.647") / 15  # 0.1098 a day
    assert ctx["forecast"].at_end == Decimal("3.294")
    assert ctx["budget"].amount == Decimal("100") and ctx["budget_percent"] == Decimal("1.6")
    assert ctx["budget_reached"] is None  # 3.294 by the month's end: far below 100
    spend = ctx["spend_chart"]
    assert len(spend["labels"]) == 30 and spend["labels"][0] == "2026-11-01"
    actual, ahead, budget = (d["data"] for d in spend["datasets"])
    def num(values):
        return [None if v is None else Decimal(v) for v in values]

    actual, ahead = num(actual), num(ahead)
    assert actual[1] == 0 and actual[2] == Decimal("0.785") and actual[9] == Decimal("1.645")
    assert actual[15] == Decimal("1.647") and actual[16] is None  # the 16th is today
    assert ahead[14] is None and ahead[15] == Decimal("1.647")
    assert ahead[29] == Decimal("3.294") == Decimal(spend["forecast_at_end"])
    assert ahead[16] == Decimal("1.647") * 17 / 15  # end of the 17th: 17 days at the rate
    assert {Decimal(b) for b in budget} == {Decimal("100")}
    # hit rate: 350,000 cached of 751,000 input tokens
    assert (ctx["prompt_tokens"], ctx["cached_tokens"]) == (751_000, 350_000)
    assert ctx["hit_rate"] == "46.6%"
    # saved: 250,000 x (2.00 - 0.50) / 1e6 + 100,000 x 2 x (2.00 - 0.50) / 1e6
    assert ctx["savings"].amount == Decimal("0.675")
    assert ctx["savings"].unpriced_tokens == 0
    # requests by tier and outcome: the engine error is counted apart
    assert ctx["outcomes"] == [
        {"tier": "default", "requests": 2, "errors": 1, "aborted": 0, "ok": 1},
        {"tier": "priority", "requests": 1, "errors": 0, "aborted": 0, "ok": 1}]
    # top projects and keys by spend: Beta (0.86) before Alpha (0.787)
    assert [(t["name"], t["bucket"].amount) for t in ctx["top_projects"]] == [
        ("Beta", Decimal("0.86")), ("Alpha", Decimal("0.787"))]
    assert [t["name"] for t in ctx["top_keys"]] == ["beta-key", "alpha-key"]
    assert ctx["upcoming"] is not None  # an owner reads billing

    # and the charts equal /api/v1/usage for the same range
    start, _, through = month_range(MID_NOV)
    client.force_login(member.user)
    api = client.get("/api/v1/usage", {
        "organization": org.public_id, "group_by": "day,model",
        "start": start.isoformat(), "end": through.isoformat()}).json()
    tokens = {(d["label"], day): n for d in ctx["tokens_chart"]["datasets"]
              for day, n in zip(ctx["tokens_chart"]["labels"], d["data"], strict=True) if n}
    assert tokens == {(b["model"], b["day"]): b["total_tokens"] for b in api["data"]}
    by_day: dict[str, Decimal] = {}
    for b in api["data"]:
        by_day[b["day"]] = by_day.get(b["day"], Decimal("0")) + Decimal(b["amount"])
    running = Decimal("0")
    for day, shown in zip(spend["labels"][:16], actual[:16], strict=True):
        running += by_day.get(day, Decimal("0"))
        assert shown == running, day
    (total,) = api["totals"]
    assert Decimal(total["amount"]) == ctx["spent"]
    assert total["requests"] == ctx["requests"] == 3


def test_the_page_says_when_the_forecast_reaches_the_budget():
    # given the same usage under a 2.00 budget, read on the 16th at 00:00
    member, org, _, _ = _world([NOV.replace(day=3, hour=10), NOV.replace(day=10, hour=12),
                                NOV.replace(day=15, hour=23, minute=59)])
    budget_set(organization=org, amount="2")

    ctx = dashboard_context(OrgAccess(org, member.role), MID_NOV)

    # then at 1.647 in 15 days, 2.00 is reached after 2 x 15 / 1.647 = 18.2 days: the 19th
    assert ctx["budget_reached"] == NOV.replace(day=19).date()
    assert ctx["budget_percent"] == Decimal("82.4")


def test_the_page_shows_this_months_figures_to_a_member(client):
    # given this month's usage (now), for the page the browser opens
    now = datetime.now(UTC)
    member, _, _, _ = _world([now, now, now])
    client.force_login(member.user)

    # when the owner opens the dashboard
    page = client.get("/console/").content.decode()

    # then the figures show with the precision they need, and no other org's usage
    assert 'id="spent">$1.65<' in page
    assert 'id="savings">$0.6750<' in page
    assert 'id="hit-rate">46.6%<' in page
    assert 'id="budget">100.00 USD<' in page
    assert 'id="upcoming">' in page
    assert "9999999" not in page
    for chart in ("spend-data", "tokens-data", "requests-data"):
        assert f'<script id="{chart}" type="application/json">' in page
    assert "<script>" not in page  # no inline script (CSP)


@pytest.mark.parametrize("role", ["developer", "viewer"])
def test_roles_without_billing_read_see_usage_but_not_the_invoice(client, role):
    now = datetime.now(UTC)
    _, org, _, _ = _world([now, now, now])
    reader = MembershipFactory(organization=org, role=role)
    client.force_login(reader.user)

    page = client.get("/console/").content.decode()

    # usage is readable by every member (as /api/v1/usage is); the invoice only by billing
    assert 'id="spent">$1.65<' in page
    assert 'id="upcoming"' not in page
    assert "Upcoming invoice" not in page


def test_another_orgs_member_sees_only_its_own_organization(client):
    now = datetime.now(UTC)
    _, victim, _, _ = _world([now, now, now])
    stranger = MembershipFactory()
    client.force_login(stranger.user)

    # the session cannot be pointed at an organization the user is not in, by its real id
    switched = client.post("/console/org/switch/", {"org": victim.public_id}, follow=True)
    assert "No such organization." in switched.content.decode()
    page = client.get("/console/").content.decode()

    assert stranger.organization.name in page
    assert 'id="spent">$0.00<' in page
    assert "alpha-key" not in page and "Beta" not in page and victim.public_id not in page


def test_signed_out_is_sent_to_log_in(client):
    response = client.get("/console/")
    assert response.status_code == 302 and "/login/" in response.url


@pytest.mark.parametrize(("amount", "shown"), [
    ("0", "$0.00"), ("0.0031", "$0.0031"), ("0.00314159", "$0.0031"), ("1.945", "$1.95"),
    ("0.125", "$0.1250"), ("0.00000123", "$0.0000012"), ("1234.5", "$1,234.50"),
    ("-0.5", "-$0.5000")])
def test_usage_money_shows_the_places_an_amount_needs(amount, shown):
    assert usage_money(Decimal(amount), "USD") == shown


def test_usage_money_keeps_a_currency_without_a_symbol_after_the_number():
    assert usage_money(Decimal("0.0031"), "CHF") == "0.0031 CHF"
    assert usage_money(Decimal("12"), "JPY") == "12 JPY"
    assert usage_money(Decimal("0.5"), "EUR") == "€0.5000"


# --- what caching saved, priced as the rater prices (plans.cache_savings) ----------------------

def _cached(day: int, model: str, cached: int, *, source: str = "on_demand", tier="default",
            requests: int = 1, prompt: int | None = None):
    from plans.cache_savings import CachedUsage

    return CachedUsage(at=NOV.replace(day=day), model=model, service_tier=tier,
                       capacity_source=source, currency="USD", requests=requests,
                       prompt_tokens=prompt if prompt is not None else cached * 2,
                       cached_tokens=cached)


def test_savings_follow_price_versions_bands_and_what_is_billed_per_token():
    from plans import services as plan_services
    from plans.cache_savings import cache_savings

    # given a book: input 2.00 / cached 0.50 until Nov 10, then input 4.00 / cached 0.50; and a
    # model whose prompts above 100,000 tokens cost input 3.00 / cached 1.00
    book = make_price_book(prices=[
        {"model": "dash-model", "input": "2.00", "cached_input": "0.50", "output": "8.00"},
        {"model": "dash-band", "input": "1.00", "cached_input": "0.25", "output": "2.00",
         "bands": [{"above_prompt_tokens": 100_000, "input": "3.00", "cached_input": "1.00",
                    "output": "4.00"}]}])
    plan_services.price_version_create(
        price_book=book, effective_from=NOV.replace(day=10), allow_backdate=True,
        prices=[{"model": "dash-model", "input": "4.00", "cached_input": "0.50",
                 "output": "8.00"}])
    org = MembershipFactory().organization

    saved = cache_savings(organization=org, at=MID_NOV, usage=[
        _cached(3, "dash-model", 1_000_000),  # 1.50 (before the change)
        _cached(12, "dash-model", 1_000_000),  # 3.50 (after it)
        _cached(12, "dash-band", 1_000_000, requests=10, prompt=2_000_000),  # mean 200,000: 2.00
        _cached(12, "dash-band", 1_000_000, requests=100, prompt=2_000_000),  # 20,000: 0.75
        _cached(12, "dash-model", 1_000_000, source="provisioned"),  # no money per token
        _cached(12, "dash-model", 1_000_000, source="plan"),  # credits, not money
        _cached(12, "unpriced-model", 7),
    ])

    assert saved.amount == Decimal("7.75")
    assert (saved.currency, saved.priced_tokens, saved.unpriced_tokens) == (
        "USD", 4_000_000, 7)
