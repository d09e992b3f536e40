"""The Redis stream of usage events: clients, XADD, and the consumer group's housekeeping.

Each entry has one field, ``e``: the event's compact JSON (``metering.events.encode``). The
clients here are separate from ``billing_platform.redis_conn`` on purpose: an append must fail
over to PostgreSQL within milliseconds when Redis is gone, so they retry once (a stale pooled
connection after a Redis restart) and never back off, where the platform client retries with
backoff. A short circuit breaker skips Redis for a moment after a failure, so a dead Redis costs
one refused connection per second, not one per request.

The stream is capped (``conf.stream_max_length``) so a consumer that stops cannot grow it
until Redis runs out of memory and takes rate limits, budgets and the broker with it. A plain
``XADD ... MAXLEN`` would make room by trimming the oldest entries whether or not the consumer
group has recorded them: undelivered entries and delivered-but-unacknowledged ones (the
group's pending entries, which a crashed consumer's successor reclaims) alike, so billable
usage would vanish without a trace. Here the append is one script that refuses (``StreamFull``)
when the events would not fit, and the caller writes them to PostgreSQL directly instead, the
same fallback as a Redis outage: nothing is trimmed that was not recorded. Recorded entries
are trimmed by the consumer (``trim_acknowledged``), so the stream's length is its backlog.
The script's ``MAXLEN ~`` is a backstop that never fires for our appends (they stop at the
cap, and ``~`` trims only whole nodes beyond it). Before the cap is reached the append logs a
warning (``conf.stream_alarm_length``) and ``/metrics`` shows the length beside the cap.

Durability beyond the master's memory is opt-in: ``TOLLGATE_USAGE_WAITAOF`` waits for the
master's AOF fsync (single Redis), ``TOLLGATE_USAGE_WAIT_REPLICAS`` for replicas (``WAIT``,
single Redis or cluster: sent on the connection that carried the append, to the stream's
master). An append that is not durable in time raises like a Redis failure, so the caller
writes the event to PostgreSQL directly; a copy left on the stream is recorded once.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any, cast

import redis
from django.core.exceptions import ImproperlyConfigured
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.commands.core import Script
from redis.exceptions import NoScriptError
from redis.retry import Retry

from billing_platform.redis_conn import (
    ClusterPipelinedConnection,
    PipelinedConnection,
    sync_cluster,
)
from metering import conf

FIELD = b"e"
BREAKER_OPEN_S = 1.0
ALARM_LOG_EVERY_S = 60.0
# KEYS: the stream. ARGV: cap, payload... Append all payloads, or none when they do not fit;
# return the stream's length after the append (the ids are not needed).
APPEND_LUA = """
local cap = tonumber(ARGV[1])
local length = redis.call('XLEN', KEYS[1])
if length + #ARGV - 1 > cap then
  return redis.error_reply('TGFULL the usage stream holds ' .. length .. ' entries, its cap is '
    .. cap)
end
for i = 2, #ARGV do
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', cap, '*', 'e', ARGV[i])
end
return length + #ARGV - 1
"""
log = logging.getLogger(__name__)


class StreamFull(redis.RedisError):
    """The usage stream is at its cap: the events were not appended (write them elsewhere)."""

_sync_clients: dict[tuple[str, float], redis.Redis] = {}
_async_connections: weakref.WeakKeyDictionary[
    asyncio.AbstractEventLoop, dict[str, PipelinedConnection | ClusterPipelinedConnection]] = (
    weakref.WeakKeyDictionary())
_lock = threading.Lock()


def _cluster() -> bool:
    """Return whether the stream lives on the platform's Redis Cluster."""
    if not conf.redis_is_cluster():
        return False
    if conf.wait_aof():
        # WAITAOF counts the writes of its own connection, which a cluster client does not
        # keep for the stream's master: refuse rather than wait on the wrong one
        raise ImproperlyConfigured("TOLLGATE_USAGE_WAITAOF is not supported with "
                                   "REDIS_CLUSTER_URL")
    return True


def client(*, socket_timeout: float = 2.0) -> redis.Redis:
    """Return the process's client of the usage stream's Redis (bytes in, bytes out); a
    ``RedisCluster`` (the same commands, typed as ``redis.Redis``) on the platform's cluster."""
    url = conf.redis_url()
    key = (url, socket_timeout)
    with _lock:
        if key not in _sync_clients:
            options: dict[str, Any] = {"socket_timeout": socket_timeout,
                                       "socket_connect_timeout": 1.0,
                                       "retry": Retry(NoBackoff(), 1)}
            _sync_clients[key] = (
                cast(redis.Redis, sync_cluster(url, require_full_coverage=False, **options))
                if _cluster() else
                redis.Redis.from_url(url, health_check_interval=0, **options))
        return _sync_clients[key]


APPEND_SHA = hashlib.sha1(APPEND_LUA.encode()).hexdigest()  # noqa: S324 - Redis's script id


def _waits() -> list[tuple[Any, ...]]:
    """Return the commands an append is followed by before it counts (none by default)."""
    waits: list[tuple[Any, ...]] = []
    if conf.wait_aof():
        waits.append(("WAITAOF", 1, 0, 1000))
    if conf.wait_replicas():
        waits.append(("WAIT", conf.wait_replicas(), conf.wait_replicas_ms()))
    return waits


def _check_waits(waits: Sequence[tuple[Any, ...]], replies: Sequence[Any]) -> None:
    """Raise ``redis.RedisError`` unless every wait was met."""
    for command, reply in zip(waits, replies, strict=True):
        if command[0] == "WAITAOF":
            if not reply[0]:
                raise redis.RedisError("Redis did not fsync the usage event(s) within 1 s")
        elif int(reply) < command[1]:
            raise redis.RedisError(
                f"{int(reply)} of {command[1]} Redis replica(s) acknowledged the usage "
                f"event(s) within {command[2]} ms (TOLLGATE_USAGE_WAIT_REPLICAS)")


def _aconnection(cluster: bool) -> PipelinedConnection | ClusterPipelinedConnection:
    """Return this loop's pipelined connection to the usage stream's Redis (or cluster).

    Pipelined, as admission's: an append is packed by hiredis and answered by the next reply,
    with none of redis-py's per-command pool, retry and parsing layers (the append was about a
    tenth of the gateway's CPU per request through redis-py's asyncio client; and its cluster
    client raised AttributeError, not a RedisError, from connections opened concurrently under
    load: the fallback never saw it). A lost connection fails the appends in flight with
    ``ConnectionError`` (they go to PostgreSQL) and the next one reconnects.
    """
    loop = asyncio.get_running_loop()
    url = conf.redis_url()
    per_loop = _async_connections.setdefault(loop, {})
    connection = per_loop.get(url)
    if connection is None:
        kind = ClusterPipelinedConnection if cluster else PipelinedConnection
        connection = per_loop[url] = kind(url, connect_timeout=1.0)
    return connection


def reset_clients() -> None:
    """Forget cached clients (tests that point metering at another Redis)."""
    with _lock:
        for c in _sync_clients.values():
            c.close()
        _sync_clients.clear()
    _async_connections.clear()
    breaker.close()
    alarm.reset()


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


_scripts: weakref.WeakKeyDictionary[redis.Redis, Script] = weakref.WeakKeyDictionary()


def _script(r: redis.Redis) -> Script:
    """Return the append script bound to ``r`` (its SHA computed once per client)."""
    script = _scripts.get(r)
    if script is None:
        script = _scripts[r] = r.register_script(APPEND_LUA)
    return script


def _full(exc: redis.ResponseError) -> redis.RedisError:
    return StreamFull(str(exc).removeprefix("TGFULL ")) if str(exc).startswith("TGFULL") else exc


class _Alarm:
    """Log, at most once a minute per process, that the stream is filling towards its cap."""

    def __init__(self) -> None:
        self._next = 0.0

    def reset(self) -> None:
        self._next = 0.0

    def check(self, length: int) -> None:
        alarm = conf.stream_alarm_length()
        if length < alarm or time.monotonic() < self._next:
            return
        self._next = time.monotonic() + ALARM_LOG_EVERY_S
        log.warning("the usage stream holds %d entries (alarm at %d, cap %d): the ingest "
                    "consumer is behind or down; at the cap, usage goes to PostgreSQL directly",
                    length, alarm, conf.stream_max_length())


alarm = _Alarm()


# The most events one append script call carries (the appends of one loop tick beyond it go
# in a next call, sent at once).
APPEND_BATCH_MAX = 64


class _Appends:
    """The appends of one event-loop tick to one stream, sent as ONE script call.

    At concurrency a gateway finishes several requests per loop tick; one ``EVALSHA`` per
    event cost the one Redis thread every gateway shares ~14 us each (the script's start, its
    XLEN, the reply), and the gateway a round trip each. Batched, they share all of that. The
    batch is all or none, as ``append_many``: each caller gets the stream's length after it,
    or the same error (``StreamFull``, or Redis's), and writes its event to PostgreSQL
    instead. A caller waits at most one loop iteration longer than it would alone.
    """

    __slots__ = ("futures", "payloads")

    def __init__(self) -> None:
        self.payloads: list[bytes] = []
        self.futures: list[asyncio.Future[int]] = []


_pending: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, _Appends]] = (
    weakref.WeakKeyDictionary())
_flushing: set[asyncio.Task[None]] = set()  # the loop holds tasks weakly


async def aappend(payload: bytes, *, key: str | None = None) -> int:
    """Append one encoded event from async code to ``key`` (the organization's shard;
    ``conf.stream_key()`` by default); return the stream's length after it.

    The appends of one loop tick to one stream go in one script call (``_Appends``). Raise
    ``StreamFull`` when the stream is at its cap (nothing appended), another
    ``redis.RedisError`` when Redis failed.
    """
    key = key or conf.stream_key()
    loop = asyncio.get_running_loop()
    pending = _pending.get(loop)
    if pending is None:
        pending = _pending[loop] = {}
    batch = pending.get(key)
    if batch is None or len(batch.payloads) >= APPEND_BATCH_MAX:
        batch = pending[key] = _Appends()
        task = loop.create_task(_send(loop, key, batch))
        _flushing.add(task)
        task.add_done_callback(_flushing.discard)
    future: asyncio.Future[int] = loop.create_future()
    batch.payloads.append(payload)
    batch.futures.append(future)
    return await future


async def _send(loop: asyncio.AbstractEventLoop, key: str, batch: _Appends) -> None:
    """Send a tick's appends to ``key`` (this task's first step runs after every append made
    in the tick it was created in has joined), and answer each."""
    pending = _pending.get(loop)
    if pending is not None and pending.get(key) is batch:
        del pending[key]  # later appends start the next batch
    try:
        length = await _append_now(key, batch.payloads)
    except Exception as exc:
        for future in batch.futures:
            if not future.done():
                future.set_exception(exc)
        return
    except BaseException:  # cancelled (the loop shuts down): so are its callers
        for future in batch.futures:
            future.cancel()
        raise
    for future in batch.futures:
        if not future.done():
            future.set_result(length)


async def _append_now(key: str, payloads: list[bytes]) -> int:
    """Append ``payloads`` to ``key`` in one script call, all or none; return the length."""
    cluster = _cluster()
    connection = _aconnection(cluster)
    cap = conf.stream_max_length()
    try:
        try:
            length = int(await connection.execute("EVALSHA", APPEND_SHA, 1, key, cap,
                                                  *payloads))
        except NoScriptError:  # a restarted or new Redis: EVAL loads it
            length = int(await connection.execute("EVAL", APPEND_LUA, 1, key, cap, *payloads))
    except redis.ResponseError as exc:
        raise _full(exc) from None
    # on the connection that carried the append (on a cluster: the stream's master's), so
    # they count its writes
    waits = _waits()
    _check_waits(waits, [await (connection.execute_on(key, *w) if isinstance(
        connection, ClusterPipelinedConnection) else connection.execute(*w)) for w in waits])
    alarm.check(length)
    return length


def append_many(payloads: Sequence[bytes], *, key: str | None = None) -> int:
    """Append several encoded events to ``key`` (one shard; ``conf.stream_key()`` by default)
    in one round trip, all or none; return the stream's length after them.

    With ``wait_aof`` / ``wait_replicas`` the answer waits until Redis has fsync'd them all /
    its replicas have them. Raise ``StreamFull`` when they do not fit under the cap (none
    appended), another ``redis.RedisError`` when Redis failed (after a wait that was not met,
    they may have been appended: a copy on the stream is recorded once).
    """
    r = client()
    script = _script(r)
    key = key or conf.stream_key()
    args: list[int | bytes] = [conf.stream_max_length(), *payloads]
    length: int
    try:
        if waits := _waits():
            # one connection carries the append and the waits (on a cluster: the master's)
            node = (r.get_redis_connection(r.get_node_from_key(key))
                    if isinstance(r, RedisCluster) else r)
            pipe = node.pipeline(transaction=False)
            script(keys=[key], args=args, client=pipe)
            for command in waits:
                # redis-py leaves Pipeline.execute_command unannotated
                pipe.execute_command(*command)  # type: ignore[no-untyped-call]
            length, *replies = pipe.execute()
            _check_waits(waits, replies)
        else:
            length = script(keys=[key], args=args)
    except redis.ResponseError as exc:
        raise _full(exc) from None
    alarm.check(length)
    return length


def ensure_group(r: redis.Redis, key: str | None = None) -> None:
    """Create the consumer group (and the stream) if missing; read from the stream's start."""
    try:
        r.xgroup_create(key or conf.stream_key(), conf.consumer_group(), id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def entry_ms(entry_id: bytes | str) -> int:
    """Return the Redis server time (ms since the epoch) at which an entry was appended."""
    if isinstance(entry_id, bytes):
        entry_id = entry_id.decode()
    return int(entry_id.split("-", 1)[0])


def trim_acknowledged(r: redis.Redis, key: str | None = None) -> None:
    """Trim entries every group has been given and acknowledged (never an unread one)."""
    key = key or conf.stream_key()
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
