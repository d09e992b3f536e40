"""The /finance/ margin page (issue 18 item 2): the report's tables, the break-even chart and a
CSV equal to the table; 404 to everyone but platform finance; malformed filters are form
messages. The figures are the seeded ones of ``tests/finance/test_margin.py`` (worked out by
hand there). One check in a real headless Chromium under the console's CSP.
"""

from __future__ import annotations

import csv
import io
import json
import re

import pytest

from billing_platform.accounts.choices import Role
from tests.console.conftest import CHROMIUM
from tests.console.test_finance_browser import PASSWORD, sign_in, table
from tests.console.test_finance_pages import Tables
from tests.factories import MembershipFactory
from tests.finance.conftest import finance_user
from tests.finance.test_margin import seeded  # noqa: F401 - the seeded rollups and costs
from tests.gateway.conftest import start_gateway, stop_gateway

URL = "/finance/reports/margin/"
RANGE = "start=2026-10-01&end=2026-11-01"


@pytest.fixture
def analyst(client, seeded):  # noqa: F811
    client.force_login(finance_user())
    return client


@pytest.mark.django_db
def test_margin_page_shows_groups_pools_and_the_break_even_chart_and_csv_is_the_table(
        analyst, seeded):  # noqa: F811
    html = analyst.get(f"{URL}?{RANGE}").content.decode()
    tables = Tables(html).tables
    header, *rows = tables["report-table"]
    assert [(r[header.index("label")], r[header.index("revenue")],
             r[header.index("cost_to_serve")], r[header.index("margin")]) for r in rows] == [
        ("Alpha", "2.0000000000", "0.1000000000", "1.9000000000"),
        ("Beta", "4.0000000000", "0.0500000000", "3.9500000000"),
        ("Epsilon", "2.7000000000", "0.0200000000", "")]
    pools_header, *pools = tables["pools"]
    pool_a = dict(zip(pools_header, next(p for p in pools if p[0] == "pool-a"), strict=True))
    assert (pool_a["idle_cost"], pool_a["cost_per_1m_tokens"],
            pool_a["break_even_utilization"], pool_a["utilization"]) == (
        "0.2300000000", "0.0727272727", "0.024286", "0.425000")
    # the break-even view: per pool, measured utilization beside break-even utilization
    chart = json.loads(re.search(r'<script id="chart-data" type="application/json">(.*?)'
                                 r"</script>", html, re.S).group(1))
    assert chart["labels"] == ["pool-a", "pool-b"]
    assert [d["data"] for d in chart["datasets"]] == [["0.425000", "0.000000"],
                                                      ["0.024286", None]]
    # the CSV link sends exactly the table shown
    link = re.search(r'id="csv-link" href="([^"]+)"', html).group(1).replace("&amp;", "&")
    exported = list(csv.reader(io.StringIO(analyst.get(f"{URL}{link}").content.decode())))
    assert exported == tables["report-table"]
    # another table asked for is the page's table and the CSV's
    html = analyst.get(f"{URL}?{RANGE}&table=requests").content.decode()
    header, *rows = Tables(html).tables["report-table"]
    assert [r[header.index("request_id")] for r in rows] == ["a1", "b1", "e1"]


@pytest.mark.django_db
def test_nobody_but_platform_finance_finds_the_margin_page(client, seeded):  # noqa: F811
    owner = MembershipFactory(organization=seeded.a, role=Role.OWNER)
    member = MembershipFactory(organization=seeded.a, role=Role.FINANCE)
    assert client.get(URL).status_code == 404
    for user in (owner.user, member.user):
        client.force_login(user)
        for query in ("", "?format=csv"):
            reply = client.get(f"{URL}{query}")
            assert reply.status_code == 404
            assert b"cost_to_serve" not in reply.content
    # nor does the customer console name it
    assert b"margin" not in client.get("/console/").content.lower()


@pytest.mark.django_db
@pytest.mark.parametrize(("query", "message"), [
    ("by=engine", "by: "), ("start=2026-11-01&end=2026-10-01", "end: Must be after start."),
    ("limit=0", "limit: "), ("organization=org_forged", "organization: No such organization."),
])
def test_malformed_margin_filters_are_form_messages(analyst, query, message):
    reply = analyst.get(f"{URL}?{query}")
    assert reply.status_code == 400
    assert message in reply.content.decode()


@pytest.fixture
def margin_server(seeded, tmp_path):  # noqa: F811
    """A finance analyst and the web process, made before the browser starts (Django refuses
    database work on Playwright's event loop)."""
    user = finance_user(email="margin-analyst@platform.example.com")
    user.set_password(PASSWORD)
    user.save()
    server = start_gateway(tmp_path, env={})
    yield server.url
    stop_gateway(server)


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed")
@pytest.mark.django_db(transaction=True)
def test_margin_page_in_chromium_draws_the_chart_and_downloads_the_table(margin_server, page):
    sign_in(page, margin_server, "margin-analyst@platform.example.com")
    page.click("nav.subnav >> text=Margin")
    page.wait_for_selector("canvas#chart[data-drawn=true]")
    page.goto(f"{margin_server}{URL}?{RANGE}&by=pool")
    page.wait_for_selector("canvas#chart[data-drawn=true]")
    assert page.evaluate("document.getElementById('chart').chart.data.labels") == [
        "pool-a", "pool-b"]
    shown = table(page, "#report-table")
    assert [r[0] for r in shown[1:]] == ["pool-a", "pool-a"]  # EUR and USD, not summed
    with page.expect_download() as download:
        page.click("#csv-link")
    with open(download.value.path(), newline="") as f:
        assert list(csv.reader(f)) == shown
