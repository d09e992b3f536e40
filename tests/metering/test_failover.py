"""Redis and PostgreSQL both down: the spool keeps every event; replay loses and doubles none.

These tests run their own PostgreSQL and Redis (``billing_platform.embedded``) so they can stop
them; a stand-in gateway process (``appender.py``) appends through the real service.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import psycopg
import pytest

from billing_platform.embedded import EmbeddedPostgres, EmbeddedRedis, free_port, remove_state
from metering import events, spool
from metering.models import UsageEvent
from tests.conftest import wait_until
from tests.metering.conftest import ROOT, metering_env


@pytest.fixture
def own_stack(tmp_path):
    """PostgreSQL (migrated) and Redis servers of this test's own."""
    pg = EmbeddedPostgres(tmp_path / "pg", free_port())
    redis = EmbeddedRedis(tmp_path / "redis", free_port())
    pg.start()
    redis.start()
    env = {**metering_env_base(), "DATABASE_URL": pg.url}
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=ROOT,
                   env=env, check=True, timeout=300)
    yield pg, redis
    redis.stop()
    pg.stop(mode="immediate")
    remove_state(tmp_path / "pg")


def metering_env_base() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def _events_in(pg: EmbeddedPostgres) -> list[str]:
    with psycopg.connect(pg.url) as conn:
        return [r[0] for r in conn.execute("SELECT request_id FROM usage_event")]


def _rollup_requests(pg: EmbeddedPostgres) -> int:
    with psycopg.connect(pg.url) as conn:
        return int(conn.execute("SELECT coalesce(sum(requests), 0) FROM usage_rollup_hourly"
                                ).fetchone()[0])


def test_redis_and_postgres_down_spool_then_replay_none_lost_none_doubled(
        own_stack, tmp_path, settings):
    pg, redis = own_stack
    spool_dir = tmp_path / "spool"
    env = {**metering_env_base(), "DATABASE_URL": pg.url,
           "TOLLGATE_USAGE_REDIS_URL": redis.url, "TOLLGATE_USAGE_STREAM": "tg:usage:failover",
           "TOLLGATE_SPOOL_DIR": str(spool_dir)}
    stop_file = tmp_path / "stop"
    appender = subprocess.Popen(
        [sys.executable, "tests/metering/appender.py", str(stop_file)], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, text=True,
    )
    paths: dict[str, str] = {}

    def pump() -> None:
        for line in appender.stdout:
            parts = line.split()
            if len(parts) == 2 and parts[0].startswith("req-"):
                paths[parts[0]] = parts[1]

    threading.Thread(target=pump, daemon=True).start()

    def count(path: str) -> int:
        return Counter(paths.values())[path]

    try:
        # given traffic flowing into Redis
        wait_until(lambda: count("redis") >= 50, timeout=90, what="appends to Redis")
        # when Redis stops, then PostgreSQL too, then both come back
        redis.stop()
        wait_until(lambda: count("postgres") >= 50, timeout=30, what="appends to PostgreSQL")
        pg.stop(mode="fast")
        wait_until(lambda: count("spool") >= 50, timeout=30, what="appends to the spool")
        pg.start()
        redis.start()
        back = count("redis")
        wait_until(lambda: count("redis") >= back + 50, timeout=30, what="Redis again")
    finally:
        stop_file.touch()
        appender.wait(timeout=30)
    assert appender.returncode == 0
    spooled = sorted(spool_dir.glob("*.spool"))
    assert spooled, "the spool should hold the events of the double outage"
    kept = tmp_path / "spool-copy"
    shutil.copytree(spool_dir, kept)

    # then the consumer's start-up replays the spool and drains the stream: each event once
    ingest = [sys.executable, "manage.py", "ingest_usage", "--drain", "--block-ms", "200"]
    subprocess.run(ingest, cwd=ROOT, env=env, check=True, timeout=120, capture_output=True)
    recorded = _events_in(pg)
    assert len(recorded) == len(set(recorded)) == len(paths)
    assert set(recorded) == set(paths)
    assert _rollup_requests(pg) == len(paths)
    assert not list(spool_dir.glob("*.spool")), "replayed spool files are removed"
    assert {"redis", "postgres", "spool"} <= set(paths.values())

    # and replaying the same spool files again doubles nothing
    for path in kept.iterdir():
        shutil.copy(path, spool_dir / path.name)
    subprocess.run(ingest, cwd=ROOT, env=env, check=True, timeout=120, capture_output=True)
    assert not list(spool_dir.glob("*.spool*"))
    assert len(_events_in(pg)) == len(paths)
    assert _rollup_requests(pg) == len(paths)


def test_beat_replays_the_spool(transactional_db, tenant, settings, celery_worker_process):
    # given events a web process spooled while Redis and PostgreSQL were down
    writer = spool.SpoolWriter(Path(settings.METERING_SPOOL_DIR))
    for i in range(20):
        writer.append(events.encode(events.normalize(tenant.event(f"req-spooled-{i}"))))

    # when the worker runs with its beat
    celery_worker_process(queues="metering", beat=True,
                          env=metering_env(settings, TOLLGATE_SPOOL_REPLAY_S="1"))

    # then the periodic replay records them and removes the file
    wait_until(lambda: UsageEvent.objects.filter(request_id__startswith="req-spooled-").count()
               == 20, timeout=90, what="the beat's spool replay")
    wait_until(lambda: not list(Path(settings.METERING_SPOOL_DIR).glob("*.spool*")),
               timeout=30, what="the replayed file to go")
