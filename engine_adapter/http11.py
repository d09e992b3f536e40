"""A lean HTTP/1.1 client for engine calls: httptools (llhttp) over asyncio streams, with
keep-alive reuse.

Engine calls are one shape only (POST a JSON body, read a JSON body or an SSE stream, over
plain keep-alive HTTP/1.1), and they sit on the gateway's critical path. httpx spent most of
the gateway's own time on them: on the benchmark machine it took ~2 ms of CPU from sending a
request to reading the engine's response headers, and ~100 us per streamed chunk, in its
layers (httpx, httpcore, anyio, sniffio). The h11 state machine that replaced it was still
~14 % of the gateway's CPU when streaming (pure Python, an event object per chunk); llhttp
(the parser of Node.js and of uvicorn's ``httptools`` protocol, already a dependency) parses in
C and hands over the body as it comes (bench/gateway.py: ``gateway_cpu_ms_per_request``).
The parser does all the parsing (status line, headers, chunked bodies, keep-alive rules,
protocol errors); this module only writes requests, moves bytes, pools connections and maps
failures.

Closing a response before its end closes the connection, which is how a caller aborts the
request at the engine. A response read to its end returns its connection to the pool.
"""

from __future__ import annotations

import asyncio
import codecs
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from urllib.parse import urlsplit

import httptools

READ_BYTES = 64 * 1024
KEEPALIVE_S = 4.0  # under uvicorn's (SGLang's) 5 s keep-alive, so we never reuse a closing one

Origin = tuple[str, str, int]
_FRAMING = frozenset((b"content-length", b"transfer-encoding"))


class TransportError(Exception):
    """The engine could not be reached, or the connection failed or broke the protocol."""


class _ProtocolError(Exception):
    """The engine's bytes are not an HTTP/1.1 response (or it closed mid-response)."""


class _Connection:
    """One keep-alive connection and the parser of the response being read on it (the
    parser's callbacks are the ``on_*`` methods: llhttp calls them from ``feed_data``)."""

    def __init__(self, origin: Origin, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.origin = origin
        self.reader = reader
        self.writer = writer
        self.parser = httptools.HttpResponseParser(self)
        self.idle_since = 0.0
        self.status = 0  # of the final (non-1xx) response; 0 until its headers are in
        self.complete = False  # that response's body has ended
        self.keep_alive = False  # and the connection may carry the next request
        self.body: list[bytes] = []  # body bytes parsed and not yet taken
        self._framed = False  # Content-Length or chunked, or else the body ends at EOF

    def reusable(self, now: float) -> bool:
        # A connection the engine closed while it sat idle shows EOF (or a closing transport).
        return (now - self.idle_since < KEEPALIVE_S and not self.writer.is_closing()
                and not self.reader.at_eof())

    def close(self) -> None:
        self.writer.close()

    def start(self) -> None:
        """Forget the last response: the connection carries a new request."""
        self.status, self.complete, self.keep_alive, self._framed = 0, False, False, False
        self.body = []

    # llhttp's callbacks (a 1xx response is a message of its own before the final one)
    def on_header(self, name: bytes, _value: bytes) -> None:
        if name.lower() in _FRAMING:
            self._framed = True

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status >= 200:
            self.status = status

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.status:  # the final response (a 1xx one is followed by it)
            self.complete = True
            self.keep_alive = self.parser.should_keep_alive()
        self._framed = False

    async def receive(self) -> None:
        """Read what the engine sent next and parse it (callbacks above)."""
        data = await self.reader.read(READ_BYTES)
        if not data:
            if self.status and not self._framed and not self.complete:
                self.complete = True  # a body delimited by the connection's close
                return
            raise _ProtocolError("the engine closed the connection mid-response")
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            raise _ProtocolError(f"not an HTTP/1.1 response: {exc}") from exc


class Response:
    """An engine's response whose headers have arrived; read the body, then ``aclose()``."""

    def __init__(self, pool: Pool, conn: _Connection, slots: asyncio.Semaphore,
                 status_code: int) -> None:
        self.status_code = status_code
        self._pool = pool
        self._conn: _Connection | None = conn
        self._slots = slots
        self._complete = False
        self._ready: deque[str] = deque()  # lines read, not yet yielded (aiter_lines)
        # The idle watch (``_watch_idle``): when the read now waiting began, and its timer
        self._waiting_since: float | None = None
        self._watch: asyncio.TimerHandle | None = None

    async def _next_data(self, idle_timeout: float | None = None) -> bytes | None:
        """Return the body's bytes that have arrived (waiting for some, at most
        ``idle_timeout`` seconds: TimeoutError), or None at its end."""
        conn = self._conn
        if conn is None or self._complete:
            return None
        try:
            while not conn.body and not conn.complete:
                if idle_timeout is None:
                    await conn.receive()
                else:
                    self._watch_idle(conn, idle_timeout)
                    try:
                        await conn.receive()
                    finally:
                        self._waiting_since = None
        except TimeoutError:
            raise  # the engine was idle too long (an OSError too: not a transport failure)
        except (OSError, _ProtocolError) as exc:
            raise TransportError(f"engine connection failed: {exc!r}") from exc
        if conn.body:
            parts, conn.body = conn.body, []
            return parts[0] if len(parts) == 1 else b"".join(parts)
        self._complete = True
        self._unwatch()
        return None

    def _watch_idle(self, conn: _Connection, idle_timeout: float) -> None:
        """Mark a read as waiting, due within ``idle_timeout``.

        One timer per response, moved on only when it fires, where an ``asyncio.timeout``
        per read made and cancelled a timer for every read of a stream (one per token; the
        gateway's CPU per request fell ~1.5 % without them). When it fires and the same
        read still waits past its time, the read fails with ``TimeoutError`` (set on the
        connection's reader, which the read then raises; the connection is not reused). A
        read that has not begun is never timed: the consumer's time between reads is not the
        engine's."""
        loop = asyncio.get_running_loop()
        since = self._waiting_since = loop.time()
        if self._watch is None:
            self._watch = loop.call_at(since + idle_timeout, self._check_idle, conn,
                                       idle_timeout)

    def _check_idle(self, conn: _Connection, idle_timeout: float) -> None:
        since = self._waiting_since
        if since is None:  # no read waits: the next one arms a timer again
            self._watch = None
            return
        loop = asyncio.get_running_loop()
        if loop.time() - since >= idle_timeout:
            self._watch = None
            conn.reader.set_exception(TimeoutError(
                f"the engine sent nothing for {idle_timeout:g} s"))
            return
        self._watch = loop.call_at(since + idle_timeout, self._check_idle, conn, idle_timeout)

    def _unwatch(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    async def aread(self) -> bytes:
        parts = []
        while (data := await self._next_data()) is not None:
            parts.append(data)
        return b"".join(parts)

    async def aiter_lines(self, *, idle_timeout: float | None = None) -> AsyncIterator[str]:
        """Yield the body's lines, without their line endings (UTF-8). With ``idle_timeout``,
        raise TimeoutError when the engine sends nothing for that long (the lines of what
        has arrived are yielded without a timer: one per read from the socket, not per line).
        ``ready_lines`` are the lines that arrived and are still to be yielded."""
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        pending = ""
        ready = self._ready
        while True:
            while ready:
                yield ready.popleft()
            data = await self._next_data(idle_timeout)
            if data is None:
                break
            pending += decoder.decode(data)
            if "\n" in pending:
                *lines, pending = pending.split("\n")
                ready.extend(line.removesuffix("\r") for line in lines)
        pending += decoder.decode(b"", final=True)
        if pending:
            yield pending.removesuffix("\r")

    @property
    def ready_lines(self) -> Sequence[str]:
        """The whole lines ``aiter_lines`` read and has not yielded yet: they come without
        waiting for the engine."""
        return self._ready

    async def aclose(self) -> None:
        """Release the connection: back to the pool if the body was read to its end, else
        closed (which aborts the request at the engine)."""
        self._unwatch()
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool._release(conn, self._slots, reuse=self._complete)


class Pool:
    """Keep-alive connections per engine origin, at most ``max_connections`` in use at once."""

    def __init__(self, *, connect_timeout: float, write_timeout: float, pool_timeout: float,
                 max_connections: int) -> None:
        self.connect_timeout = connect_timeout
        self.write_timeout = write_timeout
        self.pool_timeout = pool_timeout
        self.max_connections = max_connections
        self._idle: dict[Origin, list[_Connection]] = {}
        self._slots: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ssl: ssl.SSLContext | None = None

    def idle_connections(self) -> int:
        return sum(len(conns) for conns in self._idle.values())

    async def post(self, url: str, body: bytes) -> Response:
        """POST a JSON body; return once the response headers have arrived."""
        return await self.request("POST", url, body)

    async def get(self, url: str) -> Response:
        """GET ``url``; return once the response headers have arrived."""
        return await self.request("GET", url)

    async def request(self, method: str, url: str, body: bytes | None = None) -> Response:
        """Send a request (a JSON ``body``, if any); return once the headers have arrived."""
        parts = urlsplit(url)
        scheme, host = parts.scheme, parts.hostname or ""
        port = parts.port or (443 if scheme == "https" else 80)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        slots = self._slots_of_this_loop()
        try:
            async with asyncio.timeout(self.pool_timeout):
                await slots.acquire()
        except TimeoutError as exc:
            raise TransportError(f"no free engine connection within {self.pool_timeout}s") \
                from exc
        if not target.isprintable() or " " in target:
            raise TransportError(f"not a valid request target: {target!r}")
        head = f"{method} {target} HTTP/1.1\r\nHost: {parts.netloc}\r\nAccept: */*\r\n"
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        request = (head + "\r\n").encode("ascii", "strict")
        conn = None
        try:
            conn = await self._connection((scheme, host, port))
            conn.start()
            # One write for the whole request: one segment, one wake-up of the engine.
            conn.writer.write(request + body if body is not None else request)
            async with asyncio.timeout(self.write_timeout):
                await conn.writer.drain()
            while not conn.status:
                await conn.receive()
            return Response(self, conn, slots, conn.status)
        except (OSError, _ProtocolError) as exc:  # TimeoutError is an OSError
            self._release(conn, slots, reuse=False)
            raise TransportError(f"engine request to {host}:{port} failed: {exc!r}") from exc
        except BaseException:  # cancelled (first-byte timeout, client gone): abort it
            self._release(conn, slots, reuse=False)
            raise

    async def aclose(self) -> None:
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()

    def _slots_of_this_loop(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        slots = self._slots
        if slots is None or self._loop is not loop:
            # First use, or a new event loop: connections of the old one are unusable here.
            self._idle = {}
            self._loop = loop
            slots = self._slots = asyncio.Semaphore(self.max_connections)
        return slots

    async def _connection(self, origin: Origin) -> _Connection:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.reusable(now):
                return conn
            conn.close()
        scheme, host, port = origin
        if scheme == "https" and self._ssl is None:
            self._ssl = ssl.create_default_context()
        async with asyncio.timeout(self.connect_timeout):
            reader, writer = await asyncio.open_connection(
                host, port, ssl=self._ssl if scheme == "https" else None, limit=READ_BYTES)
        return _Connection(origin, reader, writer)

    def _release(self, conn: _Connection | None, slots: asyncio.Semaphore, *,
                 reuse: bool) -> None:
        slots.release()
        if conn is None:
            return
        if not (reuse and conn.complete and conn.keep_alive and slots is self._slots):
            conn.close()
            return
        now = conn.idle_since = time.monotonic()
        idle = self._idle.setdefault(conn.origin, [])
        while idle and not idle[0].reusable(now):  # the oldest first: close expired ones
            idle.pop(0).close()
        idle.append(conn)
