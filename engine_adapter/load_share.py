"""The router's load view shared by every gateway process, through one Redis hash.

Each process routes with its own router (``engine_adapter.router``); alone, it would see only
its own in-flight requests, a 1/N share of each engine's load with N processes, and its
bounded-load affinity would spill a tenant's prefix to a second engine N times too early (or
never, when the N processes' shares together overload one engine). So while a process has
traffic it writes its in-flight counts per engine into its own field of ``KEY`` and reads the
others' fields back, in one round trip every ``TOLLGATE_ROUTER_SHARE_S`` (default 0.1 s),
off the request path. A field older than ``STALE_S`` is ignored (its process stopped or went
idle) and removed a while later.

Redis unreachable: the process routes on its own counts (the single-process behaviour) until
Redis answers again; the failure is logged once per outage, and no request waits or fails for
it. The hash is one key, so it lives in one slot of a Redis Cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import time
import weakref
from collections.abc import Callable

import redis.asyncio as aredis
import redis.exceptions

from engine_adapter.router import Router

KEY = "tg:router:inflight"
STALE_S = 1.0  # a field not rewritten for this long is no longer counted
FORGET_S = 30.0  # ... and is deleted after this long
IDLE_STOP_S = 2.0  # a process with no traffic for this long stops exchanging
log = logging.getLogger(__name__)


def share_interval_s() -> float:
    """Return how often a busy process exchanges loads (``TOLLGATE_ROUTER_SHARE_S``; 0: never)."""
    return float(os.environ.get("TOLLGATE_ROUTER_SHARE_S", "0.1"))


class LoadShare:
    """One process's side of the exchange: ``note_activity`` on every routed request."""

    def __init__(self, router: Router, redis_url: str, *, key: str = KEY,
                 interval_s: float | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.router = router
        self.url = redis_url
        self.key = key
        self.interval = share_interval_s() if interval_s is None else interval_s
        self.clock = clock
        self.field = f"{os.getpid()}:{secrets.token_hex(4)}"  # unique across hosts too
        self._clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._task: asyncio.Task | None = None
        self._active_at = 0.0
        self._failing = False

    def note_activity(self) -> None:
        """A request is being routed: keep the exchange running (started if it is not)."""
        if self.interval <= 0:
            return
        self._active_at = time.monotonic()
        task = self._task
        loop = asyncio.get_running_loop()
        if task is None or task.done() or task.get_loop() is not loop:
            self._task = loop.create_task(self._run())

    def _client(self) -> aredis.Redis:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            client = self._clients[loop] = aredis.Redis.from_url(
                self.url, decode_responses=True, socket_timeout=1, socket_connect_timeout=1)
        return client

    async def _run(self) -> None:
        while True:
            await self.exchange()
            if time.monotonic() - self._active_at > IDLE_STOP_S and not any(
                    self.router.inflight_counts().values()):
                await self.exchange()  # leave a last, idle entry behind: nothing in flight
                return
            await asyncio.sleep(self.interval)

    async def exchange(self) -> None:
        """Publish this process's counts and take the others' into the router."""
        now = self.clock()
        mine = json.dumps({"t": now, "n": self.router.inflight_counts()})
        try:
            async with self._client().pipeline(transaction=False) as pipe:
                pipe.hset(self.key, self.field, mine)
                pipe.pexpire(self.key, int(FORGET_S * 1000))
                pipe.hgetall(self.key)
                _, _, fields = await pipe.execute()
        except (redis.exceptions.RedisError, OSError) as exc:
            if not self._failing:
                log.warning("router load share: Redis failed (%r); routing on this process's "
                            "own in-flight counts until it answers", exc)
                self._failing = True
            self.router.observe_peers({})
            return
        if self._failing:
            log.warning("router load share: Redis answers again")
            self._failing = False
        peers: dict[str, int] = {}
        forgotten = []
        for field, raw in fields.items():
            if field == self.field:
                continue
            try:
                entry = json.loads(raw)
                age = now - float(entry["t"])
                counts = entry["n"]
            except (ValueError, KeyError, TypeError):
                forgotten.append(field)
                continue
            if age > FORGET_S:
                forgotten.append(field)
            elif age <= STALE_S:
                for engine_id, n in counts.items():
                    peers[engine_id] = peers.get(engine_id, 0) + int(n)
        self.router.observe_peers(peers)
        if forgotten:
            # a failure here is harmless: the next exchange tries again
            with contextlib.suppress(redis.exceptions.RedisError, OSError):
                await self._client().hdel(self.key, *forgotten)
