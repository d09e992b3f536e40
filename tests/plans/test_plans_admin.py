"""Staff admin: every plans page opens; a price version in force can no longer be edited."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from plans import services
from plans.models import PriceVersion
from tests.factories import UserFactory, make_price_book

pytestmark = pytest.mark.django_db

MODELS = ["pricebook", "priceversion", "modelprice", "plan", "subscription", "tokenplanperiod",
          "tokenplanusage", "provisionedoffering", "reservation", "creditgrant"]


def test_admin_pages_open_and_versions_in_force_are_read_only(client):
    staff = UserFactory(is_staff=True, is_superuser=True)
    client.force_login(staff)
    book = make_price_book()
    in_force = PriceVersion.objects.get(price_book=book)
    future = services.price_version_create(price_book=book,
                                           effective_from=timezone.now() + timedelta(days=7))
    for name in MODELS:
        response = client.get(reverse(f"admin:plans_{name}_changelist"))
        assert response.status_code == 200, name
    past_page = client.get(reverse("admin:plans_priceversion_change", args=[in_force.pk]))
    future_page = client.get(reverse("admin:plans_priceversion_change", args=[future.pk]))
    assert past_page.status_code == future_page.status_code == 200
    # the future version's copied prices are an editable form; the one in force is not
    assert 'name="prices-0-input"' in future_page.content.decode()
    assert 'name="prices-0-input"' not in past_page.content.decode()
