"""A lean HTTP/1.1 client for engine calls: h11 over asyncio streams, with keep-alive reuse.

Engine calls are one shape only (POST a JSON body, read a JSON body or an SSE stream, over
plain keep-alive HTTP/1.1), and they sit on the gateway's critical path. httpx spent most of
the gateway's own time on them: on the benchmark machine it took ~2 ms of CPU from sending a
request to reading the engine's response headers, and ~100 us per streamed chunk, in its
layers (httpx, httpcore, anyio, sniffio) around the same h11 state machine used here
(bench/gateway.py). h11 still does all the parsing (chunked bodies, keep-alive rules,
protocol errors); this module only moves bytes, pools connections and maps failures.

Closing a response before its end closes the connection, which is how a caller aborts the
request at the engine. A response read to its end returns its connection to the pool.
"""

from __future__ import annotations

import asyncio
import codecs
import ssl
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import h11

READ_BYTES = 64 * 1024
KEEPALIVE_S = 4.0  # under uvicorn's (SGLang's) 5 s keep-alive, so we never reuse a closing one

Origin = tuple[str, str, int]


class TransportError(Exception):
    """The engine could not be reached, or the connection failed or broke the protocol."""


class _Connection:
    def __init__(self, origin: Origin, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.origin = origin
        self.reader = reader
        self.writer = writer
        self.h11 = h11.Connection(h11.CLIENT)
        self.idle_since = 0.0

    def reusable(self, now: float) -> bool:
        # A connection the engine closed while it sat idle shows EOF (or a closing transport).
        return (now - self.idle_since < KEEPALIVE_S and not self.writer.is_closing()
                and not self.reader.at_eof())

    def close(self) -> None:
        self.writer.close()

    async def next_event(self) -> Any:
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            self.h11.receive_data(await self.reader.read(READ_BYTES))  # b"" is EOF to h11


class Response:
    """An engine's response whose headers have arrived; read the body, then ``aclose()``."""

    def __init__(self, pool: Pool, conn: _Connection, slots: asyncio.Semaphore,
                 status_code: int) -> None:
        self.status_code = status_code
        self._pool = pool
        self._conn: _Connection | None = conn
        self._slots = slots
        self._complete = False

    async def _next_data(self) -> bytes | None:
        """Return the next piece of the body, or None at its end."""
        conn = self._conn
        if conn is None or self._complete:
            return None
        try:
            event = await conn.next_event()
        except (OSError, h11.ProtocolError) as exc:
            raise TransportError(f"engine connection failed: {exc!r}") from exc
        if isinstance(event, h11.Data):
            return bytes(event.data)
        if isinstance(event, h11.EndOfMessage):
            self._complete = True
            return None
        raise TransportError(f"unexpected HTTP event from the engine: {event!r}")

    async def aread(self) -> bytes:
        parts = []
        while (data := await self._next_data()) is not None:
            parts.append(data)
        return b"".join(parts)

    async def aiter_lines(self) -> AsyncIterator[str]:
        """Yield the body's lines, without their line endings (UTF-8)."""
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        pending = ""
        while (data := await self._next_data()) is not None:
            pending += decoder.decode(data)
            if "\n" in pending:
                *lines, pending = pending.split("\n")
                for line in lines:
                    yield line.removesuffix("\r")
        pending += decoder.decode(b"", final=True)
        if pending:
            yield pending.removesuffix("\r")

    async def aclose(self) -> None:
        """Release the connection: back to the pool if the body was read to its end, else
        closed (which aborts the request at the engine)."""
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
        conn = None
        try:
            conn = await self._connection((scheme, host, port))
            headers = [("Host", parts.netloc), ("Accept", "*/*")]
            if body is not None:
                headers += [("Content-Type", "application/json"),
                            ("Content-Length", str(len(body)))]
            request = conn.h11.send(h11.Request(method=method, target=target, headers=headers))
            if body is not None:
                request += conn.h11.send(h11.Data(data=body))
            # One write for the whole request: one segment, one wake-up of the engine.
            conn.writer.write(request + conn.h11.send(h11.EndOfMessage()))
            async with asyncio.timeout(self.write_timeout):
                await conn.writer.drain()
            while True:
                event = await conn.next_event()
                if isinstance(event, h11.Response):
                    return Response(self, conn, slots, event.status_code)
                if not isinstance(event, h11.InformationalResponse):
                    raise TransportError(f"unexpected HTTP event from the engine: {event!r}")
        except (OSError, h11.ProtocolError) as exc:  # TimeoutError is an OSError
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
        state = conn.h11
        if not (reuse and state.our_state is h11.DONE and state.their_state is h11.DONE
                and slots is self._slots):
            conn.close()
            return
        state.start_next_cycle()
        now = conn.idle_since = time.monotonic()
        idle = self._idle.setdefault(conn.origin, [])
        while idle and not idle[0].reusable(now):  # the oldest first: close expired ones
            idle.pop(0).close()
        idle.append(conn)
