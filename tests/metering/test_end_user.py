"""The end user on usage events (issue 20 item 4, OpenAI's ``user``): bounded and checked by
``events.normalize``, carried by the wire row (rows written before the field still read, as
having none), and recorded by both COPY paths of the record path."""

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


def test_a_row_written_before_the_end_user_reads_as_having_none(tenant):
    event = events.normalize(tenant.event("req-old", end_user="bob"))
    old = json.loads(events.encode(event))[:-1]  # the wire form before end_user existed
    raw = json.dumps(old).encode()

    assert events.decode(raw).end_user is None
    assert events.decode_row(raw)[events.I_END_USER] is None
    assert _framed(json.loads(raw))  # the consumer's batch path takes it too
    assert record_rows([events.decode_row(raw)], origin="stream").recorded
    assert UsageEvent.objects.get(request_id="req-old").end_user is None


@pytest.mark.parametrize("value", ["x" * 257, "tab\there", "back\\slash", "nul\x00", 7, ["a"]])
def test_a_bad_end_user_is_refused_naming_the_field(tenant, value):
    with pytest.raises(InvalidRequest) as info:
        events.normalize(tenant.event("req-bad-user", end_user=value))
    assert info.value.param == "end_user"
