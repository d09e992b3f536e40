"""Platform request ids: unguessable, and issued in time order (the ingest's index locality)."""

from __future__ import annotations

from metering import events


def test_ids_issued_later_sort_later(monkeypatch):
    # given the clock at one millisecond, then the next
    clock = iter([1_764_000_000_000, 1_764_000_000_000, 1_764_000_000_001])
    monkeypatch.setattr(events, "_now_ms", lambda: next(clock))
    # when three ids are issued
    first, same_ms, later = (events.new_request_id() for _ in range(3))
    # then the later millisecond's id sorts after both, as PostgreSQL's "C" collation does
    assert max(first, same_ms) < later
    assert first[4:16] == same_ms[4:16] == f"{1_764_000_000_000:012x}"


def test_ids_keep_the_platform_form_and_80_random_bits(monkeypatch):
    # given one and the same millisecond for every id
    monkeypatch.setattr(events, "_now_ms", lambda: 1_764_000_000_000)
    # when many ids are issued
    ids = [events.new_request_id() for _ in range(2_000)]
    # then each is a platform id, and they differ only in their random tail
    assert all(events.looks_like_platform_id(i) for i in ids)
    assert len(set(ids)) == len(ids)
    assert len({i[16:] for i in ids}) == len(ids)
    assert all(len(i[16:]) == 20 for i in ids)


def test_real_clock_ids_name_the_time_they_were_issued():
    # when an id is issued now
    before = events.time.time_ns() // 1_000_000
    rid = events.new_request_id()
    after = events.time.time_ns() // 1_000_000
    # then its first 12 hex digits are that millisecond
    assert before <= int(rid[4:16], 16) <= after
