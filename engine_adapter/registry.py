"""The per-process router and engine client, kept in step with the fleet table.

Web processes call ``get_fleet()``; the router's engine list and scraped loads are refreshed
from PostgreSQL at most every ``REFRESH_S`` seconds (the health task writes them), while
in-flight counts and prefix indexes stay in the process (the in-flight counts of the other
gateway processes come through Redis: ``engine_adapter.load_share``).

A request never sees a view older than ``REFRESH_S``, but under traffic none waits for the
read either: once the view is half that old, one background task refreshes it and requests go
on with the current one. Only a view that did go stale (an idle process, the first request)
is refreshed in line, and concurrent requests then share that one read.

PostgreSQL down: a read that fails keeps the last good view, and requests go on with it (no
request waits on a database that just failed; one background read at a time retries) for up
to ``MAX_STALE_S`` (``TOLLGATE_FLEET_MAX_STALE_S``). Past that, or with no view at all, the
read's own error reaches the request (the gateway answers it with a 503). The outage is logged
when it starts and when it ends, not per request, and is on ``/metrics``
(``tollgate_fleet_view_refreshed_timestamp_seconds``, ``tollgate_fleet_view_refresh_failures``).
"""

from __future__ import annotations

import asyncio
import logging
import time

from asgiref.sync import sync_to_async

from engine_adapter import conf
from engine_adapter.client import EngineClient
from engine_adapter.load_share import LoadShare
from engine_adapter.metrics import FLEET_VIEW_REFRESH_FAILURES, FLEET_VIEW_REFRESHED
from engine_adapter.router import Router
from engine_adapter.selectors import fleet_snapshot

REFRESH_S = conf.fleet_refresh_s()
REFRESH_AHEAD = 0.5  # fraction of REFRESH_S after which a background refresh starts
MAX_STALE_S = conf.fleet_max_stale_s()
log = logging.getLogger(__name__)


class Fleet:
    def __init__(self, *, policy: str = "cache_aware", salt_secret: str = "",
                 redis_url: str | None = None) -> None:
        self.router = Router(policy=policy)
        self.client = EngineClient(self.router, salt_secret=salt_secret)
        # the other gateway processes' loads, for the router's bound (None: this one only)
        self.share = LoadShare(self.router, redis_url) if redis_url else None
        self._refreshed = 0.0
        self._refreshing: asyncio.Task | None = None
        self._failing_since: float | None = None  # monotonic time of an outage's first failure
        self._failed_at = 0.0
        self.zones: dict[str, set[str]] = {}

    def refresh(self) -> None:
        started = time.monotonic()  # the view is as old as the read's start
        snap = fleet_snapshot()
        self.zones = snap.zones
        self.router.set_engines(snap.engines, healthy=snap.healthy, offered=snap.offered,
                                traits=snap.traits)
        for engine_id, load in snap.loads.items():
            self.router.observe_load(engine_id, load)
        self._refreshed = started
        FLEET_VIEW_REFRESHED.set(time.time())

    async def aroute_lookup(self, *, namespace: str, prompt_text: str) -> None:
        """Before a prompt is routed, take where the other gateway processes placed its
        prefixes (``LoadShare.lookup``: one Redis round trip, only while other processes
        share the view), so its engine is the same whichever process it reached."""
        if self.share is not None:
            await self.share.lookup(namespace=namespace, prompt=prompt_text)

    def regions_in_zone(self, zone: str) -> set[str] | None:
        """Return the regions a data zone may run in; None for ``global`` (every region)."""
        return None if zone == "global" else self.zones.get(zone, set())

    async def arefresh_if_stale(self) -> None:
        """Keep the view at most REFRESH_S old, refreshing it in the background ahead of that.

        While reads fail, go on with the last good view up to MAX_STALE_S old; past that (or
        with no view yet) raise the read's error.
        """
        if self.share is not None:
            self.share.note_activity()
        now = time.monotonic()
        age = now - self._refreshed
        if age <= REFRESH_S * REFRESH_AHEAD:
            return
        if self._failing_since is not None and self._refreshed and age <= MAX_STALE_S:
            # An outage: no request waits; one read at a time retries, REFRESH_AHEAD apart.
            if now - self._failed_at > REFRESH_S * REFRESH_AHEAD:
                self._refresh_task()
            return
        if age <= REFRESH_S:
            self._refresh_task()
            return
        try:
            # Shielded: a cancelled request must not cancel the read others are waiting on.
            await asyncio.shield(self._refresh_task())
        except Exception:
            if not self._refreshed or time.monotonic() - self._refreshed > MAX_STALE_S:
                raise

    def _refresh_task(self) -> asyncio.Task:
        """Return the refresh in flight on this loop, or start one."""
        loop = asyncio.get_running_loop()
        task = self._refreshing
        if task is None or task.done() or task.get_loop() is not loop:
            task = self._refreshing = loop.create_task(
                sync_to_async(self.refresh, thread_sensitive=False)())
            task.add_done_callback(self._refresh_done)
        return task

    def _refresh_done(self, task: asyncio.Task) -> None:
        # Said once per outage, when it starts and when it ends (the exception is retrieved
        # here, so an unawaited background read that failed is not reported again).
        exc = None if task.cancelled() else task.exception()
        now = time.monotonic()
        if exc is None:
            if self._failing_since is not None and not task.cancelled():
                log.warning("fleet view: PostgreSQL read again after %.1f s of failed reads",
                            now - self._failing_since)
                self._failing_since = None
            return
        FLEET_VIEW_REFRESH_FAILURES.inc()
        self._failed_at = now
        if self._failing_since is None:
            self._failing_since = now
            log.warning("fleet view: reading the fleet from PostgreSQL failed (%r); serving the "
                        "view of %.1f s ago until it is %.0f s old, then answering 503",
                        exc, now - self._refreshed if self._refreshed else float("inf"),
                        MAX_STALE_S)


_fleet: Fleet | None = None


def get_fleet() -> Fleet:
    """Return this process's fleet view (created on first use)."""
    global _fleet
    if _fleet is None:
        from django.conf import settings

        _fleet = Fleet(policy=conf.router_policy(), salt_secret=settings.SECRET_KEY,
                       redis_url=settings.REDIS_URL)
    return _fleet
