"""The Redis stream of usage events: clients, XADD, and the consumer group's housekeeping.

Each entry has one field, ``e``: the event's compact JSON (``metering.events.encode``). The
clients here are separate from ``billing_platform.redis_conn`` on purpose: an append must fail
over to PostgreSQL within milliseconds when Redis is gone, so they retry once (a stale pooled
connection after a Redis restart) and never back off, where the platform client retries with
backoff. A short circuit breaker skips Redis for a moment after a failure, so a dead Redis costs
one refused connection per second, not one per request.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections.abc import Sequence

import redis
import redis.asyncio as aredis
from redis.backoff import NoBackoff
from redis.retry import Retry

from metering import conf

FIELD = b"e"
BREAKER_OPEN_S = 1.0

_sync_clients: dict[tuple[str, float], redis.Redis] = {}
_async_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, aredis.Redis]] = (
    weakref.WeakKeyDictionary()
)
_lock = threading.Lock()


def client(*, socket_timeout: float = 2.0) -> redis.Redis:
    """Return the process's client of the usage stream's Redis (bytes in, bytes out)."""
    url = conf.redis_url()
    key = (url, socket_timeout)
    with _lock:
        if key not in _sync_clients:
            _sync_clients[key] = redis.Redis.from_url(
                url, socket_timeout=socket_timeout, socket_connect_timeout=1.0,
                retry=Retry(NoBackoff(), 1), health_check_interval=0,
            )
        return _sync_clients[key]


def aclient() -> aredis.Redis:
    """Return this event loop's asyncio client of the usage stream's Redis."""
    loop = asyncio.get_running_loop()
    url = conf.redis_url()
    per_loop = _async_clients.setdefault(loop, {})
    if url not in per_loop:
        per_loop[url] = aredis.Redis.from_url(
            url, socket_timeout=2.0, socket_connect_timeout=1.0, retry=Retry(NoBackoff(), 1),
        )
    return per_loop[url]


def reset_clients() -> None:
    """Forget cached clients (tests that point metering at another Redis)."""
    with _lock:
        for c in _sync_clients.values():
            c.close()
        _sync_clients.clear()
    _async_clients.clear()
    breaker.close()


class Breaker:
    """Skip Redis for ``BREAKER_OPEN_S`` after it failed; let one probe through after that."""

    def __init__(self) -> None:
        self._open_until = 0.0

    def allow(self) -> bool:
        return time.monotonic() >= self._open_until

    def trip(self) -> None:
        self._open_until = time.monotonic() + BREAKER_OPEN_S

    def close(self) -> None:
        self._open_until = 0.0


breaker = Breaker()


async def aappend(payload: bytes) -> bytes:
    """XADD one encoded event from async code; return its entry id."""
    r = aclient()
    if conf.wait_aof():
        async with r.pipeline(transaction=False) as pipe:
            pipe.xadd(conf.stream_key(), {FIELD: payload})
            pipe.execute_command("WAITAOF", 1, 0, 1000)
            entry_id, (local, _replicas) = await pipe.execute()
        if not local:
            raise redis.RedisError("Redis did not fsync the usage event within 1 s")
        return entry_id
    return await r.xadd(conf.stream_key(), {FIELD: payload})


def append_many(payloads: Sequence[bytes]) -> list[bytes]:
    """XADD several encoded events in one round trip; return their entry ids.

    With ``wait_aof`` the answer waits until Redis has fsync'd them all. Raise
    ``redis.RedisError`` on failure (some of them may have been added).
    """
    pipe = client().pipeline(transaction=False)
    key = conf.stream_key()
    for payload in payloads:
        pipe.xadd(key, {FIELD: payload})
    if conf.wait_aof():
        pipe.execute_command("WAITAOF", 1, 0, 1000)
        *ids, (local, _replicas) = pipe.execute()
        if not local:
            raise redis.RedisError("Redis did not fsync the usage events within 1 s")
        return ids
    return pipe.execute()


def ensure_group(r: redis.Redis) -> None:
    """Create the consumer group (and the stream) if missing; read from the stream's start."""
    try:
        r.xgroup_create(conf.stream_key(), conf.consumer_group(), id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def entry_ms(entry_id: bytes | str) -> int:
    """Return the Redis server time (ms since the epoch) at which an entry was appended."""
    if isinstance(entry_id, bytes):
        entry_id = entry_id.decode()
    return int(entry_id.split("-", 1)[0])


def trim_acknowledged(r: redis.Redis) -> None:
    """Trim entries every group has been given and acknowledged (never an unread one)."""
    key = conf.stream_key()
    floor: tuple[int, int] | None = None
    for group in r.xinfo_groups(key):
        name = group["name"]
        last = _parse_id(group["last-delivered-id"])
        pending = r.xpending(key, name)
        # the oldest entry this group still needs: its oldest unacknowledged one, else the
        # first it has not been given yet
        need = _parse_id(pending["min"]) if pending["pending"] else (last[0], last[1] + 1)
        floor = need if floor is None else min(floor, need)
    if floor is not None and floor > (0, 0):
        # MINID drops entries strictly older than the floor; "~" trims whole nodes only
        r.xtrim(key, minid=f"{floor[0]}-{floor[1]}", approximate=True)


def _parse_id(value: bytes | str) -> tuple[int, int]:
    if isinstance(value, bytes):
        value = value.decode()
    ms, _, seq = value.partition("-")
    return (int(ms), int(seq or 0))
