"""The per-process router and engine client, kept in step with the fleet table.

Web processes call ``get_fleet()``; the router's engine list and scraped loads are refreshed
from PostgreSQL at most every ``REFRESH_S`` seconds (the health task writes them), while
in-flight counts and prefix indexes stay in the process.
"""

from __future__ import annotations

import os
import time

from asgiref.sync import sync_to_async

from engine_adapter.client import EngineClient
from engine_adapter.router import Router
from engine_adapter.selectors import fleet_snapshot, zone_regions

REFRESH_S = float(os.environ.get("TOLLGATE_FLEET_REFRESH_S", "2"))


class Fleet:
    def __init__(self, *, policy: str = "cache_aware", salt_secret: str = "") -> None:
        self.router = Router(policy=policy)
        self.client = EngineClient(self.router, salt_secret=salt_secret)
        self._refreshed = 0.0
        self.zones: dict[str, set[str]] = {}

    def refresh(self) -> None:
        snap = fleet_snapshot()
        self.zones = zone_regions()
        self.router.set_engines(snap.engines, healthy=snap.healthy)
        for engine_id, load in snap.loads.items():
            self.router.observe_load(engine_id, load)
        self._refreshed = time.monotonic()

    def regions_in_zone(self, zone: str) -> set[str] | None:
        """Return the regions a data zone may run in; None for ``global`` (every region)."""
        return None if zone == "global" else self.zones.get(zone, set())

    async def arefresh_if_stale(self) -> None:
        if time.monotonic() - self._refreshed > REFRESH_S:
            await sync_to_async(self.refresh, thread_sensitive=False)()


_fleet: Fleet | None = None


def get_fleet() -> Fleet:
    """Return this process's fleet view (created on first use)."""
    global _fleet
    if _fleet is None:
        from django.conf import settings

        _fleet = Fleet(policy=os.environ.get("TOLLGATE_ROUTER_POLICY", "cache_aware"),
                       salt_secret=settings.SECRET_KEY)
    return _fleet
