"""The end user and the reasoning tokens on usage events (issue 20 items 4 and 5: OpenAI's
``user``, the engine's reasoning count): bounded and checked by ``events.normalize``, carried
by the wire row (rows written before the fields still read, as having their defaults), and
recorded by both COPY paths of the record path."""

from __future__ import annotations

import json

import pytest

from billing_platform.errors import InvalidRequest
from metering import events
from metering.ingest import _framed
from metering.models import UsageEvent
from metering.recording import record_rows


def test_the_end_user_round_trips_and_is_recorded_by_both_copy_paths(tenant):
    # given two events naming an end user (one with non-ASCII text: JSON escapes it, so its
    # wire row is not "trusted text") and one naming none
    named = events.normalize(tenant.event("req-u1", end_user="alice@example.com"))
    accented = events.normalize(tenant.event("req-u2", end_user="zoë-42"))
    anonymous = events.normalize(tenant.event("req-u3", end_user=""))
    assert anonymous.end_user is None
    for event in (named, accented, anonymous):
        assert events.decode(events.encode(event)) == event

    # when they are recorded, through the trusted and the escaping COPY path
    record_rows([events.decode_row(events.encode(named))], origin="stream", trusted_text=True)
    record_rows([events.decode_row(events.encode(e)) for e in (accented, anonymous)],
                origin="stream", trusted_text=False)

    # then each stored event has its end user
    stored = dict(UsageEvent.objects.values_list("request_id", "end_user"))
    assert stored == {"req-u1": "alice@example.com", "req-u2": "zoë-42", "req-u3": None}


@pytest.mark.parametrize("missing", [1, 2], ids=["before-reasoning", "before-end-user"])
def test_a_row_written_before_the_added_fields_reads_as_having_their_defaults(tenant,
                                                                               missing):
    event = events.normalize(tenant.event("req-old", end_user="bob", completion_tokens=9,
                                          reasoning_tokens=3))
    old = json.loads(events.encode(event))[:-missing]  # the wire form before those fields
    raw = json.dumps(old).encode()

    decoded = events.decode(raw)
    assert decoded.reasoning_tokens == 0
    assert (decoded.end_user is None) == (missing == 2)
    assert events.decode_row(raw)[events.I_REASONING] == 0
    assert _framed(json.loads(raw))  # the consumer's batch path takes it too
    assert record_rows([events.decode_row(raw)], origin="stream").recorded
    stored = UsageEvent.objects.get(request_id="req-old")
    assert (stored.end_user, stored.reasoning_tokens) == ("bob" if missing == 1 else None, 0)


def test_reasoning_tokens_are_recorded_by_both_copy_paths_and_bounded(tenant):
    thinking = events.normalize(tenant.event("req-r1", completion_tokens=9,
                                             reasoning_tokens=7))
    quiet = events.normalize(tenant.event("req-r2", completion_tokens=9))
    assert events.decode(events.encode(thinking)) == thinking and quiet.reasoning_tokens == 0
    record_rows([events.decode_row(events.encode(thinking))], origin="stream",
                trusted_text=True)
    record_rows([events.decode_row(events.encode(quiet))], origin="stream",
                trusted_text=False)
    stored = dict(UsageEvent.objects.values_list("request_id", "reasoning_tokens"))
    assert stored == {"req-r1": 7, "req-r2": 0}
    # reasoning is part of the completion: never more of it than the completion holds
    with pytest.raises(InvalidRequest) as info:
        events.normalize(tenant.event("req-r3", completion_tokens=2, reasoning_tokens=3))
    assert info.value.param == "reasoning_tokens"


@pytest.mark.parametrize("value", ["x" * 257, "tab\there", "back\\slash", "nul\x00", 7, ["a"]])
def test_a_bad_end_user_is_refused_naming_the_field(tenant, value):
    with pytest.raises(InvalidRequest) as info:
        events.normalize(tenant.event("req-bad-user", end_user=value))
    assert info.value.param == "end_user"


def test_sums_by_user_equal_the_rollups_sums_whatever_else_is_grouped(tenant):
    from datetime import UTC, datetime, timedelta

    from metering.recording import record_events
    from metering.selectors import UsageFilter, usage_summary

    # given events of several end users, two projects, three hours and every status
    hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - timedelta(hours=3)
    batch = []
    for i in range(24):
        batch.append(events.normalize(tenant.event(
            f"req-g{i}", end_user=["alice", "bob", None][i % 3],
            project_id=(tenant.project if i % 2 else tenant.project2).id,
            api_key_id=(tenant.key if i % 2 else tenant.key2).id,
            status=["ok", "ok", "engine_error", "client_aborted"][i % 4],
            completion_tokens=10 + i, event_time=hour + timedelta(hours=i % 3, minutes=i))))
    record_events(batch, origin="api")
    window = UsageFilter(org_id=tenant.org.id, start=hour, end=hour + timedelta(hours=3))
    sums = ("requests", "error_requests", "aborted_requests", "prompt_tokens", "cached_tokens",
            "completion_tokens", "normalized_tokens", "amount", "credits_consumed")

    def totals(buckets):
        return {s: sum(getattr(b, s) for b in buckets) for s in sums}

    # when usage is read by user (from the events) and by project and hour (from the rollups)
    by_user = usage_summary(usage_filter=window, group_by=("user", "project", "hour"))
    by_rollup = usage_summary(usage_filter=window, group_by=("project", "hour"))

    # then the user groups add up to the rollups' sums exactly, and each group is its events'
    assert totals(by_user) == totals(by_rollup)
    assert totals(by_user)["requests"] == 24 and totals(by_user)["error_requests"] == 6
    assert totals(by_user)["aborted_requests"] == 6
    alice = [b for b in by_user if b.group["user"] == "alice"]
    assert sum(b.completion_tokens for b in alice) == sum(10 + i for i in range(0, 24, 3))
    assert {b.group["project"] for b in by_user} == {tenant.project.public_id,
                                                      tenant.project2.public_id}
    # a filter applies to the events as to the rollups
    only = usage_summary(usage_filter=UsageFilter(
        org_id=tenant.org.id, start=window.start, end=window.end,
        project_ids=(tenant.project.id,)), group_by=("user",))
    assert totals(only) == totals(usage_summary(usage_filter=UsageFilter(
        org_id=tenant.org.id, start=window.start, end=window.end,
        project_ids=(tenant.project.id,))))
