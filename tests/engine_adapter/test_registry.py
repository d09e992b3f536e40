"""The per-process fleet view: never older than REFRESH_S, refreshed ahead of that off the
request's path, one read at a time.

The view's age is read on the module's clock, which these tests drive by hand, and the read from
PostgreSQL is a stand-in that the test lets finish: whether a request waited for a read is
whether its call returned before the read was let through, never how long it took.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from types import SimpleNamespace

import pytest

from engine_adapter import registry


class Clock:
    """The registry's ``time.monotonic``, moved only by the test."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 1000.0
        monkeypatch.setattr(registry, "time", SimpleNamespace(monotonic=self, time=time.time))

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Reads:
    """A stand-in for the fleet's read from PostgreSQL: records when (on the clock) each read
    started; with ``gated``, each read waits until the test lets one through."""

    def __init__(self, fleet: registry.Fleet, clock: Clock, *, gated: bool) -> None:
        self.fleet, self.clock, self.gated = fleet, clock, gated
        self.started: list[float] = []
        self.permits = threading.Semaphore(0)
        self.failing = False
        fleet.refresh = self.read

    def read(self) -> None:
        started = self.clock()
        self.started.append(started)
        if self.gated and not self.permits.acquire(timeout=60):
            raise AssertionError("a read was never let through")
        if self.failing:
            raise ConnectionError("PostgreSQL is down")
        self.fleet._refreshed = started

    def let_one_through(self) -> None:
        self.permits.release()

    async def until_started(self, n: int) -> None:
        """Wait (on the read's state) until ``n`` reads have started."""
        for _ in range(60_000):
            if len(self.started) >= n:
                return
            await asyncio.sleep(0.001)
        raise AssertionError(f"read {n} never started")


def returned_at_once(coro) -> bool:
    """Return True if the call finished without suspending: it waited for nothing."""
    try:
        coro.send(None)
    except StopIteration:
        return True
    coro.close()
    return False


def test_requests_wait_only_for_a_stale_view_and_share_one_read(monkeypatch):
    # given a fleet view refreshed at most every second, whose reads the test lets through
    clock = Clock(monkeypatch)
    monkeypatch.setattr(registry, "REFRESH_S", 1.0)
    fleet = registry.Fleet()
    reads = Reads(fleet, clock, gated=True)

    async def scenario():
        # a view never read: the first requests wait for one read, together
        first = [asyncio.create_task(fleet.arefresh_if_stale()) for _ in range(2)]
        await reads.until_started(1)
        await asyncio.sleep(0)
        assert not any(task.done() for task in first)
        reads.let_one_through()
        await asyncio.gather(*first)
        assert len(reads.started) == 1
        # a fresh view: nothing to do
        assert returned_at_once(fleet.arefresh_if_stale()) and len(reads.started) == 1
        # half-way to stale: the requests go on at once, one read starts behind them
        clock.advance(registry.REFRESH_S * registry.REFRESH_AHEAD + 0.0625)
        assert returned_at_once(fleet.arefresh_if_stale())
        assert returned_at_once(fleet.arefresh_if_stale())
        await reads.until_started(2)
        reads.let_one_through()
        await fleet._refreshing
        assert len(reads.started) == 2
        # stale (an idle process): the request waits for a fresh read again
        clock.advance(registry.REFRESH_S + 0.0625)
        waiting = asyncio.create_task(fleet.arefresh_if_stale())
        await reads.until_started(3)
        await asyncio.sleep(0)
        assert not waiting.done()
        reads.let_one_through()
        await waiting
        assert len(reads.started) == 3 and fleet._refreshed == clock()
        await fleet.client.aclose()

    asyncio.run(scenario())


def test_while_postgres_is_down_the_last_good_view_is_served_up_to_its_bound(monkeypatch,
                                                                             caplog):
    # given a fleet view read once, whose reads then fail (PostgreSQL down)
    clock = Clock(monkeypatch)
    monkeypatch.setattr(registry, "REFRESH_S", 0.25)
    monkeypatch.setattr(registry, "MAX_STALE_S", 1.0)
    fleet = registry.Fleet()
    reads = Reads(fleet, clock, gated=False)

    async def settled() -> None:
        """Let a background read in flight finish before the clock moves on."""
        task = fleet._refreshing
        if task is not None and not task.done():
            await asyncio.gather(task, return_exceptions=True)

    async def scenario():
        await fleet.arefresh_if_stale()
        good = fleet._refreshed
        reads.failing = True
        # when a request comes once the view is stale, it waits for the read, which fails,
        # and is served the last good view anyway
        clock.advance(registry.REFRESH_S + 0.0625)
        await fleet.arefresh_if_stale()
        served = 1
        # then while the view is within its bound, no request waits for a read
        while clock() - good < registry.MAX_STALE_S - 0.0625:
            assert returned_at_once(fleet.arefresh_if_stale())
            served += 1
            await settled()
            clock.advance(1 / 64)
        # one read at a time retries, at most every REFRESH_S * REFRESH_AHEAD
        gaps = [b - a for a, b in itertools.pairwise(reads.started[1:])]
        assert served > 3 and gaps and min(gaps) >= registry.REFRESH_S * registry.REFRESH_AHEAD
        # then past the bound the read's own error reaches the request
        clock.advance(0.25)
        with pytest.raises(ConnectionError):
            await fleet.arefresh_if_stale()
        # and when PostgreSQL is back, the view is read again
        reads.failing = False
        await fleet.arefresh_if_stale()
        assert fleet._refreshed == clock()
        await fleet.client.aclose()

    asyncio.run(scenario())
    # the outage was said once when it began and once when it ended
    messages = [r.getMessage() for r in caplog.records if r.name == registry.__name__]
    assert sum("reading the fleet from PostgreSQL failed" in m for m in messages) == 1
    assert sum("PostgreSQL read again" in m for m in messages) == 1
