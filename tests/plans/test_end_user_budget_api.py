"""Per-end-user budgets through the management API (issue 20 item 4): who may read and write
them, what is stored and audited, that the gateway's policy reads them back, and the hostile
tenant's ids and bodies refused in DRF's shape with nothing written."""

from __future__ import annotations

from decimal import Decimal

import pytest

from billing_platform.accounts.choices import Role
from billing_platform.audit.models import AuditEvent
from plans import admission
from plans.models import EndUserBudget
from tests.factories import OrganizationFactory, ProjectFactory, make_key
from tests.plans.test_quota_api import _member

pytestmark = pytest.mark.django_db


def _url(org, budget_id: str | None = None) -> str:
    base = f"/api/v1/organizations/{org.public_id}/end_user_budgets/"
    return base if budget_id is None else f"{base}{budget_id}/"


def test_admin_sets_a_default_and_named_budgets_and_the_policy_reads_them(api_client):
    org = OrganizationFactory()
    project = ProjectFactory(organization=org)
    key, _secret = make_key(project=project, scopes=["inference"])
    admin = _member(api_client, org, Role.ADMIN)

    default = api_client.put(_url(org), {"end_user": None, "amount": "2.50"}, format="json")
    assert default.status_code == 200, default.content
    assert default.json()["end_user"] is None and default.json()["spend"] is None
    for user, amount in (("alice@example.com", "10"), ("zoë-42", "1.25")):
        named = api_client.put(_url(org), {"end_user": user, "amount": amount}, format="json")
        assert named.status_code == 200, named.content
        assert named.json()["spend"] == "0" and named.json()["currency"] == org.currency
    # PUT again: the same end user's budget is replaced, not duplicated
    again = api_client.put(_url(org), {"end_user": "zoë-42", "amount": "3"}, format="json")
    assert again.json()["id"] == named.json()["id"]
    assert EndUserBudget.objects.filter(organization=org).count() == 3

    listed = api_client.get(_url(org)).json()
    assert [(b["end_user"], Decimal(b["amount"])) for b in listed["data"]] == [
        (None, Decimal("2.5")), ("alice@example.com", Decimal("10")), ("zoë-42", Decimal("3"))]
    page = api_client.get(_url(org), {"limit": 2}).json()
    assert len(page["data"]) == 2 and page["has_more"]
    rest = api_client.get(_url(org), {"limit": 2, "after": page["last_id"]}).json()
    assert [b["end_user"] for b in rest["data"]] == ["zoë-42"] and not rest["has_more"]
    one = api_client.get(_url(org), {"end_user": "alice@example.com"}).json()["data"]
    assert [b["end_user"] for b in one] == ["alice@example.com"]

    policy = admission.quota_policy_load(organization_id=org.id, project_id=project.id,
                                         key_id=key.id, model="m")
    assert policy.end_user_limit("alice@example.com").limit == Decimal("10")
    assert policy.end_user_limit("someone-else").limit == Decimal("2.5")  # the default
    assert policy.end_user_limit(None) is None  # a request naming no end user

    gone = api_client.delete(_url(org, one[0]["id"]))
    assert gone.status_code == 204
    assert api_client.get(_url(org, one[0]["id"])).status_code == 404
    audit = AuditEvent.objects.filter(organization=org, action__startswith="end_user_budget")
    assert sorted(a.action for a in audit) == ["end_user_budget.delete"] + [
        "end_user_budget.set"] * 4
    assert {a.actor_user_id for a in audit} == {admin.id}


def test_roles_strangers_and_forged_ids(api_client):
    org = OrganizationFactory()
    _member(api_client, org, Role.OWNER)
    made = api_client.put(_url(org), {"end_user": "alice", "amount": "5"}, format="json").json()

    _member(api_client, org, Role.VIEWER)
    assert api_client.get(_url(org, made["id"])).status_code == 200
    assert api_client.put(_url(org), {"end_user": "bob", "amount": "1"},
                          format="json").status_code == 403
    assert api_client.delete(_url(org, made["id"])).status_code == 403

    other = OrganizationFactory()
    _member(api_client, other, Role.OWNER)  # an owner elsewhere: this org does not exist
    assert api_client.get(_url(org)).status_code == 404
    assert api_client.put(_url(org), {"end_user": "x", "amount": "1"},
                          format="json").status_code == 404
    # ...and in its own organization, another's budget id is no budget
    assert api_client.get(_url(other, made["id"])).status_code == 404
    assert api_client.delete(_url(other, made["id"])).status_code == 404
    assert api_client.get(_url(other, "eub_forged")).status_code == 404
    bad_after = api_client.get(_url(other), {"after": made["id"]})
    assert bad_after.status_code == 400 and bad_after.json()["param"] == "after"
    assert EndUserBudget.objects.get(public_id=made["id"]).amount == Decimal("5")


@pytest.mark.parametrize(("body", "field"), [
    ({"end_user": "tab\there", "amount": "1"}, "end_user"),
    ({"end_user": "back\\slash", "amount": "1"}, "end_user"),
    ({"end_user": "", "amount": "1"}, "end_user"),
    ({"end_user": "x" * 257, "amount": "1"}, "end_user"),
    ({"end_user": 7, "amount": "1"}, "end_user"),
    ({"end_user": "alice", "amount": "0"}, "amount"),
    ({"end_user": "alice", "amount": "-3"}, "amount"),
    ({"end_user": "alice", "amount": "lots"}, "amount"),
    ({"end_user": "alice", "amount": "1e40"}, "amount"),
    ({"end_user": "alice"}, "amount"),
    ({"amount": "1"}, "end_user"),
])
def test_bad_bodies_are_refused_in_drf_shape_and_nothing_is_written(api_client, body, field):
    org = OrganizationFactory()
    _member(api_client, org, Role.OWNER)
    reply = api_client.put(_url(org), body, format="json")
    assert reply.status_code == 400, reply.content
    if field is not None:
        data = reply.json()
        assert field in data or data.get("param") == field, data
    assert not EndUserBudget.objects.filter(organization=org).exists()
    assert not AuditEvent.objects.filter(organization=org,
                                         action__startswith="end_user_budget").exists()
