"""Fixtures of the invoicing tests: a priced catalogue and a month of rated usage.

Every test here that touches the database ends with the billing invariant: whatever it
recorded, closed, voided or left open, each organization's rated usage equals what its
invoices and its draft bill (``billing_invariant_holds``). So the invariant is checked over
all the data the invoicing suite creates, test by test, before pytest-django rolls it back.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

# the live gateway (uvicorn in front of simulated engines) of the gateway tests
from tests.gateway.conftest import live_gateway  # noqa: F401

OCT = datetime(2026, 10, 1, tzinfo=UTC)
NOV = datetime(2026, 11, 1, tzinfo=UTC)
DEC = datetime(2026, 12, 1, tzinfo=UTC)


@pytest.fixture(autouse=True)
def billing_invariant_holds(request) -> Iterator[None]:
    """After each database test: rated = billed for every organization, to the cent."""
    marker = request.node.get_closest_marker("django_db")
    names = request.fixturenames
    if "transactional_db" in names or (marker is not None and marker.kwargs.get("transaction")):
        request.getfixturevalue("transactional_db")  # torn down (flushed) after this check
    elif "db" in names or marker is not None:
        request.getfixturevalue("db")  # rolled back after this check
    else:
        yield
        return
    yield
    from billing_platform.invoicing.invariants import billing_invariant_check

    differences = billing_invariant_check()
    assert differences == [], f"rated usage differs from what is billed: {differences}"


@pytest.fixture
def catalog(db):
    """The default USD book: m-small 1.00/2.00 (cached 0.10 by default), m-big 3/0.30/15."""
    from tests.factories import make_price_book

    return make_price_book(prices=[
        {"model": "m-small", "input": "1.00", "output": "2.00"},
        {"model": "m-big", "input": "3.00", "cached_input": "0.30", "output": "15.00"},
    ])


def record(org, request_id: str, when: datetime, **fields) -> None:
    """Record one usage event through metering's real record path (rated, rolled up)."""
    from metering import events, services

    event = {"request_id": request_id, "org_id": org.id,
             "project_id": org.projects.first().id, "model": "m-small", "region": "us-east",
             "event_time": when, "prompt_tokens": 0, "cached_tokens": 0,
             "completion_tokens": 0}
    event.update(fields)
    result = services.usage_events_record([events.normalize(event)], origin="test")
    assert len(result.recorded) == 1, result
