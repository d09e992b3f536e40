"""Management API: tenancy isolation (404 across orgs), role rules, keys, members, schema."""

from __future__ import annotations

import pytest
from django.core import mail

from billing_platform.accounts.choices import Role
from billing_platform.accounts.models import ApiKey, Membership
from tests.factories import MembershipFactory, ProjectFactory, UserFactory, make_key

pytestmark = pytest.mark.django_db(transaction=True)


def _member(role: str, org=None) -> Membership:
    kwargs = {"organization": org} if org else {}
    return MembershipFactory(role=role, **kwargs)


def _login(client, membership: Membership):
    client.force_login(membership.user)
    return membership.organization.public_id


def test_key_of_org_a_can_read_nothing_of_org_b(api_client):
    # given an admin key of org A and the objects of org B
    _key_a, secret_a = make_key(scopes=["admin"])
    owner_b = _member(Role.OWNER)
    project_b = ProjectFactory(organization=owner_b.organization)
    key_b, _ = make_key(project=project_b)
    org_b = owner_b.organization.public_id
    api_client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret_a}")
    # then every path into org B answers 404, exactly like a path that does not exist
    paths = [
        f"/api/v1/organizations/{org_b}/",
        f"/api/v1/organizations/{org_b}/projects/",
        f"/api/v1/organizations/{org_b}/projects/{project_b.public_id}/",
        f"/api/v1/organizations/{org_b}/projects/{project_b.public_id}/api_keys/",
        f"/api/v1/organizations/{org_b}/projects/{project_b.public_id}/api_keys/"
        f"{key_b.public_id}/",
        f"/api/v1/organizations/{org_b}/members/",
        "/api/v1/organizations/org_doesnotexist/",
    ]
    for path in paths:
        assert api_client.get(path).status_code == 404, path
    revoke = (f"/api/v1/organizations/{org_b}/projects/{project_b.public_id}/api_keys/"
              f"{key_b.public_id}/revoke/")
    assert api_client.post(revoke).status_code == 404
    assert ApiKey.objects.get(pk=key_b.pk).revoked_at is None
    # and the org list shows only org A
    listed = api_client.get("/api/v1/organizations/").json()["data"]
    assert [o["id"] for o in listed] != [org_b]
    assert len(listed) == 1


def test_project_of_another_org_is_404_even_under_your_own_org(api_client):
    mine = _member(Role.OWNER)
    theirs = ProjectFactory()
    org = _login(api_client, mine)
    response = api_client.get(f"/api/v1/organizations/{org}/projects/{theirs.public_id}/api_keys/")
    assert response.status_code == 404


def test_key_without_admin_scope_is_forbidden_on_management_api(api_client):
    key, secret = make_key(scopes=["inference"])
    api_client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    response = api_client.get(f"/api/v1/organizations/{key.organization.public_id}/projects/")
    assert response.status_code == 403
    assert "admin" in response.json()["detail"]


def test_viewer_cannot_create_keys_but_developer_can(api_client):
    viewer = _member(Role.VIEWER)
    org = viewer.organization
    project = org.projects.create(name="p")
    url = f"/api/v1/organizations/{org.public_id}/projects/{project.public_id}/api_keys/"
    _login(api_client, viewer)
    response = api_client.post(url, {"name": "nope"}, format="json")
    assert response.status_code == 403
    assert not ApiKey.objects.exists()
    assert api_client.get(url).status_code == 200  # a viewer may still read

    developer = _member(Role.DEVELOPER, org=org)
    _login(api_client, developer)
    response = api_client.post(url, {"name": "ci", "scopes": ["inference", "batch"]},
                               format="json")
    assert response.status_code == 201
    body = response.json()
    assert body["secret"].startswith(f"tg-{body['prefix']}_")
    # the secret is in the create response only
    listed = api_client.get(url).json()["data"]
    assert listed[0]["id"] == body["id"]
    assert "secret" not in listed[0]
    assert body["secret"] not in str(listed)


def test_developer_cannot_change_members_and_admin_cannot_make_owners(api_client):
    owner = _member(Role.OWNER)
    org = owner.organization
    developer = _member(Role.DEVELOPER, org=org)
    admin = _member(Role.ADMIN, org=org)
    base = f"/api/v1/organizations/{org.public_id}/members/"

    _login(api_client, developer)
    assert api_client.patch(f"{base}{admin.pk}/", {"role": "viewer"}, format="json"
                            ).status_code == 403
    assert api_client.post(base, {"email": "x@example.com"}, format="json").status_code == 403
    assert api_client.get(base).status_code == 200

    _login(api_client, admin)
    response = api_client.patch(f"{base}{developer.pk}/", {"role": "owner"}, format="json")
    assert response.status_code == 403
    response = api_client.patch(f"{base}{developer.pk}/", {"role": "finance"}, format="json")
    assert response.status_code == 200
    assert response.json()["role"] == "finance"
    developer.refresh_from_db()
    assert developer.role == Role.FINANCE


def test_last_owner_cannot_be_demoted(api_client):
    owner = _member(Role.OWNER)
    org = _login(api_client, owner)
    response = api_client.patch(f"/api/v1/organizations/{org}/members/{owner.pk}/",
                                {"role": "admin"}, format="json")
    assert response.status_code == 409
    assert "at least one owner" in response.json()["detail"]


def test_invite_emails_a_link_that_adds_the_member(api_client, client):
    owner = _member(Role.OWNER)
    org = _login(api_client, owner)
    response = api_client.post(f"/api/v1/organizations/{org}/members/",
                               {"email": "New.Person@Example.com", "role": "developer"},
                               format="json")
    assert response.status_code == 201
    assert len(mail.outbox) == 1
    assert mail.outbox[0].to == ["new.person@example.com"]
    link = next(w for w in mail.outbox[0].body.split() if "/console/invitations/" in w)
    path = link[link.index("/console/"):]
    invitee = UserFactory(email="new.person@example.com")
    client.force_login(invitee)
    assert client.post(path).status_code == 302
    assert Membership.objects.get(user=invitee, organization__public_id=org).role == "developer"
    assert client.post(path).status_code == 302  # a used invitation does nothing more
    assert Membership.objects.filter(user=invitee).count() == 1


def test_projects_crud_and_archive_revokes_keys(api_client):
    owner = _member(Role.OWNER)
    org = _login(api_client, owner)
    base = f"/api/v1/organizations/{org}/projects/"
    created = api_client.post(base, {"name": "Search"}, format="json")
    assert created.status_code == 201
    pid = created.json()["id"]
    assert api_client.patch(f"{base}{pid}/", {"name": "Search v2"}, format="json"
                            ).json()["name"] == "Search v2"
    assert api_client.post(base, {"name": ""}, format="json").status_code == 400
    key = api_client.post(f"{base}{pid}/api_keys/", {"name": "k"}, format="json").json()
    archived = api_client.delete(f"{base}{pid}/")
    assert archived.json()["status"] == "archived"
    assert ApiKey.objects.get(public_id=key["id"]).revoked_at is not None


def test_bad_key_body_gets_drf_errors_with_field_names(api_client):
    owner = _member(Role.OWNER)
    org = _login(api_client, owner)
    project = owner.organization.projects.create(name="p")
    url = f"/api/v1/organizations/{org}/projects/{project.public_id}/api_keys/"
    response = api_client.post(url, {"name": "k", "scopes": ["root"]}, format="json")
    assert response.status_code == 400
    assert "scopes" in response.json()


def test_unauthenticated_requests_are_refused(api_client):
    assert api_client.get("/api/v1/organizations/").status_code in (401, 403)
    api_client.credentials(HTTP_AUTHORIZATION="Bearer tg-aaaaaaaaaaaa_" + "x" * 43)
    assert api_client.get("/api/v1/organizations/").status_code == 401


def test_openapi_schema_validates(api_client):
    from openapi_spec_validator import validate

    response = api_client.get("/api/v1/schema/", {"format": "json"})
    assert response.status_code == 200
    schema = response.json()
    validate(schema)
    assert "/api/v1/organizations/{org_id}/projects/{project_id}/api_keys/" in schema["paths"]
    assert api_client.get("/api/v1/docs/").status_code == 200


def test_metrics_endpoint_serves_prometheus_text(client):
    response = client.get("/metrics")
    assert response.status_code == 200
    assert b"django_http_requests_total_by_method" in response.content
