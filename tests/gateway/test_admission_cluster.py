"""The gateway's limits tests again, with the platform's keys on a real three-master Redis
Cluster (``REDIS_CLUSTER_URL``): quota state, the key cache and the usage stream on the
cluster, the Celery broker and Django's cache on the single ``REDIS_URL``.

The tests are ``test_admission``'s own, collected here a second time with ``metering_stream``
overridden, so they run unchanged: an RPM limit exact across four gateway processes, a TPM
limit, a hard budget never exceeded by 200 concurrent requests, a key revoked through the API
refused by all four processes at once.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.gateway.test_admission import (  # noqa: F401 - collected here against the cluster
    gateways,
    test_200_concurrent_requests_never_exceed_a_hard_budget,
    test_a_key_revoked_through_the_api_is_refused_by_all_four_processes_at_once,
    test_rpm_limit_of_60_across_four_gateway_processes_admits_exactly_60,
    test_tpm_limit_rejects_a_request_larger_than_the_limit_and_counts_max_tokens,
)
from tests.redis_cluster import RedisCluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[RedisCluster]:
    started = RedisCluster(tmp_path_factory.mktemp("cluster")).start()
    yield started
    started.stop()


def on_cluster(settings, cluster: RedisCluster, tmp_path) -> dict[str, str]:
    """Point this process's platform clients at ``cluster``; return the env that does the same
    for child processes (gateways, ingest consumers)."""
    from billing_platform import redis_conn
    from metering import stream

    settings.REDIS_CLUSTER_URL = cluster.url
    settings.METERING_REDIS_URL = cluster.url
    settings.METERING_STREAM_KEY = f"tg:usage:test:{uuid.uuid4().hex[:10]}"
    settings.METERING_SPOOL_DIR = str(tmp_path / "spool")
    redis_conn.reset_clients()
    stream.reset_clients()
    return {"REDIS_CLUSTER_URL": cluster.url, "TOLLGATE_USAGE_REDIS_URL": cluster.url,
            "TOLLGATE_USAGE_STREAM": settings.METERING_STREAM_KEY,
            "TOLLGATE_SPOOL_DIR": settings.METERING_SPOOL_DIR}


@pytest.fixture
def metering_stream(settings, tmp_path, cluster) -> Iterator[dict[str, str]]:
    """The usage stream and every platform key on the cluster, for this test and its
    gateways."""
    from billing_platform import redis_conn
    from metering import stream

    cluster.flush()
    yield on_cluster(settings, cluster, tmp_path)
    redis_conn.reset_clients()  # the next test's settings are restored: forget these clients
    stream.reset_clients()
