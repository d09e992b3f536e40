"""Durable append: Redis stream first, PostgreSQL when Redis is down; nothing lost or doubled."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter

import pytest
import redis
from asgiref.sync import sync_to_async
from django.db import connection
from django.db.models import Sum

from billing_platform.embedded import EmbeddedRedis, free_port
from metering import conf, services, stream
from metering.ingest import Ingestor
from metering.models import UsageEvent, UsageRollupHourly
from tests.conftest import wait_until


def _drain() -> None:
    Ingestor(batch_size=200, block_ms=100, claim_idle_ms=500).run(drain=True)


def test_appended_events_are_recorded_once_by_the_consumer(tenant):
    # given 300 events appended, and 50 of them appended a second time (a retried request)
    paths = [services.usage_event_append(tenant.event(f"req-{i}")) for i in range(300)]
    paths += [services.usage_event_append(tenant.event(f"req-{i}")) for i in range(50)]
    assert set(paths) == {"redis"}

    # when the consumer drains the stream (one writer: a second one would have a connection of
    # its own, outside this test's transaction)
    ingestor = Ingestor(batch_size=128, block_ms=100, writers=1)
    stats = ingestor.run(drain=True)

    # then each request is one row, the rollups count 300 requests, nothing is left pending
    assert UsageEvent.objects.count() == 300
    assert stats.recorded == 300 and stats.duplicates == 50
    assert UsageRollupHourly.objects.aggregate(n=Sum("requests"))["n"] == 300
    r = stream.client()
    assert r.xpending(conf.stream_key(), conf.consumer_group())["pending"] == 0
    assert r.xlen(conf.stream_key()) < 350  # acknowledged entries are trimmed


def test_async_append_uses_the_stream(transactional_db, tenant):
    path = asyncio.run(services.ausage_event_append(tenant.event("req-async")))

    assert path == "redis"
    _drain()
    assert UsageEvent.objects.filter(request_id="req-async").count() == 1


def test_async_append_falls_back_to_postgres_when_redis_is_unreachable(
        transactional_db, tenant, settings):
    settings.METERING_REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens
    stream.reset_clients()

    async def append_then_close() -> str:
        path = await services.ausage_event_append(tenant.event("req-async-pg"))
        await sync_to_async(lambda: connection.close())()  # the fallback thread's own one
        return path

    path = asyncio.run(append_then_close())

    assert path == "postgres"
    assert UsageEvent.objects.filter(request_id="req-async-pg").count() == 1


@pytest.fixture
def own_redis(tmp_path, settings):
    """A Redis server of this test's own, which it may stop and start."""
    server = EmbeddedRedis(tmp_path / "redis", free_port())
    server.start()
    settings.METERING_REDIS_URL = server.url
    stream.reset_clients()
    yield server
    if server.running():
        server.stop()


def test_redis_stopped_during_appends_loses_nothing(transactional_db, tenant, own_redis):
    # given a thread appending events as a gateway would
    paths: dict[str, str] = {}
    stop = threading.Event()

    def traffic() -> None:
        i = 0
        try:
            while not stop.is_set():
                request_id = f"req-{i}"
                paths[request_id] = services.usage_event_append(tenant.event(request_id))
                i += 1
                stop.wait(0.002)
        finally:
            connection.close()

    thread = threading.Thread(target=traffic)
    thread.start()
    try:
        def count(path: str) -> int:
            return Counter(paths.values())[path]

        wait_until(lambda: count("redis") >= 100, timeout=30, what="appends to Redis")
        # when Redis stops in the middle of the traffic, and comes back later
        own_redis.stop()
        wait_until(lambda: count("postgres") >= 100, timeout=30, what="appends to PostgreSQL")
        own_redis.start()
        before = count("redis")
        wait_until(lambda: count("redis") >= before + 100, timeout=30,
                   what="appends to Redis again")
    finally:
        stop.set()
        thread.join(timeout=30)

    # then after the consumer drained the stream every appended event is recorded exactly once
    _drain()
    recorded = list(UsageEvent.objects.values_list("request_id", flat=True))
    assert len(recorded) == len(set(recorded)) == len(paths)
    assert set(recorded) == set(paths)
    assert set(paths.values()) == {"redis", "postgres"}
    assert UsageRollupHourly.objects.aggregate(n=Sum("requests"))["n"] == len(paths)


def test_events_appended_together_are_recorded_once_also_when_redis_is_down(
        transactional_db, tenant, own_redis):
    # given 200 events appended in groups of 50 (a batch runner's finished lines) while Redis
    # runs, one group appended twice (a runner retried after a crash), and then Redis stops
    groups = [[tenant.event(f"req-g{g}-{i}") for i in range(50)] for g in range(4)]
    paths = [services.usage_events_append(group) for group in groups[:2]]
    paths.append(services.usage_events_append(groups[1]))
    own_redis.stop()
    # when the last two groups are appended
    paths += [services.usage_events_append(group) for group in groups[2:]]

    # then the first groups went on the stream in one call each, the rest to PostgreSQL
    assert paths == ["redis", "redis", "redis", "postgres", "postgres"]
    assert services.usage_events_append([]) is None
    own_redis.start()
    _drain()
    # and every event is one row, counted once in the rollups
    assert UsageEvent.objects.count() == 200
    assert UsageRollupHourly.objects.aggregate(n=Sum("requests"))["n"] == 200


def test_concurrent_async_appends_share_script_calls_and_each_is_recorded_once(
        transactional_db, tenant, own_redis, settings):
    # given 150 gateway requests finishing at once (their appends made in one loop tick)
    async def appends(first: int, n: int) -> list[str]:
        return await asyncio.gather(*(services.ausage_event_append(
            tenant.event(f"req-tick-{first + i}")) for i in range(n)))

    def script_calls() -> int:
        stats = redis.Redis.from_url(own_redis.url).info("commandstats")
        return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("evalsha", "eval"))

    assert asyncio.run(appends(1000, 1)) == ["redis"]  # the script loaded into this Redis
    before = script_calls()
    paths = asyncio.run(appends(0, 150))

    # then they went on the stream in a few script calls (64 events at most each), not 150
    assert paths == ["redis"] * 150
    assert script_calls() - before <= 3

    # and when the stream has room for only part of the next tick's appends, that tick's
    # events go to PostgreSQL instead, all of them (a batch is all or none), and none is lost
    settings.METERING_STREAM_MAX_LENGTH = 151 + 10  # 10 more fit, not 20
    paths += asyncio.run(appends(150, 20))
    connection.close()  # the fallback's thread had its own
    assert paths[150:] == ["postgres"] * 20
    _drain()
    recorded = list(UsageEvent.objects.values_list("request_id", flat=True))
    assert len(recorded) == len(set(recorded)) == 171
    assert UsageRollupHourly.objects.aggregate(n=Sum("requests"))["n"] == 171
