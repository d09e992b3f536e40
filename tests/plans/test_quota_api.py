"""Limits and budgets through the management API: who may read and write, what is stored,
and that the gateway's policy reads it back."""

from __future__ import annotations

import pytest

from billing_platform.accounts.choices import Role
from billing_platform.audit.models import AuditEvent
from plans import quotas
from tests.factories import (
    MembershipFactory,
    OrganizationFactory,
    ProjectFactory,
    UserFactory,
    make_key,
)

pytestmark = pytest.mark.django_db


def _member(api_client, org, role):
    user = UserFactory()
    MembershipFactory(user=user, organization=org, role=role)
    api_client.force_login(user)
    return user


def test_admin_sets_org_project_and_key_limits_and_the_policy_reflects_them(api_client):
    org = OrganizationFactory()
    project = ProjectFactory(organization=org)
    key, _secret = make_key(project=project, scopes=["inference"])
    _member(api_client, org, Role.ADMIN)
    base = f"/api/v1/organizations/{org.public_id}"

    r = api_client.put(f"{base}/limits/", {"usage_tier": "tier-1"}, format="json")
    assert r.status_code == 200, r.content
    r = api_client.put(f"{base}/projects/{project.public_id}/limits/",
                       {"rpm": 100, "allowed_regions": ["eu-west"]}, format="json")
    assert r.status_code == 200, r.content
    r = api_client.put(f"{base}/projects/{project.public_id}/api_keys/{key.public_id}/limits/",
                       {"tpm": 1000}, format="json")
    assert r.status_code == 200, r.content
    overview = api_client.get(f"{base}/limits/").json()
    assert overview["effective"] == {"usage_tier": "tier-1", "rpm": 500, "tpm": 200_000}
    assert {row["scope"] for row in overview["data"]} == {"organization", "project", "key"}

    policy = quotas.quota_policy_load(organization_id=org.id, project_id=project.id,
                                      key_id=key.id, model="m")
    assert dict(policy.rpm) == {f"o{org.id}": 500, f"p{project.id}": 100}
    assert dict(policy.tpm) == {f"o{org.id}": 200_000, f"k{key.id}": 1000}
    assert policy.allowed_regions == frozenset({"eu-west"})
    assert AuditEvent.objects.filter(organization=org, action="limits.set").count() == 3


def test_budget_api_roles_secret_and_404_for_strangers(api_client):
    org = OrganizationFactory()
    project = ProjectFactory(organization=org)
    base = f"/api/v1/organizations/{org.public_id}"
    _member(api_client, org, Role.ADMIN)
    r = api_client.put(f"{base}/projects/{project.public_id}/budget/",
                       {"amount": "25.00", "hard": True, "webhook_url": "https://h.example/x"},
                       format="json")
    assert r.status_code == 200, r.content
    body = r.json()
    assert body["scope"] == "project" and body["amount"] == "25.0000000000"
    assert body["thresholds"] == [50, 80, 100] and body["webhook_secret"].startswith("whsec_")
    assert body["spend"] == "0" and body["suspended"] is False

    _member(api_client, org, Role.VIEWER)
    seen = api_client.get(f"{base}/projects/{project.public_id}/budget/")
    assert seen.status_code == 200 and "webhook_secret" not in seen.json()
    assert api_client.put(f"{base}/budget/", {"amount": "1"}, format="json").status_code == 403
    assert api_client.get(f"{base}/budget/").status_code == 404  # no org budget yet

    _member(api_client, OrganizationFactory(), Role.OWNER)  # a stranger
    assert api_client.get(f"{base}/limits/").status_code == 404
    assert api_client.put(f"{base}/budget/", {"amount": "1"}, format="json").status_code == 404


def test_invalid_budget_and_tier_are_rejected(api_client):
    org = OrganizationFactory()
    _member(api_client, org, Role.OWNER)
    base = f"/api/v1/organizations/{org.public_id}"
    assert api_client.put(f"{base}/budget/", {"amount": "-1"}, format="json").status_code == 400
    r = api_client.put(f"{base}/limits/", {"usage_tier": "tier-99"}, format="json")
    assert r.status_code == 400 and r.json()["param"] == "usage_tier"
