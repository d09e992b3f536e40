"""Requests one organization has in flight on /v1 at once, bounded so no tenant can hold every
gateway connection, engine slot and database thread the others need.

Each request holds a slot from after authentication until its response has been sent, or the
client went away (``gateway/asgi.py`` releases it; a stream holds it to its end). A slot is a
member of the organization's sorted set (``admission.policy.inflight_key``) scored by when its
lease lapses: one script drops lapsed slots, refuses when the organization already holds its
limit, and adds the new one. A process that dies holding slots cannot leak them: they lapse
after ``ORG_CONCURRENCY_LEASE_S``, longer than any request runs (reservations expire after 10
minutes). A plain INCR/DECR counter with a TTL would not do: every request renews the TTL, so
under steady traffic a crashed process's increments would never expire, and the organization
would be refused for good.

The limit is the organization's ``max_concurrent_requests`` (set by staff, carried in the
cached key principal) or ``ORG_MAX_CONCURRENT_REQUESTS``. Redis unreachable: the request goes
on unbounded (logged), as admission does without a hard budget: this bounds shared capacity,
not money.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis
from django.conf import settings
from redis.exceptions import NoScriptError

from billing_platform.errors import RateLimited
from billing_platform.redis_conn import get_pipelined
from plans.admission.policy import inflight_key

log = logging.getLogger(__name__)

# KEYS: the org's in-flight set. ARGV: lease (ms), limit, member. Return the slots held after
# the call, negated when the limit refused this one.
ACQUIRE_LUA = """
local now = redis.call('TIME')
local ms = now[1] * 1000 + math.floor(now[2] / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ms)
local held = redis.call('ZCARD', KEYS[1])
if held >= tonumber(ARGV[2]) then
  return -held
end
redis.call('ZADD', KEYS[1], ms + tonumber(ARGV[1]), ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return held + 1
"""
_sha: str | None = None


@dataclass
class Slot:
    """One request's place among its organization's requests in flight."""

    org_id: int
    member: str
    released: bool = False


def limit_of(max_concurrent_requests: int | None) -> int:
    """Return an organization's limit: its own setting, else the deployment's default."""
    return max_concurrent_requests or settings.ORG_MAX_CONCURRENT_REQUESTS


async def _run(keys: list[str], args: list[object]) -> int:
    global _sha
    connection = get_pipelined()
    if _sha is None:
        _sha = await connection.execute("SCRIPT", "LOAD", ACQUIRE_LUA)
    try:
        return int(await connection.execute("EVALSHA", _sha, len(keys), *keys, *args))
    except NoScriptError:  # Redis lost its script cache (a restart): nothing ran
        _sha = await connection.execute("SCRIPT", "LOAD", ACQUIRE_LUA)
        return int(await connection.execute("EVALSHA", _sha, len(keys), *keys, *args))


async def aacquire(*, org_id: int, limit: int, request_id: str) -> Slot | None:
    """Take one of the organization's ``limit`` slots for a request, or raise ``RateLimited``
    (429 ``too_many_concurrent_requests``). Return None when Redis is unreachable."""
    try:
        held = await _run([inflight_key(org_id)],
                          [int(settings.ORG_CONCURRENCY_LEASE_S * 1000), limit, request_id])
    except redis.RedisError as exc:
        log.warning("concurrency limit skipped for %s: Redis unavailable (%r)", request_id, exc)
        return None
    if held < 0:
        raise RateLimited(
            f"Your organization has {-held} requests in flight, its limit of concurrent "
            f"requests ({limit}); retry when one of them has finished.",
            code="too_many_concurrent_requests", headers={"retry-after": "1"})
    return Slot(org_id=org_id, member=request_id)


async def arelease(slot: Slot | None) -> None:
    """Give a slot back (once; a failure is logged and the slot lapses with its lease)."""
    if slot is None or slot.released:
        return
    slot.released = True
    try:
        await get_pipelined().execute("ZREM", inflight_key(slot.org_id), slot.member)
    except redis.RedisError as exc:
        log.warning("in-flight slot of %s not released (%r); it lapses after %.0fs",
                    slot.member, exc, settings.ORG_CONCURRENCY_LEASE_S)
