"""Requests one organization has in flight on /v1 at once, bounded so no tenant can hold every
gateway connection, engine slot and database thread the others need.

Each request holds a slot from after authentication until its response has been sent, or the
client went away (``gateway/asgi.py`` releases it; a stream holds it to its end). A slot is a
member of the organization's sorted set (``admission.policy.inflight_key``) scored by when its
lease lapses: one script drops lapsed slots, refuses when the organization already holds its
limit, and adds the new one. The process renews the slots it holds every ``RENEW_S`` (one
script call per organization), adding back any the set lost: after a Redis restart, requests
in flight count again within ``RENEW_S``, and a request may outlive the lease. A process that
dies holding slots cannot leak them: they lapse after ``ORG_CONCURRENCY_LEASE_S``. A plain
INCR/DECR counter with a TTL would not do: every request renews the TTL, so under steady
traffic a crashed process's increments would never expire, and the organization would be
refused for good.

The limit is the organization's ``max_concurrent_requests`` (set by staff, carried in the
cached key principal) or ``ORG_MAX_CONCURRENT_REQUESTS``. Redis unreachable: the request goes
on unbounded (logged), as admission does without a hard budget: this bounds shared capacity,
not money.

**Pools.** A slot taken and given back in Redis costs every request two round trips (one of
them before the body is read, on its time to first token) and the one Redis thread two
commands. So a busy organization's slots are taken ahead: once it is busy in a process
(``plans.demand``: 4 requests within 0.1 s), the acquire that goes to Redis also adds members
named for the process's pool, and the process then hands those members to its requests and
takes them back itself. A pool starts at 1/16 of the limit (``ORG_CONCURRENCY_POOL_MAX`` at
most) and doubles each time a request finds all its members in use, up to 1/4 of the limit
and ``ORG_CONCURRENCY_POOL_MAX``, but Redis grants only what leaves at least half the limit
free; members no request needed for ``CHECK_S`` (fewer free than that never happened) go back,
down to the starting size. So a process with many requests of one organization in flight
serves nearly all of them from its pool (with a fixed 1/16, a process holding 64 of a 256
limit still sent three in four to Redis, twice each), and a pool shrinks back once the burst
has passed. Members are real members of the set, scored like any slot and renewed while the
pool lives, so every process's requests and pools together never pass the limit. A pool's
unused members can make the organization look full to its other processes before its requests
are: so a refusal marks the organization full for ``FULL_MS``, and a pool that sees the mark
(looked for every ``CHECK_S`` while it has members free) is given back, so a retry after the
refusal's ``retry-after`` finds those slots free. A pool is given back after ``IDLE_S`` without
a request in flight, at once when the organization's limit changes (its members in use are
then released one by one, as plain slots), when a renewal (every ``RENEW_S``) finds that Redis
lost some of its members (a restart: the members in use are added back), and at shutdown; a
process that dies leaves it to lapse like its slots.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import redis
from django.conf import settings
from redis.exceptions import NoScriptError

from billing_platform.errors import RateLimited
from billing_platform.redis_conn import get_pipelined
from plans.admission.policy import inflight_full_key, inflight_key
from plans.demand import BUSY, Demand

log = logging.getLogger(__name__)

# KEYS: the org's in-flight set, its "full" mark. ARGV: lease (ms), limit, member, pool name,
# pool members wanted (granted as many as leave half the limit free), how long a refusal marks
# the organization full (ms). Return {slots held after the call (negated when the limit refused
# this one), pool members added (named <pool name>:1..n)}.
ACQUIRE_LUA = """
local now = redis.call('TIME')
local ms = now[1] * 1000 + math.floor(now[2] / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ms)
local held = redis.call('ZCARD', KEYS[1])
local limit = tonumber(ARGV[2])
if held >= limit then
  redis.call('SET', KEYS[2], '1', 'PX', ARGV[6])
  return {-held, 0}
end
local expiry = ms + tonumber(ARGV[1])
local n = math.min(tonumber(ARGV[5]), math.floor(limit / 2) - held - 1)
if n > 0 then
  local args = {expiry, ARGV[3]}
  for i = 1, n do
    args[#args + 1] = expiry
    args[#args + 1] = ARGV[4] .. ':' .. i
  end
  redis.call('ZADD', KEYS[1], unpack(args))
else
  n = 0
  redis.call('ZADD', KEYS[1], expiry, ARGV[3])
end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return {held + 1 + n, n}
"""
# KEYS: the org's in-flight set. ARGV: lease (ms), how many of the pool's members are in use,
# those members, then its free ones. Each lives another lease from now: one in use is added
# back if the set lost it (its request is in flight), a free one only renewed. Return how many
# free members the set no longer held (Redis restarted or lost the set).
RENEW_LUA = """
local now = redis.call('TIME')
local expiry = now[1] * 1000 + math.floor(now[2] / 1000) + tonumber(ARGV[1])
local used = tonumber(ARGV[2])
local lost = 0
for i = 3, #ARGV do
  if i < 3 + used then
    redis.call('ZADD', KEYS[1], expiry, ARGV[i])
  elseif redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    redis.call('ZADD', KEYS[1], 'XX', expiry, ARGV[i])
  else
    lost = lost + 1
  end
end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return lost
"""
_shas: dict[str, str] = {}

IDLE_S = 1.0  # a pool with nothing in flight for this long is given back
# A refusal at the limit marks the organization full for this long: pools that see the mark
# (``_check``) give their unused slots back, so its next request need not be refused.
FULL_MS = 2000
# How often the slots a process holds are renewed (a live pool's, and plain ones): well within
# their lease, and often enough that slots Redis lost (a restart) count again soon, and a pool
# that lost some is dropped soon (``_renew``, ``_renew_plain``).
RENEW_S = 10.0
CHECK_S = 0.5  # how often a pool is looked at (idle, spare members, due for renewal)


@dataclass(eq=False)
class _Pool:
    """Slots of one organization this process took ahead (members of its in-flight set)."""

    org_id: int
    limit: int
    members: set[str]
    free: list[str]
    renew_at: float
    last_used: float
    low: int = 0  # the fewest members free since it was last looked at (``_check``)
    closed: bool = False


@dataclass
class Slot:
    """One request's place among its organization's requests in flight."""

    org_id: int
    member: str
    released: bool = False
    pool: _Pool | None = None


_pools: dict[int, _Pool] = {}
# Members of the plain slots (not a pool's) this process holds, per organization: renewed every
# ``RENEW_S`` as a pool's members in use are, by one timer on the loop that took them.
_plain: dict[int, set[str]] = {}
_plain_timer: tuple[asyncio.AbstractEventLoop, asyncio.TimerHandle] | None = None
_demand: dict[int, Demand] = {}
_tasks: set[asyncio.Task[None]] = set()  # pool give-backs and renewals under way
_asking: set[int] = set()  # organizations a call is adding pool members for


def limit_of(max_concurrent_requests: int | None) -> int:
    """Return an organization's limit: its own setting, else the deployment's default."""
    return max_concurrent_requests or settings.ORG_MAX_CONCURRENT_REQUESTS


def _lease_ms() -> int:
    return int(settings.ORG_CONCURRENCY_LEASE_S * 1000)


def _renew_s() -> float:
    return min(RENEW_S, settings.ORG_CONCURRENCY_LEASE_S / 2)


async def _run(script: str, keys: list[str], args: list[object]) -> Any:
    connection = get_pipelined()
    sha = _shas.get(script)
    if sha is None:
        sha = _shas[script] = await connection.execute("SCRIPT", "LOAD", script)
    try:
        return await connection.execute("EVALSHA", sha, len(keys), *keys, *args)
    except NoScriptError:  # Redis lost its script cache (a restart): nothing ran
        sha = _shas[script] = await connection.execute("SCRIPT", "LOAD", script)
        return await connection.execute("EVALSHA", sha, len(keys), *keys, *args)


def _sizes(limit: int) -> tuple[int, int]:
    """Return the size a pool of an organization with ``limit`` starts at, and the most it
    grows to (0, 0: pools are off, or its limit is too small to spare 2)."""
    most = settings.ORG_CONCURRENCY_POOL_MAX
    base = min(most, limit // 16)
    return (base, min(most, limit // 4)) if base >= 2 else (0, 0)


def _wanted(org_id: int, limit: int) -> int:
    """Count one of the organization's requests (it found no free pool member); return how
    many pool members to ask for: a new pool's size, or as many again as the pool holds (up
    to the most it may hold); 0 while it is not busy or pools are off."""
    base, most = _sizes(limit)
    if base == 0:
        return 0
    demand = _demand.get(org_id)
    if demand is None:
        if len(_demand) >= 10_000:  # quiet organizations are forgotten
            _demand.clear()
        demand = _demand[org_id] = Demand()
    demand.add(time.monotonic())
    if demand.level < BUSY:
        return 0
    if org_id in _asking:  # one call at a time adds to an organization's pool
        return 0
    pool = _pools.get(org_id)
    if pool is None or pool.limit != limit:
        return base
    held = len(pool.members)
    return min(max(held, base), most - held)


def _pooled(org_id: int, limit: int, name: str, added: int) -> None:
    """Record the members a call added for the process's pool of the organization."""
    now = time.monotonic()
    pool = old = _pools.get(org_id)
    if pool is None or pool.limit != limit:
        pool = _pools[org_id] = _Pool(
            org_id=org_id, limit=limit, members=set(), free=[],
            renew_at=now + _renew_s(), last_used=now)
        if old is not None:
            _spawn(_give_back(old))
        asyncio.get_running_loop().call_later(CHECK_S, _check, pool)
    fresh = [f"{name}:{i}" for i in range(1, added + 1)]
    pool.members.update(fresh)
    pool.free.extend(fresh)
    pool.renew_at = min(pool.renew_at, now + _renew_s())


def _spawn(coroutine: Coroutine[Any, Any, None]) -> None:
    task = asyncio.get_running_loop().create_task(coroutine)
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)


def _check(pool: _Pool) -> None:
    """Give an idle pool back; give back the members of a live one that no request needed
    since it was last looked at (down to its starting size); renew the others before they
    would lapse; look for the organization's full mark while members are free
    (``_yield_if_full``)."""
    if pool.closed:
        return
    now = time.monotonic()
    if len(pool.free) == len(pool.members) and now - pool.last_used >= IDLE_S:
        _spawn(_give_back(pool))
        return
    spare = min(pool.low, len(pool.members) - _sizes(pool.limit)[0])  # down to its start
    if spare > 0:  # the longest free go (requests take the last freed first)
        gone, pool.free = pool.free[:spare], pool.free[spare:]
        pool.members.difference_update(gone)
        _spawn(_remove(pool.org_id, gone))
    pool.low = len(pool.free)
    if pool.free:
        _spawn(_yield_if_full(pool))
    if now >= pool.renew_at:
        pool.renew_at = now + _renew_s()
        _spawn(_renew(pool))
    asyncio.get_running_loop().call_later(CHECK_S, _check, pool)


async def _renew(pool: _Pool) -> None:
    """Renew the pool's members; drop the pool if Redis lost any of its free ones (it restarted
    or lost the set): handed out, they would let requests in that no slot counts. Its members
    in use are added back (their requests are in flight) and released as plain slots."""
    free = list(pool.free)
    used = pool.members.difference(free)
    try:
        lost = await _run(RENEW_LUA, [inflight_key(pool.org_id)],
                          [_lease_ms(), len(used), *used, *free])
    except redis.RedisError as exc:
        log.warning("in-flight pool of organization %s not renewed (%r)", pool.org_id, exc)
        return
    if lost:
        log.warning("in-flight pool of organization %s: Redis no longer held %d of its slots "
                    "(restarted?); the pool is dropped", pool.org_id, lost)
        await _give_back(pool)


async def _yield_if_full(pool: _Pool) -> None:
    """Give the pool back when a request of its organization was refused at the limit lately:
    its unused slots may be what made the organization look full (its members in use are
    released as plain slots as their requests end)."""
    try:
        full = await get_pipelined().execute("EXISTS", inflight_full_key(pool.org_id))
    except redis.RedisError as exc:
        log.debug("in-flight pool of organization %s: full mark not read (%r)", pool.org_id, exc)
        return
    if full and not pool.closed:
        log.info("in-flight pool of organization %s given back: a request was refused at its "
                 "limit", pool.org_id)
        await _give_back(pool)


def _hold(org_id: int, member: str) -> None:
    """Count a plain slot among those this process renews (the timer starts with the first)."""
    _plain.setdefault(org_id, set()).add(member)
    if _plain_timer is None or _plain_timer[0] is not asyncio.get_running_loop():
        _arm_plain_renewal()


def _arm_plain_renewal() -> None:
    global _plain_timer
    loop = asyncio.get_running_loop()
    _plain_timer = (loop, loop.call_later(_renew_s(), _renew_plain))


def _renew_plain() -> None:
    """Renew every plain slot this process holds: each lives another lease, and one the set
    lost (a Redis restart) is added back, since its request is still in flight; otherwise a
    restart let an organization pass its limit by what it had in flight until that ended."""
    global _plain_timer
    _plain_timer = None
    for org_id, members in list(_plain.items()):
        _spawn(_renew_held(org_id, list(members)))
    if _plain:
        _arm_plain_renewal()


async def _renew_held(org_id: int, members: list[str]) -> None:
    try:
        await _run(RENEW_LUA, [inflight_key(org_id)], [_lease_ms(), len(members), *members])
    except redis.RedisError as exc:
        log.warning("in-flight slots of organization %s not renewed (%r)", org_id, exc)


async def _remove(org_id: int, members: list[str]) -> None:
    """Remove a pool's members from the organization's set (a failure: they lapse)."""
    try:
        await get_pipelined().execute("ZREM", inflight_key(org_id), *members)
    except redis.RedisError as exc:
        log.warning("in-flight pool of organization %s not given back (%r); it lapses after "
                    "%.0fs", org_id, exc, settings.ORG_CONCURRENCY_LEASE_S)


async def _give_back(pool: _Pool) -> None:
    """Close the pool and remove its free members (those in use go as their requests end)."""
    if not pool.closed:
        pool.closed = True
        if _pools.get(pool.org_id) is pool:
            del _pools[pool.org_id]
    free, pool.free = pool.free, []
    pool.members.difference_update(free)
    for member in pool.members:  # in use: renewed as plain slots until their requests end
        _hold(pool.org_id, member)
    if free:
        await _remove(pool.org_id, free)


async def aacquire(*, org_id: int, limit: int, request_id: str) -> Slot | None:
    """Take one of the organization's ``limit`` slots for a request, or raise ``RateLimited``
    (429 ``too_many_concurrent_requests``). Return None when Redis is unreachable."""
    pool = _pools.get(org_id)
    if pool is not None:
        if pool.limit != limit:  # the organization's limit changed: its pool goes first
            await _give_back(pool)
        elif pool.free:
            member = pool.free.pop()
            pool.low = min(pool.low, len(pool.free))
            return Slot(org_id=org_id, member=member, pool=pool)
    wanted = _wanted(org_id, limit)
    name = ""
    if wanted > 0:
        name = f"pool_{uuid.uuid4().hex}"
        _asking.add(org_id)
    try:
        raw = await _run(ACQUIRE_LUA, [inflight_key(org_id), inflight_full_key(org_id)],
                         [_lease_ms(), limit, request_id, name, wanted, FULL_MS])
    except redis.RedisError as exc:
        log.warning("concurrency limit skipped for %s: Redis unavailable (%r)", request_id, exc)
        return None
    finally:
        if name:
            _asking.discard(org_id)
    held, added = int(raw[0]), int(raw[1])
    if held < 0:
        raise RateLimited(
            # not the count held: it includes slots gateway processes keep ready (pools)
            f"Your organization has reached its limit of concurrent requests ({limit}); "
            f"retry when one of its requests in flight has finished.",
            code="too_many_concurrent_requests", headers={"retry-after": "1"})
    if added:
        _pooled(org_id, limit, name, added)
    _hold(org_id, request_id)
    return Slot(org_id=org_id, member=request_id)


async def arelease(slot: Slot | None) -> None:
    """Give a slot back (once; a failure is logged and the slot lapses with its lease)."""
    if slot is None or slot.released:
        return
    slot.released = True
    pool = slot.pool
    if pool is not None:
        if not pool.closed:
            pool.free.append(slot.member)
            pool.last_used = time.monotonic()
            return
        pool.members.discard(slot.member)
    held = _plain.get(slot.org_id)
    if held is not None:
        held.discard(slot.member)
        if not held:
            del _plain[slot.org_id]
    try:
        await get_pipelined().execute("ZREM", inflight_key(slot.org_id), slot.member)
    except redis.RedisError as exc:
        log.warning("in-flight slot of %s not released (%r); it lapses after %.0fs",
                    slot.member, exc, settings.ORG_CONCURRENCY_LEASE_S)


async def aclose() -> int:
    """Give back every pool this process holds (at shutdown); return how many."""
    pools = list(_pools.values())
    await asyncio.gather(*(_give_back(pool) for pool in pools))
    return len(pools)
