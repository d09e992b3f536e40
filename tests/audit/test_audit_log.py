"""The audit log: written with the action, readable by the right people only, never editable."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from billing_platform.accounts.choices import Role
from billing_platform.audit.models import AuditEvent
from plans import services
from plans.models import Plan
from tests.factories import (
    MembershipFactory,
    OrganizationFactory,
    UserFactory,
    make_key,
    make_token_plan,
)

pytestmark = pytest.mark.django_db


def _org_on_token_plan():
    owner = MembershipFactory(role=Role.OWNER)
    plan = make_token_plan()
    services.credit_pack_create(plan=plan, code="boost", name="Boost", credits="500",
                                price="3.00", validity_days=30)
    services.subscription_create(organization=owner.organization, plan=plan,
                                 starts_at=timezone.now() - timedelta(days=1))
    return owner


def _log_url(org) -> str:
    return f"/api/v1/organizations/{org.public_id}/audit_log/"


def test_a_purchase_writes_one_row_with_actor_target_and_the_request_id(api_client):
    # given an owner on a token plan
    owner = _org_on_token_plan()
    org = owner.organization
    api_client.force_login(owner.user)

    # when the owner buys a pack
    response = api_client.post(f"/api/v1/organizations/{org.public_id}/subscription/"
                               "credit_packs/", {"pack": "boost"}, format="json")
    assert response.status_code == 201, response.json()

    # then the org's audit log shows who bought what, tied to that request
    log = api_client.get(_log_url(org), {"action": "credit_pack."}).json()
    assert [e["action"] for e in log["data"]] == ["credit_pack.purchase"]
    row = log["data"][0]
    assert row["actor"] == {"type": "user", "label": owner.user.email}
    assert row["target"] == response.json()["id"]
    assert row["organization"] == org.public_id
    assert row["after"]["price"] == "3.0000000000"
    assert row["request_id"] == response["x-request-id"]


def test_only_owners_and_admins_read_their_org_log_and_only_staff_read_all(api_client):
    owner = _org_on_token_plan()
    org = owner.organization
    other = _org_on_token_plan().organization
    assert AuditEvent.objects.filter(organization=org).exists()

    # a developer and a viewer of the org are refused, in DRF's shape
    for role in (Role.DEVELOPER, Role.VIEWER, Role.FINANCE):
        member = MembershipFactory(role=role, organization=org)
        api_client.force_login(member.user)
        response = api_client.get(_log_url(org))
        assert response.status_code == 403, role
        assert "detail" in response.json()

    # an owner of another org (or a forged id) gets 404, not the rows
    api_client.force_login(owner.user)
    assert api_client.get(_log_url(other)).status_code == 404
    assert api_client.get("/api/v1/organizations/org_forged/audit_log/").status_code == 404
    mine = api_client.get(_log_url(org)).json()["data"]
    assert mine and {e["organization"] for e in mine} == {org.public_id}

    # the platform-wide log is staff-only, even for an API key
    assert api_client.get("/api/v1/audit_log/").status_code == 403
    _, secret = make_key()
    api_client.logout()
    assert api_client.get("/api/v1/audit_log/",
                          HTTP_AUTHORIZATION=f"Bearer {secret}").status_code == 403
    api_client.force_login(UserFactory(is_staff=True))
    everything = api_client.get("/api/v1/audit_log/", {"action": "subscription."}).json()
    assert {org.public_id, other.public_id} <= {e["organization"] for e in everything["data"]}


def test_the_log_pages_with_a_cursor_and_refuses_malformed_queries(api_client):
    owner = _org_on_token_plan()
    org = owner.organization
    api_client.force_login(owner.user)
    url = f"/api/v1/organizations/{org.public_id}/subscription/credit_packs/"
    for _ in range(5):
        assert api_client.post(url, {"pack": "boost"}, format="json").status_code == 201

    first = api_client.get(_log_url(org), {"action": "credit_pack.", "limit": 2}).json()
    assert len(first["data"]) == 2 and first["has_more"]
    seen = [e["id"] for e in first["data"]]
    page = first
    while page["has_more"]:
        page = api_client.get(_log_url(org), {"action": "credit_pack.", "limit": 2,
                                              "after": page["last_id"]}).json()
        seen += [e["id"] for e in page["data"]]
    assert len(seen) == len(set(seen)) == 5

    for bad in ({"limit": "abc"}, {"limit": 100000}, {"since": "yesterday"},
                {"after": "aud_forged"}, {"action": "x" * 500}):
        response = api_client.get(_log_url(org), bad)
        assert response.status_code == 400, bad
        assert set(response.json()) & {"limit", "since", "after", "action"}, response.json()


def test_rows_cannot_be_edited_or_deleted_even_with_raw_sql():
    _org_on_token_plan()
    row = AuditEvent.objects.filter(action="subscription.create").first()
    row.action = "nothing.happened"
    with pytest.raises(TypeError):
        row.save()
    with pytest.raises(TypeError):
        row.delete()
    for sql in ("UPDATE audit_auditevent SET action = 'x'", "DELETE FROM audit_auditevent"):
        with pytest.raises(DatabaseError, match="append-only"), transaction.atomic(), \
                connection.cursor() as cur:
            cur.execute(sql)
    assert AuditEvent.objects.filter(action="subscription.create").count() == 1


def test_the_row_rolls_back_with_a_failed_action():
    org = OrganizationFactory()
    plan = make_token_plan()
    with pytest.raises(RuntimeError), transaction.atomic():
        services.subscription_create(organization=org, plan=plan)
        raise RuntimeError("the rest of the action failed")
    assert not AuditEvent.objects.filter(organization=org).exists()


def test_a_staff_change_in_django_admin_is_recorded_with_before_and_after(client):
    staff = UserFactory(is_staff=True, is_superuser=True)
    plan = make_token_plan()
    client.force_login(staff)
    url = f"/admin/plans/plan/{plan.pk}/change/"
    form = client.get(url).context["adminform"].form
    data = {}
    for k, v in form.initial.items():
        if isinstance(v, datetime):  # the admin's split date/time widget
            data.update({f"{k}_0": f"{v:%Y-%m-%d}", f"{k}_1": f"{v:%H:%M:%S}"})
        elif v is not None:
            data[k] = v
    data.update(monthly_fee="99.00", price_book="")
    for prefix in ("coefficients", "credit_packs"):
        data.update({f"{prefix}-TOTAL_FORMS": "0", f"{prefix}-INITIAL_FORMS": "0"})
    data.update({"coefficients-TOTAL_FORMS": str(plan.coefficients.count()),
                 "coefficients-INITIAL_FORMS": str(plan.coefficients.count())})
    for i, c in enumerate(plan.coefficients.all()):
        data.update({f"coefficients-{i}-id": c.pk, f"coefficients-{i}-plan": plan.pk,
                     f"coefficients-{i}-model": c.model,
                     f"coefficients-{i}-token_class": c.token_class,
                     f"coefficients-{i}-coefficient": str(c.coefficient)})
    response = client.post(url, data)
    assert response.status_code == 302, response.context["adminform"].form.errors
    assert Plan.objects.get(pk=plan.pk).monthly_fee == 99
    row = AuditEvent.objects.get(action="admin.plan.change", target=plan.code)
    assert row.actor_label == staff.email
    assert row.before["monthly_fee"] == "10.0000000000"
    assert row.after["monthly_fee"] == "99.00"


def test_console_audit_page_for_admins_only(client):
    owner = _org_on_token_plan()
    org = owner.organization
    client.force_login(owner.user)
    page = client.get("/console/audit/")
    assert page.status_code == 200
    assert b"subscription.create" in page.content
    developer = MembershipFactory(role=Role.DEVELOPER, organization=org)
    client.force_login(developer.user)
    refused = client.get("/console/audit/", follow=True)
    assert b"subscription.create" not in refused.content
    assert b"cannot do that" in refused.content


def test_staff_deletes_in_django_admin_are_recorded_without_secrets(client):
    from tests.factories import ProjectFactory

    staff = UserFactory(is_staff=True, is_superuser=True)
    client.force_login(staff)
    # a key deleted from its change page, a plan through the bulk "delete selected" action
    key, _ = make_key(ProjectFactory())
    page = client.post(f"/admin/accounts/apikey/{key.pk}/delete/", {"post": "yes"})
    assert page.status_code == 302
    plan = make_token_plan()
    page = client.post("/admin/plans/plan/", {"action": "delete_selected", "post": "yes",
                                              "_selected_action": [plan.pk]})
    assert page.status_code == 302

    row = AuditEvent.objects.get(action="admin.apikey.delete", target=key.public_id)
    assert row.actor_label == staff.email and row.organization_id == key.organization_id
    assert row.before["name"] == key.name
    assert not any("hash" in k or "secret" in k for k in row.before)
    assert AuditEvent.objects.filter(action="admin.plan.delete", target=plan.code).exists()
