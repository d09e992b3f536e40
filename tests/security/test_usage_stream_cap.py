"""A tenant flooding requests while the usage consumer is down cannot grow the usage stream past
its cap (Redis memory stays bounded for everyone's rate limits, budgets and the broker), and the
cap never costs an event: entries the consumer group has not recorded (undelivered, or
delivered and pending acknowledgement) are never trimmed; events that do not fit go to
PostgreSQL directly. The alarm (a log line and metrics) comes before the cap.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime

import httpx
import openai
import pytest

from metering import conf, services, stream
from metering.ingest import Ingestor
from metering.metrics import STREAM_FULL
from metering.models import UsageEvent
from tests.factories import OrganizationFactory, ProjectFactory, make_key, make_price_book
from tests.gateway.conftest import (
    drain_usage,
    live_gateway,  # noqa: F401
)


def _event(key, n: int) -> dict:
    return {"request_id": f"req-cap-{n}", "org_id": key.organization_id,
            "project_id": key.project_id, "api_key_id": key.id, "model": "test-model",
            "region": "us-east", "data_zone": "global", "engine": "sim-0", "prompt_tokens": 10,
            "cached_tokens": 0, "completion_tokens": 5, "event_time": datetime.now(UTC)}


def test_at_the_cap_pending_entries_stay_and_events_go_to_postgres(
        transactional_db, metering_stream, settings, caplog):
    # given a stream capped at 5 entries with an alarm at 4, and a consumer that read 3 of the
    # first 4 entries and died before acknowledging them (the group's pending entries)
    make_price_book()
    key, _secret = make_key(ProjectFactory())
    settings.METERING_STREAM_MAX_LENGTH = 5
    settings.METERING_STREAM_ALARM_LENGTH = 4
    r = stream.client()
    stream.ensure_group(r)
    for n in range(4):
        assert services.usage_event_append(_event(key, n)) == "redis"
    r.xreadgroup(conf.consumer_group(), "dead-consumer", {conf.stream_key(): ">"}, count=3)
    refused_before = STREAM_FULL._value.get()

    # when the tenant's requests keep coming (8 more events) with no consumer running
    with caplog.at_level(logging.WARNING, logger="metering"):
        paths = [services.usage_event_append(_event(key, n)) for n in range(4, 12)]

    # then the stream stopped at its cap, without trimming: the 3 pending entries and the
    # undelivered one are still there, and the rest went to PostgreSQL, each once
    assert paths == ["redis"] + ["postgres"] * 7
    assert r.xlen(conf.stream_key()) == 5
    assert r.xpending(conf.stream_key(), conf.consumer_group())["pending"] == 3
    on_stream = [stream_entry_request_id(fields) for _id, fields in r.xrange(conf.stream_key())]
    assert on_stream == [f"req-cap-{n}" for n in range(5)]
    assert set(UsageEvent.objects.values_list("request_id", flat=True)) == {
        f"req-cap-{n}" for n in range(5, 12)}
    # the alarm came first (length 4 and 5 reached), then the refusal, both logged and counted
    messages = [rec.getMessage() for rec in caplog.records]
    assert any("usage stream holds 4 entries (alarm at 4, cap 5)" in m for m in messages)
    assert any("usage stream full" in m for m in messages)
    assert STREAM_FULL._value.get() == refused_before + 1

    # when a consumer comes back (reclaiming the dead one's pending entries)
    Ingestor(block_ms=100, claim_idle_ms=0).run(drain=True)

    # then every one of the 12 events is recorded exactly once
    recorded = list(UsageEvent.objects.values_list("request_id", flat=True))
    assert sorted(recorded) == sorted(f"req-cap-{n}" for n in range(12))
    assert r.xlen(conf.stream_key()) == 0


def test_a_batch_that_does_not_fit_is_appended_whole_elsewhere(
        transactional_db, metering_stream, settings):
    # given a stream capped at 5 that holds 3 entries
    make_price_book()
    key, _secret = make_key(ProjectFactory())
    settings.METERING_STREAM_MAX_LENGTH = 5
    assert services.usage_events_append([_event(key, n) for n in range(3)]) == "redis"

    # when a batch runner appends 4 finished lines at once
    path = services.usage_events_append([_event(key, n) for n in range(3, 7)])

    # then none of them is on the stream (all or none), and all 4 are in PostgreSQL
    assert path == "postgres"
    assert stream.client().xlen(conf.stream_key()) == 3
    assert UsageEvent.objects.count() == 4


@pytest.fixture
def gateway_env() -> dict[str, str]:
    return {"TOLLGATE_USAGE_STREAM_MAX_LENGTH": "3", "TOLLGATE_USAGE_STREAM_ALARM_LENGTH": "2"}


def test_a_flood_through_the_gateway_with_the_consumer_down_loses_nothing(
        live_gateway):  # noqa: F811 - the fixture, imported above
    # given a gateway whose usage stream is capped at 3, with no consumer running, and a
    # flooding tenant beside a quiet one
    flooder = make_key(ProjectFactory(organization=OrganizationFactory()))[1]
    quiet = make_key(ProjectFactory(organization=OrganizationFactory()))[1]

    def ask(secret: str) -> str:
        client = openai.OpenAI(base_url=f"{live_gateway.url}/v1", api_key=secret,
                               max_retries=0)
        raw = client.chat.completions.with_raw_response.create(
            model="small", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        return raw.headers["x-request-id"]

    # when the flooder sends 8 requests, then the quiet tenant one
    flood = [ask(flooder) for _ in range(8)]
    time.sleep(stream.BREAKER_OPEN_S)  # past the breaker the refusal opened: Redis is asked
    quiet_id = ask(quiet)

    # then every request was served, the stream never passed its cap, and the operator was told
    r = stream.client()
    assert r.xlen(conf.stream_key()) == 3
    scrape = httpx.get(f"{live_gateway.url}/metrics", timeout=30).text
    assert "tollgate_usage_stream_max_length_events 3.0" in scrape
    assert _sample(scrape, "tollgate_usage_stream_full_total") >= 1
    assert "usage stream full" in live_gateway.log()
    assert "usage stream holds 2 entries (alarm at 2, cap 3)" in live_gateway.log()

    # and once the consumer runs, each request is recorded exactly once
    drain_usage()
    recorded = list(UsageEvent.objects.values_list("request_id", flat=True))
    assert sorted(recorded) == sorted([*flood, quiet_id])


def stream_entry_request_id(fields: dict) -> str:
    from metering import events

    return events.decode_row(fields[stream.FIELD])[events.I_REQUEST]


def _sample(scrape: str, name: str) -> float:
    for line in scrape.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not exported")
