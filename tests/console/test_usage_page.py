"""Console usage page: this month's usage per model and day, equal to the recorded events."""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime
from decimal import Decimal

import pytest

from metering import events, services
from tests.factories import MembershipFactory, make_price_book

pytestmark = pytest.mark.django_db(transaction=True)


def _record(org, request_id: str, **fields) -> None:
    event = {"request_id": request_id, "org_id": org.id, "project_id": org.projects.get().id,
             "model": "page-model", "region": "us-east", "event_time": datetime.now(UTC),
             "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0, **fields}
    assert services.usage_events_record([events.normalize(event)], origin="test").recorded


def test_usage_page_shows_the_months_usage_and_csv_sums_to_it(client):
    # given priced usage: 3 requests, 1,000,000 input tokens (250,000 cached), 40,000 output
    make_price_book(prices=[{"model": "page-model", "input": "2.00",
                             "cached_input": "0.50", "output": "8.00"}])
    member = MembershipFactory()
    org = member.organization
    org.projects.create(name="Default project")
    _record(org, "r1", prompt_tokens=500_000, cached_tokens=250_000, completion_tokens=20_000)
    _record(org, "r2", prompt_tokens=250_000, completion_tokens=10_000)
    _record(org, "r3", prompt_tokens=250_000, completion_tokens=10_000)
    other = MembershipFactory()
    other.organization.projects.create(name="p")
    _record(other.organization, "x1", prompt_tokens=999_999)
    client.force_login(member.user)

    # when the member opens the usage page
    page = client.get("/console/usage/").content.decode()

    # then: (750,000 x 2.00 + 250,000 x 0.50 + 40,000 x 8.00) / 1e6 = 1.50 + 0.125 + 0.32
    #       = 1.945 -> shown as 1.95 USD; hit rate 250,000 / 1,000,000 = 25 %
    assert "page-model" in page and "1000000" in page
    assert "1.95 USD" in page and "25%" in page
    assert "999999" not in page  # another org's usage never shows
    rows = list(csv.DictReader(io.StringIO(client.get("/console/usage/?format=csv")
                                           .content.decode())))
    assert sum(Decimal(r["amount"]) for r in rows) == Decimal("1.945")
    assert sum(int(r["requests"]) for r in rows) == 3
