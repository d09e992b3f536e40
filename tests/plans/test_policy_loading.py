"""Admission policies read from PostgreSQL: what every key reads alike (a price book's pricing
of a model) is read once per policy TTL for all the keys of a process, and a price change
still reaches admission within that TTL."""

from __future__ import annotations

import time
from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext, override_settings
from django.utils import timezone

from plans import services as plan_services
from plans.admission import quota_policy_load
from tests.factories import OrganizationFactory, ProjectFactory, make_key, make_price_book

pytestmark = pytest.mark.django_db


def _key():
    org = OrganizationFactory()
    project = ProjectFactory(organization=org)
    key, _secret = make_key(project=project, scopes=["inference"])
    return {"organization_id": org.id, "project_id": project.id, "key_id": key.id}


def _price_queries(ctx: CaptureQueriesContext) -> list[str]:
    return [q["sql"] for q in ctx.captured_queries
            if "plans_modelprice" in q["sql"] or "plans_priceversion" in q["sql"]]


def test_keys_of_other_organizations_share_one_read_of_the_price_book():
    # given the default book prices a model, and one key's policy was read
    make_price_book(prices=[{"model": "m1", "input": "1.00", "output": "2.00"}])
    first = quota_policy_load(**_key(), model="m1")

    # when a key of another organization is read for the same model
    with CaptureQueriesContext(connection) as ctx:
        second = quota_policy_load(**_key(), model="m1")

    # then it prices alike without reading the book again; another model is read
    assert second.pricing == first.pricing
    assert second.pricing.base.output == Decimal("2.00")
    assert _price_queries(ctx) == []
    with CaptureQueriesContext(connection) as ctx:
        other = quota_policy_load(**_key(), model="m2")
    assert other.pricing is None  # not on the book
    assert _price_queries(ctx) != []


@override_settings(QUOTA_POLICY_TTL_S=0.3)
def test_a_new_price_reaches_admission_within_the_policy_ttl():
    # given a key's policy priced by the default book
    book = make_price_book(prices=[{"model": "m1", "input": "1.00", "output": "2.00"}])
    key = _key()
    assert quota_policy_load(**key, model="m1").pricing.base.output == Decimal("2.00")

    # when the book gets a new version in force now
    plan_services.price_version_create(
        price_book=book, effective_from=timezone.now() - timedelta(seconds=1),
        allow_backdate=True, prices=[{"model": "m1", "input": "1.00", "output": "5.00"}])

    # then within the TTL the shared read may still answer the old price; past it, the new
    assert quota_policy_load(**key, model="m1").pricing.base.output in (
        Decimal("2.00"), Decimal("5.00"))
    time.sleep(0.35)
    assert quota_policy_load(**key, model="m1").pricing.base.output == Decimal("5.00")


def test_a_blocking_token_plan_loads_its_period_window_and_packs_in_three_round_trips():
    # given an organization on a token plan that blocks at its cap (1,000 credits a period,
    # 300 per 5-hour window), whose ledger holds credits two and three minutes ago and six
    # hours ago (outside the window), with the period's totals, a pack in force (40 of 100
    # credits used) and an expired one
    from billing_platform.accounts.models import Organization
    from plans.models import CreditPackPurchase, TokenPlanPeriod, TokenPlanUsage
    from plans.periods import period_bounds
    from plans.selectors import token_plan_status
    from tests.factories import make_token_plan

    make_price_book(prices=[{"model": "test-model", "input": "1.00", "output": "2.00"}])
    key = _key()
    now = timezone.now()
    sub = plan_services.subscription_create(
        organization=Organization.objects.get(pk=key["organization_id"]),
        plan=make_token_plan(cap_policy="block"),
        starts_at=now - timedelta(days=2))
    start, end = period_bounds(sub.billing_anchor, now)
    for i, (ago, credits) in enumerate(((timedelta(minutes=3), "20"),
                                        (timedelta(minutes=2), "30"),
                                        (timedelta(minutes=2), "5"),
                                        (timedelta(hours=6), "100"))):
        TokenPlanUsage.objects.create(
            subscription=sub, request_id=f"req-{i}", event_time=now - ago, period_start=start,
            plan_credits=Decimal(credits), pack_credits=Decimal("0"),
            overage_credits=Decimal("0"))
    TokenPlanPeriod.objects.create(subscription=sub, period_start=start, period_end=end,
                                   plan_credits=Decimal("155"), pack_credits=Decimal("40"))
    for expires, used in ((now + timedelta(days=5), "40"), (now - timedelta(days=1), "0")):
        CreditPackPurchase.objects.create(
            subscription=sub, credits=Decimal("100"), credits_used=Decimal(used),
            price=Decimal("1"), currency="USD", purchased_at=now - timedelta(days=1),
            expires_at=expires)
    quota_policy_load(**key, model="test-model")  # the book's pricing, read once per TTL

    # when its policy is loaded
    with CaptureQueriesContext(connection) as ctx:
        policy = quota_policy_load(**key, model="test-model")

    # then the plan's period rule holds the period's credits plus what packs add, seeded with
    # what the period used, as the console's status reads them
    status = token_plan_status(subscription=sub)
    assert status.pack_credits_left == Decimal("60")
    (rule,) = [b for b in policy.budgets if b.scope == "plan"]
    assert (rule.limit, rule.spent_seed) == (Decimal("1000") + 60 + 40, Decimal("195"))
    assert rule.coefficients == (Decimal("1"), Decimal("0.1"), Decimal("3"))
    # and the window rule its 300 credits plus the packs left, seeded minute by minute with
    # what is still in the window
    minute = int(now.timestamp()) // 60
    assert policy.window.limit == Decimal("300") + 60
    assert dict(policy.window.seed) == {
        (int((now - timedelta(minutes=3)).timestamp()) // 60): 20_000_000,
        (int((now - timedelta(minutes=2)).timestamp()) // 60): 35_000_000,
    }
    assert max(dict(policy.window.seed)) <= minute
    assert policy.plan_exhausted == ""
    # in three round trips: the key's reads, the subscription with its plan, its credits
    assert len(ctx.captured_queries) == 3, [q["sql"][:80] for q in ctx.captured_queries]
