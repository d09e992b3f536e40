"""A Redis Cluster master lost for good, its replica promoted: no usage event is lost.

Redis replicates asynchronously, so an event a master acknowledged and then took with it into
a crash, before its replica had it, would be gone. With ``TOLLGATE_USAGE_WAIT_REPLICAS=1`` an
append counts only once a replica has it (``WAIT`` on the master's connection); an append the
replica did not acknowledge in time is written to PostgreSQL directly. The test stalls the
replica (SIGSTOP) while requests arrive, kills the master (SIGKILL), lets the replica take over
and only then starts the ingest consumer (``REDIS_CLUSTER_URL`` names every master, the dead
one first): every answered request is recorded exactly once.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from metering import conf
from tests.conftest import wait_until
from tests.gateway.test_admission import _org_key, _post
from tests.gateway.test_admission_cluster import on_cluster
from tests.gateway.test_usage_cluster import (
    all_recorded_once,
    master_of,
    start_consumers,
    stop_consumers,
)
from tests.redis_cluster import RedisCluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[RedisCluster]:
    started = RedisCluster(tmp_path_factory.mktemp("cluster"), replicas=1).start()
    yield started
    started.stop()


@pytest.fixture
def metering_stream(settings, tmp_path, cluster) -> Iterator[dict[str, str]]:
    """Every platform key on the cluster; appends wait for one replica, 300 ms at most."""
    from billing_platform import redis_conn
    from metering import stream

    env = on_cluster(settings, cluster, tmp_path)
    # a stream on the master REDIS_CLUSTER_URL names first: the consumer, started after it
    # died, learns the cluster from the other nodes the URL names
    key = f"tg:usage:failover:{uuid.uuid4().hex[:8]}"
    while master_of(cluster, key) is not cluster.masters[0]:
        key = f"tg:usage:failover:{uuid.uuid4().hex[:8]}"
    settings.METERING_STREAM_KEY = env["TOLLGATE_USAGE_STREAM"] = key
    yield {**env, "TOLLGATE_USAGE_WAIT_REPLICAS": "1", "TOLLGATE_USAGE_WAIT_REPLICAS_MS": "300"}
    redis_conn.reset_clients()
    stream.reset_clients()


def _role(node) -> str:
    try:
        return str(node.client().info("replication")["role"])
    except redis.RedisError:  # a node that does not answer yet has no role
        return ""


def test_a_master_lost_for_good_fails_over_and_no_acknowledged_usage_event_is_lost(
        live_gateway, metering_stream, cluster, tmp_path):
    # given requests whose usage events reached the stream's master and its replica
    secrets = [_org_key()[3] for _ in range(3)]
    victim = master_of(cluster, conf.stream_key())
    replica = cluster.replica_nodes[cluster.masters.index(victim)]
    answered = [_post(live_gateway, secrets[i % 3], max_tokens=2) for i in range(10)]
    time.sleep(0.5)  # their appends are done (acknowledged by the replica: none refused)
    assert "replica(s) acknowledged" not in live_gateway.log()

    # when the replica stalls, more requests are answered, and the master then dies for good
    os.kill(replica.proc.pid, signal.SIGSTOP)
    try:
        answered += [_post(live_gateway, secrets[i % 3], max_tokens=2) for i in range(8)]
        # (their appends found no replica to acknowledge them, and went to PostgreSQL)
        wait_until(lambda: "replica(s) acknowledged the usage event(s)" in live_gateway.log(),
                   timeout=10, what="an append refused for want of a replica")
    finally:
        victim.kill()
        os.kill(replica.proc.pid, signal.SIGCONT)
    # and the replica takes over its slots (with what it had: not the last 8 appends)
    wait_until(lambda: _role(replica) == "master", timeout=60, what="the replica's promotion")
    cluster.wait_ok(timeout=60)
    answered += [_post(live_gateway, secrets[i % 3], max_tokens=2) for i in range(10)]

    # then every answered request, before, during and after, is recorded exactly once when a
    # consumer drains the stream
    ok = [r for r in answered if r.status_code == 200]
    assert len(ok) >= 26, [r.status_code for r in answered]
    consumers = start_consumers(metering_stream, tmp_path, [None])
    try:
        all_recorded_once([r.headers["x-request-id"] for r in ok])
    finally:
        stop_consumers(consumers)
