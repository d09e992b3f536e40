"""The console's pages under their Content-Security-Policy, in a real headless Chromium: every
main page (and the admin) carries the policy, Chromium reports no violation on any of them, the
stylesheet and the script (which replaced the inline ones) load and work.
"""

from __future__ import annotations

import pytest

from tests.console.conftest import CHROMIUM
from tests.factories import MembershipFactory, OrganizationFactory, ProjectFactory

pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed"),
    pytest.mark.django_db(transaction=True),
]

PASSWORD = "a-long-passphrase-42"

MAIN_PAGES = ["/console/", "/console/usage/", "/console/batches/", "/console/projects/",
              "/console/projects/{project}/keys/", "/console/members/", "/console/settings/",
              "/console/invoices/", "/console/invoices/upcoming/", "/console/plan-advice/",
              "/console/audit/", "/console/plan/", "/console/billing/",
              "/console/usage/?start=2026-10-01&through=2026-10-31&group=day&split=model",
              "/admin/", "/admin/accounts/organization/"]


@pytest.fixture
def staff_owner(transactional_db) -> dict[str, str]:
    """A staff user owning two organizations (so the console offers to switch)."""
    member = MembershipFactory(user__email="root@example.com",
                               organization=OrganizationFactory(name="First Org"))
    member.user.set_password(PASSWORD)
    member.user.is_staff = member.user.is_superuser = True
    member.user.save()
    MembershipFactory(user=member.user, organization=OrganizationFactory(name="Second Org"))
    project = ProjectFactory(organization=member.organization)
    return {"email": member.user.email, "project": project.public_id}


def _violations(page) -> list[str]:
    return page.evaluate("window.__cspViolations")


def test_main_pages_carry_the_policy_and_nothing_is_blocked(staff_owner, live_console, page):
    base = live_console.url

    # when the staff owner logs in through the console's login page
    login = page.goto(f"{base}/console/login/")
    assert "script-src 'self'" in login.headers["content-security-policy"]
    page.fill("#id_username", staff_owner["email"])
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url(f"{base}/console/")

    # then every main page answers with the policy, and Chromium blocked nothing on it
    for path in MAIN_PAGES:
        response = page.goto(base + path.format(project=staff_owner["project"]))
        assert response.status == 200, path
        policy = response.headers["content-security-policy"]
        assert "default-src 'self'" in policy and "frame-ancestors 'none'" in policy, path
        assert _violations(page) == [], path

    # and the stylesheet applies (the header is laid out by console.css)
    page.goto(f"{base}/console/")
    assert page.eval_on_selector("header", "e => getComputedStyle(e).display") == "flex"
    # and the script works: choosing the other organization switches to it at once
    page.select_option("select[name=org]", label="Second Org")
    page.wait_for_selector("h1:has-text('Second Org')")
    assert _violations(page) == []
