"""Who may use the finance workspace: the two groups of migration finance.0001, and nobody
else (an organization's own finance member, staff without the permission, an API key)."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import AnonymousUser, Group

from billing_platform.accounts.choices import Role
from billing_platform.finance.permissions import (
    ANALYST_GROUP,
    CONTROLLER_GROUP,
    can_operate_finance,
    can_read_finance,
)
from tests.factories import MembershipFactory, UserFactory

pytestmark = pytest.mark.django_db


def test_the_migration_creates_both_groups_with_their_permissions():
    # given the migrated database (no fixture re-creates the groups here)
    perms = {name: set(Group.objects.get(name=name).permissions.values_list(
        "content_type__app_label", "codename")) for name in (ANALYST_GROUP, CONTROLLER_GROUP)}
    # then an analyst reads, a controller reads and operates
    assert perms[ANALYST_GROUP] == {("finance", "view_reports")}
    assert perms[CONTROLLER_GROUP] == {("finance", "view_reports"), ("finance", "operate")}


def test_analyst_reads_and_controller_also_operates(finance_analyst, finance_controller):
    assert can_read_finance(finance_analyst)
    assert not can_operate_finance(finance_analyst)
    assert can_read_finance(finance_controller)
    assert can_operate_finance(finance_controller)


def test_nobody_else_reads_finance():
    # given an org's own finance member, an org owner, staff without the group, an anonymous
    # visitor and a deactivated analyst
    org_finance = MembershipFactory(role=Role.FINANCE).user
    owner = MembershipFactory(role=Role.OWNER).user
    staff = UserFactory(is_staff=True)
    inactive = UserFactory(is_active=False)
    inactive.groups.add(Group.objects.get(name=CONTROLLER_GROUP))
    # then none of them reads or operates the platform's finance workspace
    for user in (org_finance, owner, staff, AnonymousUser(), inactive, None):
        assert not can_read_finance(user), user
        assert not can_operate_finance(user), user
