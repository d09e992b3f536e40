"""The console's limits and budgets page: admins set them, viewers only look."""

from __future__ import annotations

from decimal import Decimal

import pytest

from billing_platform.accounts.choices import Role
from plans.models import Budget, QuotaLimit
from tests.factories import MembershipFactory, OrganizationFactory, ProjectFactory, UserFactory

pytestmark = pytest.mark.django_db


def _login(client, org, role):
    user = UserFactory()
    MembershipFactory(user=user, organization=org, role=role)
    client.force_login(user)


def test_admin_sets_a_project_budget_and_org_limits_on_the_settings_page(client):
    org = OrganizationFactory()
    project = ProjectFactory(organization=org, name="Search")
    _login(client, org, Role.ADMIN)

    page = client.get("/console/settings/")
    assert page.status_code == 200 and b"Usage tier" in page.content

    r = client.post("/console/settings/", {"kind": "budget", "scope": project.public_id,
                                           "amount": "12.50", "hard": "on",
                                           "alert_emails": "a@example.com, b@example.com"})
    assert r.status_code == 302
    budget = Budget.objects.get(project=project)
    assert budget.amount == Decimal("12.50") and budget.hard
    assert budget.alert_emails == ["a@example.com", "b@example.com"]

    r = client.post("/console/settings/", {"kind": "limits", "scope": "org",
                                           "usage_tier": "tier-5", "rpm": "120"})
    assert r.status_code == 302
    row = QuotaLimit.objects.get(organization=org, project__isnull=True, api_key__isnull=True)
    # the tier is Tollgate staff's to set: the page offers none and a posted one is ignored
    assert (row.usage_tier, row.rpm, row.tpm) == ("", 120, None)

    r = client.post("/console/settings/", {"kind": "limits", "scope": "org", "rpm": "999999"},
                    follow=True)
    assert "may be at most 5,000" in r.content.decode()
    row.refresh_from_db()
    assert row.rpm == 120

    page = client.get("/console/settings/").content.decode()
    assert "Project Search" in page and "12.50 USD" in page and "hard" in page
    assert "limits.set" in page and "budget.set" in page


def test_a_viewer_sees_the_page_but_cannot_change_anything(client):
    org = OrganizationFactory()
    _login(client, org, Role.VIEWER)
    page = client.get("/console/settings/")
    assert page.status_code == 200 and b"budget-form" not in page.content
    client.post("/console/settings/", {"kind": "budget", "scope": "org", "amount": "5"})
    assert not Budget.objects.filter(organization=org).exists()
