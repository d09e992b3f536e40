"""Plans management API: staff write the catalog, customers read what they hold, quotes."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from billing_platform.accounts.choices import Role
from plans import services
from plans.models import PriceVersion, Subscription
from plans.rating import rate_usage_batch
from tests.factories import (
    MembershipFactory,
    OrganizationFactory,
    UserFactory,
    make_key,
    make_price_book,
    make_token_plan,
)
from tests.plans.helpers import usage

pytestmark = pytest.mark.django_db
D = Decimal


@pytest.fixture
def staff(api_client):
    user = UserFactory(is_staff=True)
    api_client.force_login(user)
    return user


@pytest.fixture
def book(db):
    return make_price_book(code="usd-test",
                           prices=[{"model": "test-model", "input": "0.30", "output": "1.20"}])


def test_staff_publish_a_price_version_that_rates_events_from_its_start(api_client, staff, book):
    """A new version from tomorrow doubles output to 2.40; cached_input stays 0.1 x input.

    Tomorrow, 1,000 out costs 1,000 x 2.40 / 1e6 = 0.0024 (it was 0.0012). Bands come along.
    """
    tomorrow = (timezone.now() + timedelta(days=1)).replace(microsecond=0)
    body = {"effective_from": tomorrow.isoformat(), "note": "output up",
            "prices": [{"model": "test-model", "input": "0.30", "output": "2.40",
                        "bands": [{"above_prompt_tokens": 1000, "input": "0.60",
                                   "output": "4.80"}]}],
            "zone_multipliers": {"eu": "1.2"}}
    response = api_client.post("/api/v1/price_books/usd-test/versions/", body, format="json")
    assert response.status_code == 201, response.json()
    data = response.json()
    assert data["prices"][0]["output"] == "2.4000000000"
    assert data["prices"][0]["bands"][0]["above_prompt_tokens"] == 1000
    assert data["zone_multipliers"]["eu"] == "1.200000"
    assert data["tier_multipliers"]["priority"] == "2.000000"  # carried forward
    org = OrganizationFactory()
    today, later = rate_usage_batch([
        usage(org, completion_tokens=1_000, event_time=tomorrow - timedelta(seconds=1)),
        usage(org, completion_tokens=1_000, event_time=tomorrow)])
    assert (today.amount, later.amount) == (D("0.0012"), D("0.0024"))
    assert later.price_version_id == data["id"]
    # and a version in the past is refused
    past = {"effective_from": "2025-02-01T00:00:00Z", "prices": []}
    response = api_client.post("/api/v1/price_books/usd-test/versions/", past, format="json")
    assert response.status_code == 400
    assert response.json()["param"] == "effective_from"


def test_customers_read_the_public_catalog_but_cannot_write_it(api_client, book):
    member = MembershipFactory(role=Role.OWNER)
    api_client.force_login(member.user)
    books = api_client.get("/api/v1/price_books/").json()["data"]
    assert [b["code"] for b in books] == ["usd-test"]
    detail = api_client.get("/api/v1/price_books/usd-test/").json()
    assert detail["current_version"]["prices"][0]["input"] == "0.3000000000"
    response = api_client.post("/api/v1/price_books/usd-test/versions/",
                               {"effective_from": "2030-01-01T00:00:00Z"}, format="json")
    assert response.status_code == 403
    response = api_client.post("/api/v1/plans/", {"code": "x", "name": "x",
                                                   "kind": "on_demand"}, format="json")
    assert response.status_code == 403
    assert PriceVersion.objects.filter(price_book=book).count() == 1


def test_staff_create_a_token_plan_with_coefficients_and_a_pack(api_client, staff):
    body = {"code": "pro", "name": "Pro", "kind": "token_plan", "monthly_fee": "20.00",
            "credits_per_period": "1000000", "window_credits": "100000",
            "cap_policy": "overage",
            "coefficients": [{"model": "big", "token_class": "output", "coefficient": "3"}]}
    response = api_client.post("/api/v1/plans/", body, format="json")
    assert response.status_code == 201, response.json()
    assert response.json()["coefficients"] == [
        {"model": "big", "token_class": "output", "coefficient": "3.000000"}]
    response = api_client.post("/api/v1/plans/pro/credit_packs/",
                               {"code": "boost", "name": "Boost", "credits": "50000",
                                "price": "2.50"}, format="json")
    assert response.status_code == 201
    plan = api_client.get("/api/v1/plans/pro/").json()
    assert plan["credit_packs"][0]["price"] == "2.5000000000"
    # a token plan without credits is refused
    bad = {**body, "code": "bad", "credits_per_period": None}
    assert api_client.post("/api/v1/plans/", bad, format="json").status_code == 400


def test_customer_reads_subscription_with_credits_left_and_other_orgs_are_404(api_client, book):
    """250 credits used of a 300-per-5h window: 50 left, shown to any member (developer)."""
    dev = MembershipFactory(role=Role.DEVELOPER)
    org = dev.organization
    plan = make_token_plan(coefficients=[
        {"model": "test-model", "token_class": "input", "coefficient": "1"},
        {"model": "test-model", "token_class": "output", "coefficient": "3"}])
    now = timezone.now()
    services.subscription_create(organization=org, plan=plan, starts_at=now - timedelta(days=1))
    rate_usage_batch([usage(org, prompt_tokens=100, completion_tokens=50,
                            event_time=now - timedelta(minutes=5))])
    api_client.force_login(dev.user)
    data = api_client.get(f"/api/v1/organizations/{org.public_id}/subscription/").json()
    assert data["plan"] == plan.code
    assert data["token_plan"]["window_used"] == "250.000000"
    assert data["token_plan"]["credits_left"] == "50.000000"
    # not a member: 404 for reads and writes alike
    other = OrganizationFactory()
    for path in (f"/api/v1/organizations/{other.public_id}/subscription/",
                 f"/api/v1/organizations/{other.public_id}/reservations/",
                 f"/api/v1/organizations/{other.public_id}/credit_grants/"):
        assert api_client.get(path).status_code == 404, path
    response = api_client.post(f"/api/v1/organizations/{other.public_id}/subscriptions/",
                               {"plan": plan.code}, format="json")
    assert response.status_code == 404
    # a member may not change their own subscription (staff do)
    response = api_client.post(f"/api/v1/organizations/{org.public_id}/subscriptions/",
                               {"plan": plan.code}, format="json")
    assert response.status_code == 403
    assert Subscription.objects.filter(organization=org).count() == 1


def test_staff_subscribe_an_org_and_the_previous_subscription_ends(api_client, staff, book):
    org = OrganizationFactory()
    first = make_token_plan()
    second = make_token_plan()
    url = f"/api/v1/organizations/{org.public_id}/subscriptions/"
    t1 = datetime(2025, 5, 1, tzinfo=UTC)
    t2 = datetime(2025, 6, 1, tzinfo=UTC)
    assert api_client.post(url, {"plan": first.code, "starts_at": t1.isoformat()},
                           format="json").status_code == 201
    response = api_client.post(url, {"plan": second.code, "starts_at": t2.isoformat()},
                               format="json")
    assert response.status_code == 201
    subs = {s["plan"]: s for s in api_client.get(url).json()["data"]}
    assert subs[first.code]["ends_at"] == "2025-06-01T00:00:00Z"
    assert subs[second.code]["ends_at"] is None


def test_reservations_staff_write_members_read(api_client, book):
    offering = services.provisioned_offering_create(
        code="off", name="off", model="test-model", region="us-east",
        tokens_per_minute_per_unit=1000, output_burndown="4", hourly_unit_price="1.00",
        monthly_unit_price="500.00")
    viewer = MembershipFactory(role=Role.VIEWER)
    org = viewer.organization
    url = f"/api/v1/organizations/{org.public_id}/reservations/"
    staff_user = UserFactory(is_staff=True)
    api_client.force_login(staff_user)
    response = api_client.post(url, {"offering": offering.code, "units": 3, "term": "monthly",
                                     "term_count": 2}, format="json")
    assert response.status_code == 201, response.json()
    assert response.json()["fee"] == "3000.0000000000"  # 3 x 500.00 x 2
    assert response.json()["tokens_per_minute"] == 3000
    api_client.force_login(viewer.user)
    listed = api_client.get(url).json()["data"]
    assert [r["units"] for r in listed] == [3]
    rid = listed[0]["id"]
    response = api_client.patch(f"{url}{rid}/", {"overflow_policy": "reject"}, format="json")
    assert response.status_code == 403


def test_credit_balance_is_billing_data(api_client):
    """Finance reads grants and the balance (25.00 + 10.00 unexpired; 5.00 expired); a
    developer gets 403."""
    finance = MembershipFactory(role=Role.FINANCE)
    org = finance.organization
    now = timezone.now()
    services.credit_grant_create(organization=org, kind="promotional", amount="25.00",
                                 expires_at=now + timedelta(days=30))
    services.credit_grant_create(organization=org, kind="purchased", amount="10.00")
    services.credit_grant_create(organization=org, kind="promotional", amount="5.00",
                                 granted_at=now - timedelta(days=60),
                                 expires_at=now - timedelta(days=1))
    url = f"/api/v1/organizations/{org.public_id}/credit_grants/"
    api_client.force_login(finance.user)
    data = api_client.get(url).json()
    assert data["balance"] == {"USD": "35.0000000000"}
    assert len(data["data"]) == 3
    dev = MembershipFactory(role=Role.DEVELOPER, organization=org)
    api_client.force_login(dev.user)
    assert api_client.get(url).status_code == 403


def test_quote_with_an_api_key_and_with_a_session(api_client, book):
    """10,000 in (4,000 cached) + 2,000 out, priority: 2 x (1,800 + 120 + 2,400) / 1e6."""
    key, secret = make_key()
    body = {"model": "test-model", "prompt_tokens": 10_000, "cached_tokens": 4_000,
            "completion_tokens": 2_000, "service_tier": "priority"}
    api_client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    response = api_client.post("/api/v1/pricing/quote", body, format="json")
    assert response.status_code == 200, response.json()
    data = response.json()
    assert data["amount"] == "0.0086400000"
    assert data["breakdown"] == {"input": "0.0036000000", "cached_input": "0.0002400000",
                                 "output": "0.0048000000"}
    assert data["currency"] == "USD"
    # another org's id with this key: 404
    other = OrganizationFactory()
    response = api_client.post("/api/v1/pricing/quote",
                               {**body, "organization": other.public_id}, format="json")
    assert response.status_code == 404
    # a signed-in member quotes for their org; a non-member's org is 404
    api_client.credentials()
    member = MembershipFactory(role=Role.VIEWER, organization=key.organization)
    api_client.force_login(member.user)
    response = api_client.post("/api/v1/pricing/quote", body, format="json")
    assert response.json()["amount"] == "0.0086400000"
    response = api_client.post("/api/v1/pricing/quote",
                               {**body, "organization": other.public_id}, format="json")
    assert response.status_code == 404
    # impossible counts are a 400
    response = api_client.post("/api/v1/pricing/quote", {**body, "cached_tokens": 20_000},
                               format="json")
    assert response.status_code == 400


def test_member_buys_a_credit_pack_of_their_plan(api_client, book):
    owner = MembershipFactory(role=Role.OWNER)
    org = owner.organization
    plan = make_token_plan()
    services.credit_pack_create(plan=plan, code="boost", name="Boost", credits="500",
                                price="3.00", validity_days=30)
    services.subscription_create(organization=org, plan=plan,
                                 starts_at=timezone.now() - timedelta(days=1))
    api_client.force_login(owner.user)
    url = f"/api/v1/organizations/{org.public_id}/subscription/credit_packs/"
    response = api_client.post(url, {"pack": "boost"}, format="json")
    assert response.status_code == 201, response.json()
    assert response.json()["credits_left"] == "500.000000"
    status = api_client.get(f"/api/v1/organizations/{org.public_id}/subscription/").json()
    assert status["token_plan"]["pack_credits_left"] == "500.000000"
    viewer = MembershipFactory(role=Role.VIEWER, organization=org)
    api_client.force_login(viewer.user)
    assert api_client.post(url, {"pack": "boost"}, format="json").status_code == 403
