"""Fixtures of the invoicing tests: a priced catalogue and a month of rated usage."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

# the live gateway (uvicorn in front of simulated engines) of the gateway tests
from tests.gateway.conftest import live_gateway  # noqa: F401

OCT = datetime(2026, 10, 1, tzinfo=UTC)
NOV = datetime(2026, 11, 1, tzinfo=UTC)
DEC = datetime(2026, 12, 1, tzinfo=UTC)


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
