"""The per-process fleet view: never older than REFRESH_S, refreshed ahead of that off the
request's path, one read at a time."""

from __future__ import annotations

import asyncio
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
