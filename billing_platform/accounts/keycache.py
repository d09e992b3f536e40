"""Redis cache of API-key lookups with no stale window after a change.

Entries are filled with ``SET NX`` and changed keys are invalidated by writing a fresh
``reload:<nonce>`` marker. A reader that saw a marker may only replace *that* marker
(compare-and-set), so a reader that read the database before a revocation committed can never
write its stale copy over the invalidation: revocation takes effect at once.

Unknown prefixes are cached too (``UNKNOWN``, for ``API_KEY_NEGATIVE_CACHE_TTL_S``), so a
client that keeps presenting a deleted or made-up key costs a Redis read, not a PostgreSQL
query, each time. The negative entry is written by the same compare-and-set fill, so it never
replaces an invalidation; a key created later under a prefix that was probed before it existed
(one in 36^12) is refused until the short negative TTL runs out.

A change is bracketed: ``hold`` runs inside the writer's transaction, before it commits, and
adds the writer's token to the key's ``changing`` set (and drops the cached entry); while that
set is not empty no reader may fill the cache, so every lookup reads the database. ``release``
runs after the commit, removes the token and writes a fresh marker. If ``hold`` cannot reach
Redis the change fails (the caller's transaction rolls back); if ``release`` cannot, the token
stays until it expires and lookups keep reading the database meanwhile. Either way a revoked
key is never served from a stale cache entry.

The gateway's processes each keep a near copy of the entries they read (``_Near``), served
only while Redis tells the process of every change to them: ``hold``'s write drops every
process's copy before the change commits, so the above holds for them too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
import weakref
from typing import Any, cast

import redis
from django.conf import settings

from billing_platform.redis_conn import (
    Invalidations,
    cluster_url,
    get_aredis,
    get_pipelined,
    get_redis,
)

# KEYS: entry, changing set. ARGV: marker seen ('' for none), payload, ttl.
_FILL = """
if redis.call('EXISTS', KEYS[2]) == 1 then
  return nil
end
if ARGV[1] == '' then
  return redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3], 'NX')
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
end
return nil
"""
# KEYS: entry, changing set. ARGV: token, marker, ttl.
_HOLD = """
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('EXPIRE', KEYS[2], ARGV[3])
return redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
"""
_RELEASE = """
redis.call('SREM', KEYS[2], ARGV[1])
return redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
"""
log = logging.getLogger(__name__)

LAST_USED_HASH = "tg:apikey:last_used"
MARKER = "reload:"
NEGATIVE = "unknown"  # the cached value of a prefix no key has
UNKNOWN: dict[str, Any] = {}  # what ``read`` returns for it (compare with ``is``)
TOUCH_BATCH_S = 1.0  # the gateway writes last-used times at most this often, all in one HSET


# A key's entry and its changing set share the hash tag ``{<prefix>}``: the fill and hold
# scripts touch both, which a Redis Cluster allows only within one slot.
def cache_key(prefix: str) -> str:
    return f"tg:apikey:{{{prefix}}}"


TRACKED_PREFIX = "tg:apikey:{"  # every cache_key and changing_key (not LAST_USED_HASH)


def changing_key(prefix: str) -> str:
    return f"tg:apikey:{{{prefix}}}:changing"


def _decode(raw: str | None) -> tuple[dict[str, Any] | None, str | None]:
    if raw is None:
        return None, None
    if raw.startswith(MARKER):
        return None, raw
    if raw == NEGATIVE:
        return UNKNOWN, None
    return json.loads(raw), None


def read(prefix: str) -> tuple[dict[str, Any] | None, str | None]:
    """Return ``(entry, marker)``: a cached entry (``UNKNOWN`` for a prefix known to have no
    key), or the marker to replace (None if absent)."""
    # a decode_responses client: str or None, never bytes
    return _decode(cast("str | None", get_redis().get(cache_key(prefix))))


async def aread(prefix: str) -> tuple[dict[str, Any] | None, str | None, bool]:
    """Async ``read`` for the gateway: ``(entry, marker, near)``, from this process's near
    copy (``_Near``; ``near`` True) when it has the key, else a GET on the pipelined
    connection (every miss)."""
    key = cache_key(prefix)
    near = _near()
    if near is None:
        return *_decode(await get_pipelined().execute("GET", key)), False
    hit = near.get(key)
    if hit is not None:
        return hit, None, True
    epoch = near.epoch
    entry, marker = _decode(await get_pipelined().execute("GET", key))
    if entry:  # a key's entry (not UNKNOWN, not a marker)
        near.put(key, entry, epoch)
    return entry, marker, False


class _Near:
    """The API-key entries this process read from Redis, kept while Redis tells it of every
    change to them (``redis_conn.Invalidations``: client-side caching), so that a busy key's
    request costs no Redis round trip (~0.2-0.3 ms of its time to first token at concurrency
    1, most of its authentication; ``bench/gateway.py``).

    What keeps it exact: every change to a key (``hold``, ``release``, a fill, the entry's
    expiry, a flush) writes or deletes the key's Redis entry, and Redis sends the key's name
    to every tracking connection before it next sleeps, while the writer's change is still
    to commit (``hold`` runs before the commit). The name is read and the copy dropped in the
    read's own callback, before any request read on the same loop turn can run, so a request
    that arrives after a revocation committed finds no copy. A copy is stored only when no
    change to its key (nor a flush, nor a lost connection) was heard between its GET being
    issued and answered. While the connection is not up (at start, after it is lost, Redis
    restarted or unreachable, or a ping unanswered for ``PING_S``) nothing is served from
    the copy and it is emptied: every read goes to Redis, as before. A copy lives at most
    ``TTL_S`` (a change made around ``api_key_cache_refresh``, straight in the database,
    reaches the gateway then at the latest, as one reaching Redis's entry does after its
    TTL); expiry and revocation times are checked on every request (``KeyPrincipal.usable``).
    Unknown prefixes are not kept (each costs a read, as before). Off on a Redis Cluster
    (tracking is per node) and with ``TOLLGATE_API_KEY_NEAR_CACHE=0``.
    """

    TTL_S = 30.0  # the longest a copy is served
    PING_S = 1.0
    RETRY_S = 1.0  # after a failed connect, reads go to Redis this long before the next try
    MAX_ENTRIES = 100_000  # past this the copy is emptied (it refills with the keys in use)
    MAX_HEARD = 10_000  # keys heard changed remembered for reads in flight (then: a flush)

    def __init__(self) -> None:
        self.entries: dict[str, tuple[dict[str, Any], float]] = {}
        self.live = False  # the tracking connection is up: entries may be served
        self.epoch = 0  # the number of changes heard
        self.flushed = 0  # the epoch of the last flush (reads begun before it store nothing)
        self.heard: dict[str, int] = {}  # key -> the epoch its last change was heard at
        self.tracker: Invalidations | None = None
        self.task: asyncio.Task[None] | None = None
        self.retry_at = 0.0
        self.failing = False

    def get(self, key: str) -> dict[str, Any] | None:
        if not self.live:
            self._start()
            return None
        hit = self.entries.get(key)
        if hit is None:
            return None
        if hit[1] < time.monotonic():
            del self.entries[key]
            return None
        return hit[0]

    def put(self, key: str, entry: dict[str, Any], epoch: int) -> None:
        """Keep ``entry``, read by a GET issued at ``epoch``, unless its key changed since."""
        if self.live and self.flushed <= epoch and self.heard.get(key, 0) <= epoch:
            if len(self.entries) >= self.MAX_ENTRIES:
                self.entries.clear()
            self.entries[key] = (entry, time.monotonic() + self.TTL_S)

    def changed(self, keys: list[str] | None) -> None:
        self.epoch += 1
        if keys is None or len(self.heard) + len(keys) > self.MAX_HEARD:
            self._flush()
            return
        for key in keys:
            self.entries.pop(key, None)
            self.heard[key] = self.epoch

    def _flush(self) -> None:
        self.epoch += 1
        self.flushed = self.epoch
        self.entries.clear()
        self.heard.clear()

    def lost(self) -> None:
        self.live = False
        self._flush()

    def _start(self) -> None:
        if self.task is not None or time.monotonic() < self.retry_at:
            return
        self.task = asyncio.get_running_loop().create_task(self._track())
        self.task.add_done_callback(self._ended)

    async def _track(self) -> None:
        tracker = self.tracker = Invalidations(
            settings.REDIS_URL, [TRACKED_PREFIX], on_keys=self.changed, on_lost=self.lost,
            ping_s=self.PING_S)
        try:
            await tracker.open()
        except redis.RedisError as exc:
            tracker.close()
            if not self.failing:
                log.warning("API key near cache: cannot track changes (%r); every request "
                            "reads the key from Redis until it can", exc)
                self.failing = True
            return
        if self.failing:
            log.warning("API key near cache: tracking changes again")
            self.failing = False
        self._flush()
        self.live = True
        await tracker.alive()

    def _ended(self, task: asyncio.Task[None]) -> None:
        self.lost()
        self.task = self.tracker = None
        self.retry_at = time.monotonic() + self.RETRY_S
        if not task.cancelled() and task.exception() is not None:
            log.warning("API key near cache stopped: %r", task.exception())

    def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
        if self.tracker is not None:
            self.tracker.close()


# per event loop: its near copy, or None when it is off (decided at the loop's first read)
_nears: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Near | None] = (
    weakref.WeakKeyDictionary())


def _near() -> _Near | None:
    """The running loop's near copy; None when it is off (setting, or a Redis Cluster)."""
    loop = asyncio.get_running_loop()
    try:
        return _nears[loop]
    except KeyError:
        near = _nears[loop] = (_Near() if settings.API_KEY_NEAR_CACHE and not cluster_url()
                               else None)
        return near


async def aclose_near() -> int:
    """Stop the running loop's near copy (its tracking connection); return 0 (nothing to
    give back: the ASGI lifespan's shutdown)."""
    near = _nears.pop(asyncio.get_running_loop(), None)
    if near is not None:
        near.close()
    return 0


def _value(entry: dict[str, Any] | None) -> tuple[str, int]:
    if entry is None:
        return NEGATIVE, settings.API_KEY_NEGATIVE_CACHE_TTL_S
    return json.dumps(entry), settings.API_KEY_CACHE_TTL_S


def fill(prefix: str, entry: dict[str, Any] | None, *, marker: str | None) -> None:
    """Store a freshly read entry (None: no key has this prefix) unless the key was
    invalidated since it was read."""
    get_redis().eval(_FILL, 2, cache_key(prefix), changing_key(prefix), marker or "",
                     *_value(entry))


async def afill(prefix: str, entry: dict[str, Any] | None, *, marker: str | None) -> None:
    """Async ``fill`` for the gateway."""
    await get_aredis().eval(_FILL, 2, cache_key(prefix), changing_key(prefix), marker or "",
                            *_value(entry))


def _bracket(script: str, prefixes: list[str], token: str) -> None:
    r = get_redis()
    # A cluster pipeline cannot carry EVAL (redis-py), and each prefix is its own slot anyway:
    # there, one call per key; on a single Redis, one round trip for them all.
    pipe = None if cluster_url() else r.pipeline(transaction=False)
    for prefix in prefixes:
        (pipe or r).eval(script, 2, cache_key(prefix), changing_key(prefix), token,
                         MARKER + secrets.token_hex(8), settings.API_KEY_CACHE_TTL_S)
    if pipe is not None:
        pipe.execute()


def hold(prefixes: list[str], *, attempts: int = 3) -> str:
    """Stop the cache serving or storing these keys until ``release``; return the token.

    Call it inside the transaction that changes the keys, before it commits. Retries a
    briefly unreachable Redis, then raises ``redis.RedisError``: the change must then fail.
    """
    token = secrets.token_hex(8)
    if not prefixes:
        return token
    for attempt in range(attempts):
        try:
            _bracket(_HOLD, prefixes, token)
        except redis.RedisError:
            if attempt == attempts - 1:
                raise
            time.sleep(0.05 * 4**attempt)
        else:
            return token
    raise AssertionError("unreachable")


def release(prefixes: list[str], token: str, *, attempts: int = 3) -> bool:
    """After the change committed, let lookups fill the cache again; return False on failure.

    A failure is logged, not raised: the change is committed, and the held keys keep reading
    the database until the hold expires (``API_KEY_CACHE_TTL_S``).
    """
    if not prefixes:
        return True
    for attempt in range(attempts):
        try:
            _bracket(_RELEASE, prefixes, token)
        except redis.RedisError as exc:
            if attempt == attempts - 1:
                log.warning("API key cache release of %d key(s) failed (%r); they read the "
                            "database until the hold expires", len(prefixes), exc)
                return False
            time.sleep(0.05 * 4**attempt)
        else:
            return True
    return False


def invalidate(prefixes: list[str]) -> None:
    """Force the next lookup of each key to read the database (no transaction to bracket)."""
    release(prefixes, hold(prefixes))


def touch(key_id: int, at: float) -> None:
    """Note that a key was used (flushed to the database by a periodic task)."""
    # last-used is advisory; a Redis outage must not fail the request
    with contextlib.suppress(redis.RedisError):
        get_redis().hset(LAST_USED_HASH, str(key_id), repr(at))


class _Touches:
    """Last-used times the gateway noted, written to Redis in one HSET every TOUCH_BATCH_S.

    One HSET per request was a Redis command and a task on the event loop for every request,
    for a time the periodic flush writes to PostgreSQL only every 30 s anyway. What a process
    noted in its last second is lost if it dies: last-used is advisory.
    """

    def __init__(self) -> None:
        self.pending: dict[int, float] = {}
        self.loop: asyncio.AbstractEventLoop | None = None  # where the next write is scheduled
        self.writing: set[asyncio.Task] = set()  # strong references until the writes finish

    def add(self, key_id: int, at: float) -> None:
        loop = asyncio.get_running_loop()
        self.pending[key_id] = max(at, self.pending.get(key_id, at))
        if self.loop is not loop:  # nothing scheduled here (first use, or that loop ended)
            self.loop = loop
            loop.call_later(TOUCH_BATCH_S, self._write)

    def _write(self) -> None:
        self.loop = None
        pending, self.pending = self.pending, {}
        if pending:
            task = asyncio.get_running_loop().create_task(_hset_many(pending))
            self.writing.add(task)
            task.add_done_callback(self.writing.discard)


async def _hset_many(pending: dict[int, float]) -> None:
    with contextlib.suppress(redis.RedisError):
        await get_aredis().hset(LAST_USED_HASH,
                                mapping={str(k): repr(v) for k, v in pending.items()})


_touches = _Touches()


def atouch_soon(key_id: int, at: float) -> None:
    """Note that a key was used; written within TOUCH_BATCH_S, off the request's path."""
    _touches.add(key_id, at)


def drain_last_used() -> dict[int, float]:
    """Atomically take all pending last-used times."""
    r = get_redis()
    pipe = r.pipeline(transaction=True)
    pipe.hgetall(LAST_USED_HASH)
    pipe.delete(LAST_USED_HASH)
    pending, _ = pipe.execute()
    return {int(k): float(v) for k, v in pending.items()}
