"""One shared Redis connection pool per process, for the platform's own keys (not the cache)."""

from __future__ import annotations

import asyncio
import collections
import functools
import ssl
import weakref
from typing import Any

import hiredis
import redis
import redis.asyncio as aioredis
import redis.exceptions
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


class _Replies(asyncio.Protocol):
    """Reads RESP replies with hiredis and hands each to the oldest waiting command."""

    def __init__(self) -> None:
        self.reader = hiredis.Reader(encoding="utf-8", replyError=redis.exceptions.ResponseError)
        self.waiters: collections.deque[asyncio.Future] = collections.deque()
        self.transport: asyncio.Transport | None = None
        self.lost: Exception | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        try:
            self._answer()
        except hiredis.ProtocolError:
            if self.transport is not None:  # set by connection_made, before any data
                self.transport.abort()  # not Redis speaking: connection_lost fails the waiters

    def _answer(self) -> None:
        while (reply := self.reader.gets()) is not False:
            waiter = self.waiters.popleft()
            if waiter.done():
                continue  # its caller gave up (cancelled); the reply is dropped in order
            if isinstance(reply, redis.exceptions.ResponseError):
                waiter.set_exception(_error(str(reply)))
            else:
                waiter.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = redis.exceptions.ConnectionError(
            f"Redis connection lost: {exc!r}" if exc else "Redis closed the connection")
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_exception(self.lost)


def _error(message: str) -> redis.exceptions.RedisError:
    """The redis-py exception for an error reply, so callers catch what they already do."""
    if message.startswith("NOSCRIPT"):
        return redis.exceptions.NoScriptError(message)
    if message.startswith(("NOAUTH", "WRONGPASS")):
        return redis.exceptions.AuthenticationError(message)
    return redis.exceptions.ResponseError(message)


class PipelinedConnection:
    """One asyncio connection to Redis that pipelines commands, for the request path's hot
    commands (admission scripts, key lookups).

    redis-py's asyncio client takes a pooled connection, arms a timeout and a retry policy and
    parses the reply through several layers for every command: about half of the gateway
    process's time per admission decision. Here a command is packed by hiredis, written, and
    answered by the next reply the protocol reads, so commands from many requests share the
    one connection without waiting for each other (Redis answers in order). Errors are
    redis-py's exceptions: error replies raise ``ResponseError`` (``NoScriptError``, ...); a
    lost connection fails every command in flight with ``ConnectionError`` and the next
    command reconnects; a command unanswered after ``timeout`` raises ``TimeoutError`` and
    drops the connection (its state is unknown).
    """

    def __init__(self, url: str, *, timeout: float = 2.0, connect_timeout: float = 2.0) -> None:
        self.options = aioredis.connection.parse_url(url)
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self.protocol: _Replies | None = None
        self.connecting: asyncio.Future | None = None

    async def execute(self, *args: Any) -> Any:
        protocol = self.protocol
        if protocol is None or protocol.lost is not None:
            protocol = await self._connect()
        return await self._send(protocol, args)

    async def _send(self, protocol: _Replies, args: tuple[Any, ...]) -> Any:
        waiter = asyncio.get_running_loop().create_future()
        protocol.waiters.append(waiter)
        if protocol.transport is None:  # connection_made set it before _connect returned
            raise redis.exceptions.ConnectionError("Redis connection not made")
        protocol.transport.write(hiredis.pack_command(args))
        try:
            async with asyncio.timeout(self.timeout):
                return await waiter
        except TimeoutError:
            self._drop(protocol)
            raise redis.exceptions.TimeoutError(
                f"Redis did not answer {args[0]} within {self.timeout:.1f}s") from None

    def _drop(self, protocol: _Replies) -> None:
        if self.protocol is protocol:
            self.protocol = None
        if protocol.transport is not None:
            protocol.transport.abort()  # connection_lost fails the other waiters

    async def _connect(self) -> _Replies:
        if self.connecting is None:
            self.connecting = asyncio.ensure_future(self._open())
        connecting = self.connecting
        try:
            return await asyncio.shield(connecting)
        finally:
            if self.connecting is connecting and connecting.done():
                self.connecting = None

    async def _open(self) -> _Replies:
        loop = asyncio.get_running_loop()
        o = self.options
        try:
            async with asyncio.timeout(self.connect_timeout):
                if "path" in o:
                    _, protocol = await loop.create_unix_connection(_Replies, o["path"])
                else:
                    context = None
                    if o.get("connection_class") is aioredis.SSLConnection:
                        context = ssl.create_default_context()
                        if o.get("ssl_cert_reqs") in ("none", ssl.CERT_NONE):
                            context.check_hostname = False
                            context.verify_mode = ssl.CERT_NONE
                    _, protocol = await loop.create_connection(
                        _Replies, o.get("host", "localhost"), o.get("port", 6379), ssl=context)
        except (OSError, TimeoutError) as exc:
            raise redis.exceptions.ConnectionError(
                f"cannot connect to Redis: {exc!r}; is it running at the configured "
                f"REDIS_URL?") from exc
        setup: list[tuple[Any, ...]] = []
        if o.get("password"):
            setup.append(("AUTH", *([o["username"]] if o.get("username") else []),
                          o["password"]))
        if o.get("db"):
            setup.append(("SELECT", o["db"]))
        try:
            for command in setup:  # before any other command can use the connection
                await self._send(protocol, command)
        except BaseException:
            self._drop(protocol)
            raise
        self.protocol = protocol
        return protocol

    def close(self) -> None:
        if self.protocol is not None:
            self._drop(self.protocol)


_pipelined: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def get_pipelined() -> PipelinedConnection:
    """Return the running event loop's pipelined connection to ``REDIS_URL`` (one per loop)."""
    loop = asyncio.get_running_loop()
    connection = _pipelined.get(loop)
    if connection is None:
        connection = _pipelined[loop] = PipelinedConnection(settings.REDIS_URL)
    return connection
