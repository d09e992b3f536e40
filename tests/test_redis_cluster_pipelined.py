"""The request path's pipelined connection on a real three-master Redis Cluster: commands reach
the master of their key's slot, scripts load on every master, and a restarted master, a slot
being migrated (ASK) and a slot that moved (MOVED) are followed without an error."""

from __future__ import annotations

import asyncio

import pytest
from redis.crc import key_slot

from billing_platform.redis_conn import ClusterPipelinedConnection
from tests.redis_cluster import ClusterNode, RedisCluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    started = RedisCluster(tmp_path_factory.mktemp("cluster")).start()
    yield started
    started.stop()


def _owner(cluster: RedisCluster, key: str) -> ClusterNode:
    slot = key_slot(key.encode())
    for start, end, (_host, port, *_id), *_replicas in cluster.masters[0].client(
            ).execute_command("CLUSTER", "SLOTS"):
        if start <= slot <= end:
            return next(n for n in cluster.masters if n.port == port)
    raise AssertionError(f"no master owns {key}")


def test_commands_of_many_callers_go_to_the_master_of_their_slot(cluster):
    async def run() -> tuple[list, list]:
        conn = ClusterPipelinedConnection(cluster.url)
        try:
            await asyncio.gather(*(conn.execute("SET", f"k{i}", i) for i in range(300)))
            got = await asyncio.gather(*(conn.execute("GET", f"k{i}") for i in range(300)))
            sha = await conn.execute("SCRIPT", "LOAD", "return redis.call('INCR', KEYS[1])")
            counts = await asyncio.gather(*(conn.execute("EVALSHA", sha, 1, f"tg:q:{{o{i}}}:n")
                                            for i in range(30)))
            return got, counts
        finally:
            conn.close()

    got, counts = asyncio.run(run())

    assert got == [str(i) for i in range(300)]
    assert counts == [1] * 30  # the script was loaded on every master
    # each key is stored on its slot's master only
    assert sum(n.client().dbsize() for n in cluster.masters) == 330
    assert {_owner(cluster, f"k{i}").port for i in range(300)} == {
        n.port for n in cluster.masters}


def test_a_restarted_master_a_migrating_slot_and_a_moved_slot_are_followed(cluster):
    key = "moving"
    source = _owner(cluster, key)
    target = next(n for n in cluster.masters if n is not source)
    slot = key_slot(key.encode())

    async def run() -> list:
        conn = ClusterPipelinedConnection(cluster.url)
        answers = []
        try:
            await conn.execute("SET", key, "v")
            cluster.restart(source)  # appendfsync always: the key survives
            await asyncio.sleep(0.2)  # the old connection's loss is seen
            answers.append(await conn.execute("GET", key))
            source_id = source.client().execute_command("CLUSTER", "MYID")
            target_id = target.client().execute_command("CLUSTER", "MYID")
            target.client().execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
            source.client().execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
            source.client().execute_command("MIGRATE", "127.0.0.1", target.port, key, 0, 5000)
            answers.append(await conn.execute("GET", key))  # ASK: on the target now
            for node in cluster.masters:
                node.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
            answers.append(await conn.execute("GET", key))  # MOVED
            answers.append(await conn.execute("GET", key))  # the map read again
        finally:
            conn.close()
        return answers

    assert asyncio.run(run()) == ["v", "v", "v", "v"]
    assert _owner(cluster, key) is target
