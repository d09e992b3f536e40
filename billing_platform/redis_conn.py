"""One shared Redis connection pool per process, for the platform's own keys (not the cache).

The platform's keys (quota state, the API-key cache, the auth throttle, the usage stream) live
on ``REDIS_URL``, or on a Redis Cluster when ``REDIS_CLUSTER_URL`` names some of its nodes
(one or more comma-separated node URLs; the clients discover the others from whichever answers,
so name more than one: a process started while the only named node is down cannot start).
Every key of one organization carries its hash tag (``{o<id>}``), so each script touches one
slot. The Celery broker and Django's cache stay on ``REDIS_URL``:
kombu's Redis transport does not speak Cluster (its queues are lists and a set of bindings
under fixed names, MULTI/EXEC across them), and the broker's load is small beside the request
path's.

Length: every Redis client a process holds is made here (sync, asyncio, the request path's
pipelined connection, each for one server or a cluster), because ``reset_clients`` must forget
all of them and the cluster clients share ``cluster_seeds``; split, the halves would import
each other. The pipelined connection (``_Replies`` to ``get_pipelined``) is the larger half.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import ssl
import weakref
from collections.abc import Callable
from typing import Any, Protocol, cast

import hiredis
import redis
import redis.asyncio as aioredis
import redis.exceptions
from django.conf import settings
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster
from redis.crc import key_slot


def cluster_url() -> str:
    """Return the node URLs (comma-separated) of the Redis Cluster holding the platform's keys
    ('' for none)."""
    return getattr(settings, "REDIS_CLUSTER_URL", "") or ""


def cluster_seeds(urls: str) -> tuple[str, list[tuple[str, int]]]:
    """Split comma-separated cluster node URLs into the first URL (its credentials and options
    serve every node) and every named node's ``(host, port)``."""
    parts = [u.strip() for u in urls.split(",") if u.strip()]
    if not parts:
        raise ValueError("no Redis Cluster node URL given")
    seeds = []
    for part in parts:
        options = aioredis.connection.parse_url(part)
        seeds.append((str(options.get("host", "localhost")), int(options.get("port", 6379))))
    return parts[0], seeds


def sync_cluster(urls: str, **options: Any) -> RedisCluster:
    """Return a ``RedisCluster`` that learns the cluster from any of the named nodes."""
    from redis.cluster import ClusterNode

    first, seeds = cluster_seeds(urls)
    return RedisCluster.from_url(first, startup_nodes=[ClusterNode(h, p) for h, p in seeds],
                                 **options)


def async_cluster(urls: str, **options: Any) -> AsyncRedisCluster:
    """Return an asyncio ``RedisCluster`` that learns the cluster from any of the named nodes."""
    from redis.asyncio.cluster import ClusterNode

    first, seeds = cluster_seeds(urls)
    client = AsyncRedisCluster.from_url(
        first, startup_nodes=[ClusterNode(h, p) for h, p in seeds], **options)
    # redis-py makes every node, those it discovers too, from these options, with a plain
    # Connection whatever it is given: give them the platform's connection class
    made = client.nodes_manager.connection_kwargs
    made["connection_class"] = _PACKING.get(made["connection_class"], made["connection_class"])
    for node in client.nodes_manager.startup_nodes.values():
        node.connection_class = made["connection_class"]
    return client


@functools.cache
def get_redis() -> redis.Redis:
    """Return the process-wide Redis client (decoded strings, short timeouts).

    With ``REDIS_CLUSTER_URL`` it is a ``RedisCluster``: the same commands, each sent to the
    master of its key's slot (typed as ``redis.Redis``, whose commands it offers)."""
    if cluster_url():
        return cast(redis.Redis, sync_cluster(
            cluster_url(), decode_responses=True, socket_timeout=2, socket_connect_timeout=2))
    return redis.Redis.from_url(
        settings.REDIS_URL, decode_responses=True, socket_timeout=2, socket_connect_timeout=2,
        health_check_interval=30,
    )


def reset_clients() -> None:
    """Forget the process's clients (tests that point the platform at another Redis)."""
    get_redis.cache_clear()
    _async_clients.clear()
    _pipelined.clear()


_async_clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _HiredisPacking:
    """Mixin for redis-py's asyncio connections: pack commands with hiredis' C packer (its
    asyncio client packs in Python, a large cost per admission decision once). Arguments
    hiredis refuses fall back to redis-py's own packer, which raises its usual errors."""

    def pack_command(self, *args):
        name = args[0]
        if isinstance(name, str) and " " not in name:
            try:
                return [hiredis.pack_command(args)]
            except TypeError:
                pass
        return super().pack_command(*args)


class _ClosedIsConnectionError:
    """Mixin: writing to a connection being closed is a ``ConnectionError``, which the clients
    retry. redis-py's cluster client closes a node's idle connections after an error on it but
    leaves them in its free list meanwhile; a command taking one then meets uvloop's bare
    ``RuntimeError`` ("the handler is closed") or, once closed, no writer (``AttributeError``):
    a 500. Nothing was sent in either case, so the retry sends the command once."""

    async def send_packed_command(self, command, check_health: bool = True) -> None:
        try:
            await super().send_packed_command(command, check_health)  # type: ignore[misc]
        except (RuntimeError, AttributeError) as e:
            if not ("closed" in str(e) if isinstance(e, RuntimeError)
                    else getattr(e, "obj", True) is None):
                raise
            raise redis.exceptions.ConnectionError(
                f"Redis connection closed while sending: {e}") from e


class _TcpConnection(_ClosedIsConnectionError, _HiredisPacking, aioredis.Connection):
    pass


class _SslConnection(_ClosedIsConnectionError, _HiredisPacking, aioredis.SSLConnection):
    pass


class _UnixConnection(_ClosedIsConnectionError, _HiredisPacking,
                      aioredis.UnixDomainSocketConnection):
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
    """Return the asyncio Redis client of the running event loop (one per loop); a
    ``redis.asyncio.cluster.RedisCluster`` with ``REDIS_CLUSTER_URL``."""
    loop = asyncio.get_running_loop()
    client = _async_clients.get(loop)
    if client is None:
        if cluster_url():
            client = cast(aioredis.Redis, async_cluster(
                cluster_url(), decode_responses=True, socket_timeout=2,
                socket_connect_timeout=2))
        else:
            client = async_client(settings.REDIS_URL)
        _async_clients[loop] = client
    return client


class _Replies(asyncio.Protocol):
    """Reads RESP replies with hiredis and hands each to the oldest waiting command; writes
    the commands of one event-loop turn together.

    A write to Redis on the same host is a system call that wakes Redis: py-spy put 38 % of a
    gateway's busy time at concurrency 1 in them (eight a request: the key and throttle reads,
    the in-flight slot, admission, the usage append, settlement, the slot's release). The
    commands a turn of the loop issues (the two reads of a key check, the append and the
    settlement, and at load other requests' commands) now go out in one write, sent by a
    callback at the end of the turn; their order, and so the order of the replies, is the
    order they were issued in.

    An unanswered command is found by one timer per connection, armed at the oldest
    command's deadline and moved on when it fires, not by an ``asyncio.timeout`` per command
    (a timer handle made and cancelled each time, about 4 us of the ~7 commands a request).
    Redis answers in order, so when the oldest is late the connection is stuck: that caller
    gets ``TimeoutError`` and the connection is dropped (the others get ``ConnectionError``).
    """

    def __init__(self, timeout: float = 2.0) -> None:
        self.reader = hiredis.Reader(encoding="utf-8", replyError=redis.exceptions.ResponseError)
        # (caller's future, deadline, command name), in the order the commands were written
        self.waiters: collections.deque[tuple[asyncio.Future, float, Any]] = collections.deque()
        self.transport: asyncio.Transport | None = None
        self.lost: Exception | None = None
        self.pending: list[bytes] = []  # issued this turn, written by flush
        self.timeout = timeout
        self.watch: asyncio.TimerHandle | None = None

    def expect(self, waiter: asyncio.Future, name: Any) -> None:
        """Queue ``waiter`` for the next reply, due within the timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        self.waiters.append((waiter, deadline, name))
        if self.watch is None:
            self.watch = loop.call_at(deadline, self._check)

    def _check(self) -> None:
        self.watch = None
        if not self.waiters or self.lost is not None:
            return
        waiter, deadline, name = self.waiters[0]
        loop = asyncio.get_running_loop()
        if loop.time() < deadline:
            self.watch = loop.call_at(deadline, self._check)
            return
        if not waiter.done():
            waiter.set_exception(redis.exceptions.TimeoutError(
                f"Redis did not answer {name} within {self.timeout:.1f}s"))
        if self.transport is not None:
            self.transport.abort()  # its state is unknown: connection_lost fails the others

    def write(self, command: bytes) -> None:
        """Queue ``command`` for this turn's write (the first one schedules it)."""
        if not self.pending:
            asyncio.get_running_loop().call_soon(self.flush)
        self.pending.append(command)

    def flush(self) -> None:
        pending, self.pending = self.pending, []
        if self.transport is not None and self.lost is None and pending:
            self.transport.write(b"".join(pending) if len(pending) > 1 else pending[0])

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
            self._reply(reply)

    def _reply(self, reply: Any) -> None:
        waiter = self.waiters.popleft()[0]
        if waiter.done():
            return  # its caller gave up (cancelled); the reply is dropped in order
        if isinstance(reply, redis.exceptions.ResponseError):
            waiter.set_exception(_error(str(reply)))
        else:
            waiter.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = redis.exceptions.ConnectionError(
            f"Redis connection lost: {exc!r}" if exc else "Redis closed the connection")
        if self.watch is not None:
            self.watch.cancel()
            self.watch = None
        while self.waiters:
            waiter = self.waiters.popleft()[0]
            if not waiter.done():
                waiter.set_exception(self.lost)


def _error(message: str) -> redis.exceptions.RedisError:
    """The redis-py exception for an error reply, so callers catch what they already do."""
    if message.startswith("NOSCRIPT"):
        return redis.exceptions.NoScriptError(message)
    if message.startswith(("NOAUTH", "WRONGPASS")):
        return redis.exceptions.AuthenticationError(message)
    return redis.exceptions.ResponseError(message)


class NotConnected(redis.exceptions.ConnectionError):
    """The connection could not be opened: the command was never sent (safe to send again)."""


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

    def __init__(self, url: str, *, timeout: float = 2.0, connect_timeout: float = 2.0,
                 protocol: Callable[[float], _Replies] = _Replies) -> None:
        self.options = aioredis.connection.parse_url(url)
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self.make_protocol = protocol  # called with the timeout for each new connection
        self.protocol: _Replies | None = None
        self.connecting: asyncio.Future | None = None

    async def execute(self, *args: Any) -> Any:
        return await self.execute_packed(hiredis.pack_command(args), args[0])

    async def execute_packed(self, command: bytes, name: Any, key: Any = None) -> Any:
        """Send a command packed already (RESP; ``key`` routes it on a cluster)."""
        protocol = self.protocol
        if protocol is None or protocol.lost is not None:
            protocol = await self._connect()
        return await self._send(protocol, command, name)

    async def _send(self, protocol: _Replies, command: bytes, name: Any) -> Any:
        waiter = asyncio.get_running_loop().create_future()
        protocol.expect(waiter, name)  # its timer fails it after self.timeout (_Replies)
        if protocol.transport is None:  # connection_made set it before _connect returned
            raise redis.exceptions.ConnectionError("Redis connection not made")
        protocol.write(command)
        return await waiter

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
        timeout = self.timeout

        def replies() -> _Replies:
            return self.make_protocol(timeout)

        try:
            async with asyncio.timeout(self.connect_timeout):
                if "path" in o:
                    _, protocol = await loop.create_unix_connection(replies, o["path"])
                else:
                    context = None
                    if o.get("connection_class") is aioredis.SSLConnection:
                        context = ssl.create_default_context()
                        if o.get("ssl_cert_reqs") in ("none", ssl.CERT_NONE):
                            context.check_hostname = False
                            context.verify_mode = ssl.CERT_NONE
                    _, protocol = await loop.create_connection(
                        replies, o.get("host", "localhost"), o.get("port", 6379), ssl=context)
        except (OSError, TimeoutError) as exc:
            where = o.get("path") or f"{o.get('host', 'localhost')}:{o.get('port', 6379)}"
            raise NotConnected(
                f"cannot connect to Redis at {where}: {exc!r}; is it running there (REDIS_URL, "
                f"or REDIS_CLUSTER_URL for a cluster)?") from exc
        setup: list[tuple[Any, ...]] = []
        if o.get("password"):
            setup.append(("AUTH", *([o["username"]] if o.get("username") else []),
                          o["password"]))
        if o.get("db"):
            setup.append(("SELECT", o["db"]))
        try:
            for command in setup:  # before any other command can use the connection
                await self._send(protocol, hiredis.pack_command(command), command[0])
        except BaseException:
            self._drop(protocol)
            raise
        self.protocol = protocol
        return protocol

    def close(self) -> None:
        if self.protocol is not None:
            self._drop(self.protocol)

    async def execute_asking(self, command: bytes, name: Any) -> Any:
        """Run one packed command after ``ASKING`` (its slot is moving to this node), both
        written in one write so that no other command comes between them."""
        protocol = self.protocol
        if protocol is None or protocol.lost is not None:
            protocol = await self._connect()
        asking = asyncio.get_running_loop().create_future()
        protocol.expect(asking, "ASKING")
        result = await self._send(protocol, b"*1\r\n$6\r\nASKING\r\n" + command, name)
        asking.result()  # ASKING's own error, if any (answered before the command's)
        return result


class _Invalidations(_Replies):
    """A connection whose client-tracking invalidations are redirected to itself (RESP2: as
    messages on ``__redis__:invalidate``), handed to ``on_keys`` as they are read."""

    def __init__(self, timeout: float, on_keys: Callable[[list[str] | None], None],
                 on_lost: Callable[[], None]) -> None:
        super().__init__(timeout)
        self.on_keys, self.on_lost = on_keys, on_lost

    def _reply(self, reply: Any) -> None:
        if isinstance(reply, list) and len(reply) == 3 and reply[0] == "message":
            self.on_keys(reply[2])  # the changed keys; None: a database was flushed
        else:
            super()._reply(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.on_lost()


class Invalidations:
    """Redis's word on which keys under ``prefixes`` changed, for a process's own copy of them
    (client-side caching: ``CLIENT TRACKING ... BCAST``, redirected to this connection).

    ``on_keys`` is called, on the loop, with the keys each change names (None: a database was
    flushed); ``on_lost`` once when the connection is lost: from then on nothing tells the
    copy about changes, so it must be dropped. A lost connection is not reopened here (a new
    one would not track); open another ``Invalidations``. ``alive`` pings it every
    ``ping_s`` and loses it when a ping is not answered within ``ping_s``, so a connection
    that went silent (no reset) is noticed within two pings.
    """

    def __init__(self, url: str, prefixes: list[str], *,
                 on_keys: Callable[[list[str] | None], None], on_lost: Callable[[], None],
                 ping_s: float = 1.0) -> None:
        self.prefixes, self.ping_s = prefixes, ping_s
        self.connection = PipelinedConnection(
            url, timeout=ping_s, connect_timeout=ping_s,
            protocol=lambda timeout: _Invalidations(timeout, on_keys, on_lost))

    async def open(self) -> None:
        """Connect, track the prefixes and subscribe; raise ``RedisError`` when it fails."""
        client_id = await self.connection.execute("CLIENT", "ID")
        await self.connection.execute(
            "CLIENT", "TRACKING", "ON", "REDIRECT", client_id, "BCAST",
            *[word for prefix in self.prefixes for word in ("PREFIX", prefix)])
        await self.connection.execute("SUBSCRIBE", "__redis__:invalidate")

    async def alive(self) -> None:
        """Ping until the connection is lost (then return)."""
        protocol = self.connection.protocol
        while protocol is not None and protocol.lost is None:
            await asyncio.sleep(self.ping_s)
            if protocol.lost is not None:
                break
            try:  # on this connection only: execute would open a new one, not tracking
                await self.connection._send(protocol, b"*1\r\n$4\r\nPING\r\n", "PING")
            except redis.exceptions.RedisError:
                break  # a late answer aborted the connection: on_lost has run
        self.close()

    def close(self) -> None:
        self.connection.close()


class Pipelined(Protocol):
    """What the request path calls on a pipelined connection (one server or a cluster)."""

    async def execute(self, *args: Any) -> Any: ...

    async def execute_packed(self, command: bytes, name: Any, key: Any = None) -> Any: ...

    def close(self) -> None: ...


SLOTS = 16384
Address = tuple[str, int]
# Commands whose keys start after (script, numkeys); every other keyed command's first
# argument is its key.
_SCRIPT_COMMANDS = frozenset({"EVAL", "EVALSHA", "EVAL_RO", "EVALSHA_RO", "FCALL"})


def _first_key(args: tuple[Any, ...]) -> Any:
    """Return the key a command is routed by (None for a command without one)."""
    name = str(args[0]).upper()
    if name in _SCRIPT_COMMANDS:
        return args[3] if len(args) > 3 and int(args[2]) > 0 else None
    return args[1] if len(args) > 1 and name not in ("SCRIPT", "PING", "TIME") else None


class ClusterPipelinedConnection:
    """``PipelinedConnection`` for a Redis Cluster: one pipelined connection per master, each
    command sent to the master of its first key's slot (``redis.crc.key_slot``).

    The slot map comes from ``CLUSTER SLOTS`` (asked of any node that answers, the URL's
    first) and is read again after a ``MOVED`` reply or a lost connection. ``MOVED`` and ``ASK``
    are followed once, to the node they name; a command whose connection could not be opened
    (``NotConnected``: never sent) is sent once more after the map is read again, so a
    restarted or failed-over master costs a refused connection, not an error. A command lost
    in flight is not sent again: an admission script may have run, and running it twice would
    count a request twice; the caller sees ``ConnectionError`` as from one Redis. ``SCRIPT``
    commands (``LOAD``) go to every master, so an ``EVALSHA`` finds its script on any of them.
    """

    def __init__(self, url: str, *, timeout: float = 2.0, connect_timeout: float = 2.0) -> None:
        self.url, seeds = cluster_seeds(url)  # the first URL's options serve every node
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self.seeds: list[Address] = seeds
        self.slots: list[Address] | None = None
        self.nodes: dict[Address, PipelinedConnection] = {}
        self.refreshing: asyncio.Future[list[Address]] | None = None

    def _node(self, address: Address) -> PipelinedConnection:
        connection = self.nodes.get(address)
        if connection is None:
            connection = PipelinedConnection(self.url, timeout=self.timeout,
                                             connect_timeout=self.connect_timeout)
            # the URL's credentials and options, another node's address; a cluster has db 0
            connection.options = {**connection.options, "host": address[0],
                                  "port": address[1], "db": 0}
            self.nodes[address] = connection
        return connection

    async def _map(self) -> list[Address]:
        if self.slots is None:
            return await self._refresh()
        return self.slots

    async def _refresh(self) -> list[Address]:
        """Read the slot map again (one read at a time, shared by every waiting command)."""
        if self.refreshing is None:
            self.refreshing = asyncio.ensure_future(self._read_map())
        refreshing = self.refreshing
        try:
            return await asyncio.shield(refreshing)
        finally:
            if self.refreshing is refreshing and refreshing.done():
                self.refreshing = None

    async def _read_map(self) -> list[Address]:
        known = list(dict.fromkeys([*self.seeds, *self.nodes]))
        failure: Exception | None = None
        for address in known:
            try:
                reply = await self._node(address).execute("CLUSTER", "SLOTS")
            except redis.exceptions.RedisError as exc:
                failure = exc
                continue
            slots: list[Address] = [address] * SLOTS
            for start, end, master, *_replicas in reply:
                owner = (master[0] or address[0], int(master[1]))
                slots[int(start):int(end) + 1] = [owner] * (int(end) - int(start) + 1)
            self.slots = slots
            return slots
        raise redis.exceptions.ConnectionError(
            f"no Redis Cluster node answered CLUSTER SLOTS ({failure!r}); is it running at "
            f"the configured REDIS_CLUSTER_URL?")

    async def execute(self, *args: Any) -> Any:
        return await self.execute_on(_first_key(args), *args)

    async def execute_on(self, key: Any, *args: Any) -> Any:
        """Send a command to the master of ``key``'s slot, on the connection that carries that
        master's other commands (``WAIT`` after a write counts the write)."""
        if key is None:
            if str(args[0]).upper() == "SCRIPT":
                masters = set(await self._map())
                answers = await asyncio.gather(*(self._node(a).execute(*args) for a in masters))
                return answers[0]
            return await self._node((await self._map())[0]).execute(*args)
        return await self.execute_packed(hiredis.pack_command(args), args[0], key)

    async def execute_packed(self, command: bytes, name: Any, key: Any = None) -> Any:
        """Send a packed command to the master of ``key``'s slot."""
        slot = key_slot(key.encode() if isinstance(key, str) else key)
        address = (await self._map())[slot]
        try:
            return await self._node(address).execute_packed(command, name)
        except NotConnected:
            address = (await self._refresh())[slot]
            return await self._node(address).execute_packed(command, name)
        except redis.exceptions.ConnectionError:
            # lost in flight (maybe run): not sent again, but the next command finds the new
            # owner
            self.slots = None
            raise
        except redis.exceptions.ResponseError as exc:
            redirect = str(exc).split()
            if len(redirect) != 3 or redirect[0] not in ("MOVED", "ASK"):
                raise
            host, _, port = redirect[2].rpartition(":")
            target = (host or address[0], int(port))
            if redirect[0] == "ASK":
                return await self._node(target).execute_asking(command, name)
            self.slots = None  # the map moved: read all of it before the next command
            return await self._node(target).execute_packed(command, name)

    def close(self) -> None:
        for connection in self.nodes.values():
            connection.close()


_pipelined: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def get_pipelined() -> Pipelined:
    """Return the running event loop's pipelined connection to ``REDIS_URL`` (one per loop);
    a ``ClusterPipelinedConnection`` with ``REDIS_CLUSTER_URL``."""
    loop = asyncio.get_running_loop()
    connection: Pipelined | None = _pipelined.get(loop)
    if connection is None:
        if cluster_url():
            connection = ClusterPipelinedConnection(cluster_url())
        else:
            connection = PipelinedConnection(settings.REDIS_URL)
        _pipelined[loop] = connection
    return connection
