"""Fixtures of the finance tests: platform finance users (analyst, controller) and clients.

The groups come from migration ``finance.0001``; a transactional test's flush empties
``auth_group``, so ``finance_user`` puts a group back (with the permissions
``finance.permissions.GROUP_PERMISSIONS`` names) when it is missing. Other helpers' finance
tests import these: ``from tests.finance.conftest import finance_user``.
"""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from billing_platform.finance.permissions import (
    ANALYST_GROUP,
    CONTROLLER_GROUP,
    GROUP_PERMISSIONS,
)


def finance_group(name: str):
    """Return the finance group ``name`` with its permissions (put back after a flush)."""
    from django.contrib.auth.models import Group, Permission

    group, created = Group.objects.get_or_create(name=name)
    if created:
        group.permissions.set(Permission.objects.filter(
            content_type__app_label="finance", codename__in=GROUP_PERMISSIONS[name]))
    return group


def finance_user(group_name: str = ANALYST_GROUP, **fields):
    """Create a platform finance user in ``group_name`` (not staff, not superuser)."""
    from tests.factories import UserFactory

    user = UserFactory(**fields)
    user.groups.add(finance_group(group_name))
    return user


@pytest.fixture
def finance_analyst(db):
    """A user of the "Finance analyst" group: reads every report, operates nothing."""
    return finance_user(ANALYST_GROUP, email="analyst@platform.example.com")


@pytest.fixture
def finance_controller(db):
    """A user of the "Finance controller" group: reads and operates."""
    return finance_user(CONTROLLER_GROUP, email="controller@platform.example.com")


@pytest.fixture
def analyst_client(finance_analyst) -> APIClient:
    """An API client signed in (session) as the finance analyst."""
    client = APIClient()
    client.force_authenticate(finance_analyst)
    return client


@pytest.fixture
def controller_client(finance_controller) -> APIClient:
    """An API client signed in (session) as the finance controller."""
    client = APIClient()
    client.force_authenticate(finance_controller)
    return client
