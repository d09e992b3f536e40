"""Fixtures of the console's browser tests: the web process and a headless Chromium page that
fails the test if any Content-Security-Policy violation was reported on it.
"""

from __future__ import annotations

import shutil

import pytest

from tests.gateway.conftest import start_gateway, stop_gateway

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


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
        page = context.new_page()
        violations = watch_csp_violations(page)
        yield page
        browser.close()
    # every flow runs under the console's Content-Security-Policy, and nothing on it was blocked
    assert violations == [], violations


# Chromium reports every resource or inline code a Content-Security-Policy blocked both as a
# `securitypolicyviolation` event and as a console error; either one counts.
_RECORD_VIOLATIONS = """
window.__cspViolations = [];
document.addEventListener("securitypolicyviolation", (e) => {
  window.__cspViolations.push(`${e.violatedDirective} blocked ${e.blockedURI || "inline"}`);
});
"""


def watch_csp_violations(page) -> list[str]:
    """Collect the CSP violations the pages opened in ``page`` report (in the list returned)."""
    violations: list[str] = []
    page.add_init_script(_RECORD_VIOLATIONS)
    page.on("console", lambda msg: violations.append(msg.text)
            if msg.type == "error" and "Content Security Policy" in msg.text else None)
    return violations
