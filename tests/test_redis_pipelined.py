"""The pipelined Redis connection of the request path (admission scripts, key lookups), against
real Redis servers this module starts itself: answers reach the right callers when many share
the connection, error replies are redis-py's exceptions, and a dead or stuck server fails the
commands in flight and is reconnected to once it is back."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import redis
import redis.exceptions

from billing_platform.embedded import EmbeddedRedis, free_port
from billing_platform.redis_conn import PipelinedConnection
from tests.conftest import wait_until


@pytest.fixture
def server(tmp_path):
    """A password-protected Redis of this test's own, also listening on a socket file."""
    sock = tmp_path / "redis.sock"
    own = EmbeddedRedis(tmp_path / "redis", free_port(),
                        extra_args=("--requirepass", "s3cret", "--unixsocket", str(sock)))
    own.start()
    own.sock = sock
    yield own
    if own.running():
        own.kill()


def _sync(server, db: int) -> redis.Redis:
    return redis.Redis(port=server.port, password="s3cret", db=db, decode_responses=True)


def test_many_callers_share_one_connection_and_each_gets_its_own_answer(server):
    async def run() -> list:
        conn = PipelinedConnection(f"redis://:s3cret@127.0.0.1:{server.port}/3")
        try:
            await asyncio.gather(*(conn.execute("SET", f"k{i}", i) for i in range(500)))
            return await asyncio.gather(*(conn.execute("GET", f"k{i}") for i in range(500)))
        finally:
            conn.close()

    answers = asyncio.run(run())

    assert answers == [str(i) for i in range(500)]
    # the URL's database was selected before any command ran
    assert _sync(server, 3).dbsize() == 500 and _sync(server, 0).dbsize() == 0


def test_error_replies_are_redis_py_exceptions_and_do_not_disturb_the_others(server):
    async def run() -> list:
        conn = PipelinedConnection(f"redis://:s3cret@127.0.0.1:{server.port}/0")
        try:
            await conn.execute("SET", "text", "x")
            return await asyncio.gather(
                conn.execute("HGET", "text", "f"), conn.execute("INCR", "n"),
                conn.execute("EVALSHA", "0" * 40, 0), conn.execute("INCR", "n"),
                return_exceptions=True)
        finally:
            conn.close()

    wrong_type, one, no_script, two = asyncio.run(run())

    assert isinstance(wrong_type, redis.exceptions.ResponseError)
    assert "WRONGTYPE" in str(wrong_type)
    assert isinstance(no_script, redis.exceptions.NoScriptError)
    assert (one, two) == (1, 2)


def test_a_wrong_password_is_an_authentication_error(server):
    async def run() -> None:
        conn = PipelinedConnection(f"redis://:wrong@127.0.0.1:{server.port}/0")
        await conn.execute("PING")

    with pytest.raises(redis.exceptions.AuthenticationError):
        asyncio.run(run())


def test_a_socket_file_url_works(server):
    async def run() -> str:
        conn = PipelinedConnection(f"unix://:s3cret@{server.sock}?db=2")
        try:
            await conn.execute("SET", "over-the-socket", "yes")
            return await conn.execute("GET", "over-the-socket")
        finally:
            conn.close()

    assert asyncio.run(run()) == "yes"
    assert _sync(server, 2).get("over-the-socket") == "yes"


def test_a_dead_server_fails_the_commands_in_flight_and_the_next_command_reconnects(server):
    async def run() -> tuple:
        conn = PipelinedConnection(f"redis://:s3cret@127.0.0.1:{server.port}/0")
        await conn.execute("SET", "before", "1")
        # a command that is in flight when the server dies
        blocked = asyncio.ensure_future(conn.execute("BLPOP", "nothing", 0))
        await asyncio.to_thread(
            wait_until, lambda: _sync(server, 0).info("clients")["blocked_clients"] == 1,
            timeout=30, what="the server to hold the BLPOP")
        await asyncio.to_thread(server.kill)
        failure = await asyncio.gather(blocked, return_exceptions=True)
        while_down = await asyncio.gather(conn.execute("PING"), return_exceptions=True)
        await asyncio.to_thread(server.start)
        try:
            return failure[0], while_down[0], await conn.execute("GET", "before")
        finally:
            conn.close()

    in_flight, while_down, after = asyncio.run(run())

    assert isinstance(in_flight, redis.exceptions.ConnectionError)
    assert isinstance(while_down, redis.exceptions.ConnectionError)
    assert "REDIS_URL" in str(while_down)  # says what to check
    assert after == "1"  # the append-only file kept it; a new connection read it


def test_a_stuck_server_times_out_and_the_connection_is_replaced(server):
    pid = int((server.data_dir / "redis.pid").read_text())

    async def run() -> tuple:
        conn = PipelinedConnection(f"redis://:s3cret@127.0.0.1:{server.port}/0", timeout=0.5)
        await conn.execute("SET", "k", "v")
        os.kill(pid, signal.SIGSTOP)
        try:
            stuck = await asyncio.gather(conn.execute("GET", "k"), return_exceptions=True)
        finally:
            os.kill(pid, signal.SIGCONT)
        try:
            return stuck[0], await conn.execute("GET", "k")
        finally:
            conn.close()

    stuck, after = asyncio.run(run())

    assert isinstance(stuck, redis.exceptions.TimeoutError)
    assert after == "v"
