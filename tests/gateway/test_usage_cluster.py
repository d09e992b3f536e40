"""Usage events on a real three-master Redis Cluster, the stream sharded by organization into
three streams (``TOLLGATE_USAGE_STREAM_SHARDS=3``), drained by two ``manage.py ingest_usage``
processes that split the shards between them: every request's event lands in PostgreSQL
exactly once, also when a cluster master is killed mid-traffic and started again (appends it
refused went to PostgreSQL directly; what it had acknowledged survived, ``appendfsync
always``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db.models import Sum
from redis.crc import key_slot

from metering import conf
from metering.models import UsageEvent, UsageRollupHourly
from tests.conftest import ROOT, wait_until
from tests.gateway import conftest as gateway_conftest
from tests.gateway.test_admission import _org_key, _post
from tests.gateway.test_admission_cluster import (  # noqa: F401 - a fixture
    cluster,
    on_cluster,
)
from tests.redis_cluster import RedisCluster

SHARDS = 3


@pytest.fixture
def metering_stream(settings, tmp_path, cluster) -> Iterator[dict[str, str]]:  # noqa: F811
    """Every platform key and a usage stream of three shards on the cluster."""
    from billing_platform import redis_conn
    from metering import stream

    cluster.flush()
    env = on_cluster(settings, cluster, tmp_path)
    settings.METERING_STREAM_SHARDS = SHARDS
    yield {**env, "TOLLGATE_USAGE_STREAM_SHARDS": str(SHARDS)}
    redis_conn.reset_clients()
    stream.reset_clients()


def start_consumers(env: dict[str, str], tmp_path, shard_sets: list[str | None]
                    ) -> list[subprocess.Popen]:
    """Start one ``manage.py ingest_usage`` per entry (its ``--shards``; None: all) with the
    gateway's ``env``; return once each has joined its consumer group."""
    procs = []
    for i, shards in enumerate(shard_sets):
        log = open(tmp_path / f"ingest-{i}.log", "wb")  # noqa: SIM115 - closed by the process
        procs.append(subprocess.Popen(
            [sys.executable, "manage.py", "ingest_usage", *(["--shards", shards] if shards
                                                             else []),
             "--block-ms", "100", "--claim-idle-ms", "2000", "--name", f"ingest-{i}"],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "DATABASE_URL": gateway_conftest.test_database_url(), **env}))
    for i in range(len(procs)):
        wait_until(lambda i=i: b"ingest_usage: consumer" in (
            tmp_path / f"ingest-{i}.log").read_bytes(), timeout=30, what="ingest started")
    return procs


def stop_consumers(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture
def consumers(live_gateway, metering_stream, tmp_path) -> Iterator[list[subprocess.Popen]]:
    """Two ingest processes: shards 0 and 1, and shard 2."""
    procs = start_consumers(metering_stream, tmp_path, ["0,1", "2"])
    yield procs
    stop_consumers(procs)


def orgs_on_every_shard(count: int) -> list[str]:
    """Return secrets of keys of ``count`` organizations, covering every shard."""
    secrets = []
    shards: set[int] = set()
    while len(secrets) < count or len(shards) < SHARDS:
        org, _project, _key, secret = _org_key()
        shards.add(org.id % SHARDS)
        secrets.append(secret)
    return secrets


def master_of(started: RedisCluster, key: str):
    slot = key_slot(key.encode())
    for start, end, (_host, port, *_id), *_replicas in started.masters[0].client(
            ).execute_command("CLUSTER", "SLOTS"):
        if start <= slot <= end:
            return next(n for n in started.masters if n.port == port)
    raise AssertionError(key)


def all_recorded_once(ids: list[str]) -> None:
    wait_until(lambda: UsageEvent.objects.filter(request_id__in=ids).count() == len(ids),
               timeout=60, what=f"{len(ids)} events in PostgreSQL")
    time.sleep(1.0)  # anything recorded twice would show now
    assert UsageEvent.objects.filter(request_id__in=ids).count() == len(ids)
    events = UsageEvent.objects.count()
    assert events >= len(ids)
    # and counted once in the hourly rollups (a batch recorded twice would count twice there)
    assert UsageRollupHourly.objects.aggregate(n=Sum("requests"))["n"] == events


def test_events_of_many_orgs_land_once_through_sharded_streams(live_gateway, consumers,
                                                               cluster):  # noqa: F811
    # given organizations on every shard
    secrets = orgs_on_every_shard(6)

    # when 90 requests of theirs arrive at once
    with ThreadPoolExecutor(12) as pool:
        responses = list(pool.map(lambda i: _post(live_gateway, secrets[i % len(secrets)],
                                                  max_tokens=2), range(90)))

    # then each is recorded once, and each shard's stream carried its organizations' events
    assert [r.status_code for r in responses] == [200] * 90
    all_recorded_once([r.headers["x-request-id"] for r in responses])
    keys = conf.stream_keys()
    assert len({master_of(cluster, k).port for k in keys}) >= 2  # spread over masters
    for key in keys:
        info = master_of(cluster, key).client().xinfo_groups(key)
        assert info and info[0]["entries-read"] > 0, key  # consumed from every shard
    assert all(p.poll() is None for p in consumers)


def test_a_master_killed_mid_traffic_loses_and_doubles_no_usage_event(live_gateway, consumers,
                                                                      cluster):  # noqa: F811
    # given traffic of organizations on every shard
    secrets = orgs_on_every_shard(6)
    victim = master_of(cluster, conf.stream_keys()[0])

    def post(i: int):
        if i == 40:
            cluster.restart(victim, down_s=1.5)  # kill -9, down 1.5 s, started again
        return _post(live_gateway, secrets[i % len(secrets)], max_tokens=2)

    # when a master holding a shard is killed and restarted while requests flow
    with ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(post, range(150)))

    # then every answered request is recorded exactly once
    ok = [r for r in responses if r.status_code == 200]
    assert len(ok) >= 140, [r.status_code for r in responses]
    all_recorded_once([r.headers["x-request-id"] for r in ok])
    assert all(p.poll() is None for p in consumers)
