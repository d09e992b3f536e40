"""One shared Redis connection pool per process, for the platform's own keys (not the cache)."""

from __future__ import annotations

import asyncio
import functools
import weakref

import hiredis
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


class _HiredisPackingConnection(aioredis.Connection):
    """redis-py's asyncio connection, packing commands with hiredis' C packer.

    redis-py's sync client packs with hiredis when it is installed; its asyncio client packs
    in Python, which was the largest single cost of an admission decision (about 25 argument
    encodes per Lua call; measured by bench/admission.py). Arguments hiredis refuses fall back
    to redis-py's own packer, which raises its usual errors.
    """

    def pack_command(self, *args):
        name = args[0]
        if isinstance(name, str) and " " not in name:
            try:
                return [hiredis.pack_command(args)]
            except TypeError:
                pass
        return super().pack_command(*args)


def get_aredis() -> aioredis.Redis:
    """Return the asyncio Redis client of the running event loop (one per loop)."""
    loop = asyncio.get_running_loop()
    client = _async_clients.get(loop)
    if client is None:
        client = aioredis.Redis.from_url(
            settings.REDIS_URL, decode_responses=True, socket_timeout=2,
            socket_connect_timeout=2, health_check_interval=30,
            **({"connection_class": _HiredisPackingConnection}
               if settings.REDIS_URL.startswith("redis://") else {}),
        )
        _async_clients[loop] = client
    return client
