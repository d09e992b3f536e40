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


class _HiredisPacking:
    """Mixin for redis-py's asyncio connections: pack commands with hiredis' C packer.

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


class _TcpConnection(_HiredisPacking, aioredis.Connection):
    pass


class _SslConnection(_HiredisPacking, aioredis.SSLConnection):
    pass


class _UnixConnection(_HiredisPacking, aioredis.UnixDomainSocketConnection):
    pass


# redis://, rediss:// and unix:// URLs each pick their own connection class
_PACKING = {aioredis.Connection: _TcpConnection, aioredis.SSLConnection: _SslConnection,
            aioredis.UnixDomainSocketConnection: _UnixConnection}


def async_client(url: str) -> aioredis.Redis:
    """Return a new asyncio client for ``url`` whose connections pack with hiredis."""
    client = aioredis.Redis.from_url(url, decode_responses=True, socket_timeout=2,
                                     socket_connect_timeout=2, health_check_interval=30)
    pool = client.connection_pool  # no connection is open yet: choose their class now
    pool.connection_class = _PACKING.get(pool.connection_class, pool.connection_class)
    return client


def get_aredis() -> aioredis.Redis:
    """Return the asyncio Redis client of the running event loop (one per loop)."""
    loop = asyncio.get_running_loop()
    client = _async_clients.get(loop)
    if client is None:
        client = _async_clients[loop] = async_client(settings.REDIS_URL)
    return client
