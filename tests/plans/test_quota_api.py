"""Limits and budgets through the management API: who may read and write, what is stored,
and that the gateway's policy reads it back."""

from __future__ import annotations

import pytest

from billing_platform.accounts.choices import Role
from billing_platform.audit.models import AuditEvent
from plans import admission, limits
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
    base = f"/api/v1/organizations/{org.public_id}"
    api_client.force_login(UserFactory(is_staff=True))  # the tier is staff's to set
    r = api_client.put(f"{base}/limits/", {"usage_tier": "tier-1"}, format="json")
    assert r.status_code == 200, r.content
    _member(api_client, org, Role.ADMIN)
    r = api_client.put(f"{base}/projects/{project.public_id}/limits/",
                       {"rpm": 100, "allowed_regions": ["eu-west"]}, format="json")
    assert r.status_code == 200, r.content
    r = api_client.put(f"{base}/projects/{project.public_id}/api_keys/{key.public_id}/limits/",
                       {"tpm": 1000}, format="json")
    assert r.status_code == 200, r.content
    overview = api_client.get(f"{base}/limits/").json()
    assert overview["effective"] == {"usage_tier": "tier-1", "rpm": 500, "tpm": 200_000}
    assert {row["scope"] for row in overview["data"]} == {"organization", "project", "key"}

    policy = admission.quota_policy_load(organization_id=org.id, project_id=project.id,
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


# --- customers cannot raise their own ceilings ---------------------------------------------------

def _org_row(org):
    from plans.models import QuotaLimit

    return QuotaLimit.objects.filter(organization=org, project__isnull=True,
                                     api_key__isnull=True).first()


def test_an_org_admin_cannot_set_its_own_usage_tier_but_staff_can(api_client):
    # given an admin of an org on the default tier
    org = OrganizationFactory()
    admin = _member(api_client, org, Role.ADMIN)
    url = f"/api/v1/organizations/{org.public_id}/limits/"
    # when the admin raises its own tier
    r = api_client.put(url, {"usage_tier": "tier-5"}, format="json")
    # then it is refused and nothing is stored
    assert r.status_code == 403, r.content
    assert r.json()["param"] == "usage_tier" and "staff" in r.json()["detail"]
    assert _org_row(org) is None
    assert api_client.get(url).json()["effective"]["usage_tier"] == limits.DEFAULT_USAGE_TIER

    # and staff (not a member) set it through the same endpoint
    staff = UserFactory(is_staff=True)
    api_client.force_login(staff)
    r = api_client.put(url, {"usage_tier": "tier-1"}, format="json")
    assert r.status_code == 200, r.content
    assert _org_row(org).usage_tier == "tier-1"

    # and the admin's later PUT of rpm keeps staff's tier (it cannot reset it either)
    api_client.force_login(admin)
    r = api_client.put(url, {"rpm": 100}, format="json")
    assert r.status_code == 200, r.content
    assert (_org_row(org).usage_tier, _org_row(org).rpm) == ("tier-1", 100)
    r = api_client.put(url, {"usage_tier": ""}, format="json")
    assert r.status_code == 403
    assert _org_row(org).usage_tier == "tier-1"
    audit = AuditEvent.objects.filter(organization=org, action="limits.set").order_by("id")
    assert [(e.actor_user_id, e.after["usage_tier"]) for e in audit] == [
        (staff.pk, "tier-1"), (admin.pk, "tier-1")]


def test_rpm_and_tpm_above_the_tier_ceiling_are_refused_with_a_drf_error(api_client):
    # given an org that staff put on tier-1 (500 RPM, 200,000 TPM)
    org = OrganizationFactory()
    project = ProjectFactory(organization=org)
    key, _ = make_key(project=project)
    limits.quota_limit_set(organization=org, usage_tier="tier-1")
    _member(api_client, org, Role.OWNER)
    base = f"/api/v1/organizations/{org.public_id}"
    # when the owner asks for more than the tier allows, at any scope
    for path, body, param in [
        (f"{base}/limits/", {"rpm": 501}, "rpm"),
        (f"{base}/limits/", {"tpm": 10**9}, "tpm"),
        (f"{base}/projects/{project.public_id}/limits/", {"rpm": 100_000}, "rpm"),
        (f"{base}/projects/{project.public_id}/api_keys/{key.public_id}/limits/",
         {"tpm": 200_001}, "tpm"),
    ]:
        r = api_client.put(path, body, format="json")
        # then each is a 400 naming the field and the ceiling
        assert r.status_code == 400, (path, r.content)
        assert r.json()["param"] == param
        assert "at most" in r.json()["detail"] and "tier-1" in r.json()["detail"]
    # and nothing was raised
    policy = admission.quota_policy_load(organization_id=org.id, project_id=project.id,
                                      key_id=key.id, model="m")
    assert dict(policy.rpm) == {f"o{org.id}": 500}
    assert dict(policy.tpm) == {f"o{org.id}": 200_000}
    # while limits at the ceiling are fine
    assert api_client.put(f"{base}/limits/", {"rpm": 500, "tpm": 150_000},
                          format="json").status_code == 200


def test_a_developer_cannot_delete_or_loosen_an_admins_key_limit(api_client):
    # given a developer's own key, limited by an admin to 10 RPM
    org = OrganizationFactory()
    project = ProjectFactory(organization=org)
    admin = UserFactory()
    MembershipFactory(user=admin, organization=org, role=Role.ADMIN)
    developer = _member(api_client, org, Role.DEVELOPER)
    url = f"/api/v1/organizations/{org.public_id}/projects/{project.public_id}/api_keys/"
    created = api_client.post(url, {"name": "mine", "scopes": ["inference"]}, format="json")
    assert created.status_code == 201, created.content
    limits = f"{url}{created.json()['id']}/limits/"
    api_client.force_login(admin)
    assert api_client.put(limits, {"rpm": 10}, format="json").status_code == 200
    # when the developer removes or raises it
    api_client.force_login(developer)
    deleted = api_client.delete(limits)
    raised = api_client.put(limits, {"rpm": 400}, format="json")
    # then both are refused and the admin's limit stands
    assert deleted.status_code == 403, deleted.content
    assert raised.status_code == 403, raised.content
    from plans.models import QuotaLimit

    row = QuotaLimit.objects.get(api_key__public_id=created.json()["id"])
    assert (row.rpm, row.set_by_role) == (10, Role.ADMIN)


def test_a_developer_manages_limits_of_its_own_keys_only(api_client):
    org = OrganizationFactory()
    project = ProjectFactory(organization=org)
    others_key, _ = make_key(project=project)
    _member(api_client, org, Role.DEVELOPER)
    base = f"/api/v1/organizations/{org.public_id}/projects/{project.public_id}/api_keys/"
    mine = api_client.post(base, {"name": "mine"}, format="json").json()["id"]
    # a limit on its own key: set, changed and removed
    assert api_client.put(f"{base}{mine}/limits/", {"rpm": 10}, format="json"
                          ).status_code == 200
    assert api_client.put(f"{base}{mine}/limits/", {"rpm": 20}, format="json"
                          ).status_code == 200
    assert api_client.delete(f"{base}{mine}/limits/").status_code == 204
    # but not on a key someone else made, nor on the project or the org
    assert api_client.put(f"{base}{others_key.public_id}/limits/", {"rpm": 1},
                          format="json").status_code == 403
    assert api_client.put(f"/api/v1/organizations/{org.public_id}/projects/"
                          f"{project.public_id}/limits/", {"rpm": 1},
                          format="json").status_code == 403
    assert api_client.put(f"/api/v1/organizations/{org.public_id}/limits/", {"rpm": 1},
                          format="json").status_code == 403
    actions = list(AuditEvent.objects.filter(organization=org, action__startswith="limits.")
                   .order_by("id").values_list("action", flat=True))
    assert actions == ["limits.set", "limits.set", "limits.delete"]
