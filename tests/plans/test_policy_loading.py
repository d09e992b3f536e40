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
