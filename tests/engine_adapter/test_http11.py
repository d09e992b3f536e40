"""The engine HTTP/1.1 client against a TCP server that answers with exact bytes: framing
(Content-Length, chunked, close-delimited), 1xx responses, keep-alive rules, broken engines.

The server is a real socket on loopback; each test gives the bytes an engine could send, to
reach the cases that SGLang and the simulator (always chunked or sized, always keep-alive)
never produce.
"""

from __future__ import annotations

import asyncio

import pytest

from engine_adapter import http11


async def _serve(answers: list[bytes | None], *, hold_open: bool = True):
    """Serve one answer per request, in order, on whichever connection asks; record each
    request's raw bytes and how many connections were opened."""
    seen: dict = {"requests": [], "connections": 0}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen["connections"] += 1
        try:
            while answers:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                seen["requests"].append(head + await reader.readexactly(length))
                answer = answers.pop(0)
                if answer is None:
                    break
                writer.write(answer)
                await writer.drain()
                if not hold_open:
                    break
            if hold_open and answers == []:
                await reader.read()  # keep the connection until the client closes it
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", seen


def _pool() -> http11.Pool:
    return http11.Pool(connect_timeout=2, write_timeout=2, pool_timeout=2, max_connections=4)


async def _post(pool: http11.Pool, url: str, body: bytes = b'{"a":1}') -> tuple[int, bytes]:
    response = await pool.post(url + "/v1/chat/completions", body)
    try:
        return response.status_code, await response.aread()
    finally:
        await response.aclose()


def test_sized_and_chunked_bodies_are_read_whole_and_the_connection_is_reused():
    async def scenario():
        server, url, seen = await _serve([
            b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n{\"ok\":true}",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"4\r\n{\"b\"\r\n3\r\n:2}\r\n0\r\n\r\n",
        ])
        pool = _pool()
        first = await _post(pool, url)
        idle_after_first = pool.idle_connections()
        second = await _post(pool, url)
        await pool.aclose()
        server.close()
        return first, idle_after_first, second, seen

    first, idle_after_first, second, seen = asyncio.run(scenario())
    assert first == (200, b'{"ok":true}')
    assert idle_after_first == 1
    assert second == (200, b'{"b":2}')
    assert seen["connections"] == 1  # the second request went over the first's connection
    request = seen["requests"][0]
    assert request.startswith(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"\r\nContent-Type: application/json\r\nContent-Length: 7\r\n\r\n{\"a\":1}" in request


def test_a_1xx_response_is_skipped_and_a_close_delimited_body_ends_at_eof():
    async def scenario():
        server, url, _seen = await _serve([
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n"
            b"until the end"], hold_open=False)
        pool = _pool()
        got = await _post(pool, url)
        idle = pool.idle_connections()
        await pool.aclose()
        server.close()
        return got, idle

    got, idle = asyncio.run(scenario())
    assert got == (200, b"until the end")
    assert idle == 0  # a body that ended with the connection leaves nothing to reuse


def test_connection_close_is_obeyed_and_the_next_request_opens_a_new_connection():
    async def scenario():
        server, url, seen = await _serve([
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi",
            b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nyou"], hold_open=False)
        pool = _pool()
        first = await _post(pool, url)
        idle = pool.idle_connections()
        second = await _post(pool, url)
        await pool.aclose()
        server.close()
        return first, idle, second, seen

    first, idle, second, seen = asyncio.run(scenario())
    assert (first, idle, second) == ((200, b"hi"), 0, (200, b"you"))
    assert seen["connections"] == 2


@pytest.mark.parametrize("answer", [
    b"SSH-2.0-OpenSSH_9.6\r\n",  # not HTTP at all
    b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\ncut short",  # closed mid-body
    None,  # closed before answering
])
def test_a_broken_engine_is_a_transport_error_and_its_connection_is_not_reused(answer):
    async def scenario():
        server, url, _seen = await _serve([answer], hold_open=False)
        pool = _pool()
        try:
            with pytest.raises(http11.TransportError):
                await _post(pool, url)
            return pool.idle_connections()
        finally:
            await pool.aclose()
            server.close()

    assert asyncio.run(scenario()) == 0


def test_lines_of_a_stream_come_as_they_arrive_and_a_stall_times_out():
    async def scenario():
        gate = asyncio.Event()
        got: list[str] = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(7)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"10\r\ndata: {\"n\": 1}\n\n\r\n")
            await writer.drain()
            await gate.wait()  # then the engine stalls
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        pool = _pool()
        response = await pool.post(url + "/v1/chat/completions", b'{"a":1}')
        try:
            with pytest.raises(TimeoutError):
                async for line in response.aiter_lines(idle_timeout=0.3):
                    got.append(line)
        finally:
            await response.aclose()
            gate.set()
            await pool.aclose()
            server.close()
        return got, pool.idle_connections()

    got, idle = asyncio.run(scenario())
    assert got == ['data: {"n": 1}', ""]
    assert idle == 0  # a stream cut off is closed, never reused


def test_the_idle_timeout_times_each_wait_for_the_engine_not_the_stream_or_the_consumer():
    async def scenario():
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(7)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for n in range(6):  # a line every 0.15 s: the stream lasts 0.9 s
                await asyncio.sleep(0.15)
                line = f"data: {n}\n".encode()
                writer.write(b"%x\r\n%s\r\n" % (len(line), line))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        pool = _pool()
        got: list[str] = []
        try:
            response = await pool.post(url + "/v1/chat/completions", b'{"a":1}')
            async for line in response.aiter_lines(idle_timeout=0.3):
                got.append(line)
                if line == "data: 2":
                    await asyncio.sleep(0.5)  # the consumer is slow once: not the engine's time
            await response.aclose()
        finally:
            await pool.aclose()
            server.close()
        return got

    assert asyncio.run(scenario()) == [f"data: {n}" for n in range(6)]
