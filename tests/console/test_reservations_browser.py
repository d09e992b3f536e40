"""The Reservations page in a real headless Chromium, under the console's CSP, against a live
web process: both charts are drawn by the vendored Chart.js from exactly the figures of the
table beside them (the usage of tests/console/test_reservations_page.py: 6,400 used and 1,400
spilled in H0, 400 and 200 two hours later), and a request to staff is sent from the form.
Screenshots at desktop (1280 px) and phone (375 px) widths go to tests/console/screenshots/
(ignored by git); at 375 px the page does not scroll sideways.
"""

from __future__ import annotations

import pytest

from billing_platform.accounts.choices import Role
from tests.console.browser import BROWSER_MARKS, DESKTOP, member_who_signs_in, shoot, sign_in
from tests.console.test_reservations_page import make_world

pytestmark = BROWSER_MARKS

# the table's columns after the hour (tests/console/test_reservations_page.py's order)
RESERVED_MIN, BUSIEST, RESERVED_HOUR, USED, SPILLOVER = 0, 1, 3, 4, 6


@pytest.fixture
def reserved_org():
    """An owner (rsv@example.com) of the reservation and usage of ``make_world``. Set up before
    the browser: Django refuses queries beside Playwright's event loop."""
    org, reservation, _owner, _h0 = make_world()
    member_who_signs_in("rsv@example.com", organization=org, role=Role.OWNER)
    return reservation


def _table(page) -> list[list[str]]:
    return page.evaluate("""() => [...document.querySelectorAll(
        "#utilization-table tbody tr")].map((tr) => [...tr.querySelectorAll("td")].slice(1)
        .map((td) => td.textContent.trim()))""")


def _drawn(page, chart: str) -> dict:
    page.wait_for_selector(f"canvas#{chart}[data-drawn=true]")
    return page.evaluate(f"""() => {{ const c = document.getElementById("{chart}");
        return {{spec: c.spec, drawn: c.chart.data.datasets.map((d) => d.data),
                 role: c.getAttribute("role"), label: c.getAttribute("aria-label")}}; }}""")


def test_reservation_charts_equal_the_table_in_chromium(reserved_org, live_console, page):
    base = live_console.url
    page.set_viewport_size(DESKTOP)
    sign_in(page, base, "rsv@example.com", lands_on="/console/")

    # the page, from the navigation
    page.click("header nav >> text=Reservations")
    page.wait_for_url(f"{base}/console/reservations/")
    hourly, minute = _drawn(page, "hourly-chart"), _drawn(page, "minute-chart")
    rows = _table(page)

    # four hours (H0 to the current one), and each chart series is a column of the table
    assert len(rows) == 4 == len(hourly["spec"]["labels"]) == len(minute["spec"]["labels"])
    used, spilled, reserved = hourly["spec"]["datasets"]
    assert used["data"] == [int(r[USED]) for r in rows] == [6400, 0, 400, 0]
    assert spilled["data"] == [int(r[SPILLOVER]) for r in rows] == [1400, 0, 200, 0]
    assert reserved["data"] == [int(r[RESERVED_HOUR]) for r in rows] == [1_200_000] * 4
    busiest, per_minute = minute["spec"]["datasets"]
    assert busiest["data"] == [int(r[BUSIEST]) for r in rows] == [5400, 0, 400, 0]
    assert per_minute["data"] == [int(r[RESERVED_MIN]) for r in rows] == [20_000] * 4
    # what Chart.js holds is what the spec said; the canvases say what they show
    assert hourly["drawn"] == [used["data"], spilled["data"], reserved["data"]]
    assert minute["drawn"] == [busiest["data"], per_minute["data"]]
    assert hourly["role"] == minute["role"] == "img" and "spilled over" in hourly["label"]
    assert page.inner_text("#total-spillover-share") == "19.0%"
    shoot(page, "reservations", "canvas#hourly-chart[data-drawn=true]", reload=True)

    # a request to staff (self-serve is off by default), sent from the form
    page.select_option("#id_offering", "l70")
    page.fill("#id_units", "3")
    page.select_option("#id_term", "monthly")
    page.fill("#id_term_count", "2")
    page.click("#buy-form button[type=submit]")
    page.wait_for_selector(".messages li.success")
    assert "staff will set up 3 units of Llama 70B unit" in page.inner_text(".messages")
    assert "9000.00 USD" in page.inner_text("#requests")
