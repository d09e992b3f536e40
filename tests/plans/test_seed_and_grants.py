"""The seeded default catalog (idempotent, realistic) and credit grants (oldest expiry first)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from io import StringIO

import pytest
from django.core.management import call_command

from plans import services
from plans.models import (
    CreditGrant,
    ModelPrice,
    Plan,
    PriceBook,
    PriceVersion,
    ProvisionedOffering,
)
from plans.rating import quote
from plans.selectors import credit_balance

pytestmark = pytest.mark.django_db
D = Decimal


def test_seed_catalog_is_idempotent_and_prices_the_demo_models(org):
    """Seeded twice: one book, one version, four models, two plans, one offering.

    Quote on the seeded prices: llama-3.3-70b-instruct, 1,000,000 in (500,000 cached at 0.44)
    + 100,000 out at 0.88: 500,000 x 0.88 + 500,000 x 0.44 + 100,000 x 0.88 = 440,000 +
    220,000 + 88,000 = 748,000 / 1e6 = 0.748. qwen3 above its 131,072-token band: 200,000 in at
    0.40 = 0.08.
    """
    out = StringIO()
    call_command("seed_catalog", stdout=out)
    call_command("seed_catalog", stdout=out)
    assert "already seeded" in out.getvalue()
    assert PriceBook.objects.filter(is_default=True, currency="USD").count() == 1
    assert PriceVersion.objects.count() == 1
    assert set(ModelPrice.objects.values_list("model", flat=True)) == {
        "tollgate/tiny-llama", "tollgate/tiny-embed", "llama-3.1-8b-instruct",
        "llama-3.3-70b-instruct",
        "qwen3-235b-a22b"}
    assert set(Plan.objects.values_list("kind", flat=True)) == {"on_demand", "token_plan"}
    assert ProvisionedOffering.objects.count() == 1
    at = datetime(2025, 6, 1, tzinfo=UTC)
    big = quote(org_id=org.pk, model="llama-3.3-70b-instruct", prompt_tokens=1_000_000,
                cached_tokens=500_000, completion_tokens=100_000, at=at)
    assert big.amount == D("0.748")
    banded = quote(org_id=org.pk, model="qwen3-235b-a22b", prompt_tokens=200_000,
                   completion_tokens=0, at=at)
    assert banded.amount == D("0.08")


def test_credit_grants_are_applied_oldest_expiry_first_and_once_per_reference(org):
    """Grants: A 10.00 expiring Mar 1, B 20.00 expiring Feb 1, C 5.00 never expiring,
    D 50.00 expired Jan 10. Applying 25.00 on Jan 20 takes B (20.00, expires first), then
    5.00 of A; D is expired, C (no expiry) is last. Applying the same reference again takes
    nothing more. Balance afterwards: A 5.00 + C 5.00 = 10.00.
    """
    jan = datetime(2025, 1, 1, tzinfo=UTC)
    a = services.credit_grant_create(organization=org, kind="promotional", amount="10.00",
                                     granted_at=jan, expires_at=datetime(2025, 3, 1, tzinfo=UTC))
    b = services.credit_grant_create(organization=org, kind="purchased", amount="20.00",
                                     granted_at=jan, expires_at=datetime(2025, 2, 1, tzinfo=UTC))
    c = services.credit_grant_create(organization=org, kind="credit_note", amount="5.00",
                                     granted_at=jan)
    services.credit_grant_create(organization=org, kind="promotional", amount="50.00",
                                 granted_at=jan, expires_at=jan + timedelta(days=9))
    at = datetime(2025, 1, 20, tzinfo=UTC)
    applied = services.credit_grants_apply(organization=org, currency="USD",
                                           amount=D("25.00"), reference="invoice:1", at=at)
    assert [(x.grant_id, x.amount) for x in applied] == [(b.pk, D("20.00")), (a.pk, D("5.00"))]
    again = services.credit_grants_apply(organization=org, currency="USD",
                                         amount=D("25.00"), reference="invoice:1", at=at)
    assert [x.pk for x in again] == [x.pk for x in applied]
    remaining = dict(CreditGrant.objects.values_list("pk", "remaining"))
    assert (remaining[a.pk], remaining[b.pk], remaining[c.pk]) == (D("5"), D("0"), D("5"))
    assert credit_balance(organization=org, at=at) == {"USD": D("10.00")}
