"""The Plan & credits page in a real headless Chromium, under the console's CSP, against a live
web process: an owner on a token plan buys a credit pack and sees the credits rise, then
previews an upgrade, confirms it and sees the new plan. Screenshots of the page and of the
preview at desktop (1280 px) and phone (375 px) widths go to tests/console/screenshots/
(ignored by git); at 375 px neither page scrolls sideways.

Credits by hand (the plan of tests/console/test_plan_page.py: 1,000 a period, 300 in any
5 hours): one request 1 h ago of 100 in + 50 out = 250 credits; the period has 750 left, the
window 50, so 50 are usable; a 500-credit pack makes it 550.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from billing_platform.accounts.choices import Role
from plans import services
from tests.console.browser import BROWSER_MARKS, DESKTOP, member_who_signs_in, shoot, sign_in
from tests.console.test_plan_page import _plans
from tests.factories import make_billed_org, make_price_book
from tests.invoicing.conftest import record

pytestmark = BROWSER_MARKS


@pytest.fixture
def plan_org():
    """An owner (plan@example.com) of an org on Basic since two days ago, 250 credits used.
    Set up before the browser: Django refuses queries beside Playwright's event loop."""
    make_price_book(prices=[{"model": "test-model", "input": "1.00", "output": "2.00"}])
    basic, _ = _plans()
    now = timezone.now()
    org = make_billed_org(name="Plan Co", created_at=now - timedelta(days=2))
    services.subscription_create(organization=org, plan=basic, starts_at=now - timedelta(days=2))
    record(org, "r1", now - timedelta(hours=1), model="test-model", prompt_tokens=100,
           completion_tokens=50)
    member_who_signs_in("plan@example.com", organization=org, role=Role.OWNER)
    return org


def test_buy_a_credit_pack_and_upgrade_in_chromium(plan_org, live_console, page):
    base = live_console.url
    page.set_viewport_size(DESKTOP)
    sign_in(page, base, "plan@example.com", lands_on="/console/")

    # the page, from the navigation: credits left as computed by hand
    page.click("header nav >> text=Plan & credits")
    page.wait_for_url(f"{base}/console/plan/")
    assert page.inner_text("#period-left") == "750"
    assert page.inner_text("#window-left") == "50"
    assert page.inner_text("#credits-left") == "50"

    # buy a pack: the credits rise by its 500, and it is listed as bought
    page.select_option("#id_pack", "p500")
    page.click("#pack-form button[type=submit]")
    page.wait_for_selector(".messages li.success")
    assert "Bought 500 pack: 500 credits" in page.inner_text(".messages")
    assert page.inner_text("#credits-left") == "550"
    assert page.inner_text("#purchases").count("500 pack") == 1
    shoot(page, "plan", "#credits-left")

    # preview an upgrade: the invoice's plan fees before and after, then confirm it
    page.click("#plans >> text=Upgrade…")
    page.wait_for_selector("#preview")
    assert "Basic → Pro" in page.inner_text("h1")
    assert "prorated" in page.inner_text("#fees")
    shoot(page, "plan-change", "#preview")
    for _ in range(2):  # fees are prorated by the second: a cent may move before the click
        page.click("#confirm-form button[type=submit]")
        page.wait_for_load_state()
        if page.url == f"{base}/console/plan/":
            break
        assert "changed since your preview" in page.inner_text(".messages")
    assert page.url == f"{base}/console/plan/"
    assert "You are now on Pro." in page.inner_text(".messages")
    assert "Pro" in page.inner_text("#subscription")
    # Pro starts where Basic stood (250 of Basic's 300-credit window is 1,250 of Pro's 1,500:
    # 250 left) and the pack's 500 credits moved with the change: 750
    assert page.inner_text("#credits-left") == "750"
