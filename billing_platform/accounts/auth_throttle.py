"""Failed API-key authentications on /v1, counted per client address and throttled past a limit.

Why: a key that is not in the key cache costs a PostgreSQL query to refuse, so a client trying
made-up keys (each with a new prefix, which no negative cache can hold) could make every one of
its requests a query. Past ``AUTH_FAILURE_LIMIT`` failures within ``AUTH_FAILURE_WINDOW_S``, the
address is throttled until the window ends: what it presents is checked against the key cache
only, so a key that verifies from the cache still gets through (another client behind the same
NAT, with a working key) and anything else is answered 429 ``too_many_failed_authentications``
without a query. The window is fixed (it starts at the first failure), and throttled requests
do not extend it.

The address is the one uvicorn reports (``X-Forwarded-For`` only from its trusted proxies,
``--forwarded-allow-ips``); an IPv6 client is counted by its /64, which one host can fill
with addresses. Redis unreachable: nothing is counted or throttled (the requests go on as
before; the key lookups read PostgreSQL).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging

import redis
from django.conf import settings

from billing_platform.errors import RateLimited
from billing_platform.redis_conn import get_pipelined

log = logging.getLogger(__name__)

# KEYS: the address's counter. ARGV: window (s). Count one failure; the first starts the window.
_FAILED = """
local n = redis.call('INCR', KEYS[1])
if n == 1 or redis.call('TTL', KEYS[1]) < 0 then
  redis.call('EXPIRE', KEYS[1], ARGV[1])
end
return n
"""


def _key(address: str) -> str:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return f"tg:authfail:{address[:64]}"
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return f"tg:authfail:{ip.ipv4_mapped}"
        return f"tg:authfail:{ipaddress.ip_network(f'{ip}/64', strict=False)}"
    return f"tg:authfail:{ip}"


async def aretry_after(address: str) -> int | None:
    """Return the seconds until a throttled address may try again; None if not throttled."""
    connection = get_pipelined()
    key = _key(address)
    try:
        count = await connection.execute("GET", key)
        if count is None or int(count) < settings.AUTH_FAILURE_LIMIT:
            return None
        ttl = await connection.execute("TTL", key)
    except redis.RedisError as exc:
        log.warning("auth throttle skipped: Redis unavailable (%r)", exc)
        return None
    return max(1, int(ttl))


async def afailed(address: str) -> None:
    """Count one failed authentication from ``address``."""
    with contextlib.suppress(redis.RedisError):
        count = await get_pipelined().execute("EVAL", _FAILED, 1, _key(address),
                                              settings.AUTH_FAILURE_WINDOW_S)
        if count == settings.AUTH_FAILURE_LIMIT:
            log.warning("client %s: %d failed API-key authentications; throttled for up to %ds",
                        address, count, settings.AUTH_FAILURE_WINDOW_S)


def throttled(retry_after: int) -> RateLimited:
    """Return the answer to a throttled address (OpenAI's 429 shape, with Retry-After)."""
    return RateLimited(
        f"Too many requests with an incorrect, revoked or expired API key from your address; "
        f"try again in {retry_after} s.", code="too_many_failed_authentications",
        headers={"retry-after": str(retry_after)})
