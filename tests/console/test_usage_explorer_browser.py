"""The usage explorer in a real headless Chromium, under the console's CSP, against a live web
process: a member picks a past month, a project and a grouping in the form; the chart the
vendored Chart.js draws equals ``GET /api/v1/usage`` for the same query (the page's own API
link, fetched by the same signed-in browser); the downloaded CSV equals the table; another
organization's project id is a form message. Screenshots at desktop (1280 px) and phone
(375 px) widths go to tests/console/screenshots/ (ignored by git)."""

from __future__ import annotations

import csv
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from metering import events, services
from tests.console.browser import (
    BROWSER_MARKS,
    DESKTOP,
    SCREENSHOTS,
    create_key,
    in_thread,
    member_who_signs_in,
    shoot,
    sign_in,
    sign_up,
)
from tests.factories import ProjectFactory, make_key, make_price_book
from tests.gateway.conftest import (
    drain_usage,
    live_gateway,  # noqa: F401 - the live gateway fixture
)

pytestmark = BROWSER_MARKS

OCT = datetime(2026, 10, 1, tzinfo=UTC)


@pytest.fixture
def explorer_org():
    """An owner (explore@example.com) whose org has October usage on two projects, two
    models, two tiers and a failed request, and usage this month; another org's project.
    Set up before the browser (Django refuses queries beside Playwright's event loop)."""
    make_price_book(prices=[{"model": "ex-large", "input": "2.00", "cached_input": "0.50",
                             "output": "8.00"},
                            {"model": "ex-small", "input": "0.10", "output": "0.40"}])
    org = member_who_signs_in("explore@example.com").organization
    web = ProjectFactory(organization=org, name="Web app")
    jobs = ProjectFactory(organization=org, name="Jobs")
    web_key, _ = make_key(web, name="server")
    jobs_key, _ = make_key(jobs, name="cron")
    batch = []
    for i in range(60):
        project, key = (web, web_key) if i % 4 else (jobs, jobs_key)
        batch.append(events.normalize({
            "request_id": f"oct{i}", "org_id": org.id, "project_id": project.id,
            "api_key_id": key.id, "model": "ex-large" if i % 3 else "ex-small",
            "region": "us-east" if i % 5 else "eu-west",
            "service_tier": "flex" if i % 7 == 0 else "default",
            "status": "engine_error" if i == 11 else "ok",
            "event_time": OCT + timedelta(days=i % 20, hours=i % 24),
            "prompt_tokens": 300 + 7 * i, "cached_tokens": 100 if i % 2 else 0,
            "completion_tokens": 20 + i}, check_age=False))
    batch.append(events.normalize({
        "request_id": "now", "org_id": org.id, "project_id": web.id, "api_key_id": web_key.id,
        "model": "ex-large", "region": "us-east", "event_time": datetime.now(UTC),
        "prompt_tokens": 1234, "completion_tokens": 56}))
    assert len(services.usage_events_record(batch, origin="test").recorded) == 61
    other = ProjectFactory(name="Not yours")
    return {"org": org, "web": web, "jobs": jobs, "other_project": other}


def _table(page) -> list[list[str]]:
    """The table's cells as the CSV writes them (an amount cell: its exact ``data-exact``)."""
    return page.eval_on_selector_all("#usage-table tr", """rows => rows.map(r =>
        [...r.cells].map(c => c.dataset.exact ?? c.textContent.trim()))""")


def test_usage_explorer_chart_and_csv_equal_the_api_in_chromium(explorer_org, live_console,
                                                                 page):
    base = live_console.url
    web = explorer_org["web"]
    page.set_viewport_size(DESKTOP)
    sign_in(page, base, "explore@example.com", lands_on="/console/")

    # the member opens the explorer (this month by day and model) and asks for October,
    # by day split by model, for the web app only
    page.click("header nav >> text=Usage")
    page.wait_for_selector("canvas#usage-chart[data-drawn=true]")
    page.fill("#f-start", "2026-10-01")
    page.fill("#f-through", "2026-10-31")
    page.select_option("#f-group", "day")
    page.select_option("#f-split", "model")
    page.select_option("#f-project", [web.public_id])
    page.click("#usage-filters button[type=submit]")
    page.wait_for_selector("canvas#usage-chart[data-drawn=true]")
    assert "2026-10-01 00:00" in page.inner_text("#shown-range")

    # what Chart.js drew: total tokens per (model, day), 31 days (quiet ones drawn as zero)
    drawn = page.evaluate("""() => { const c = document.getElementById('usage-chart').chart;
        return {labels: c.data.labels, sets: c.data.datasets.map(d => [d.label, d.data])}; }""")
    assert len(drawn["labels"]) == 31
    shown = {(label, day): n for label, data in drawn["sets"]
             for day, n in zip(drawn["labels"], data, strict=True) if n}

    # equals the browser's own /api/v1/usage for the same query (the page's API link)
    api_url = page.get_attribute("#api-link", "href")
    api = page.evaluate("async (url) => (await fetch(url)).json()", api_url)
    assert api["group_by"] == ["day", "model"]
    assert shown == {(b["model"], b["day"]): b["total_tokens"] for b in api["data"]}
    (total,) = api["totals"]
    assert total["requests"] == 45  # the web app's 45 of October's 60 requests
    assert sum(shown.values()) == total["total_tokens"]

    # the table is the API's rows, and the downloaded CSV is the table
    shown_table = _table(page)
    assert len(shown_table) == len(api["data"]) + 1
    assert [Decimal(r[-1]) for r in shown_table[1:]] == [Decimal(b["amount"])
                                                         for b in api["data"]]
    with page.expect_download() as download:
        page.click("#csv-link")
    with open(download.value.path(), newline="") as f:
        assert list(csv.reader(f)) == shown_table

    # by tier over the whole org, the chart shows requests: it equals the API's counts
    page.select_option("#f-project", [])
    page.select_option("#f-group", "service_tier")
    page.select_option("#f-split", "")
    page.select_option("#f-metric", "requests")
    page.click("#usage-filters button[type=submit]")
    page.wait_for_selector("canvas#usage-chart[data-drawn=true]")
    drawn = page.evaluate("""() => { const c = document.getElementById('usage-chart').chart;
        return [c.data.labels, c.data.datasets.map(d => d.data)]; }""")
    api = page.evaluate("async (url) => (await fetch(url)).json()",
                        page.get_attribute("#api-link", "href"))
    assert drawn == [[b["service_tier"] for b in api["data"]],
                     [[b["requests"] for b in api["data"]]]]
    assert sum(drawn[1][0]) == 60
    SCREENSHOTS.mkdir(exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "usage-explorer-tiers-1280.png"), full_page=True)

    # October by day and model again, for the screenshots at desktop and phone widths; at
    # 375 px the page does not scroll sideways (the table scrolls in its own box)
    page.goto(f"{base}/console/usage/?start=2026-10-01&through=2026-10-31&group=day"
              "&split=model")
    page.wait_for_selector("canvas#usage-chart[data-drawn=true]")
    shoot(page, "usage-explorer", "canvas#usage-chart[data-drawn=true]", reload=True,
          back=False)

    # another organization's project id in the filter: a form message, no table, no chart
    page.goto(f"{base}/console/usage/?project={explorer_org['other_project'].public_id}")
    assert "No such project in this organization" in page.inner_text("#filter-errors")
    assert page.locator("#usage-table").count() == 0
    assert page.locator("canvas#usage-chart").count() == 0
    # and a malformed date
    page.goto(f"{base}/console/usage/?start=2026-02-30")
    assert "start must be a date" in page.inner_text("#filter-errors")
    page.screenshot(path=str(SCREENSHOTS / "usage-explorer-error-375.png"), full_page=True)


def test_sign_up_call_the_api_with_the_sdk_and_explore_it_in_chromium(
        live_gateway, page):  # noqa: F811 - the fixture imported above
    import openai

    # a developer signs up and creates a key in the console
    base = live_gateway.url
    page.set_viewport_size(DESKTOP)
    sign_up(page, base, "lin@example.com", "Explorer Labs")
    secret = create_key(page, "sdk")

    # makes 5 requests with the openai SDK; the usage is ingested (rated, rolled up)
    sdk = openai.OpenAI(base_url=f"{base}/v1", api_key=secret, max_retries=0)
    for i in range(5):
        sdk.chat.completions.create(model="small", max_tokens=8, messages=[
            {"role": "user", "content": f"Say something about the number {i}."}])
    in_thread(drain_usage)

    # and reads today by hour in the explorer: the chart draws the API's numbers
    page.click("header nav >> text=Usage")
    page.click("#presets >> text=Today by hour")
    page.wait_for_selector("canvas#usage-chart[data-drawn=true]")
    drawn = page.evaluate("""() => { const c = document.getElementById('usage-chart').chart;
        return {labels: c.data.labels, sets: c.data.datasets.map(d => [d.label, d.data])}; }""")
    assert len(drawn["labels"]) == 24
    api = page.evaluate("async (url) => (await fetch(url)).json()",
                        page.get_attribute("#api-link", "href"))
    assert api["group_by"] == ["hour", "model"]
    shown = {(label, hour): n for label, data in drawn["sets"]
             for hour, n in zip(drawn["labels"], data, strict=True) if n}
    assert shown == {(b["model"], b["hour"][:13].replace("T", " ") + ":00"): b["total_tokens"]
                     for b in api["data"]}
    (total,) = api["totals"]
    assert total["requests"] == 5 and total["completion_tokens"] > 0
    assert Decimal(total["amount"]) > 0
    # the amount reads with the places it needs, never "$0.00" for real usage
    assert page.inner_text("#usage-totals b[data-exact]") != "$0.00"
    with page.expect_download() as download:
        page.click("#csv-link")
    with open(download.value.path(), newline="") as f:
        assert list(csv.reader(f)) == _table(page)
    SCREENSHOTS.mkdir(exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "usage-explorer-today-1280.png"), full_page=True)
