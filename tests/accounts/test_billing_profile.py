"""The billing profile: owners set who they are, the platform's finance team also how they are
billed, through /api/v1 and the console settings page; every change is audited.

Hostile: an admin, a developer or an admin-scoped key changes nothing; an owner cannot set the
tax rate or currency; another organization's profile is a 404; malformed or oversized input is
a 400 in DRF's shape; after each refusal nothing has changed and no audit row was written.
"""

from __future__ import annotations

from decimal import Decimal

import pytest
from rest_framework.test import APIClient

from billing_platform.accounts.choices import Role
from billing_platform.accounts.models import Organization
from billing_platform.audit.models import AuditEvent
from billing_platform.finance.permissions import ANALYST_GROUP, CONTROLLER_GROUP
from tests.factories import MembershipFactory, UserFactory, make_key, make_price_book
from tests.finance.conftest import finance_user

ADDRESS = {"legal_name": "Acme Research GmbH", "address_line1": "Invalidenstr. 117",
           "postal_code": "10115", "city": "Berlin", "country": "de",
           "tax_id": "de 123456789", "billing_email": "ap@acme.example"}


def _url(org: Organization) -> str:
    return f"/api/v1/organizations/{org.public_id}/billing-profile/"


def _as(user) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client


def _member(role: str, org: Organization | None = None):
    membership = MembershipFactory(role=role, **({"organization": org} if org else {}))
    return membership.user, membership.organization


def _profile(org: Organization) -> dict[str, str]:
    org.refresh_from_db()
    return {f: str(getattr(org, f)) for f in (*ADDRESS, "address_line2", "region", "currency",
                                             "tax_rate")}


def test_an_owner_sets_who_they_are_and_the_change_is_audited(db):
    owner, org = _member(Role.OWNER)

    response = _as(owner).patch(_url(org), ADDRESS, format="json")

    assert response.status_code == 200, response.content
    body = response.json()
    assert body["object"] == "billing_profile" and body["organization"] == org.public_id
    assert (body["country"], body["tax_id"], body["city"]) == ("DE", "DE 123456789", "Berlin")
    assert "tax_rate" not in body["editable"] and "legal_name" in body["editable"]
    org.refresh_from_db()
    assert (org.legal_name, org.address_line1, org.billing_email) == (
        "Acme Research GmbH", "Invalidenstr. 117", "ap@acme.example")
    (row,) = AuditEvent.objects.filter(action="organization.update", organization_id=org.pk)
    assert row.actor_user_id == owner.pk
    assert row.before["legal_name"] == "" and row.after["legal_name"] == "Acme Research GmbH"
    assert set(row.after) == set(ADDRESS)  # only what changed
    assert _as(owner).get(_url(org)).json()["tax_id"] == "DE 123456789"


@pytest.mark.parametrize("field", [{"tax_rate": "0.19"}, {"currency": "EUR"}])
def test_an_owner_cannot_set_tax_rate_or_currency(db, field):
    make_price_book(currency="EUR")
    owner, org = _member(Role.OWNER)
    before = _profile(org)

    response = _as(owner).patch(_url(org), {**field, "legal_name": "Sneaky Ltd"}, format="json")

    assert response.status_code == 403
    assert response.json()["param"] == next(iter(field))
    assert _profile(org) == before
    assert not AuditEvent.objects.filter(action="organization.update").exists()


@pytest.mark.parametrize("role", [Role.ADMIN, Role.DEVELOPER, Role.FINANCE, Role.VIEWER])
def test_other_roles_of_the_org_change_nothing(db, role):
    _, org = _member(Role.OWNER)
    user, _ = _member(role, org)
    before = _profile(org)

    response = _as(user).patch(_url(org), {"legal_name": "Mine now"}, format="json")

    assert response.status_code == 403
    assert _profile(org) == before
    assert not AuditEvent.objects.filter(action="organization.update").exists()


def test_an_admin_scoped_key_of_an_owner_changes_nothing(db):
    owner, org = _member(Role.OWNER)
    _, secret = make_key(project=org.projects.create(name="p"), scopes=["admin"],
                         acting_user=owner)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    before = _profile(org)

    assert client.get(_url(org)).status_code == 200  # a key acts as admin at most: reads
    assert client.patch(_url(org), {"legal_name": "Key Ltd"}, format="json").status_code == 403
    assert _profile(org) == before


def test_another_orgs_profile_is_not_found(db):
    owner, _ = _member(Role.OWNER)
    _, theirs = _member(Role.OWNER)
    analyst = finance_user(ANALYST_GROUP)  # reads reports, operates nothing
    before = _profile(theirs)

    for client in (_as(owner), _as(analyst)):
        assert client.get(_url(theirs)).status_code == 404
        assert client.patch(_url(theirs), {"legal_name": "x"}, format="json").status_code == 404
    missing = _as(owner).patch("/api/v1/organizations/org_nope/billing-profile/",
                               {"legal_name": "x"}, format="json")
    assert missing.status_code == 404
    assert _profile(theirs) == before


@pytest.mark.parametrize("who", ["controller", "staff"])
def test_platform_finance_sets_tax_rate_and_currency_of_any_org(db, who):
    make_price_book(currency="EUR")
    _, org = _member(Role.OWNER)
    user = (finance_user(CONTROLLER_GROUP) if who == "controller"
            else UserFactory(is_staff=True))

    response = _as(user).patch(_url(org), {"tax_rate": "0.19", "currency": "eur",
                                           "tax_id": "DE987654321"}, format="json")

    assert response.status_code == 200, response.content
    assert "tax_rate" in response.json()["editable"]
    org.refresh_from_db()
    assert (org.tax_rate, org.currency, org.tax_id) == (Decimal("0.19"), "EUR", "DE987654321")
    (row,) = AuditEvent.objects.filter(action="organization.update", organization_id=org.pk)
    assert row.actor_user_id == user.pk
    assert (row.before["tax_rate"], row.after["tax_rate"]) == ("0.0000", "0.1900")
    assert (row.before["currency"], row.after["currency"]) == ("USD", "EUR")


@pytest.mark.parametrize(("body", "param"), [
    ({"legal_name": "x" * 201}, "legal_name"),
    ({"legal_name": "x" * 1_000_000}, "legal_name"),
    ({"address_line1": "line one\nline two"}, "address_line1"),
    ({"country": "Germany"}, "country"),
    ({"country": "D1"}, "country"),
    ({"tax_id": "<script>alert(1)</script>"}, "tax_id"),
    ({"postal_code": "10115;DROP"}, "postal_code"),
    ({"billing_email": "not-an-email"}, "billing_email"),
    ({"billing_email": ""}, "billing_email"),
    ({"tax_rate": "1.5"}, "tax_rate"),
    ({"tax_rate": "-0.1"}, "tax_rate"),
    ({"tax_rate": "0.123456"}, "tax_rate"),
    ({"tax_rate": "NaN"}, "tax_rate"),
    ({"tax_rate": "abc"}, "tax_rate"),
    ({"currency": "XYZ"}, "currency"),
    ({"currency": "EURO"}, "currency"),
    ({"status": "active"}, "status"),
    ({"legal_name": ["a", "list"]}, "legal_name"),
])
def test_malformed_or_oversized_input_is_a_400_and_changes_nothing(db, body, param):
    _, org = _member(Role.OWNER)
    controller = finance_user(CONTROLLER_GROUP)  # may set every field
    before = _profile(org)

    response = _as(controller).patch(_url(org), {**body, "city": "Paris"}, format="json")

    assert response.status_code == 400, response.content
    error = response.json()
    assert param in error or error.get("param") == param, error
    assert _profile(org) == before
    assert not AuditEvent.objects.filter(action="organization.update").exists()


def test_a_body_that_is_not_an_object_is_a_400(db):
    owner, org = _member(Role.OWNER)
    for body in ([], "legal_name"):
        response = _as(owner).patch(_url(org), body, format="json")
        assert response.status_code == 400


def test_the_org_endpoint_no_longer_lets_an_admin_change_the_billing_email(db):
    _, org = _member(Role.OWNER)
    admin, _ = _member(Role.ADMIN, org)
    before = org.billing_email
    response = _as(admin).patch(f"/api/v1/organizations/{org.public_id}/",
                                {"name": "Renamed", "billing_email": "me@evil.example"},
                                format="json")
    assert response.status_code == 200  # the name is the admin's to change
    org.refresh_from_db()
    assert (org.name, org.billing_email) == ("Renamed", before)


# --- console ----------------------------------------------------------------------------

def test_an_owner_saves_the_profile_in_the_console_settings(db, client):
    owner, org = _member(Role.OWNER)
    client.force_login(owner)
    page = client.get("/console/settings/").content.decode()
    assert 'id="billing-profile-form"' in page and 'name="tax_id"' in page
    assert 'name="tax_rate"' not in page  # not the owner's to set

    response = client.post("/console/settings/billing-profile/", ADDRESS, follow=True)

    assert "Billing profile saved." in response.content.decode()
    org.refresh_from_db()
    assert (org.legal_name, org.country, org.tax_id) == ("Acme Research GmbH", "DE",
                                                         "DE 123456789")
    assert AuditEvent.objects.filter(action="organization.update",
                                     actor_user_id=owner.pk).count() == 1


@pytest.mark.parametrize(("role", "body", "message"), [
    (Role.ADMIN, {"legal_name": "Admin Ltd"}, "owners"),
    (Role.OWNER, {"tax_rate": "0.5"}, "finance team"),
    (Role.OWNER, {"country": "Deutschland"}, "country"),
])
def test_the_console_refuses_what_the_role_may_not_set(db, client, role, body, message):
    _, org = _member(Role.OWNER)
    user, _ = _member(role, org) if role != Role.OWNER else (org.memberships.get().user, org)
    client.force_login(user)
    before = _profile(org)
    if role == Role.ADMIN:
        assert 'id="billing-profile-form"' not in client.get("/console/settings/").content.decode()

    response = client.post("/console/settings/billing-profile/", body, follow=True)

    assert message in response.content.decode()
    assert _profile(org) == before
    assert not AuditEvent.objects.filter(action="organization.update").exists()
