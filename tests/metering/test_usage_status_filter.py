"""``GET /api/v1/usage?status=`` and the console explorer's outcome filter: the tokens and
amounts of the requests that ended so, read from the events (the rollups count outcomes, not
their tokens), equal to those events' sums; bounded to 31 days; an unknown status a 400."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from billing_platform.accounts.choices import Role
from metering import events
from metering.recording import record_events
from tests.factories import MembershipFactory, OrganizationFactory, ProjectFactory, make_key

STATUSES = ["ok", "ok", "engine_error", "client_aborted"]


def _auth(secret: str) -> dict[str, str]:
    return {"HTTP_AUTHORIZATION": f"Bearer {secret}"}


@pytest.fixture
def outcomes(tenant):
    """12 events in the last hours, 3 per status in turn (i % 4), output 10 + i tokens; and one
    engine_error of another organization."""
    hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - timedelta(hours=2)
    batch = [events.normalize(tenant.event(f"st-{i}", status=STATUSES[i % 4],
                                           completion_tokens=10 + i,
                                           event_time=hour + timedelta(minutes=5 * i)))
             for i in range(12)]
    other = ProjectFactory(organization=OrganizationFactory())
    other_key, _ = make_key(other)
    batch.append(events.normalize({**tenant.event("st-other", status="engine_error",
                                                  completion_tokens=999, event_time=hour),
                                   "org_id": other.organization_id, "project_id": other.id,
                                   "api_key_id": other_key.id}))
    assert len(record_events(batch, origin="api").recorded) == 13
    return tenant, hour


def test_the_status_filter_sums_only_the_requests_that_ended_so(api_client, outcomes):
    tenant, hour = outcomes
    params = {"start": hour.isoformat(), "group_by": "model"}

    def read(**extra):
        reply = api_client.get("/api/v1/usage", {**params, **extra}, **_auth(tenant.secret))
        assert reply.status_code == 200, reply.json()
        (bucket,) = reply.json()["data"]
        return bucket

    everything = read()
    failed = read(status="engine_error")
    finished = read(status="ok,client_aborted")

    # then each status's tokens are its own events' (i = 2, 6, 10 ended engine_error)
    assert (failed["requests"], failed["error_requests"]) == (3, 3)
    assert failed["completion_tokens"] == 12 + 16 + 20  # not the other org's 999
    assert finished["requests"] == 9 and finished["error_requests"] == 0
    assert finished["completion_tokens"] + failed["completion_tokens"] == sum(
        10 + i for i in range(12)) == everything["completion_tokens"]
    assert Decimal(finished["amount"]) + Decimal(failed["amount"]) == Decimal(
        everything["amount"])


@pytest.mark.parametrize(("extra", "param", "says"), [
    ({"status": "exploded"}, "status", "Unknown status 'exploded'"),
    ({"status": "ok", "start": "2026-01-01", "end": "2026-03-01"}, "end",
     "Filtering by status sums the recorded events themselves"),
])
def test_an_unknown_status_or_a_long_status_range_is_a_400_naming_it(api_client, tenant, extra,
                                                                      param, says):
    reply = api_client.get("/api/v1/usage", extra, **_auth(tenant.secret))

    assert reply.status_code == 400
    assert says in str(reply.json()) and param in str(reply.json())


def test_the_console_explorers_outcome_filter_is_the_apis(client, outcomes):
    tenant, hour = outcomes
    client.force_login(MembershipFactory(organization=tenant.org, role=Role.VIEWER).user)
    day = hour.date().isoformat()

    page = client.get("/console/usage/", {"start": day, "through": day, "group": "model",
                                          "split": "", "status": "engine_error"})

    body = page.content.decode()
    assert page.status_code == 200
    assert 'value="engine_error" selected' in body
    assert "status=engine_error" in body  # the API link and the CSV carry the filter
    csv = client.get("/console/usage/", {"start": day, "through": day, "group": "model",
                                         "split": "", "status": "engine_error",
                                         "format": "csv"})
    rows = b"".join(csv.streaming_content).decode().splitlines()
    assert len(rows) == 2 and ",3,3,0," in rows[1]  # requests, failed, aborted
