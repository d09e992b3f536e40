"""The data-residency page in a real headless Chromium, under the console's CSP, against a live
web process: its chart is drawn by the vendored Chart.js from the numbers of its table, the
proof downloads and states the same figures, and screenshots at desktop (1280 px) and phone
(375 px) widths go to tests/console/screenshots/ (ignored by git)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from billing_platform.accounts.choices import DataZone, Role
from metering import events, services
from tests.console.browser import BROWSER_MARKS, DESKTOP, member_who_signs_in, shoot, sign_in
from tests.console.test_residency_page import fleet
from tests.factories import MembershipFactory, OrganizationFactory, make_price_book

pytestmark = BROWSER_MARKS


@pytest.fixture
def residency_org():
    """A finance member (res@example.com) of an EU org with this month's requests in two EU
    regions and one in us-east; another org's requests beside them. Set up before the browser:
    Django refuses queries beside Playwright's event loop."""
    make_price_book(prices=[{"model": "res-model", "input": "1.00", "output": "2.00"}])
    fleet()
    org = OrganizationFactory(data_zone=DataZone.EU, name="Residency GmbH")
    member_who_signs_in("res@example.com", organization=org, role=Role.FINANCE)
    project = org.projects.create(name="Main")
    now = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    start = now.replace(day=1, hour=0)
    other = MembershipFactory().organization
    theirs = other.projects.create(name="Theirs")
    batch = [events.normalize({
        "request_id": f"r{i}", "org_id": org.id, "project_id": project.id,
        "model": "res-model", "region": region, "event_time": start + timedelta(minutes=i),
        "prompt_tokens": 100 + i, "cached_tokens": 0, "completion_tokens": 20}, check_age=False)
        for i, region in enumerate(["eu-west"] * 5 + ["eu-central"] * 2 + ["us-east"])]
    batch.append(events.normalize({
        "request_id": "t1", "org_id": other.id, "project_id": theirs.id, "model": "res-model",
        "region": "us-east", "event_time": start, "prompt_tokens": 5_000,
        "cached_tokens": 0, "completion_tokens": 1}, check_age=False))
    assert len(services.usage_events_record(batch, origin="test").recorded) == 9
    return org


def test_the_residency_chart_equals_its_table_and_the_proof_downloads(residency_org,
                                                                      live_console, page):
    base = live_console.url
    page.set_viewport_size(DESKTOP)
    sign_in(page, base, "res@example.com")
    page.goto(f"{base}/console/residency/")

    # the chart is drawn, from the table's numbers
    page.wait_for_selector("canvas#region-chart[data-drawn=true]")
    drawn = page.evaluate("""() => {
        const c = document.getElementById('region-chart').chart;
        return {labels: c.data.labels, sets: c.data.datasets.map((d) => d.data)};
    }""")
    table = page.evaluate("""() => [...document.querySelectorAll('#region-table tbody tr')]
        .map((tr) => [...tr.children].map((td) => td.innerText.trim()))""")
    assert drawn["labels"] == [row[0] for row in table] == ["eu-central", "eu-west", "us-east"]
    assert drawn["sets"][0] == [int(row[3]) for row in table] == [2, 5, 1]
    assert drawn["sets"][1] == [int(row[6]) for row in table]
    assert [row[2] for row in table] == ["yes", "yes", "NO"]
    assert page.inner_text("#total-events") == "8"
    assert page.inner_text("#outside") == "1"

    # the proof downloads, and states the page's figures and the one event outside the zone
    with page.expect_download() as download:
        page.click("#proof-json")
    proof = json.loads(Path(download.value.path()).read_text())
    assert proof["organization"] == residency_org.public_id
    assert proof["total_events"] == 8 and proof["events_outside_zone"] == 1
    assert [e["request_id"] for e in proof["outside_events"]] == ["r7"]
    assert [r["events"] for r in proof["regions"]] == drawn["sets"][0]
    assert proof["digest_sha256"] == page.inner_text("#digest")
    with page.expect_download() as download:
        page.click("#proof-csv")
    assert download.value.suggested_filename.endswith(".csv")
    assert b"r7," in Path(download.value.path()).read_bytes()

    # screenshots at desktop and phone widths; at 375 px the page does not scroll sideways
    shoot(page, "residency", "canvas#region-chart[data-drawn=true]", reload=True, back=False)
