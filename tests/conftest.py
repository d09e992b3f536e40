"""Suite-wide fixtures: real PostgreSQL (pytest-django's test database) and real Redis.

The README's test command starts the servers (or uses DATABASE_URL / REDIS_URL) before pytest
runs, so these fixtures only connect. Redis keys of ours all start with ``tg:``; they are
cleared around each test so no test sees another's cache.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from django.db import connection
from rest_framework.test import APIClient

from tests.webhook_receivers import receivers  # noqa: F401 - a fixture of every test

ROOT = Path(__file__).resolve().parent.parent


def _clear_tollgate_keys() -> None:
    from billing_platform.redis_conn import get_redis

    r = get_redis()
    keys = list(r.scan_iter(match="tg:*", count=1000))
    if keys:
        r.delete(*keys)


@pytest.fixture(autouse=True)
def _clean_redis() -> Iterator[None]:
    _clear_tollgate_keys()
    return


@pytest.fixture(autouse=True)
def _forget_shared_policy_reads() -> None:
    """Price books read for admission are shared for a TTL within a process; a test's
    database is not the last test's (ids are reused after a flush)."""
    from plans.admission.loading import forget_pricing_reads

    forget_pricing_reads()


@pytest.fixture
def api_client() -> APIClient:
    return APIClient()


def wait_until(predicate: Callable[[], object], *, timeout: float, what: str) -> object:
    """Poll ``predicate`` until it returns something truthy; fail with ``what`` after timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")


@pytest.fixture
def celery_worker_process(transactional_db, tmp_path) -> Iterator[Callable[..., subprocess.Popen]]:
    """Start a real Celery worker (optionally with embedded beat) on the test database."""
    procs: list[subprocess.Popen] = []

    def start(*, queues: str = "quota", beat: bool = False, env: dict | None = None):
        settings = connection.settings_dict
        db_url = (f"postgres://{settings['USER'] or 'postgres'}@{settings['HOST']}:"
                  f"{settings['PORT']}/{settings['NAME']}")
        argv = [sys.executable, "-m", "celery", "-A", "billing_platform", "worker", "-Q", queues,
                "--concurrency", "1", "-l", "INFO", "--without-gossip", "--without-mingle",
                "-n", f"test-{os.getpid()}@%h"]
        if beat:
            argv += ["-B", "-s", str(tmp_path / "beat-schedule")]
        log = open(tmp_path / "worker.log", "wb")  # noqa: SIM115 - closed by the process
        proc = subprocess.Popen(
            argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "DATABASE_URL": db_url, **(env or {})},
            start_new_session=True,  # its own process group: see the teardown below
        )
        proc.log_path = tmp_path / "worker.log"  # type: ignore[attr-defined]
        procs.append(proc)
        return proc

    yield start
    # A warm shutdown waits for the running task (a batch can run for minutes); killing only the
    # main process then left its pool child and embedded beat running after the test session.
    # The worker's whole process group goes, whatever is left of it.
    for proc in procs:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=20)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture
def gateway_env() -> dict[str, str]:
    """Extra environment of the live gateway's process (``tests/gateway/conftest.py``); a test
    module overrides this fixture to run the gateway with settings of its own."""
    return {}


# --- invoicing: a real localstripe server (Stripe's API over HTTP, via the stripe library) ---

def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def localstripe_url(tmp_path_factory) -> Iterator[str]:
    """Start localstripe (with Stripe's idempotent requests: tests/stripe_standin.py) on a
    free port for the session; return its base URL."""
    import socket

    port = _free_port()
    workdir = tmp_path_factory.mktemp("localstripe")
    log = open(workdir / "localstripe.log", "wb")  # noqa: SIM115 - closed by the process
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("stripe_standin.py")), "--port",
         str(port), "--from-scratch"],
        cwd=workdir, stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "TMPDIR": str(workdir)},
    )

    def listening() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    try:
        wait_until(listening, timeout=30, what="localstripe to listen")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture
def stripe_settings(settings, localstripe_url):
    """Point the platform's Stripe client at localstripe, with a known webhook secret."""
    settings.STRIPE_API_BASE = localstripe_url
    settings.STRIPE_API_KEY = "sk_test_tollgate"
    settings.STRIPE_WEBHOOK_SECRET = "whsec_tollgate_test"
    settings.STRIPE_MAX_NETWORK_RETRIES = 0
    return settings


@pytest.fixture(scope="session")
def stripe_webhook_inbox(localstripe_url):
    """The stand-in's signed webhook deliveries (every event it emits, signed with the
    ``stripe_settings`` secret), for a test to take and post to the platform."""
    from tests.stripe_inbox import StripeInbox

    inbox = StripeInbox()
    inbox.register(localstripe_url, secret="whsec_tollgate_test")
    yield inbox
    inbox.close()


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup, django_db_blocker):
    """Before the test database is dropped, end sessions that threads or children left open.

    New connections are refused first: a thread that reconnected between the terminations and
    the drop (a background job's next turn) made the drop fail ("being accessed by other
    users"), and each such run left its test database behind on the server.
    """
    yield
    name = connection.settings_dict["NAME"]
    with django_db_blocker.unblock():
        connection.close()
        # from the server's maintenance database, as Django's own drop runs
        with connection.creation._nodb_cursor() as cursor:
            cursor.execute(f"ALTER DATABASE {connection.ops.quote_name(name)} "
                           "ALLOW_CONNECTIONS false")
            cursor.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                           "WHERE datname = %s AND pid <> pg_backend_pid()", [name])


@pytest.fixture
def metering_stream(settings, tmp_path) -> Iterator[dict[str, str]]:
    """A private usage stream and spool for this test; returns the env for child processes."""
    from metering import stream

    settings.METERING_STREAM_KEY = f"tg:usage:test:{uuid.uuid4().hex[:10]}"
    settings.METERING_SPOOL_DIR = str(tmp_path / "spool")
    settings.METERING_REDIS_URL = settings.REDIS_URL
    stream.reset_clients()
    yield {"TOLLGATE_USAGE_STREAM": settings.METERING_STREAM_KEY,
           "TOLLGATE_USAGE_REDIS_URL": settings.REDIS_URL,
           "TOLLGATE_SPOOL_DIR": settings.METERING_SPOOL_DIR}
    stream.reset_clients()
