"""Every privileged action the issue lists leaves its audit row, through the real /api/v1.

Customers (owners and admins) and staff act through the management API as a client would;
each action is then found, once, with its actor, organization and target, in the log its
readers see: the organization's log for its owner, the platform log for staff. A row is
written in the action's own transaction, so an action that fails leaves none.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import DatabaseError, connection
from django.utils import timezone

from billing_platform.accounts.choices import Role
from billing_platform.audit.models import AuditEvent
from plans.models import Budget
from tests.factories import MembershipFactory, ProjectFactory, UserFactory, make_price_book


def _org_log(api_client, org, user) -> dict[str, list[tuple[str, str]]]:
    """The org's audit log as its owner reads it: action -> [(actor label, target)]."""
    api_client.force_login(user)
    reply = api_client.get(f"/api/v1/organizations/{org.public_id}/audit_log/",
                           {"limit": 500})
    assert reply.status_code == 200, reply.content
    out: dict[str, list[tuple[str, str]]] = {}
    for row in reply.json()["data"]:
        assert row["organization"] == org.public_id
        out.setdefault(row["action"], []).append((row["actor"]["label"], row["target"]))
    return out


@pytest.mark.django_db
def test_members_keys_zone_limits_and_budgets_changed_through_the_api_are_each_one_row(
        api_client):
    # given an org with an owner, an admin and a developer
    owner = MembershipFactory(role=Role.OWNER)
    org = owner.organization
    admin = MembershipFactory(organization=org, role=Role.ADMIN)
    developer = MembershipFactory(organization=org, role=Role.DEVELOPER)
    project = ProjectFactory(organization=org)
    base = f"/api/v1/organizations/{org.public_id}"
    keys = f"{base}/projects/{project.public_id}/api_keys/"

    # when the owner and the admin do each privileged thing an org's members can do
    api_client.force_login(owner.user)
    steps = [
        api_client.patch(f"{base}/", {"data_zone": "eu"}, format="json"),
        api_client.post(f"{base}/members/", {"email": "new@x.example", "role": "viewer"},
                        format="json"),
        api_client.patch(f"{base}/members/{developer.pk}/", {"role": "viewer"}, format="json"),
        api_client.put(f"{base}/budget/", {"amount": "25.00"}, format="json"),
    ]
    api_client.force_login(admin.user)
    key = api_client.post(keys, {"name": "ci", "scopes": ["inference"]}, format="json")
    steps += [
        key,
        api_client.put(f"{base}/projects/{project.public_id}/limits/", {"rpm": 100},
                       format="json"),
        api_client.post(f"{keys}{key.json()['id']}/revoke/"),
        api_client.delete(f"{base}/budget/"),
        api_client.delete(f"{base}/members/{developer.pk}/"),
    ]
    assert [r.status_code for r in steps] == [200, 201, 200, 200, 201, 200, 200, 204, 204], [
        r.content for r in steps]

    # then the owner's view of the log holds each, once, by who did it, on what it acted
    budget_id = AuditEvent.objects.get(action="budget.set").target
    o, a = owner.user.email, admin.user.email
    log = _org_log(api_client, org, owner.user)
    assert log == {
        "organization.update": [(o, org.public_id)],
        "member.invite": [(o, "new@x.example")],
        "member.role_set": [(o, developer.user.email)],
        "member.remove": [(a, developer.user.email)],
        "budget.set": [(o, budget_id)],
        "budget.delete": [(a, budget_id)],
        "api_key.create": [(a, key.json()["id"])],
        "api_key.revoke": [(a, key.json()["id"])],
        "limits.set": [(a, project.public_id)],
    }
    zone = AuditEvent.objects.get(action="organization.update")
    assert (zone.before, zone.after) == ({"data_zone": "global"}, {"data_zone": "eu"})


@pytest.mark.django_db
def test_staff_catalogue_and_customer_holdings_changes_are_each_one_row(api_client):
    # given an org and a staff member
    owner = MembershipFactory(role=Role.OWNER)
    org = owner.organization
    make_price_book(code="base-usd", prices=[{"model": "m", "input": "1.00", "output": "2.00"}])
    staff = UserFactory(is_staff=True)
    api_client.force_login(staff)
    base = f"/api/v1/organizations/{org.public_id}"
    tomorrow = (timezone.now() + timedelta(days=1)).replace(microsecond=0)

    # when staff change the catalogue and what the org holds
    steps = [
        api_client.post("/api/v1/price_books/", {"code": "eu-book", "name": "EU",
                                                  "currency": "EUR"}, format="json"),
        api_client.post("/api/v1/price_books/base-usd/versions/", {
            "effective_from": tomorrow.isoformat(),
            "prices": [{"model": "m", "input": "1.50", "output": "3.00"}]}, format="json"),
        api_client.post("/api/v1/plans/", {"code": "team", "name": "Team", "kind": "on_demand",
                                           "currency": "USD", "monthly_fee": "20.00"},
                        format="json"),
        api_client.post("/api/v1/provisioned_offerings/", {
            "code": "m-units", "name": "m units", "model": "m", "region": "us-east",
            "currency": "USD", "tokens_per_minute_per_unit": 1000,
            "hourly_unit_price": "1.00", "monthly_unit_price": "500.00"}, format="json"),
    ]
    steps += [
        api_client.post(f"{base}/subscriptions/", {"plan": "team"}, format="json"),
        api_client.post(f"{base}/reservations/", {"offering": "m-units", "units": 2,
                                                  "term": "monthly"}, format="json"),
        api_client.post(f"{base}/credit_grants/", {"kind": "promotional", "amount": "5.00"},
                        format="json"),
    ]
    assert [r.status_code for r in steps] == [201] * 7, [r.content for r in steps]
    reservation = steps[5].json()["id"]
    patched = api_client.patch(f"{base}/reservations/{reservation}/",
                               {"overflow_policy": "reject"}, format="json")
    assert patched.status_code == 200, patched.content

    # then the catalogue changes are in the platform log (they belong to no org) ...
    reply = api_client.get("/api/v1/audit_log/", {"actor": staff.email, "limit": 500})
    assert reply.status_code == 200, reply.content
    platform = {(r["action"], r["organization"]) for r in reply.json()["data"]}
    assert {("price_book.create", None), ("price_version.create", None),
            ("plan.create", None), ("provisioned_offering.create", None)} <= platform
    # ... and the org's owner sees each change to what it holds, once, by the staff member
    log = _org_log(api_client, org, owner.user)
    for action in ("subscription.create", "reservation.create", "reservation.update",
                   "credit_grant.create"):
        assert [label for label, _target in log.get(action, [])] == [staff.email], (action, log)
    assert log["reservation.update"][0][1] == reservation


@pytest.fixture
def budget_deletes_fail(transactional_db):
    """Make PostgreSQL refuse every deletion of a budget (an action failing half-way)."""
    table = Budget._meta.db_table
    with connection.cursor() as cur:
        cur.execute("CREATE FUNCTION h1_refuse() RETURNS trigger AS $$ BEGIN "
                    "RAISE EXCEPTION 'refused by the test'; END $$ LANGUAGE plpgsql")
        cur.execute(f"CREATE TRIGGER h1_refuse BEFORE DELETE ON {table} "
                    "FOR EACH ROW EXECUTE FUNCTION h1_refuse()")
    try:
        yield
    finally:
        with connection.cursor() as cur:
            cur.execute(f"DROP TRIGGER h1_refuse ON {table}")
            cur.execute("DROP FUNCTION h1_refuse()")


@pytest.mark.django_db(transaction=True)
def test_a_budget_deletion_that_fails_leaves_no_audit_row(api_client, budget_deletes_fail):
    # given an owner's budget
    owner = MembershipFactory(role=Role.OWNER)
    org = owner.organization
    api_client.force_login(owner.user)
    url = f"/api/v1/organizations/{org.public_id}/budget/"
    assert api_client.put(url, {"amount": "25.00"}, format="json").status_code == 200

    # when its deletion fails in PostgreSQL
    with pytest.raises(DatabaseError):
        api_client.delete(url)

    # then the budget is still there and the log does not claim it was deleted
    assert Budget.objects.filter(organization=org).exists()
    assert not AuditEvent.objects.filter(organization=org, action="budget.delete").exists()
    assert AuditEvent.objects.filter(organization=org, action="budget.set").count() == 1
