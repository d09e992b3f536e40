"""The dashboard in a real headless Chromium, under the console's CSP, against a live web
process: its charts are drawn by the vendored Chart.js, and what they draw equals
``GET /api/v1/usage`` for the same range, fetched by the same signed-in browser. Screenshots
at desktop (1280 px) and phone (375 px) widths go to tests/console/screenshots/ (ignored by
git: artifacts for a reader, not sources)."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import pytest

from metering import events, services
from plans.quotas import budget_set
from tests.console.conftest import CHROMIUM
from tests.factories import MembershipFactory, ProjectFactory, make_key, make_price_book

pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (the test command "
                       "installs Debian's chromium where it can: apt-get install chromium)"),
    pytest.mark.django_db(transaction=True),
]

PASSWORD = "a-long-passphrase-42"
SCREENSHOTS = Path(__file__).parent / "screenshots"


@pytest.fixture
def dashboard_org():
    """An owner (dash@example.com) whose org has this month's usage on two models, cached
    tokens and a budget. Set up before the browser: Playwright's sync API runs an event loop,
    and Django refuses queries beside one."""
    make_price_book(prices=[{"model": "dash-model", "input": "2.00", "cached_input": "0.50",
                             "output": "8.00"},
                            {"model": "dash-mini", "input": "1.00", "output": "4.00"}])
    member = MembershipFactory(user__email="dash@example.com")
    member.user.set_password(PASSWORD)
    member.user.save()
    org = member.organization
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
    page.set_viewport_size({"width": 1280, "height": 900})
    page.goto(f"{base}/console/login/")
    page.fill("#id_username", "dash@example.com")
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url(f"{base}/console/")

    # the three charts are drawn
    for chart in ("spend-chart", "tokens-chart", "requests-chart"):
        page.wait_for_selector(f"canvas#{chart}[data-drawn=true]")
    specs = page.evaluate("""() => Object.fromEntries(["spend-chart", "tokens-chart",
        "requests-chart"].map((id) => [id, document.getElementById(id).spec]))""")
    drawn = page.evaluate("document.getElementById('tokens-chart').chart.data.datasets"
                          ".map((d) => [d.label, d.data])")

    # and the browser's own /api/v1/usage (its defaults: this month through this hour, the
    # dashboard's range) holds the same tokens per model and day, and the same spend
    api = page.evaluate("""async (org) => (await fetch(
        `/api/v1/usage?organization=${org}&group_by=day,model`)).json()""",
                        dashboard_org.public_id)
    tokens = specs["tokens-chart"]
    shown = {(d["label"], day): n for d in tokens["datasets"]
             for day, n in zip(tokens["labels"], d["data"], strict=True) if n}
    assert shown == {(b["model"], b["day"]): b["total_tokens"] for b in api["data"]}
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
    SCREENSHOTS.mkdir(exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "dashboard-1280.png"), full_page=True)
    page.set_viewport_size({"width": 375, "height": 800})
    page.reload()
    page.wait_for_selector("canvas#tokens-chart[data-drawn=true]")
    page.screenshot(path=str(SCREENSHOTS / "dashboard-375.png"), full_page=True)
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= 375, width
