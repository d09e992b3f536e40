"""ORM queries compiled once and run with new values (``billing_platform.compiled_sql``): each
run answers for its own values, exactly as the queryset would, several run in one round trip,
and a query whose values the ORM does not pass through is refused rather than run with the
placeholder's value."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection
from django.db.models import Q
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from billing_platform.compiled_sql import CompiledQuery, rows_of
from plans.models import Budget
from tests.factories import OrganizationFactory, ProjectFactory

pytestmark = pytest.mark.django_db

_BUDGETS = CompiledQuery(
    lambda org, project, since: Budget.objects.filter(
        Q(organization_id=org, project__isnull=True) | Q(project_id=project),
        created_at__gte=since).order_by("project_id", "amount").values_list("amount", "hard"),
    org=-1, project=-2, since=datetime(1901, 1, 1, tzinfo=UTC))


def _org_with_budgets(*amounts: str):
    org = OrganizationFactory()
    project = ProjectFactory(organization=org)
    Budget.objects.create(organization=org, amount=Decimal(amounts[0]), hard=True,
                          currency="USD")
    for amount in amounts[1:]:
        Budget.objects.create(organization=org, project=project, amount=Decimal(amount),
                              hard=False, currency="USD")
    return org, project


def test_each_run_reads_its_own_values_as_the_orm_would():
    # given two organizations with budgets of their own
    a, a_project = _org_with_budgets("100.00", "7.50")
    b, b_project = _org_with_budgets("42.00")
    since = timezone.now() - timedelta(hours=1)

    # when the one compiled query runs for each
    mine = _BUDGETS.rows(org=a.id, project=a_project.id, since=since)
    theirs = _BUDGETS.rows(org=b.id, project=b_project.id, since=since)

    # then each answers its own rows, the same the ORM builds each time
    assert mine == [(Decimal("7.50"), False), (Decimal("100.00"), True)]  # NULL project last
    assert theirs == [(Decimal("42.00"), True)]
    with CompiledQuery.built_each_time():
        assert _BUDGETS.rows(org=a.id, project=a_project.id, since=since) == mine
    # and a value in the future finds nothing (the instant is a parameter, not a constant)
    assert _BUDGETS.rows(org=a.id, project=a_project.id,
                         since=timezone.now() + timedelta(days=1)) == []


def test_a_placeholder_the_orm_does_not_pass_through_is_refused():
    # given a lookup that wraps its value (contains: '%value%')
    query = CompiledQuery(lambda name: OrganizationFactory._meta.model.objects.filter(
        name__contains=name).values_list("id"), name="<name>")
    OrganizationFactory(name="Acme")

    # when it is run, then it is refused, not sent with the placeholder's value
    with pytest.raises(ImproperlyConfigured, match="name"):
        query.rows(name="Acme")


def test_a_constant_equal_to_a_placeholder_stays_a_constant():
    # given a query whose constant (the 50 of amount > 50) equals its placeholder's value
    query = CompiledQuery(lambda amount: Budget.objects.filter(
        amount__gt=Decimal("50"), amount__lt=amount).order_by("amount").values_list("amount"),
        amount=Decimal("50"))
    _org_with_budgets("100.00", "20.00")

    # when run with another value, then only the placeholder took it: 50 < amount < 1000
    assert query.rows(amount=Decimal("1000")) == [(Decimal("100.00"),)]


def test_several_queries_run_in_one_round_trip_and_answer_in_order():
    # given two organizations, and a second query of another shape
    a, a_project = _org_with_budgets("100.00", "7.50")
    _b, _ = _org_with_budgets("42.00")
    names = CompiledQuery(lambda org: OrganizationFactory._meta.model.objects.filter(
        pk=org).values_list("slug"), org=-1)
    since = timezone.now() - timedelta(hours=1)

    # when both run at once
    with CaptureQueriesContext(connection) as ctx:
        budgets, slugs = rows_of(_BUDGETS, names, org=a.id, project=a_project.id, since=since)

    # then one statement was sent, and each query answered as it does alone
    assert len(ctx.captured_queries) == 1
    assert budgets == _BUDGETS.rows(org=a.id, project=a_project.id, since=since)
    assert slugs == [(a.slug,)]
    # and a query that finds nothing still answers its (empty) place
    assert rows_of(names, _BUDGETS, org=-5, project=-6, since=since) == [[], []]
