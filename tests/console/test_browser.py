"""The console in a real headless Chromium: sign up, create a key (shown once, copy button),
revoke it after the confirmation page, and see the gateway refuse it.
"""

from __future__ import annotations

import re
import shutil

import httpx
import pytest

from tests.gateway.conftest import start_gateway, stop_gateway

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (the test command "
                       "installs Debian's chromium where it can: apt-get install chromium)"),
    pytest.mark.django_db(transaction=True),
]


@pytest.fixture
def live_console(tmp_path):
    server = start_gateway(tmp_path)
    yield server
    stop_gateway(server)


@pytest.fixture
def page(tmp_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM, headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"])
        context = browser.new_context(permissions=["clipboard-read", "clipboard-write"])
        yield context.new_page()
        browser.close()


def test_sign_up_create_copy_and_revoke_a_key_in_chromium(live_console, page, tmp_path):
    base = live_console.url
    page.goto(f"{base}/console/signup/")
    page.fill("#id_email", "grace@example.com")
    page.fill("#id_password", "a-long-passphrase-42")
    page.fill("#id_org_name", "Hopper Labs")
    page.click("button[type=submit]")
    page.wait_for_url(f"{base}/console/")
    assert "Hopper Labs" in page.content()

    page.click("text=Projects & keys")
    page.click("text=API keys →")
    page.fill("#id_name", "laptop")
    page.click("text=Create key")
    secret = page.inner_text("#new-secret").strip()
    assert re.fullmatch(r"tg-[a-z0-9]{12}_[A-Za-z0-9_-]+", secret)
    page.click("#copy-secret")
    page.wait_for_function("document.getElementById('copy-secret').textContent === 'Copied'")
    assert page.evaluate("navigator.clipboard.readText()") == secret
    page.screenshot(path=str(tmp_path / "keys.png"))

    auth = {"Authorization": f"Bearer {secret}"}
    assert httpx.get(f"{base}/v1/models", headers=auth).status_code == 200

    page.reload()  # re-sends the POST: no second key, and the secret is not shown again
    assert secret not in page.content()
    assert page.locator("text=laptop").count() == 1
    page.click("text=Revoke")
    assert "cannot be undone" in page.content()
    page.click("text=Yes, revoke this key")
    page.wait_for_selector("text=stopped working immediately")
    assert httpx.get(f"{base}/v1/models", headers=auth).status_code == 401
