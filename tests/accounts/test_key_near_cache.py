"""A web process's near copy of API-key entries (``keycache._Near``), against a Redis server of
the test's own: the copy serves a key only while Redis tells the process of every change to it,
and a change, a lost connection or a restarted Redis takes the copy out of service at once.

The gateway-level check (four processes refuse a revoked key they all served from their
copies) is in tests/gateway/test_admission.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import redis

from billing_platform.accounts import keycache
from billing_platform.embedded import EmbeddedRedis, free_port
from billing_platform.redis_conn import reset_clients

ENTRY = {"key_id": 7, "org_id": 3, "secret_hash": "ab" * 32}


@pytest.fixture
def own_redis(tmp_path, settings):
    """A Redis server of this test's own, which it may stop and start, as ``REDIS_URL``."""
    server = EmbeddedRedis(tmp_path / "redis", free_port())
    server.start()
    settings.REDIS_URL = server.url
    settings.API_KEY_NEAR_CACHE = True
    reset_clients()
    yield server
    if server.running():
        server.stop()
    reset_clients()


async def _read_until_near(prefix: str, *, tries: int = 300) -> dict:
    """Read the key until a read comes from the near copy (tracking starts with the first
    read and takes a round trip or two); return that read's entry."""
    for _ in range(tries):
        entry, _marker, near = await keycache.aread(prefix)
        if near:
            return entry
        await asyncio.sleep(0.01)
    raise AssertionError("no read came from the near copy within 3 s")


def test_the_copy_serves_a_key_only_while_redis_tells_the_process_of_changes(own_redis):
    writer = redis.Redis.from_url(own_redis.url, decode_responses=True)
    key = keycache.cache_key("abcdef012345")

    async def scenario() -> None:
        # given a key's entry in Redis, read often enough by this process to be kept near
        writer.set(key, json.dumps(ENTRY))
        assert await _read_until_near("abcdef012345") == ENTRY

        # when the key is changed (hold, as a revocation does before it commits, from
        # another thread: in production another process)
        token = await asyncio.to_thread(keycache.hold, ["abcdef012345"])

        # then the very next read is Redis's (the change's marker, no entry), not the copy
        entry, marker, near = await keycache.aread("abcdef012345")
        assert entry is None and marker is not None and marker.startswith(keycache.MARKER)
        assert not near

        # and after the change is released and the entry filled again, it is kept again
        await asyncio.to_thread(keycache.release, ["abcdef012345"], token)
        writer.set(key, json.dumps({**ENTRY, "scopes": ["inference"]}))
        assert await _read_until_near("abcdef012345") == {**ENTRY, "scopes": ["inference"]}

        # when Redis stops, nothing is served from the copy: the read fails as Redis does
        own_redis.stop()
        await asyncio.sleep(0.2)  # the tracking connection's loss is read
        with pytest.raises(redis.ConnectionError):
            await keycache.aread("abcdef012345")

        # and when Redis is back (the entry changed meanwhile, which no one could hear), the
        # copy is not trusted: reads see Redis's entry, then keep that one near again
        own_redis.start()
        writer.set(key, json.dumps({**ENTRY, "scopes": ["admin"]}))
        entry, _marker, near = await keycache.aread("abcdef012345")
        assert entry == {**ENTRY, "scopes": ["admin"]} and not near
        assert await _read_until_near("abcdef012345") == {**ENTRY, "scopes": ["admin"]}
        await keycache.aclose_near()

    asyncio.run(scenario())


def test_a_flushed_redis_or_an_expired_entry_is_not_served_from_the_copy(own_redis):
    writer = redis.Redis.from_url(own_redis.url, decode_responses=True)
    key = keycache.cache_key("fedcba987654")

    async def scenario() -> None:
        writer.set(key, json.dumps(ENTRY), px=1000)
        assert await _read_until_near("fedcba987654") == ENTRY

        # when the entry expires in Redis (its TTL), the copy goes with it
        await asyncio.sleep(1.1)
        writer.exists(key)  # an expired key is deleted (and its change told) when touched
        await asyncio.sleep(0.05)
        assert await keycache.aread("fedcba987654") == (None, None, False)

        # and a flushed database drops every copy
        writer.set(key, json.dumps(ENTRY))
        assert await _read_until_near("fedcba987654") == ENTRY
        writer.flushdb()
        await asyncio.sleep(0.05)
        assert await keycache.aread("fedcba987654") == (None, None, False)
        await keycache.aclose_near()

    asyncio.run(scenario())


def test_without_the_setting_every_read_goes_to_redis(own_redis, settings):
    settings.API_KEY_NEAR_CACHE = False
    writer = redis.Redis.from_url(own_redis.url, decode_responses=True)
    writer.set(keycache.cache_key("aaaabbbbcccc"), json.dumps(ENTRY))

    async def scenario() -> None:
        for _ in range(20):
            assert await keycache.aread("aaaabbbbcccc") == (ENTRY, None, False)
            await asyncio.sleep(0.01)

    asyncio.run(scenario())
