"""Hostile tenants against ``GET /api/v1/usage``: one request cannot make the platform sum an
unbounded range, answer an unbounded number of groups or expand an unbounded filter list.
Each bound is refused with a 400 in DRF's shape that names the parameter and the bound, before
any rollup is read where that can be known up front; what fits still answers in full.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from metering import events, services
from tests.factories import ProjectFactory, make_key, make_price_book

MODELS = ("m-a", "m-b", "m-c", "m-d", "m-e")


@pytest.fixture
def reader(db):
    """An organization with usage of five models in the last hours; an admin key's secret."""
    make_price_book(prices=[{"model": m, "input": "1.00", "output": "2.00"} for m in MODELS])
    project = ProjectFactory()
    key, secret = make_key(project, scopes=["inference", "admin"])
    now = datetime.now(UTC)
    services.usage_events_record([events.normalize({
        "request_id": f"req-bound-{i}", "org_id": project.organization_id,
        "project_id": project.id, "api_key_id": key.id, "model": MODELS[i % len(MODELS)],
        "region": "us-east", "data_zone": "global", "engine": "sim-0", "prompt_tokens": 10,
        "cached_tokens": 0, "completion_tokens": 5, "event_time": now - timedelta(minutes=i),
    }) for i in range(10)], origin="test")
    return secret


def _get(api_client, secret: str, **params: str):
    return api_client.get("/api/v1/usage", params, HTTP_AUTHORIZATION=f"Bearer {secret}")


def _refused(reply, *, param: str, code: str, says: str) -> None:
    assert reply.status_code == 400, reply.content
    body = reply.json()
    assert body["param"] == param and body["code"] == code
    assert says in body["detail"]


def test_a_range_beyond_the_bound_is_refused_and_one_within_it_answers(api_client, reader):
    # when a tenant asks for ten years at once, and then for exactly the longest range allowed
    decade = _get(api_client, reader, start="2016-01-01", end="2026-01-01")
    year = _get(api_client, reader, start=_day(-365), end=_day(1))

    # then the decade is refused, saying the bound; the year answers with the usage
    _refused(decade, param="end", code="usage_range_too_large", says="at most 366 days")
    assert year.status_code == 200, year.content
    assert year.json()["totals"][0]["requests"] == 10


def test_hourly_groups_over_a_long_range_are_refused_before_any_query(
        api_client, reader, settings, django_assert_max_num_queries):
    # given answers of at most 1000 groups
    settings.METERING_USAGE_MAX_GROUPS = 1000

    # when a tenant groups 60 days by hour (1440 buckets), then by day
    with django_assert_max_num_queries(3):  # the key and the organization, no rollup
        hourly = _get(api_client, reader, start=_day(-59), end=_day(1), group_by="hour")
    daily = _get(api_client, reader, start=_day(-59), end=_day(1), group_by="day")

    # then the hourly read is refused up front, the daily one answers
    _refused(hourly, param="group_by", code="usage_too_many_groups", says="1440 groups")
    assert daily.status_code == 200 and daily.json()["totals"][0]["requests"] == 10


def test_more_groups_than_one_answer_holds_are_refused_not_truncated(
        api_client, reader, settings):
    # given answers of at most 4 groups, and usage of 5 models
    settings.METERING_USAGE_MAX_GROUPS = 4

    # when the tenant groups by model, then filters to 4 of them
    all_models = _get(api_client, reader, group_by="model")
    four = _get(api_client, reader, group_by="model", model=",".join(MODELS[:4]))

    # then the 5 groups are refused (never silently cut to 4), and the 4 answer in full
    _refused(all_models, param="group_by", code="usage_too_many_groups",
             says="more than 4 groups")
    assert four.status_code == 200
    assert sorted(b["model"] for b in four.json()["data"]) == list(MODELS[:4])


def test_filter_lists_are_bounded(api_client, reader, settings):
    # given filters of at most 100 values
    # when a tenant sends 5,000 made-up key ids, and 5,000 model names
    keys = _get(api_client, reader, key=",".join(f"key_{i:024d}" for i in range(5000)))
    models = _get(api_client, reader, model=",".join(f"model-{i}" for i in range(5000)))
    repeated = _get(api_client, reader, model=",".join(["m-a"] * 5000))

    # then both are refused by their parameter, and repeats count once
    _refused(keys, param="key", code="too_many_values", says="at most 100")
    _refused(models, param="model", code="too_many_values", says="5000 values")
    assert repeated.status_code == 200 and repeated.json()["totals"][0]["requests"] == 2


def _day(offset: int) -> str:
    return (datetime.now(UTC) + timedelta(days=offset)).date().isoformat()
