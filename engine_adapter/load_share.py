"""The router's load view shared by every gateway process, through one Redis hash.

Each process routes with its own router (``engine_adapter.router``); alone, it would see only
its own in-flight requests, a 1/N share of each engine's load with N processes, and its
bounded-load affinity would spill a tenant's prefix to a second engine N times too early (or
never, when the N processes' shares together overload one engine). So while a process has
traffic it writes its in-flight counts per engine into its own field of ``KEY`` and reads the
others' fields back, in one round trip every ``TOLLGATE_ROUTER_SHARE_S`` (default 0.1 s),
off the request path. A field older than ``STALE_S`` is ignored (its process stopped or went
idle) and removed a while later.

Placements travel faster than loads: a conversation's next turn may follow its previous one
within milliseconds, through another process. So each placement (blocks of a routed prompt:
the deepest and those at depths 2**k, ``router.published_blocks``, and its engine) is
published at once, batched per event-loop turn, two ways: as keys ``{<KEY>}:at:<block>`` that
live ``ROUTES_WARM_S``, which a process looks up for a prompt before routing it (``lookup``:
one ``MGET`` of the prompt's blocks, the request's only Redis round trip for routing, made only
while other processes share the key), and on the stream ``<KEY>:routes``, which every busy
process reads with a blocking ``XREAD`` into its router (``Router.observe_routes``) between
requests. The lookup is what makes the next turn go where the previous one is cached whichever
process placed it: a stream entry can reach a process busy on its other requests later than
the conversation's next turn does. The stream is capped (``ROUTES_MAXLEN`` entries, one per
published batch); a process that starts reading reads the last ``ROUTES_WARM_S`` of it first.

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

from engine_adapter.router import Router, prefix_blocks

KEY = "tg:router:inflight"
STALE_S = 1.0  # a field not rewritten for this long is no longer counted
FORGET_S = 30.0  # ... and is deleted after this long
IDLE_STOP_S = 2.0  # a process with no traffic for this long stops exchanging
ROUTES_MAXLEN = 20000  # entries of the placements stream (each one published batch)
ROUTES_WARM_S = 60.0  # a process (re)starting its reader reads this much of the stream first
ROUTES_READ = 1000  # entries taken per read at most
ROUTES_BLOCK_MS = 500  # how long one blocking read waits for placements
# A request waits this long at most for its lookup; a slower one goes on in the background
# (not cancelled: a cancelled read drops its connection, and on a loaded 2-core machine
# reconnecting made the next lookups slower still) and its answer serves the next turns.
LOOKUP_WAIT_S = 0.02
LOOKUPS_PENDING_MAX = 64  # more slow lookups than this in flight: skip it (Redis is in trouble)
log = logging.getLogger(__name__)


def share_interval_s() -> float:
    """Return how often a busy process exchanges loads (``TOLLGATE_ROUTER_SHARE_S``; 0: never)."""
    return float(os.environ.get("TOLLGATE_ROUTER_SHARE_S", "0.1"))


class LoadShare:
    """One process's side of the exchange: ``note_activity`` on every routed request."""

    def __init__(self, router: Router, redis_url: str, *, key: str = KEY,
                 interval_s: float | None = None, lookup_wait_s: float = LOOKUP_WAIT_S,
                 clock: Callable[[], float] = time.time) -> None:
        self.router = router
        self.url = redis_url
        self.key = key
        self.interval = share_interval_s() if interval_s is None else interval_s
        self.clock = clock
        self.lookup_wait_s = lookup_wait_s
        self.field = f"{os.getpid()}:{secrets.token_hex(4)}"  # unique across hosts too
        self._clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._task: asyncio.Task | None = None
        self.routes_key = f"{key}:routes"
        self._routes_from = ""  # the last stream id read ('': none yet, start ROUTES_WARM_S back)
        self._reader: asyncio.Task | None = None
        self._publishing: set[asyncio.Task] = set()
        self._lookups: set[asyncio.Future] = set()
        self._batch_pending = False  # a batch of placements is scheduled, not yet taken
        self._active_at = 0.0
        self._failing = False
        self._peers = False  # the last exchange saw another process
        router.on_route = self._route_noted

    def note_activity(self) -> None:
        """A request is being routed: keep the exchange running (started if it is not)."""
        if self.interval <= 0:
            return
        self._active_at = time.monotonic()
        loop = asyncio.get_running_loop()
        if not _running(self._task, loop):
            self._task = loop.create_task(self._run())
        if not _running(self._reader, loop):
            self._reader = loop.create_task(self._read_routes())

    def _route_noted(self) -> None:
        """The router placed a prompt: publish it (with this loop turn's others) right away."""
        if self.interval <= 0:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # routed outside an event loop (a test, a script): nothing to share with
        # One batch per loop turn, not waiting for the last one's answer: a write behind a
        # slow answer reached Redis after the conversation's next turn had looked it up.
        if self._batch_pending:
            return
        self._batch_pending = True
        task = loop.create_task(self._publish_routes())
        self._publishing.add(task)  # held: the loop keeps only weak references to tasks
        task.add_done_callback(self._publishing.discard)

    async def _publish_routes(self) -> None:
        await asyncio.sleep(0)  # the placements of this loop turn's other requests join in
        self._batch_pending = False
        if routed := self.router.drain_routed():
            payload = json.dumps([[block.hex(), engine_id] for block, engine_id in routed])
            try:
                async with self._client().pipeline(transaction=False) as pipe:
                    pipe.xadd(self.routes_key, {"p": self.field, "r": payload},
                              maxlen=ROUTES_MAXLEN, approximate=True)
                    pipe.pexpire(self.routes_key, int(ROUTES_WARM_S * 1000))
                    # the last placement of a block wins: where that prefix was sent last
                    for block, engine_id in dict(routed).items():
                        pipe.set(self._placed_key(block), engine_id,
                                 px=int(ROUTES_WARM_S * 1000))
                    await pipe.execute()
            except (redis.exceptions.RedisError, OSError):
                pass  # placements are hints: lost ones cost cache hits, never a request

    def _placed_key(self, block: bytes) -> str:
        # one hash tag: a lookup's MGET names keys of one slot on a Redis Cluster too
        return f"{{{self.key}}}:at:{block.hex()}"

    async def lookup(self, *, namespace: str, prompt: str) -> None:
        """Before routing a prompt, take where the other processes placed its prefixes.

        One ``MGET`` of the prompt's blocks (``Router.observe_routes`` gets what it finds).
        Only while other processes share the key: a process alone knows its own placements.
        The request waits ``lookup_wait_s`` (``LOOKUP_WAIT_S``) at most: a slower lookup
        finishes in the background for the prompt's next turns, and Redis failing costs the
        hint, never the request.
        """
        if self.interval <= 0 or not self._peers or self.router.policy != "cache_aware":
            return
        blocks = prefix_blocks(namespace, prompt)
        if not blocks or len(self._lookups) >= LOOKUPS_PENDING_MAX:
            return
        task = asyncio.ensure_future(self._lookup(blocks))
        self._lookups.add(task)  # held: the loop keeps only weak references to tasks
        task.add_done_callback(self._lookups.discard)
        await asyncio.wait((task,), timeout=self.lookup_wait_s)

    async def _lookup(self, blocks: list[bytes]) -> None:
        try:
            engines = await self._client().mget([self._placed_key(b) for b in blocks])
        except (redis.exceptions.RedisError, OSError):
            return
        self.router.observe_routes((block, engine_id) for block, engine_id
                                   in zip(blocks, engines, strict=True) if engine_id)

    async def _read_routes(self) -> None:
        # its own connection: a blocking read would hold up the exchange's commands
        client = aredis.Redis.from_url(self.url, decode_responses=True,
                                       socket_timeout=ROUTES_BLOCK_MS / 1000 + 2,
                                       socket_connect_timeout=1)
        try:
            while time.monotonic() - self._active_at <= IDLE_STOP_S:
                start = self._routes_from or f"{int((self.clock() - ROUTES_WARM_S) * 1000)}-0"
                try:
                    replies = await client.xread({self.routes_key: start}, count=ROUTES_READ,
                                                 block=ROUTES_BLOCK_MS)
                except (redis.exceptions.RedisError, OSError):
                    await asyncio.sleep(max(self.interval, 0.1))  # the exchange logs it
                    continue
                for _stream, entries in replies or ():
                    self._take_routes(entries)
        finally:
            await client.aclose()

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
        mine = json.dumps({"t": now, "n": self.router.inflight_counts(),
                           "r": self.router.routed_rates()})
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
            self._peers = False
            return
        if self._failing:
            log.warning("router load share: Redis answers again")
            self._failing = False
        peers: dict[str, int] = {}
        rates: dict[str, float] = {}
        forgotten = []
        for field, raw in fields.items():
            if field == self.field:
                continue
            try:
                entry = json.loads(raw)
                age = now - float(entry["t"])
                counts = entry["n"]
                routed = entry.get("r") or {}
            except (ValueError, KeyError, TypeError, AttributeError):
                forgotten.append(field)
                continue
            if age > FORGET_S:
                forgotten.append(field)
            elif age <= STALE_S:
                for engine_id, n in counts.items():
                    peers[engine_id] = peers.get(engine_id, 0) + int(n)
                for engine_id, v in routed.items():
                    rates[engine_id] = rates.get(engine_id, 0.0) + float(v)
        # another process counts while it is not stale, even with nothing in flight
        self._peers = any(field != self.field and field not in forgotten for field in fields)
        self.router.observe_peers(peers, rates)
        if forgotten:
            # a failure here is harmless: the next exchange tries again
            with contextlib.suppress(redis.exceptions.RedisError, OSError):
                await self._client().hdel(self.key, *forgotten)

    def _take_routes(self, entries: list[tuple[str, dict[str, str]]]) -> None:
        routes: list[tuple[bytes, str]] = []
        for _id, values in entries:
            if values.get("p") == self.field:
                continue
            try:
                routes.extend((bytes.fromhex(block), str(engine_id))
                              for block, engine_id in json.loads(values["r"]))
            except (ValueError, KeyError, TypeError):
                continue  # not a placements entry of ours: skip it
        if entries:
            self._routes_from = entries[-1][0]
        self.router.observe_routes(routes)


def _running(task: asyncio.Task | None, loop: asyncio.AbstractEventLoop) -> bool:
    return task is not None and not task.done() and task.get_loop() is loop
