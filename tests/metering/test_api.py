"""The usage API: external ingest (bulk, idempotent, per-event errors) and usage read-out."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import httpx
import pytest
from django.db.models import Count, Q, Sum
from django.db.models.functions import TruncDay

from billing_platform.accounts.choices import Role
from metering import events, services
from metering.models import UsageEvent, UsageRollupHourly
from tests.factories import MembershipFactory, UserFactory, make_key

URL = "/api/v1/usage/events"


def _auth(secret: str) -> dict[str, str]:
    return {"HTTP_AUTHORIZATION": f"Bearer {secret}"}


def _external(event_id: str, **overrides) -> dict:
    event = {"id": event_id, "model": "test-model", "prompt_tokens": 1200,
             "cached_tokens": 200, "completion_tokens": 300,
             "event_time": datetime.now(UTC).isoformat()}
    event.update(overrides)
    return event


def test_100_duplicate_submissions_of_one_event_make_one_row(live_server, tenant):
    # given one event, submitted 100 times by 10 concurrent clients (a retrying engine)
    body = {"events": [_external("evt-dup")]}
    headers = {"Authorization": f"Bearer {tenant.secret}"}

    def submit(_: int) -> dict:
        reply = httpx.post(f"{live_server.url}{URL}", json=body, headers=headers, timeout=30)
        assert reply.status_code == 200, reply.text
        return reply.json()

    with ThreadPoolExecutor(max_workers=10) as pool:
        replies = list(pool.map(submit, range(100)))

    # then one submission recorded it, 99 were told it was a duplicate, and one row exists
    statuses = [r["data"][0]["status"] for r in replies]
    assert statuses.count("recorded") == 1 and statuses.count("duplicate") == 99
    assert {r["data"][0]["id"] for r in replies} == {"evt-dup"}  # the caller's own id back
    assert UsageEvent.objects.filter(request_id="ext:evt-dup").count() == 1
    assert UsageRollupHourly.objects.aggregate(n=Sum("requests"))["n"] == 1


def test_invalid_events_are_reported_by_index_and_the_valid_ones_recorded(api_client, tenant):
    body = {"events": [
        _external("evt-0"),
        _external("evt-1", prompt_tokens=-5),
        "not an object",
        _external("evt-3", cached_tokens=5000),
        _external("evt-4", project="proj_nope"),
        _external("evt-5", api_key=tenant.key2.public_id),
        _external("evt-6", model="unpriced-model"),
        _external("evt-0"),
        _external("evt-8", reasoning_tokens=120),
        _external("evt-9", reasoning_tokens=301),  # more than the completion holds
    ]}

    reply = api_client.post(URL, body, format="json", **_auth(tenant.secret))

    assert reply.status_code == 200
    data = reply.json()
    assert [(d["index"], d["status"]) for d in data["data"]] == [
        (0, "recorded"), (5, "recorded"), (7, "duplicate"), (8, "recorded")]
    assert [(e["index"], e["code"]) for e in data["errors"]] == [
        (1, "invalid"), (2, "invalid"), (3, "invalid"), (4, "invalid"), (6, "not_rated"),
        (9, "invalid")]
    assert "prompt_tokens" in data["errors"][0]["errors"]
    assert "cached_tokens" in data["errors"][2]["errors"]
    assert "project" in data["errors"][3]["errors"]
    assert "reasoning_tokens" in data["errors"][5]["errors"]
    assert data["recorded"] == 3 and data["duplicates"] == 1 and data["rejected"] == 6
    # the key's project by default; a named key brings its own project
    stored = {events.caller_event_id(e.request_id): e for e in UsageEvent.objects.all()}
    assert stored["evt-0"].project_id == tenant.project.id
    assert stored["evt-0"].api_key_id is None and stored["evt-0"].source == "external"
    assert stored["evt-5"].project_id == tenant.project2.id
    assert stored["evt-5"].api_key_id == tenant.key2.id
    assert (stored["evt-8"].reasoning_tokens, stored["evt-0"].reasoning_tokens) == (120, 0)


def test_ingest_is_bulk_up_to_10000(api_client, tenant):
    now = datetime.now(UTC).isoformat()
    body = {"events": [_external(f"evt-{i}", event_time=now) for i in range(10_000)]}

    reply = api_client.post(URL, body, format="json", **_auth(tenant.secret))
    too_many = api_client.post(URL, {"events": [*body["events"], _external("evt-x")]},
                               format="json", **_auth(tenant.secret))

    assert reply.status_code == 200 and reply.json()["recorded"] == 10_000
    assert UsageEvent.objects.count() == 10_000
    assert too_many.status_code == 400


def test_who_may_report_usage(api_client, tenant):
    body = {"events": [_external("evt-auth")]}
    _key, inference_only = make_key(tenant.project, scopes=["inference"])
    developer = UserFactory()
    MembershipFactory(user=developer, organization=tenant.org, role=Role.DEVELOPER)
    admin = UserFactory()
    MembershipFactory(user=admin, organization=tenant.org, role=Role.ADMIN)

    assert api_client.post(URL, body, format="json").status_code in (401, 403)
    assert api_client.post(URL, body, format="json",
                           **_auth(inference_only)).status_code == 403
    api_client.force_login(developer)
    assert api_client.post(URL, body, format="json").status_code == 403
    api_client.force_login(admin)
    without_project = api_client.post(URL, body, format="json")
    assert without_project.json()["errors"][0]["errors"] == {
        "project": ["project is required."]}
    body["events"][0]["project"] = tenant.project.public_id
    reply = api_client.post(URL, {**body, "organization": tenant.org.public_id}, format="json")
    assert reply.status_code == 200 and reply.json()["recorded"] == 1


# --- GET /api/v1/usage -----------------------------------------------------------------------

@pytest.fixture
def usage(tenant):
    """Record 400 varied events over the last 20 days; return the tenant."""
    rng = random.Random(5)
    now = datetime.now(UTC)
    batch = []
    for i in range(400):
        project, key = rng.choice([(tenant.project, tenant.key), (tenant.project2, tenant.key2)])
        prompt = rng.randrange(1, 3000)
        batch.append(events.normalize(tenant.event(
            f"req-{i}", project_id=project.id, api_key_id=key.id,
            model=rng.choice(["test-model", "big-model"]),
            service_tier=rng.choice(["default", "priority", "flex"]), prompt_tokens=prompt,
            cached_tokens=rng.randrange(prompt + 1), completion_tokens=rng.randrange(500),
            event_time=now - timedelta(hours=rng.randrange(24 * 20), minutes=rng.randrange(60)),
        )))
    services.usage_events_record(batch, origin="test")
    return tenant


def _expected(q: Q, *group: str) -> dict[tuple, dict]:
    qs = UsageEvent.objects.filter(q).annotate(day=TruncDay("event_time", tzinfo=UTC))
    rows = qs.values(*group).annotate(requests=Count("id"), prompt_tokens=Sum("prompt_tokens"),
                                      cached_tokens=Sum("cached_tokens"),
                                      completion_tokens=Sum("completion_tokens"),
                                      amount=Sum("amount"))
    def plain(value):
        return value.date() if isinstance(value, datetime) else value

    return {tuple(plain(r[g]) for g in group): r for r in rows}


def test_usage_numbers_equal_the_sums_of_the_events(api_client, usage):
    # when usage is read per day and model, and per project and key
    by_day = api_client.get("/api/v1/usage", {"group_by": "day,model", "start": _days_ago(30)},
                            **_auth(usage.secret)).json()
    by_key = api_client.get("/api/v1/usage", {"group_by": "project,key",
                                              "start": _days_ago(30)},
                            **_auth(usage.secret)).json()

    # then each bucket equals the sum over its events
    expected = _expected(Q(), "day", "model")
    assert len(by_day["data"]) == len(expected)
    for b in by_day["data"]:
        e = expected[(datetime.fromisoformat(b["day"]).date(), b["model"])]
        assert b["requests"] == e["requests"]
        assert b["prompt_tokens"] == e["prompt_tokens"]
        assert b["cached_tokens"] == e["cached_tokens"]
        assert b["completion_tokens"] == e["completion_tokens"]
        assert b["total_tokens"] == e["prompt_tokens"] + e["completion_tokens"]
        assert Decimal(b["amount"]) == e["amount"]
    keys = {b["key"]: b["requests"] for b in by_key["data"]}
    assert keys == {usage.key.public_id: UsageEvent.objects.filter(api_key=usage.key).count(),
                    usage.key2.public_id: UsageEvent.objects.filter(api_key=usage.key2).count()}
    total = by_day["totals"][0]
    assert total["requests"] == 400 and total["currency"] == "USD"
    assert Decimal(total["amount"]) == UsageEvent.objects.aggregate(a=Sum("amount"))["a"]


def _days_ago(n: int) -> str:
    return (datetime.now(UTC) - timedelta(days=n)).date().isoformat()


def test_usage_filters(api_client, usage):
    start = (datetime.now(UTC) - timedelta(days=7)).replace(minute=0, second=0, microsecond=0)
    params = {"project": usage.project.public_id, "model": "big-model",
              "service_tier": "priority,flex", "start": start.isoformat(),
              "key": usage.key.public_id}

    reply = api_client.get("/api/v1/usage", params, **_auth(usage.secret))

    assert reply.status_code == 200, reply.content
    expected = UsageEvent.objects.filter(
        project=usage.project, model="big-model", service_tier__in=["priority", "flex"],
        api_key=usage.key, event_time__gte=start,
    ).aggregate(n=Count("id"), p=Sum("prompt_tokens"))
    totals = reply.json()["totals"]
    assert totals[0]["requests"] == expected["n"] > 0
    assert totals[0]["prompt_tokens"] == expected["p"]


def test_usage_read_key_sees_only_its_project(api_client, usage):
    _key, reader = make_key(usage.project2, scopes=["usage:read"])
    _key, neither = make_key(usage.project2, scopes=["inference"])

    mine = api_client.get("/api/v1/usage", {"start": _days_ago(30)}, **_auth(reader))
    other = api_client.get("/api/v1/usage", {"project": usage.project.public_id},
                           **_auth(reader))

    assert mine.json()["totals"][0]["requests"] == UsageEvent.objects.filter(
        project=usage.project2).count()
    probe = api_client.get("/api/v1/usage", {"key": usage.key.public_id}, **_auth(reader))
    assert other.status_code == 404
    assert probe.status_code == 400  # another project's key is as unknown as a made-up one
    assert api_client.get("/api/v1/usage", **_auth(neither)).status_code == 403


def test_usage_member_session_and_bad_parameters(api_client, usage):
    viewer = UserFactory()
    MembershipFactory(user=viewer, organization=usage.org, role=Role.VIEWER)
    api_client.force_login(viewer)

    ok = api_client.get("/api/v1/usage", {"start": _days_ago(30), "group_by": "service_tier"})
    off_hour = api_client.get("/api/v1/usage", {"start": "2026-01-01T10:30:00Z"})
    bad_group = api_client.get("/api/v1/usage", {"group_by": "colour"})
    stranger = api_client.get("/api/v1/usage", {"organization": "org_not_mine"})

    assert ok.status_code == 200
    assert sum(b["requests"] for b in ok.json()["data"]) == 400
    assert off_hour.status_code == 400 and off_hour.json()["param"] == "start"
    assert bad_group.status_code == 400 and bad_group.json()["param"] == "group_by"
    assert stranger.status_code == 404


def test_usage_api_is_in_the_openapi_schema(api_client):
    schema = api_client.get("/api/v1/schema/", {"format": "json"}).json()

    assert "post" in schema["paths"]["/api/v1/usage/events"]
    assert "get" in schema["paths"]["/api/v1/usage"]


def test_an_event_from_before_the_organization_existed_is_refused(api_client, tenant):
    # given a tenant created just now that backdates usage (which no invoice period could hold)
    early = tenant.org.created_at - timedelta(days=2)
    body = {"events": [_external("evt-early", event_time=early.isoformat()),
                       _external("evt-now")]}
    reply = api_client.post(URL, body, format="json", **_auth(tenant.secret)).json()
    # then the backdated one is refused by name and only the other is stored
    assert [(e["id"], list(e["errors"])) for e in reply["errors"]] == [
        ("evt-early", ["event_time"])]
    assert reply["recorded"] == 1
    assert not UsageEvent.objects.filter(request_id="ext:evt-early").exists()
