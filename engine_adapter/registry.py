"""The per-process router and engine client, kept in step with the fleet table.

Web processes call ``get_fleet()``; the router's engine list and scraped loads are refreshed
from PostgreSQL at most every ``REFRESH_S`` seconds (the health task writes them), while
in-flight counts and prefix indexes stay in the process.

A request never sees a view older than ``REFRESH_S``, but under traffic none waits for the
read either: once the view is half that old, one background task refreshes it and requests go
on with the current one. Only a view that did go stale (an idle process, the first request)
is refreshed in line, and concurrent requests then share that one read.
"""

from __future__ import annotations

import asyncio
import logging
import time

from asgiref.sync import sync_to_async

from engine_adapter import conf
from engine_adapter.client import EngineClient
from engine_adapter.router import Router
from engine_adapter.selectors import fleet_snapshot, zone_regions

REFRESH_S = conf.fleet_refresh_s()
REFRESH_AHEAD = 0.5  # fraction of REFRESH_S after which a background refresh starts
log = logging.getLogger(__name__)


class Fleet:
    def __init__(self, *, policy: str = "cache_aware", salt_secret: str = "") -> None:
        self.router = Router(policy=policy)
        self.client = EngineClient(self.router, salt_secret=salt_secret)
        self._refreshed = 0.0
        self._refreshing: asyncio.Task | None = None
        self.zones: dict[str, set[str]] = {}

    def refresh(self) -> None:
        started = time.monotonic()  # the view is as old as the read's start
        snap = fleet_snapshot()
        self.zones = zone_regions()
        self.router.set_engines(snap.engines, healthy=snap.healthy, offered=snap.offered)
        for engine_id, load in snap.loads.items():
            self.router.observe_load(engine_id, load)
        self._refreshed = started

    def regions_in_zone(self, zone: str) -> set[str] | None:
        """Return the regions a data zone may run in; None for ``global`` (every region)."""
        return None if zone == "global" else self.zones.get(zone, set())

    async def arefresh_if_stale(self) -> None:
        """Keep the view at most REFRESH_S old, refreshing it in the background ahead of that."""
        age = time.monotonic() - self._refreshed
        if age > REFRESH_S:
            # Shielded: a cancelled request must not cancel the read others are waiting on.
            await asyncio.shield(self._refresh_task())
        elif age > REFRESH_S * REFRESH_AHEAD:
            self._refresh_task()

    def _refresh_task(self) -> asyncio.Task:
        """Return the refresh in flight on this loop, or start one."""
        loop = asyncio.get_running_loop()
        task = self._refreshing
        if task is None or task.done() or task.get_loop() is not loop:
            task = self._refreshing = loop.create_task(
                sync_to_async(self.refresh, thread_sensitive=False)())
            task.add_done_callback(_log_failure)
        return task


def _log_failure(task: asyncio.Task) -> None:
    # A background refresh that failed is retried by the next request; one that someone
    # awaited raises there too. Either way, say so once (and mark the exception retrieved).
    if not task.cancelled() and task.exception() is not None:
        log.warning("fleet refresh failed: %r", task.exception())


_fleet: Fleet | None = None


def get_fleet() -> Fleet:
    """Return this process's fleet view (created on first use)."""
    global _fleet
    if _fleet is None:
        from django.conf import settings

        _fleet = Fleet(policy=conf.router_policy(),
                       salt_secret=settings.SECRET_KEY)
    return _fleet
