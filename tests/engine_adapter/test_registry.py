"""The per-process fleet view: never older than REFRESH_S, refreshed ahead of that off the
request's path, one read at a time."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

from engine_adapter import registry

READ_S = 0.3  # how long the fake read from PostgreSQL takes


def _timed(coro):
    async def run():
        t0 = time.monotonic()
        await coro
        return time.monotonic() - t0

    return run()


def test_requests_wait_only_for_a_stale_view_and_share_one_read(monkeypatch):
    # given a fleet view refreshed at most every second, whose read takes 0.3 s
    monkeypatch.setattr(registry, "REFRESH_S", 1.0)
    fleet = registry.Fleet()
    reads = []
    lock = threading.Lock()

    def slow_refresh():
        started = time.monotonic()
        with lock:
            reads.append(started)
        time.sleep(READ_S)
        fleet._refreshed = started

    fleet.refresh = slow_refresh

    async def scenario():
        # a view never read: the first requests wait for one read, together
        waited = await asyncio.gather(_timed(fleet.arefresh_if_stale()),
                                      _timed(fleet.arefresh_if_stale()))
        assert min(waited) >= READ_S * 0.9 and len(reads) == 1
        # a fresh view: nothing to do
        assert await _timed(fleet.arefresh_if_stale()) < 0.1 and len(reads) == 1
        # half-way to stale: the request goes on at once, one read starts behind it
        await asyncio.sleep(registry.REFRESH_S * registry.REFRESH_AHEAD + 0.05 - READ_S)
        assert await _timed(fleet.arefresh_if_stale()) < 0.1
        assert await _timed(fleet.arefresh_if_stale()) < 0.1
        await asyncio.sleep(0.05)
        assert len(reads) == 2
        await fleet._refreshing
        # stale (an idle process): the request waits for a fresh read again
        await asyncio.sleep(registry.REFRESH_S + 0.05)
        assert await _timed(fleet.arefresh_if_stale()) >= READ_S * 0.9
        assert len(reads) == 3
        await fleet.client.aclose()

    asyncio.run(scenario())


def test_while_postgres_is_down_the_last_good_view_is_served_up_to_its_bound(monkeypatch,
                                                                             caplog):
    # given a fleet view read once, whose reads then fail (PostgreSQL down)
    monkeypatch.setattr(registry, "REFRESH_S", 0.2)
    monkeypatch.setattr(registry, "MAX_STALE_S", 1.0)
    fleet = registry.Fleet()
    reads = []
    down = threading.Event()

    def refresh():
        started = time.monotonic()
        reads.append(started)
        if down.is_set():
            time.sleep(READ_S)  # a request that waited for it would take this long
            raise ConnectionError("PostgreSQL is down")
        fleet._refreshed = started

    fleet.refresh = refresh

    async def scenario():
        await fleet.arefresh_if_stale()
        down.set()
        # when requests come while the view is stale: each goes on with the last good view
        await asyncio.sleep(registry.REFRESH_S + 0.05)
        await fleet.arefresh_if_stale()  # waited for the read, which failed: served anyway
        served = 1
        while time.monotonic() - fleet._refreshed < registry.MAX_STALE_S - 0.1:
            assert await _timed(fleet.arefresh_if_stale()) < READ_S * 0.8  # none waits
            served += 1
            await asyncio.sleep(0.01)
        # one read at a time retries, at most every REFRESH_S * REFRESH_AHEAD
        gaps = [b - a for a, b in itertools.pairwise(reads[1:])]
        assert served > 3 and gaps and min(gaps) >= registry.REFRESH_S * registry.REFRESH_AHEAD
        # then past the bound the read's own error reaches the request
        await asyncio.sleep(0.2)
        try:
            await fleet.arefresh_if_stale()
        except ConnectionError:
            pass
        else:
            raise AssertionError("a view past MAX_STALE_S was served")
        # and when PostgreSQL is back, the view is read again
        down.clear()
        await fleet.arefresh_if_stale()
        assert time.monotonic() - fleet._refreshed < 0.5
        await fleet.client.aclose()

    asyncio.run(scenario())
    # the outage was said once when it began and once when it ended
    messages = [r.getMessage() for r in caplog.records if r.name == registry.__name__]
    assert sum("reading the fleet from PostgreSQL failed" in m for m in messages) == 1
    assert sum("PostgreSQL read again" in m for m in messages) == 1
