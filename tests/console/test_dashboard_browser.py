"""The dashboard in a real headless Chromium, under the console's CSP, against a live web
process: its charts are drawn by the vendored Chart.js, and what they draw equals
``GET /api/v1/usage`` for the same range, fetched by the same signed-in browser. Screenshots
at desktop (1280 px) and phone (375 px) widths go to tests/console/screenshots/ (ignored by
git: artifacts for a reader, not sources)."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from decimal import Decimal

import openai
import pytest

from billing_platform.console.templatetags.money import usage_money
from metering import events, services
from metering.models import UsageEvent
from plans.quotas import budget_set
from tests.conftest import wait_until
from tests.console.browser import (
    BROWSER_MARKS,
    DESKTOP,
    create_key,
    in_thread,
    member_who_signs_in,
    shoot,
    sign_in,
    sign_up,
)
from tests.factories import ProjectFactory, make_key, make_price_book
from tests.gateway.conftest import drain_usage, live_gateway  # noqa: F401 (a fixture)

# F811 below: ``live_gateway`` is the fixture imported above, named as a test's argument

pytestmark = BROWSER_MARKS

CHARTS = ("spend-chart", "tokens-chart", "requests-chart")
LONG = "Tollgate meters every token exactly once, durably and fast. " * 40


def chart_specs(page) -> dict:
    for chart in CHARTS:
        page.wait_for_selector(f"canvas#{chart}[data-drawn=true]")
    return page.evaluate("""() => Object.fromEntries(["spend-chart", "tokens-chart",
        "requests-chart"].map((id) => [id, document.getElementById(id).spec]))""")


def api_usage(page, org_id: str) -> dict:
    """``GET /api/v1/usage`` by day and model, fetched by the signed-in browser: its defaults
    (this month through this hour) are the dashboard's range."""
    return page.evaluate("""async (org) => (await fetch(
        `/api/v1/usage?organization=${org}&group_by=day,model`)).json()""", org_id)


def tokens_by_model_day(spec: dict) -> dict:
    return {(d["label"], day): n for d in spec["datasets"]
            for day, n in zip(spec["labels"], d["data"], strict=True) if n}


@pytest.fixture
def dashboard_org():
    """An owner (dash@example.com) whose org has this month's usage on two models, cached
    tokens and a budget. Set up before the browser: Playwright's sync API runs an event loop,
    and Django refuses queries beside one."""
    make_price_book(prices=[{"model": "dash-model", "input": "2.00", "cached_input": "0.50",
                             "output": "8.00"},
                            {"model": "dash-mini", "input": "1.00", "output": "4.00"}])
    org = member_who_signs_in("dash@example.com").organization
    project = ProjectFactory(organization=org, name="Web app")
    key, _ = make_key(project, name="server")
    now = datetime.now(UTC)
    batch = [events.normalize({
        "request_id": f"b{i}", "org_id": org.id, "project_id": project.id,
        "api_key_id": key.id, "model": "dash-model" if i % 3 else "dash-mini",
        "region": "us-east", "event_time": now, "prompt_tokens": 1_000 + 10 * i,
        "cached_tokens": 500 if i % 2 else 0, "completion_tokens": 200 + i}) for i in range(30)]
    assert len(services.usage_events_record(batch, origin="test").recorded) == 30
    budget_set(organization=org, amount="5")
    return org


def test_dashboard_charts_equal_the_usage_api_in_chromium(dashboard_org, live_console, page):
    base = live_console.url
    page.set_viewport_size(DESKTOP)
    sign_in(page, base, "dash@example.com", lands_on="/console/")

    # the three charts are drawn
    specs = chart_specs(page)
    drawn = page.evaluate("document.getElementById('tokens-chart').chart.data.datasets"
                          ".map((d) => [d.label, d.data])")

    # and the browser's own /api/v1/usage (its defaults: this month through this hour, the
    # dashboard's range) holds the same tokens per model and day, and the same spend
    api = api_usage(page, dashboard_org.public_id)
    assert tokens_by_model_day(specs["tokens-chart"]) == {
        (b["model"], b["day"]): b["total_tokens"] for b in api["data"]}
    assert [label for label, _ in drawn] == ["dash-mini", "dash-model"]
    (total,) = api["totals"]
    spend = specs["spend-chart"]
    today = api["data"][0]["day"]
    actual = spend["datasets"][0]["data"]
    assert Decimal(actual[spend["labels"].index(today)]) == Decimal(total["amount"])
    requests = specs["requests-chart"]
    assert sum(sum(d["data"]) for d in requests["datasets"]) == total["requests"] == 30
    assert page.inner_text("#requests") == "30"

    # screenshots at desktop and phone widths; at 375 px the page does not scroll sideways
    shoot(page, "dashboard", "canvas#tokens-chart[data-drawn=true]", reload=True, back=False)


def test_sign_up_make_requests_with_the_sdk_and_see_them_on_the_dashboard(
        live_gateway, page):  # noqa: F811
    """Issue 19's end-to-end check: a new customer signs up, creates a key, calls /v1 with the
    openai SDK (simulated engines that report cached tokens as SGLang does), and the dashboard
    shows those requests, equal to /api/v1/usage, with the cache's saving at the price book's
    prices (the gateway fixture's: input 0.50, cached input 0.05 = 0.1 x input per 1M)."""
    base = live_gateway.url
    page.set_viewport_size(DESKTOP)
    sign_up(page, base, "sdk@example.com", "SDK Labs")
    assert page.inner_text("#requests") == "0"
    secret = create_key(page, "sdk")
    org_id = re.search(r"org_[a-z0-9]+", page.goto(f"{base}/console/").text()).group(0)

    # the SDK makes four requests; the repeated long prompt is served from the prompt cache
    sdk = openai.OpenAI(base_url=f"{base}/v1", api_key=secret, max_retries=0)
    for _ in range(3):
        sdk.chat.completions.create(model="small", max_tokens=5,
                                    messages=[{"role": "user", "content": LONG}])
    sdk.chat.completions.create(model="small", max_tokens=3,
                                messages=[{"role": "user", "content": "Say hi"}])

    def recorded() -> bool:
        drain_usage()
        return UsageEvent.objects.filter(organization__public_id=org_id).count() == 4

    in_thread(lambda: wait_until(recorded, timeout=30, what="the four usage events"))

    page.reload()
    specs = chart_specs(page)
    api = api_usage(page, org_id)
    (total,) = api["totals"]
    assert total["requests"] == 4 and total["cached_tokens"] > 0
    assert tokens_by_model_day(specs["tokens-chart"]) == {
        (b["model"], b["day"]): b["total_tokens"] for b in api["data"]}
    assert page.inner_text("#requests") == "4"
    assert page.inner_text("#spent") == usage_money(Decimal(total["amount"]), "USD")
    saved = Decimal(total["cached_tokens"]) * (Decimal("0.50") - Decimal("0.05")) / 1_000_000
    assert page.inner_text("#savings") == usage_money(saved, "USD")
    shoot(page, "dashboard-sdk", *(f"canvas#{c}[data-drawn=true]" for c in CHARTS),
          reload=True, back=False)
