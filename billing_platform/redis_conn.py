"""One shared Redis connection pool per process, for the platform's own keys (not the cache)."""

from __future__ import annotations

import asyncio
import functools
import weakref

import redis
import redis.asyncio as aioredis
from django.conf import settings


@functools.cache
def get_redis() -> redis.Redis:
    """Return the process-wide Redis client (decoded strings, short timeouts)."""
    return redis.Redis.from_url(
        settings.REDIS_URL, decode_responses=True, socket_timeout=2, socket_connect_timeout=2,
        health_check_interval=30,
    )


_async_clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def get_aredis() -> aioredis.Redis:
    """Return the asyncio Redis client of the running event loop (one per loop)."""
    loop = asyncio.get_running_loop()
    client = _async_clients.get(loop)
    if client is None:
        client = aioredis.Redis.from_url(
            settings.REDIS_URL, decode_responses=True, socket_timeout=2,
            socket_connect_timeout=2, health_check_interval=30,
        )
        _async_clients[loop] = client
    return client
