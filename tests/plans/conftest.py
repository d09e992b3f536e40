"""Fixtures of the plans tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def org(db):
    from tests.factories import OrganizationFactory

    return OrganizationFactory()
