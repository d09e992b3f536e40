"""Helpers of the console's Chromium tests, written once: the marks every browser test carries,
signing up and in through the console's own forms, a key made in the console, screenshots at
desktop and phone widths (no sideways scrolling at the phone's), Django code run beside
Playwright's event loop, and the open October invoice the billing tests start from.

Screenshots go to tests/console/screenshots/ (ignored by git: artifacts for a reader, not
sources).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import pytest

from billing_platform.invoicing import services
from billing_platform.invoicing.models import Invoice
from plans import services as plan_services
from tests.console.conftest import CHROMIUM
from tests.factories import MembershipFactory, make_billed_org, make_offering, make_price_book
from tests.invoicing.conftest import NOV, OCT

T = TypeVar("T")

# a module's ``pytestmark = BROWSER_MARKS``: skipped without Chromium; the web process reads
# the test's rows, so they are committed (a transactional database)
BROWSER_MARKS = [
    pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (the test command "
                       "installs Debian's chromium where it can: apt-get install chromium)"),
    pytest.mark.django_db(transaction=True),
]

PASSWORD = "a-long-passphrase-42"
SCREENSHOTS = Path(__file__).parent / "screenshots"
DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 375, "height": 800}



def member_who_signs_in(email: str, **factory: Any) -> Any:
    """A membership (MembershipFactory's, with ``factory``'s fields) whose user, ``email``,
    signs in with PASSWORD."""
    member = MembershipFactory(user__email=email, **factory)
    member.user.set_password(PASSWORD)
    member.user.save()
    return member


def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run Django code beside Playwright's event loop (Django refuses it on that thread)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args).result()


def stripe_env(localstripe_url: str) -> dict[str, str]:
    """The environment of a web process or a worker that talks to the Stripe stand-in."""
    return {"STRIPE_API_BASE": localstripe_url, "STRIPE_API_KEY": "sk_test_tollgate",
            "STRIPE_WEBHOOK_SECRET": "whsec_tollgate_test"}


def sign_in(page, base: str, email: str, *, lands_on: str | None = None) -> None:
    """Sign in through the console's login form (as nobody before); wait for ``lands_on``
    (a path) where given, else for the page the form leads to."""
    page.context.clear_cookies()
    page.goto(f"{base}/console/login/")
    page.fill("#id_username", email)
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    if lands_on is None:
        page.wait_for_load_state()
    else:
        page.wait_for_url(f"{base}{lands_on}")


def sign_up(page, base: str, email: str, org_name: str) -> None:
    """Sign up through the console's form; wait for the dashboard it leads to."""
    page.goto(f"{base}/console/signup/")
    page.fill("#id_email", email)
    page.fill("#id_password", PASSWORD)
    page.fill("#id_org_name", org_name)
    page.click("button[type=submit]")
    page.wait_for_url(f"{base}/console/")


def create_key(page, name: str) -> str:
    """Create an API key in the console (from the navigation); return its secret."""
    page.click("text=Projects & keys")
    page.click("text=API keys →")
    page.fill("#id_name", name)
    page.click("text=Create key")
    return page.inner_text("#new-secret").strip()


def shoot(page, name: str, *ready: str, reload: bool = False, back: bool = True) -> None:
    """Screenshot the page at desktop and at phone width (``name``-1280.png, -375.png) and
    assert that at the phone's it does not scroll sideways. At phone width the page is
    reloaded first where ``reload`` says so, and each selector in ``ready`` waited for;
    ``back``: return to desktop width after."""
    SCREENSHOTS.mkdir(exist_ok=True)
    page.set_viewport_size(DESKTOP)
    page.screenshot(path=str(SCREENSHOTS / f"{name}-{DESKTOP['width']}.png"), full_page=True)
    page.set_viewport_size(PHONE)
    if reload:
        page.reload()
    for selector in ready:
        page.wait_for_selector(selector)
    page.screenshot(path=str(SCREENSHOTS / f"{name}-{PHONE['width']}.png"), full_page=True)
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= PHONE["width"], (name, width)
    if back:
        page.set_viewport_size(DESKTOP)


def open_october_invoice(name: str) -> Invoice:
    """An org (``name``) whose October invoice, a 200.00 reservation fee, is closed and open
    (nothing charged); the price book has m-small. Return the invoice."""
    make_price_book(prices=[{"model": "m-small", "input": "1.00", "output": "2.00"}])
    org = make_billed_org(name=name)
    plan_services.reservation_create(organization=org, offering=make_offering(model="m-big"),
                                     units=2, term="monthly", starts_at=OCT)
    services.period_close_run(now=NOV + timedelta(hours=1), enqueue_payments=False)
    return Invoice.objects.get(organization=org, period_start=OCT)
