"""The record path: exactly once, rated, rollups equal to the events, monthly partitions."""

from __future__ import annotations

import importlib
import random
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.db import connection
from django.db.models import Count, Sum

from billing_platform.errors import InvalidRequest
from metering import events, partitions, services
from metering.models import UsageDeadLetter, UsageEvent, UsageEventId, UsageRollupHourly

SUMMED = ("prompt_tokens", "cached_tokens", "completion_tokens", "normalized_tokens", "amount",
          "credits_consumed", "cost_to_serve")
CLASSES = ("input", "cached_input", "output")
DIMENSIONS = ("organization_id", "project_id", "api_key_id", "model", "region", "service_tier",
              "capacity_source", "currency")


def _varied_events(tenant, n: int, *, seed: int = 1) -> list[events.UsageEventData]:
    rng = random.Random(seed)
    now = datetime.now(UTC)
    out = []
    for i in range(n):
        project, key = rng.choice([(tenant.project, tenant.key), (tenant.project2, tenant.key2),
                                   (tenant.project, None)])
        prompt = rng.randrange(1, 5000)
        out.append(events.normalize(tenant.event(
            f"req-{seed}-{i}", project_id=project.id, api_key_id=key.id if key else None,
            model=rng.choice(["test-model", "big-model"]),
            region=rng.choice(["us-east", "eu-west"]),
            service_tier=rng.choice(["default", "priority", "flex", "batch"]),
            status=rng.choice(["ok", "ok", "ok", "client_aborted", "engine_error"]),
            prompt_tokens=prompt, cached_tokens=rng.randrange(0, prompt + 1),
            completion_tokens=rng.randrange(0, 900),
            event_time=now - timedelta(hours=rng.randrange(0, 24 * 45), seconds=rng.random()),
            cost_to_serve=f"0.{rng.randrange(10**9):09d}",
        )))
    return out


def _rollups_by_key() -> dict[tuple, dict]:
    out = {}
    for r in UsageRollupHourly.objects.values():
        out[(*(r[d] for d in DIMENSIONS), r["hour"])] = r
    return out


def _events_by_key() -> dict[tuple, dict]:
    from django.db.models.functions import TruncHour

    rows = (UsageEvent.objects.annotate(hour=TruncHour("event_time", tzinfo=UTC))
            .values(*DIMENSIONS, "hour")
            .annotate(requests=Count("id"), **{f"s_{c}": Sum(c) for c in SUMMED}))
    return {(*(r[d] for d in DIMENSIONS), r["hour"]): r for r in rows}


def test_rollups_equal_the_sums_of_the_events_and_survive_redelivery(tenant):
    # given 600 events over 45 days, several projects, keys, models, regions and tiers
    batch = _varied_events(tenant, 600)

    # when they are recorded, then recorded again (a redelivered batch) and in another order
    first = services.usage_events_record(batch, origin="test")
    again = services.usage_events_record(list(reversed(batch)), origin="test")

    # then every event is there once, and every hourly rollup equals its events' sums
    assert len(first.recorded) == 600 and not first.duplicates
    assert not again.recorded and len(again.duplicates) == 600
    assert UsageEvent.objects.count() == 600 == UsageEventId.objects.count()
    rollups, sums = _rollups_by_key(), _events_by_key()
    assert rollups.keys() == sums.keys()
    for key, ev in sums.items():
        roll = rollups[key]
        assert roll["requests"] == ev["requests"]
        for column in SUMMED:
            assert roll[column] == ev[f"s_{column}"], (key, column)
    assert sum(r["error_requests"] for r in rollups.values()) == sum(
        1 for e in batch if e.status == "engine_error")
    assert sum(r["aborted_requests"] for r in rollups.values()) == sum(
        1 for e in batch if e.status == "client_aborted")
    # and each rollup's amount, split by token class, equals its events' rating breakdowns
    by_class: dict[tuple, Decimal] = defaultdict(Decimal)
    for e in UsageEvent.objects.all():
        hour = e.event_time.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
        for cls, amount in e.rating_breakdown.items():
            by_class[(*(getattr(e, d) for d in DIMENSIONS), hour, cls)] += Decimal(amount)
    for key, roll in rollups.items():
        split = [roll[f"{cls}_amount"] for cls in CLASSES]
        assert split == [by_class[(*key, cls)] for cls in CLASSES], key
        assert sum(split) == roll["amount"], key
    assert sum(r["cached_input_amount"] for r in rollups.values()) > 0


def test_a_batch_mixing_recorded_and_new_events_records_only_the_new_ones(tenant):
    # given 300 of 600 events already recorded
    batch = _varied_events(tenant, 600, seed=7)
    services.usage_events_record(batch[::2], origin="test")

    # when the whole batch arrives (a replay that overlaps events the gateway sent since)
    result = services.usage_events_record(batch, origin="test")

    # then the other 300 are recorded, each once, rated as the first ones were, and the
    # rollups count every event once
    assert sorted(result.recorded) == sorted(e.key for e in batch[1::2])
    assert sorted(result.duplicates) == sorted(e.key for e in batch[::2])
    assert UsageEvent.objects.count() == 600 == UsageEventId.objects.count()
    assert UsageRollupHourly.objects.aggregate(n=Sum("requests"))["n"] == 600
    assert UsageEvent.objects.filter(amount__gt=0).count() > 500


def test_the_migration_backfill_rebuilds_the_token_class_split_from_the_events(tenant):
    services.usage_events_record(_varied_events(tenant, 200, seed=3), origin="test")
    columns = [f"{cls}_amount" for cls in CLASSES]
    before = {k: [r[c] for c in columns] for k, r in _rollups_by_key().items()}
    # given rollups written before the split existed
    UsageRollupHourly.objects.update(**dict.fromkeys(columns, 0))

    # when the migration's backfill runs
    migration = importlib.import_module(
        "metering.migrations.0004_rollup_amounts_by_token_class")
    with connection.cursor() as cur:
        cur.execute(migration.BACKFILL)

    # then every rollup has its split back
    assert {k: [r[c] for c in columns] for k, r in _rollups_by_key().items()} == before
    assert any(any(v) for v in before.values())


def test_events_are_rated_with_the_price_book_in_force(tenant):
    # given test-model at 1.00 in / 2.00 out per 1M (cached input 0.1 x input)
    event = events.normalize(tenant.event("req-rated", prompt_tokens=1_000_000,
                                          cached_tokens=400_000, completion_tokens=500_000))

    services.usage_events_record([event], origin="test")

    # then amount = 600k x 1.00 + 400k x 0.10 + 500k x 2.00, per 1M tokens
    stored = UsageEvent.objects.get(request_id="req-rated")
    assert stored.amount == Decimal("1.6400000000")
    assert stored.currency == "USD"
    assert stored.price_version_id is not None
    assert sum(Decimal(v) for v in stored.rating_breakdown.values()) == stored.amount
    assert stored.data_zone == tenant.org.data_zone


def test_an_engine_error_before_any_engine_is_recorded_with_zero_tokens(tenant):
    # given the gateway's event of a request that failed before an engine was chosen
    event = tenant.event("req-failed", region="", engine="", status="engine_error",
                         prompt_tokens=0, cached_tokens=0, completion_tokens=0)

    services.usage_events_record([events.normalize(event)], origin="test")

    stored = UsageEvent.objects.get(request_id="req-failed")
    assert (stored.status, stored.region, stored.amount) == ("engine_error", "", Decimal("0"))
    assert UsageRollupHourly.objects.get().error_requests == 1


def test_a_batch_of_rollups_with_blank_and_missing_dimensions_adds_up_per_row(tenant):
    # given one batch whose rollups differ: a failure before any engine (blank region), a
    # key-less event and two ordinary ones in one hour
    batch = [
        tenant.event("req-a", region="", engine="", status="engine_error", prompt_tokens=0,
                     cached_tokens=0, completion_tokens=0),
        tenant.event("req-b", api_key_id=None, prompt_tokens=7,
                     cached_tokens=0),
        tenant.event("req-c", prompt_tokens=100, cached_tokens=0, completion_tokens=10),
        tenant.event("req-d", prompt_tokens=50, cached_tokens=0, completion_tokens=5),
    ]

    services.usage_events_record([events.normalize(e) for e in batch], origin="test")

    # then each dimension's row holds exactly its events, the blank region and the missing
    # key kept as they came
    rows = {(r.region, r.api_key_id): (r.requests, r.error_requests, r.prompt_tokens)
            for r in UsageRollupHourly.objects.all()}
    assert rows == {
        ("", tenant.key.id): (1, 1, 0),
        ("us-east", None): (1, 0, 7),
        ("us-east", tenant.key.id): (2, 0, 150),
    }


def test_a_duplicate_inside_one_batch_is_recorded_once(tenant):
    event = events.normalize(tenant.event("req-twice"))

    result = services.usage_events_record([event, event], origin="test")

    assert result.recorded == [(tenant.org.id, "req-twice")]
    assert result.duplicates == [(tenant.org.id, "req-twice")]
    assert UsageRollupHourly.objects.get().requests == 1


def test_late_and_early_events_get_their_month_partition(transactional_db, tenant):
    # given events 11 months ago and 20 hours ahead (clock skew), months without partitions
    now = datetime.now(UTC)
    late = events.normalize(tenant.event("req-late", event_time=now - timedelta(days=330)))
    early = events.normalize(tenant.event("req-early", event_time=now + timedelta(hours=20)))

    services.usage_events_record([late, early], origin="test")

    months = partitions.existing()
    assert partitions.month_of(late.event_time) in months
    assert partitions.month_of(early.event_time) in months
    with connection.cursor() as cur:
        cur.execute(f"SELECT request_id FROM {partitions.partition_name(partitions.month_of(late.event_time))}")  # noqa: E501, S608
        assert cur.fetchall() == [("req-late",)]


def test_partitions_are_created_ahead(transactional_db):
    created_or_known = services.usage_partitions_ensure(months_ahead=2)

    current = partitions.month_of(datetime.now(UTC))
    expected = {partitions.add_months(current, n) for n in range(3)}
    assert expected <= partitions.existing()
    assert all(name.startswith("usage_event_y") for name in created_or_known)


def test_an_unpriced_event_is_dead_lettered_and_the_rest_recorded(tenant):
    # given a batch where one event uses a model no price book prices
    good = [events.normalize(tenant.event(f"req-ok-{i}")) for i in range(7)]
    bad = events.normalize(tenant.event("req-unpriced", model="nobody-prices-me"))

    result = services.usage_events_record([*good[:3], bad, *good[3:]], origin="test")

    assert len(result.recorded) == 7
    assert result.dead_lettered == [(tenant.org.id, "req-unpriced")]
    letter = UsageDeadLetter.objects.get()
    assert "nobody-prices-me" in letter.payload and letter.resolved_at is None

    # when the model gets a price and the dead letters are retried
    from tests.factories import make_price_book

    make_price_book(prices=[{"model": "nobody-prices-me", "input": "1", "output": "1"}])
    services.usage_dead_letter_retry(letter_id=letter.id, acting_user=None)

    assert UsageEvent.objects.filter(request_id="req-unpriced").count() == 1
    assert UsageDeadLetter.objects.get().resolved_at is not None
    assert UsageRollupHourly.objects.aggregate(n=Sum("requests"))["n"] == 8


@pytest.mark.parametrize(("field", "value"), [
    ("prompt_tokens", -1), ("cached_tokens", 5000), ("service_tier", "turbo"),
    ("status", "fine"), ("model", "tab\tmodel"), ("event_time", "yesterday"),
    ("event_time", "2001-01-01T00:00:00+00:00"), ("request_id", "x" * 129),
])
def test_invalid_events_are_refused_naming_the_field(tenant, field, value):
    with pytest.raises(InvalidRequest) as info:
        services.usage_event_append({**tenant.event("req-bad"), field: value})

    assert info.value.param == field


def test_wire_form_round_trips(tenant):
    event = events.normalize(tenant.event("req-wire", batch_id="batch_1", queue_ms=None))

    assert events.decode(events.encode(event)) == event


def test_an_event_outside_its_sources_id_space_is_refused(tenant):
    # the external namespace is the usage API's alone, and the usage API has no other
    for event in (tenant.event("ext:req-1"), tenant.event("req-2", source="external")):
        with pytest.raises(InvalidRequest) as info:
            services.usage_event_append(event)
        assert info.value.param == "request_id"

    assert services.usage_event_append(
        tenant.event(events.external_request_id("req-2"), source="external")) == "redis"
