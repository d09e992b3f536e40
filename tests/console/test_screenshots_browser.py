"""Every console page the other browser tests do not already photograph, in a real headless
Chromium under the console's CSP: a screenshot of each at desktop and phone widths (for a reader
to look at, in tests/console/screenshots/), and none wider than the phone (no sideways scroll).
The dashboard, usage explorer, plan, billing, reservations, alerts and residency pages are shot
by their own tests."""

from __future__ import annotations

import pytest

from billing_platform.accounts.choices import Role
from tests.console.browser import (
    BROWSER_MARKS,
    member_who_signs_in,
    open_october_invoice,
    shoot,
    sign_in,
)
from tests.factories import ProjectFactory, make_key

pytestmark = BROWSER_MARKS

EMAIL = "pages@example.com"


@pytest.fixture
def world():
    """An owner of an organization with an invoice (October's, open), a project with a key,
    and a second member. Made before the browser starts."""
    invoice = open_october_invoice("Pages Co")
    org = invoice.organization
    member_who_signs_in(EMAIL, organization=org, role=Role.OWNER)
    member_who_signs_in("dev@example.com", organization=org, role=Role.DEVELOPER)
    project = ProjectFactory(organization=org, name="Mobile app")
    make_key(project, name="ios-release")
    return {"invoice": invoice.public_id, "project": project.public_id}


def test_every_page_fits_a_phone_and_is_photographed(world, live_console, page):
    base = live_console.url
    page.goto(f"{base}/console/signup/")
    shoot(page, "signup", "#id_email")
    page.goto(f"{base}/console/login/")
    shoot(page, "login", "#id_username")
    sign_in(page, base, EMAIL)
    pages = {
        "projects": "/console/projects/",
        "api-keys": f"/console/projects/{world['project']}/keys/",
        "members": "/console/members/",
        "settings": "/console/settings/",
        "invoices": "/console/invoices/",
        "invoice": f"/console/invoices/{world['invoice']}/",
        "plan-advice": "/console/plan-advice/",
        "batches": "/console/batches/",
        "audit": "/console/audit/",
    }
    for name, path in pages.items():
        response = page.goto(f"{base}{path}")
        assert response is not None and response.status == 200, (name, response)
        assert page.url == f"{base}{path}", name  # not sent elsewhere (no permission, no org)
        shoot(page, name, "body")
