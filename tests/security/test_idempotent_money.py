"""Retried money-moving POSTs return their first result (``Idempotency-Key``, as Stripe's API)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from billing_platform.accounts.choices import Role
from billing_platform.audit.models import AuditEvent
from plans import services
from plans.models import CreditGrant, CreditPackPurchase
from tests.factories import MembershipFactory, UserFactory, make_token_plan


def _owner_on_token_plan():
    owner = MembershipFactory(role=Role.OWNER)
    plan = make_token_plan()
    for code, price in (("boost", "3.00"), ("mega", "9.00")):
        services.credit_pack_create(plan=plan, code=code, name=code, credits="500",
                                    price=price, validity_days=30)
    services.subscription_create(organization=owner.organization, plan=plan,
                                 starts_at=timezone.now() - timedelta(days=1))
    return owner


def _packs_url(org) -> str:
    return f"/api/v1/organizations/{org.public_id}/subscription/credit_packs/"


@pytest.mark.django_db
def test_a_retried_credit_pack_purchase_buys_once_and_returns_the_first_result(api_client):
    # given an owner who buys a pack with an idempotency key
    owner = _owner_on_token_plan()
    org = owner.organization
    api_client.force_login(owner.user)
    first = api_client.post(_packs_url(org), {"pack": "boost"}, format="json",
                            HTTP_IDEMPOTENCY_KEY="buy-boost-1")
    assert first.status_code == 201, first.json()

    # when the client retries (a timeout, a double click)
    again = api_client.post(_packs_url(org), {"pack": "boost"}, format="json",
                            HTTP_IDEMPOTENCY_KEY="buy-boost-1")

    # then it gets the same purchase back and is charged for one
    assert again.status_code == 201
    assert again.json() == first.json()
    assert again["Idempotent-Replayed"] == "true"
    assert CreditPackPurchase.objects.filter(subscription__organization=org).count() == 1
    assert AuditEvent.objects.filter(organization=org, action="credit_pack.purchase").count() == 1

    # a new key is a new purchase
    other = api_client.post(_packs_url(org), {"pack": "boost"}, format="json",
                            HTTP_IDEMPOTENCY_KEY="buy-boost-2")
    assert other.status_code == 201 and other.json()["id"] != first.json()["id"]


@pytest.mark.django_db
def test_the_same_key_with_other_parameters_is_refused_and_buys_nothing(api_client):
    owner = _owner_on_token_plan()
    org = owner.organization
    api_client.force_login(owner.user)
    assert api_client.post(_packs_url(org), {"pack": "boost"}, format="json",
                           HTTP_IDEMPOTENCY_KEY="k1").status_code == 201
    reused = api_client.post(_packs_url(org), {"pack": "mega"}, format="json",
                             HTTP_IDEMPOTENCY_KEY="k1")
    assert reused.status_code == 400
    assert "same parameters" in reused.json()["detail"]
    assert list(CreditPackPurchase.objects.filter(subscription__organization=org)
                .values_list("pack__code", flat=True)) == ["boost"]

    for bad in ("", " ", "x" * 256):
        response = api_client.post(_packs_url(org), {"pack": "boost"}, format="json",
                                   HTTP_IDEMPOTENCY_KEY=bad)
        assert response.status_code == 400, bad
        assert "Idempotency-Key" in response.json()
    assert CreditPackPurchase.objects.filter(subscription__organization=org).count() == 1


@pytest.mark.django_db
def test_a_key_is_the_callers_own_another_member_cannot_replay_it(api_client):
    # given the owner bought with key k
    owner = _owner_on_token_plan()
    org = owner.organization
    api_client.force_login(owner.user)
    mine = api_client.post(_packs_url(org), {"pack": "boost"}, format="json",
                           HTTP_IDEMPOTENCY_KEY="k").json()
    # when another admin sends the same key, it is a request of theirs, not a peek at the owner's
    admin = MembershipFactory(role=Role.ADMIN, organization=org)
    api_client.force_login(admin.user)
    theirs = api_client.post(_packs_url(org), {"pack": "boost"}, format="json",
                             HTTP_IDEMPOTENCY_KEY="k")
    assert theirs.status_code == 201 and theirs.json()["id"] != mine["id"]
    assert "Idempotent-Replayed" not in theirs


@pytest.mark.django_db
def test_a_failed_request_stores_nothing_and_a_retry_runs_again(api_client):
    owner = _owner_on_token_plan()
    org = owner.organization
    api_client.force_login(owner.user)
    missing = api_client.post(_packs_url(org), {"pack": "nope"}, format="json",
                              HTTP_IDEMPOTENCY_KEY="k")
    assert missing.status_code == 404
    retry = api_client.post(_packs_url(org), {"pack": "nope"}, format="json",
                            HTTP_IDEMPOTENCY_KEY="k")
    assert retry.status_code == 404 and "Idempotent-Replayed" not in retry


@pytest.mark.django_db(transaction=True)
def test_concurrent_retries_with_one_key_charge_once():
    # given an owner whose client fires the same purchase from 6 threads at once
    owner = _owner_on_token_plan()
    org = owner.organization
    results: list[tuple[int, str]] = []
    barrier = threading.Barrier(6)

    def buy() -> None:
        client = Client()
        client.force_login(owner.user)
        barrier.wait()
        r = client.post(_packs_url(org), {"pack": "boost"}, content_type="application/json",
                        HTTP_IDEMPOTENCY_KEY="race")
        results.append((r.status_code, r.json()["id"]))

    threads = [threading.Thread(target=buy) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)

    # then every response is the one purchase
    assert len(results) == 6
    assert {code for code, _ in results} == {201}
    assert len({pid for _, pid in results}) == 1
    assert CreditPackPurchase.objects.filter(subscription__organization=org).count() == 1


@pytest.mark.django_db
def test_a_retried_staff_credit_grant_grants_once(api_client):
    owner = MembershipFactory(role=Role.OWNER)
    org = owner.organization
    staff = UserFactory(is_staff=True)
    api_client.force_login(staff)
    url = f"/api/v1/organizations/{org.public_id}/credit_grants/"
    body = {"kind": "promotional", "amount": "25.00"}
    a = api_client.post(url, body, format="json", HTTP_IDEMPOTENCY_KEY="grant-1")
    b = api_client.post(url, body, format="json", HTTP_IDEMPOTENCY_KEY="grant-1")
    assert a.status_code == 201, a.json()
    assert b.json() == a.json()
    assert CreditGrant.objects.filter(organization=org).count() == 1
    row = AuditEvent.objects.get(organization=org, action="credit_grant.create")
    assert row.actor_label == staff.email


@pytest.mark.django_db
def test_keys_are_forgotten_after_24_hours(api_client):
    from billing_platform.idempotency.services import idempotent_requests_prune

    owner = _owner_on_token_plan()
    org = owner.organization
    api_client.force_login(owner.user)
    api_client.post(_packs_url(org), {"pack": "boost"}, format="json", HTTP_IDEMPOTENCY_KEY="k")
    assert idempotent_requests_prune(now=timezone.now() + timedelta(hours=1)) == 0
    assert idempotent_requests_prune(now=timezone.now() + timedelta(hours=25)) == 1
    again = api_client.post(_packs_url(org), {"pack": "boost"}, format="json",
                            HTTP_IDEMPOTENCY_KEY="k")
    assert again.status_code == 201 and "Idempotent-Replayed" not in again
    assert CreditPackPurchase.objects.filter(subscription__organization=org).count() == 2
